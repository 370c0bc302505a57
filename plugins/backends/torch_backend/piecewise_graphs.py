"""Piecewise CUDA graphs for steps that carry prefill tokens: everything but attention is replayed from graphs.

A step with a prefill chunk (a newcomer beside the running decodes, or a prompt alone) cannot replay a decode graph:
its attention's launch grid follows the chunks' lengths. Run eagerly it launches some 200 kernels from Python, and
on the H200 that is what such a step's time was (a sweep, docs/benchmarks.md, 2026-11-29: 31 decodes beside a 640-token
chunk spent 3.1 ms in kernels and 18-20 ms on the host). Everything between two attentions (o_proj, the norms, the
MLP, the next layer's qkv projection, rotary embedding and the KV-cache write) depends on the token count alone, so
each such stretch is one graph per padded token count, and only attention launches eagerly: at most three kernels
a layer.

Segment i (0 <= i <= num_layers) finishes layer i - 1 from its attention output and starts layer i, through static
buffers: it reads the attention output and the residual and leaves layer i's rotated queries and the new residual.
Those copies cost a few microseconds a layer and keep the graphs' own memory to one segment's temporaries. Padding
rows past the step's tokens store their K/V in slot 0 of the null block, which nothing reads; attention never sees
them, and every other operation is row by row, so they cannot leak into real rows.
"""

from __future__ import annotations

import torch

from rtx_plugins.backends.torch_backend.cuda_graphs import capturing
from rtx_plugins.backends.torch_backend.model import LlamaForCausalLM
from rtx_plugins.backends.torch_backend.triton_attention import TritonAttentionMetadata, attend, rotate_and_store
from rtxcore.contracts.backend import ForwardBatch

# Steps of up to this many tokens run from graphs; longer ones (rare: several long prompts at once) run eagerly,
# where the launches weigh less against the kernels' own time.
MAX_GRAPH_TOKENS = 8192


def token_ladder(max_tokens: int) -> list[int]:
    """Padded token counts with a graph each: 16, 32, then every 64 to 512, every 128 to 2048, every 512 beyond.
    A step pads to the next size up; past 64 tokens the padding is at most a fifth of its rows."""
    sizes = [16, 32, *range(64, 513, 64), *range(640, 2049, 128), *range(2560, MAX_GRAPH_TOKENS + 1, 512)]
    sizes = [s for s in sizes if s < max_tokens]
    return sizes + [max_tokens]


class PiecewiseGraphs:
    """Until :meth:`capture` runs, the same segments run without graphs (the CPU tests check the segmentation so)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, max_tokens: int = MAX_GRAPH_TOKENS, sizes: list[int] | None = None):
        cfg = model.config
        self.sizes = sizes or token_ladder(max_tokens)
        self.max_tokens = self.sizes[-1]
        self._model = model
        self._kv_caches = kv_caches
        self._scale = cfg.head_dim ** -0.5
        n, dtype = self.max_tokens, model.embed_tokens.weight.dtype
        heads = model.layers[0].self_attn.num_heads
        self._ids = torch.zeros(n, dtype=torch.long, device=device)
        self._pos = torch.zeros(n, dtype=torch.long, device=device)
        self._slots = torch.zeros(n, dtype=torch.long, device=device)
        self._q = torch.zeros(n, heads, cfg.head_dim, dtype=dtype, device=device)
        self._attn = torch.zeros(n, heads, cfg.head_dim, dtype=dtype, device=device)
        self._residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self._hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved. Every graph of every
        # size shares it: a segment's outputs live in the static buffers, so the pool holds temporaries only.
        for size in reversed(self.sizes):
            graphs = []
            for i in range(len(self._model.layers) + 1):
                self._segment(i, size)  # compiles the kernels, warms the allocator outside the capture
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, pool):
                    self._segment(i, size)
                pool = graph.pool()
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.write_kv and 0 < batch.num_tokens <= self.max_tokens

    def hidden_states(self, batch: ForwardBatch, meta: TritonAttentionMetadata) -> torch.Tensor:
        """The final norm's output for the step's tokens, [num_tokens, hidden]; ``meta`` describes the step."""
        n = batch.num_tokens
        size = next(s for s in self.sizes if s >= n)
        _fill(self._ids[:n], batch.input_ids)
        _fill(self._pos[:n], batch.positions)
        self._slots[:n].copy_(meta.slot_mapping)
        if size > n:
            self._slots[n:size].zero_()
        graphs = self._graphs.get(size)
        for i, kv_cache in enumerate(self._kv_caches):
            self._run_segment(graphs, i, size)
            attend(self._q[:n], kv_cache, meta, self._scale, out=self._attn[:n])
        self._run_segment(graphs, len(self._kv_caches), size)
        return self._hidden[:n]

    def _run_segment(self, graphs: list[torch.cuda.CUDAGraph] | None, i: int, size: int) -> None:
        if graphs is None:
            self._segment(i, size)
        else:
            graphs[i].replay()

    def _segment(self, i: int, size: int) -> None:
        """Finish layer i - 1 (none for i == 0) and start layer i (the final norm for i == num_layers)."""
        layers = self._model.layers
        if i == 0:
            x, residual = self._model.embed_tokens(self._ids[:size]), None
        else:
            prev = layers[i - 1]
            x, residual = prev.after_attention(prev.self_attn.project_out(self._attn[:size]), self._residual[:size])
        if i == len(layers):
            self._hidden[:size].copy_(self._model.norm(x, residual)[0])
            return
        layer = layers[i]
        q, k, v, residual = layer.before_attention(x, residual)
        rotate_and_store(q, k, v, self._pos[:size], layer.self_attn.rotary, self._kv_caches[i], self._slots[:size])
        self._q[:size].copy_(q)
        self._residual[:size].copy_(residual)


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``src`` (host or device) into the static buffer ``dst`` without waiting for the device."""
    if src.device.type == "cpu" and dst.device.type != "cpu":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)
