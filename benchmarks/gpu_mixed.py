"""Where a continuous-batching "mixed" step's time goes on the GPU: 31 decoding requests plus a newcomer's
640-token prefill chunk in one step of ``dummy:llama-1b`` (bfloat16; 32 query heads, 8 KV heads, head size 64,
block size 16, 16 layers).

- ``ops``: one decoder layer's operations at that shape on synthetic tensors, each timed three ways: as CUDA-graph
  replays (the GPU's time alone), eagerly (launch overhead included when the host is the slower side), and the
  host's time per call. Their sum times 16 estimates the step's GPU floor with today's kernels.
- ``prefill``: launch shapes of the prefill-attention kernel at that chunk, against torch's SDPA on the same q/k/v.
- ``steps``: the engine itself (its default CUDA graphs, synchronous scheduling): mixed steps and decode steps timed on the
  host with a synchronization around each, then a profile of mixed steps: per-kernel device time, the sum of kernel
  time and the span from the first kernel's start to the last one's end (the gap is idle GPU).
- ``busy``: how much of W2's wall time (64 running, asynchronous scheduling) the GPU spends in kernels.
Usage: python benchmarks/gpu_mixed.py [ops] [prefill] [steps] [busy]   (default: the first three)
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
import torch.nn.functional as F

from rtx_kernels.activation import silu_and_mul
from rtx_kernels.decode_attention import choose_num_splits, decode_attention
from rtx_kernels.prefill_attention import prefill_attention
from rtx_kernels.rmsnorm import rms_norm
from rtx_kernels.rotary import apply_rotary

H, KVH, D, BS = 32, 8, 64, 16
HIDDEN, INTER, VOCAB, LAYERS = 2048, 8192, 128256, 16
NUM_DECODES, CHUNK = 31, 640


def _time(fn, reps: int = 50) -> tuple[float, float, float]:
    """(graph replay us, eager us, host us per call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) / reps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000, eager * 1000, host * 1e6


class Step:
    """Synthetic tensors of one mixed step, the prefill's blocks and the decodes' scattered over the cache."""

    def __init__(self, chunk: int = CHUNK, num_decodes: int = NUM_DECODES):
        gen = torch.Generator(device="cuda").manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        self.chunk, self.nd = chunk, num_decodes
        self.tokens = t = num_decodes + chunk

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

        self.x, self.residual = randn(t, HIDDEN), randn(t, HIDDEN)
        self.norm_w = randn(HIDDEN)
        self.w_qkv, self.w_o = randn((H + 2 * KVH) * D, HIDDEN, scale=0.02), randn(HIDDEN, H * D, scale=0.02)
        self.w_gu, self.w_down = randn(2 * INTER, HIDDEN, scale=0.02), randn(HIDDEN, INTER, scale=0.02)
        self.lm_head = randn(VOCAB, HIDDEN, scale=0.02)
        self.qkv = F.linear(self.x, self.w_qkv)
        self.q = self.qkv[:, : H * D].view(t, H, D)
        self.k = self.qkv[:, H * D:(H + KVH) * D].view(t, KVH, D)
        self.v = self.qkv[:, (H + KVH) * D:].view(t, KVH, D)
        lens = torch.randint(100, 2049, (num_decodes,), generator=torch.Generator().manual_seed(0))
        self.decode_lens = lens.int().to(dev)
        all_lens = lens.tolist() + [chunk]
        width = -(-max(all_lens) // BS)
        num_blocks = sum(-(-n // BS) for n in all_lens) + 1
        self.k_cache, self.v_cache = randn(KVH, num_blocks, BS, D), randn(KVH, num_blocks, BS, D)
        perm = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
        tables = torch.zeros(len(all_lens), width, dtype=torch.int32)
        used = 0
        for i, n in enumerate(all_lens):
            nb = -(-n // BS)
            tables[i, :nb] = torch.tensor(perm[used:used + nb])
            used += nb
        self.tables = tables.to(dev)
        pos = lens.tolist()
        positions = [n - 1 for n in pos] + list(range(chunk))
        self.positions = torch.tensor(positions, device=dev)
        slots = [int(tables[i, p // BS]) * BS + p % BS for i, p in enumerate(positions[:num_decodes])]
        slots += [int(tables[num_decodes, p // BS]) * BS + p % BS for p in range(chunk)]
        self.slots = torch.tensor(slots, device=dev)
        angles = torch.outer(torch.arange(4096, dtype=torch.float32), 500000.0 ** -(torch.arange(0, D, 2) / D))
        self.cos, self.sin = angles.cos().to(dev), angles.sin().to(dev)
        self.splits = choose_num_splits(num_decodes, KVH, int(lens.max()))
        self.prefill_qsl = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        self.prefill_lens = torch.tensor([chunk], dtype=torch.int32, device=dev)
        self.out = torch.empty(t, H, D, dtype=bf, device=dev)
        self.gate_up = F.linear(self.x, self.w_gu)
        self.act = silu_and_mul(self.gate_up)
        self.scale = D ** -0.5

    def prefill(self, **shape):
        nd = self.nd
        return prefill_attention(self.q[nd:], self.k_cache, self.v_cache, self.prefill_qsl, self.prefill_lens,
                                 self.tables[nd:], self.scale, self.chunk, out=self.out[nd:], **shape)

    def ops(self) -> dict:
        nd = self.nd
        return {
            "rms_norm (+residual)": lambda: rms_norm(self.x, self.norm_w, 1e-5, self.residual),
            "qkv_proj": lambda: F.linear(self.x, self.w_qkv),
            "rotary + KV write": lambda: apply_rotary(self.q, self.k, self.positions, self.cos, self.sin, self.v,
                                                      self.k_cache, self.v_cache, self.slots),
            f"decode attention ({nd} rows, {self.splits} splits)": lambda: decode_attention(
                self.q[:nd], self.k_cache, self.v_cache, self.tables[:nd], self.decode_lens, self.scale,
                self.splits, out=self.out[:nd]),
            f"prefill attention ({self.chunk})": self.prefill,
            "o_proj": lambda: F.linear(self.out.view(self.tokens, H * D), self.w_o),
            "rms_norm (+residual) 2": lambda: rms_norm(self.x, self.norm_w, 1e-5, self.residual),
            "gate_up_proj": lambda: F.linear(self.x, self.w_gu),
            "silu_and_mul": lambda: silu_and_mul(self.gate_up),
            "down_proj": lambda: F.linear(self.act, self.w_down),
        }


def ops() -> None:
    s = Step()
    print(f"\n=== one layer's ops at {s.nd} decodes + a {s.chunk}-token chunk ({s.tokens} rows), us ===")
    print(f"{'op':44s} {'graph':>9s} {'eager':>9s} {'host':>9s}")
    totals = [0.0, 0.0, 0.0]
    for name, fn in s.ops().items():
        r = _time(fn)
        totals = [a + b for a, b in zip(totals, r)]
        print(f"{name:44s} {r[0]:9.1f} {r[1]:9.1f} {r[2]:9.1f}", flush=True)
    print(f"{'layer total':44s} {totals[0]:9.1f} {totals[1]:9.1f} {totals[2]:9.1f}")
    lm = _time(lambda: F.linear(s.x[:32], s.lm_head))
    print(f"{'lm_head (32 rows)':44s} {lm[0]:9.1f} {lm[1]:9.1f} {lm[2]:9.1f}")
    print(f"estimated step: {LAYERS} layers x {totals[0]:.1f} + lm_head = "
          f"{(LAYERS * totals[0] + lm[0]) / 1000:.2f} ms of GPU time; eager "
          f"{(LAYERS * totals[1] + lm[1]) / 1000:.2f} ms")


def prefill() -> None:
    s = Step()
    nd = s.nd
    q = s.q[nd:].transpose(0, 1).unsqueeze(0).contiguous()
    k = s.k[nd:].transpose(0, 1).unsqueeze(0).contiguous()
    v = s.v[nd:].transpose(0, 1).unsqueeze(0).contiguous()
    sdpa = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale, enable_gqa=True))
    print(f"\n=== prefill attention, one {s.chunk}-token chunk, graph replay us ===")
    print(f"torch SDPA (contiguous q/k/v, causal, gqa): {sdpa[0]:.1f}")
    rows = []
    for block_rows, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        shape = dict(block_rows=block_rows, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            rows.append((_time(lambda: s.prefill(**shape))[0], shape))
        except Exception as exc:  # a shape the compiler rejects (shared memory) is skipped, not fatal
            print(f"{shape}: {type(exc).__name__}: {str(exc)[:80]}")
    for us, shape in sorted(rows, key=lambda r: r[0]):
        print(f"{us:8.1f}  {shape}")


def steps() -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rtxcore.contracts.scheduler import SchedulerConfig
    from rtxcore.engine.config import EngineConfig
    from rtxcore.engine.llm_engine import LLMEngine
    from rtxcore.sampling_params import SamplingParams

    t = time.perf_counter()
    e = LLMEngine(EngineConfig(model="dummy:llama-1b", device="cuda", dtype="bfloat16", max_model_len=4096,
                               async_scheduling=False,
                               scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=64)))
    print(f"\nengine start (weights, KV cache, graph capture): {time.perf_counter() - t:.1f} s; "
          f"GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB")
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(NUM_DECODES):
        e.add_request([1000 + (i * 7 + j) % 5000 for j in range(800)], params)
    for _ in range(6):
        e.step()

    def timed_step() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        e.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000

    mixed, decode = [], []
    for seed in range(8):
        e.add_request([2000 + (seed * 13 + j) % 5000 for j in range(CHUNK)], SamplingParams(max_tokens=1))
        mixed.append(timed_step())
        decode.append(timed_step())
    print(f"\n=== engine steps (CUDA graphs on), ms, synchronized: mixed {[round(x, 2) for x in mixed[1:]]}, "
          f"decode {[round(x, 2) for x in decode[1:]]}")
    num = 4
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for seed in range(100, 100 + num):
            e.add_request([2000 + (seed * 13 + j) % 5000 for j in range(CHUNK)], SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
            e.step()
            torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda ev: ev.time_range.start)
    busy = sum(ev.time_range.end - ev.time_range.start for ev in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    print(f"=== profile of {num} mixed steps: {len(kernels) / num:.0f} device ops per step, kernel time "
          f"{busy / num / 1000:.2f} ms per step, first-to-last span {span / num / 1000:.2f} ms per step (includes "
          "the host between steps) ===")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=80))
    for req_id in list(e.requests):
        e.abort(req_id)


def busy(max_num_seqs: int = 64, first: int = 500, num: int = 400) -> None:
    """How busy the GPU is while ``rtx bench`` runs W2 (asynchronous scheduling, as the bench runs it): the union
    of kernel intervals over steps ``first`` .. ``first + num`` of the second pass, against their wall time. Well
    under 100% means the host (scheduling, batch building, sampling, launches) sets the pace, not the kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rtxcore.bench.workloads import make_requests
    from rtxcore.contracts.scheduler import SchedulerConfig
    from rtxcore.engine.config import EngineConfig
    from rtxcore.engine.llm_engine import LLMEngine
    from rtxcore.sampling_params import SamplingParams

    e = LLMEngine(EngineConfig(model="dummy:llama-1b", device="cuda", dtype="bfloat16", max_model_len=4096,
                               scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs)))
    for attempt in range(2):  # the first pass compiles every kernel specialization the workload reaches
        for r in make_requests("W2", e.model_config.vocab_size, seed=0):
            e.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                             ignore_eos=True))
        for _ in range(first):
            e.step()
        if attempt == 1:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(num):
                    e.step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
        while e.has_unfinished_requests():
            e.step()
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == DeviceType.CUDA)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            covered += b - max(a, end)
            end = b
    print(f"\n=== W2 at {max_num_seqs} running, steps {first}..{first + num} of the second pass (profiled): "
          f"{wall * 1000 / num:.3f} ms per step on the host's clock; GPU busy {covered / 1000 / num:.3f} ms per "
          f"step ({covered / 1000 / (wall * 1000):.0%}) ===")


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["ops", "prefill", "steps"]
    for part in chosen:
        {"ops": ops, "prefill": prefill, "steps": steps, "busy": busy}[part]()
