"""The torch backend's Triton path (fused kernels, Triton attention over the paged cache) gives the same tokens as
its plain torch path, end to end through the engine.

Without a GPU the kernels run in Triton's interpreter (RTX_TORCH_KERNELS=triton on the CPU), in float32, on the tiny
random-weight model: this exercises the metadata the backend builds for the kernels (decode rows, chunked prefills
that read a cached prefix, prefix-cache hits) in CI. CUDA graphs are checked on the GPU by benchmarks/gpu_checks.py.
"""

from __future__ import annotations

import pytest

from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

pytest.importorskip("triton")

PROMPTS = [[3 + (7 * i + 5 * j) % 500 for j in range(n)] for i, n in enumerate((5, 19, 40, 70))]
# The fourth prompt repeats the third's first 40 tokens: a prefix-cache hit of whole blocks.
PROMPTS.append(PROMPTS[2] + [11, 12, 13, 14, 15, 16, 17, 18])


def _tokens(monkeypatch, kernels: str, prompts=PROMPTS, dtype: str = "float32", **kwargs) -> list[list[int]]:
    monkeypatch.setenv("RTX_TORCH_KERNELS", kernels)
    engine = make_engine(device="cpu", dtype=dtype, block_size=8, **kwargs)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


def test_triton_path_matches_torch_path(monkeypatch):
    # A small token budget splits the longer prompts into chunks, so later chunks attend to their cached prefix
    # while other requests decode in the same step.
    expected = _tokens(monkeypatch, "torch", max_num_batched_tokens=32)
    assert _tokens(monkeypatch, "triton", max_num_batched_tokens=32) == expected


def test_piecewise_segments_match_torch_path(monkeypatch):
    # Steps with prefill tokens run through the piecewise-graph segments (uncaptured here), padded to a ladder of
    # token counts: the padding rows must not disturb the cache or the real rows.
    from rtx_plugins.backends.torch_backend.piecewise_graphs import PiecewiseGraphs

    expected = _tokens(monkeypatch, "torch", max_num_batched_tokens=32)
    monkeypatch.setenv("RTX_TORCH_KERNELS", "triton")
    engine = make_engine(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=32)
    backend = engine.core.backend
    backend._mixed = PiecewiseGraphs(backend.model, backend.kv_caches, backend.device, sizes=[4, 16, 40])
    calls = []
    hidden_states = backend._mixed.hidden_states
    backend._mixed.hidden_states = lambda batch, meta: calls.append(batch.num_tokens) or hidden_states(batch, meta)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
    assert calls and any(n not in (4, 16, 40) for n in calls)


def test_single_stream_matches_torch_path(monkeypatch):
    # Alone, a request decodes one row per step: its projections run through the GEMV kernel.
    prompts = PROMPTS[3:4]
    assert _tokens(monkeypatch, "triton", prompts) == _tokens(monkeypatch, "torch", prompts)


def test_unknown_kernel_choice_is_refused(monkeypatch):
    from rtxcore.errors import ConfigError

    monkeypatch.setenv("RTX_TORCH_KERNELS", "cuda-magic")
    with pytest.raises(ConfigError, match="RTX_TORCH_KERNELS"):
        make_engine(device="cpu")


def test_fp8_layers_take_rows_rounded_by_the_norm_and_activation_kernels(monkeypatch):
    """Where an fp8 layer takes its input already rounded (on a GPU past the weight-only rows), RMSNorm and
    SiLU-and-mul round it in their own pass: the tokens equal those of rounding inside the layer. Here the layers are
    told to take rounded rows on the CPU too, so the fused kernels run in the interpreter (bfloat16: the norm fuses
    16-bit rows only) and the product runs from the rows they rounded."""
    import rtx_kernels.activation
    import rtx_kernels.rmsnorm
    from rtx_plugins.quantizers.fp8 import FP8Quantizer
    from rtxcore.contracts.quantizer import FP8_ROWS

    prompts = PROMPTS[:3]
    expected = _tokens(monkeypatch, "triton", prompts, dtype="bfloat16", quantization="fp8")
    calls = {"rms_norm_fp8": 0, "silu_and_mul_fp8": 0}

    def counted(module, name):
        kernel = getattr(module, name)

        def run(*args):
            calls[name] += 1
            return kernel(*args)
        monkeypatch.setattr(module, name, run)

    counted(rtx_kernels.rmsnorm, "rms_norm_fp8")
    counted(rtx_kernels.activation, "silu_and_mul_fp8")
    monkeypatch.setattr(FP8Quantizer, "rounded_rows", lambda self, qt, rows, device: FP8_ROWS)
    assert _tokens(monkeypatch, "triton", prompts, dtype="bfloat16", quantization="fp8") == expected
    # Every layer of every step: two norms (before qkv and gate|up) to one activation (before down).
    assert calls["silu_and_mul_fp8"] > 0 and calls["rms_norm_fp8"] == 2 * calls["silu_and_mul_fp8"], calls
