"""Every ``RTX_*`` environment switch, declared once: its name, type, default and what it is for.

A switch is read when its value is asked for (``envs.RTX_PDL.get()``), never when a module is imported, so a test
or a launcher may set the variable at any point before first use. Readers on a per-call hot path cache the value
themselves after the first read, and say so where they do. A malformed value raises :class:`ConfigError` naming the
variable and the values it accepts. An empty value counts as unset.

``get`` takes an optional mapping in place of ``os.environ``, for code that is handed its environment (a
configuration loaded for a child process, a test). ``docs/environment.md`` lists every switch declared here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from rtxcore.errors import ConfigError

# Covariant: a Switch[bool] is a Switch[object] (SWITCHES below holds every kind); switches are frozen.
T = TypeVar("T", covariant=True)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Switch(Generic[T]):
    """One environment variable: parsed from its text on every :meth:`get`."""

    name: str
    # What the value is, as docs/environment.md shows it: bool, str, path, names, or the choices "a|b|c".
    kind: str
    # The value when the variable is unset or empty.
    default: T
    # One line: what the switch does and why one would set it.
    doc: str
    # Text to value; raises ValueError with the accepted values when the text is malformed.
    parse: Callable[[str], T]

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The switch's value in ``environ`` (default ``os.environ``).

        :raises ConfigError: the value is set but malformed; the message names the variable and what it accepts.
        """
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={raw!r} is not valid: {exc}") from None


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"use one of {', '.join(_TRUE + _FALSE)}")


def _str(raw: str) -> str:
    return raw


def _positive_int(raw: str) -> int:
    value = int(raw)  # a ValueError names the text
    if value < 1:
        raise ValueError("use an integer of at least 1")
    return value


def _count(raw: str) -> int:
    value = int(raw)  # a ValueError names the text
    if value < 0:
        raise ValueError("use an integer of at least 0")
    return value


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _names(raw: str) -> frozenset[str]:
    """Comma-separated names; blanks around them and empty items are dropped."""
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return value

    return parse


def _bool_switch(name: str, default: bool, doc: str) -> Switch[bool]:
    return Switch(name, "bool", default, doc, _bool)


def _choice_switch(name: str, choices: tuple[str, ...], doc: str) -> Switch[str]:
    """A choice among ``choices``; the first is the default."""
    return Switch(name, "|".join(choices), choices[0], doc, _choice(*choices))


# Plugins and serving.
RTX_PLUGINS: Switch[frozenset[str] | None] = Switch(
    "RTX_PLUGINS", "names", None,
    "Comma-separated entry-point names of group `rtx` to load (unset: all installed); to run with only some "
    "plugins, or to leave out a broken one.",
    _names)
RTX_API_KEYS: Switch[str] = Switch(
    "RTX_API_KEYS", "str", "",
    "API keys as `tenant=key,other=key2`, added to the tenants of the serve config; for keys that come from a "
    "secret store rather than a file.",
    _str)
RTX_API_KEY: Switch[str] = Switch(
    "RTX_API_KEY", "str", "",
    "The key `rtx chat --url` sends to a server when `--api-key` is not given (then `OPENAI_API_KEY` is tried); a "
    "client's key, not one the server accepts.",
    _str)
RTX_FAULT_INJECTION = _bool_switch(
    "RTX_FAULT_INJECTION", False,
    "Register the fault_injection logits processor, which fails the requests that ask for it (chaos drills only).")

# Backends.
RTX_TORCH_KERNELS = _choice_switch(
    "RTX_TORCH_KERNELS", ("auto", "torch", "triton"),
    "The torch backend's kernels: `auto` uses Triton on CUDA where it is installed, `torch` forces plain torch, "
    "`triton` forces Triton (on the CPU in Triton's interpreter: slow, for tests).")
RTX_TORCH_GEMV = _bool_switch(
    "RTX_TORCH_GEMV", True,
    "With the Triton kernels, small-batch projections stream their weights through the Triton GEMV; `0` keeps "
    "them on cuBLAS, to compare the two.")
RTX_LAUNCH_CACHE = _bool_switch(
    "RTX_LAUNCH_CACHE", True,
    "Eager CUDA steps launch each layer's attention kernels without Triton's dispatch after the first layer; `0` "
    "sends every launch through Triton, to compare the two. Read once per process.")
RTX_ORT_PROVIDER = _choice_switch(
    "RTX_ORT_PROVIDER", ("auto", "cpu", "cuda"),
    "The onnxruntime backend's execution provider when `--device` is auto: `auto` picks CUDA where "
    "onnxruntime-gpu and a GPU are present, else the CPU.")
RTX_GRAPH_CACHE: Switch[Path | None] = Switch(
    "RTX_GRAPH_CACHE", "path", None,
    "Where exported ONNX graphs and TensorRT engines are cached (unset: `$XDG_CACHE_HOME/rtx-serve/graphs`, "
    "`~/.cache/rtx-serve/graphs`); point it at a volume that outlives the container.",
    _path)

RTX_PP_MICRO_BATCH_TOKENS: Switch[int] = Switch(
    "RTX_PP_MICRO_BATCH_TOKENS", "int", 256,
    "With pipeline parallelism, a step is cut into micro-batches (at most one per stage) of at least this many "
    "tokens, so stages overlap on large steps; smaller steps go through whole, since a memory-bound decode step "
    "costs each stage nearly as much per micro-batch as for the whole batch. Read by rank 0 only.",
    _positive_int)

# Kernels.
RTX_CPU_KERNELS = _bool_switch(
    "RTX_CPU_KERNELS", True,
    "The C++ CPU decode-attention kernel, compiled on first use; `0` skips the build and uses the torch path "
    "(no compiler, or a quicker start). Read once per process.")
RTX_INT4_MMA = _bool_switch(
    "RTX_INT4_MMA", True,
    "int4 decode products of 2 to 8 rows run on the tensor cores; `0` sends them to the FMA GEMV instead, for "
    "A/B measurements. Read once per process.")
RTX_FP8_TRITON_GEMM = _bool_switch(
    "RTX_FP8_TRITON_GEMM", True,
    "fp8 products of 9 to 64 rows on Hopper run through rtx_kernels.fp8_matmul (smaller tiles than cuBLAS's, "
    "as precise) instead of torch._scaled_mm (W2 at 64 running +2.3% on an H100); `0` runs cuBLAS's, for A/B "
    "measurements. Read once per process.")
RTX_FP8_FAST_ACCUM = _bool_switch(
    "RTX_FP8_FAST_ACCUM", True,
    "fp8 products in cuBLAS (torch._scaled_mm) take its fast-accumulation mode: Hopper's fp8 MMA accumulator "
    "for the whole K loop, as vLLM's CUTLASS fp8 GEMMs on sm_90 do. W8B fp8 6% faster on an H100, outputs off by "
    "up to 0.7% of the largest against 0.3%, the default model's fp8 perplexity within its budget either way "
    "(docs/benchmarks.md); 0 for cuBLAS's default accumulation. Read once per process.")
RTX_PDL = _bool_switch(
    "RTX_PDL", True,
    "Programmatic dependent launch for the decode path's Triton kernels on Hopper and later; `0` turns it off, "
    "for A/B measurements. Read once per process.")
RTX_KV_ROW_COPY = _bool_switch(
    "RTX_KV_ROW_COPY", True,
    "KV blocks move between the GPU and the pinned host tier in one Triton launch per reload or spill; `0` makes "
    "one copy per run of adjacent host slots instead, for A/B measurements. Read once per process.")
RTX_KV_EVICT_AHEAD: Switch[int] = Switch(
    "RTX_KV_EVICT_AHEAD", "int", 64,
    "On a GPU over a host tier, prefix-cache blocks are evicted to the tier in batches of this many before a step's "
    "launch once fewer than half a batch are empty, so that most allocations spill nothing of their own (a pool of "
    "fewer than 16 batches keeps no reserve); `0` evicts at each allocation instead, for A/B measurements. Read "
    "when a KV cache is made.",
    _count)

SWITCHES: dict[str, Switch[object]] = {
    switch.name: switch
    for switch in (RTX_PLUGINS, RTX_API_KEYS, RTX_API_KEY, RTX_FAULT_INJECTION, RTX_TORCH_KERNELS, RTX_TORCH_GEMV,
                   RTX_LAUNCH_CACHE, RTX_ORT_PROVIDER, RTX_PP_MICRO_BATCH_TOKENS, RTX_GRAPH_CACHE, RTX_CPU_KERNELS,
                   RTX_INT4_MMA, RTX_PDL, RTX_FP8_TRITON_GEMM, RTX_FP8_FAST_ACCUM, RTX_KV_ROW_COPY, RTX_KV_EVICT_AHEAD)
}
