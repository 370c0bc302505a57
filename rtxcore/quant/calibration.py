"""Calibration and evaluation text, and the statistics calibration collects at each linear layer's input.

Both texts come from CPython's bundled ``pydoc_data`` topics, split by topic: the first half of the topics (in key
order) is evaluation text, the second half calibration text less the paragraphs that quote the first half, so no
sentence is in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from rtxcore.contracts.quantizer import LayerStats


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


# Lines this long are sentences, not boilerplate ("Changed in version 3.8."): none may be in both texts.
_SHARED_LINE_CHARS = 40


def _long_lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= _SHARED_LINE_CHARS}


def evaluation_text(num_chars: int | None = None) -> str:
    topics = _topics()
    text = "\n\n".join(topics[:len(topics) // 2])
    return text if num_chars is None else text[:num_chars]


def calibration_text(num_chars: int | None = None) -> str:
    """The second half of the topics, less every paragraph that shares a sentence with the first half (topics
    quote each other)."""
    topics = _topics()
    seen = _long_lines(evaluation_text())
    paragraphs = [p for topic in topics[len(topics) // 2:] for p in topic.split("\n\n")]
    text = "\n\n".join(p for p in paragraphs if not _long_lines(p) & seen)
    return text if num_chars is None else text[:num_chars]


def calibration_chunks(tokenizer, bos: int | None, num_tokens: int, chunk_len: int,
                       text: str | None = None) -> list[list[int]]:
    """About ``num_tokens`` tokens of calibration text (``text``, else the built-in one), in pieces of
    ``chunk_len`` each after a BOS."""
    ids = tokenizer.encode((text[:8 * num_tokens] if text is not None else calibration_text(8 * num_tokens)),
                           add_special_tokens=False)
    return token_chunks(ids, bos, max(1, num_tokens // chunk_len), chunk_len)


_PLANNING_TEXT_CHARS = 4 << 20


def planning_chunks(tokenizer, bos: int | None, num_tokens: int, chunk_len: int, skip_tokens: int,
                    text: str | None = None) -> list[list[int]]:
    """About ``num_tokens`` tokens of calibration text (``text``, else the built-in one) in pieces of ``chunk_len``
    spread evenly over the text after its first ``skip_tokens`` tokens (what calibration took). Not the next stretch:
    the built-in text's topics differ in how much quantization hurts them, so a plan chosen on one stretch fits that
    stretch, and one chosen across the whole text holds better on text it never saw."""
    text = text if text is not None else calibration_text()
    # At most this much text past calibration's is tokenized: a large file's pieces are spread over its first
    # megabytes (more spread gains little, and tokenizing it all would cost more than planning).
    text = text[:8 * skip_tokens + _PLANNING_TEXT_CHARS]
    ids = tokenizer.encode(text, add_special_tokens=False)[skip_tokens:]
    pieces = token_chunks(ids, bos, len(ids) // max(1, chunk_len - 1) + 1, chunk_len)
    wanted = min(len(pieces), -(-num_tokens // chunk_len))
    return [pieces[(2 * i + 1) * len(pieces) // (2 * wanted)] for i in range(wanted)]


def token_chunks(token_ids: list[int], bos: int | None, num_chunks: int, chunk_len: int) -> list[list[int]]:
    """Consecutive ``chunk_len``-token pieces of ``token_ids``, each after a BOS when the model has one."""
    prefix = [bos] if bos is not None else []
    body = chunk_len - len(prefix)
    chunks = [prefix + token_ids[i * body:(i + 1) * body] for i in range(num_chunks)]
    return [c for c in chunks if len(c) == chunk_len]


@dataclass
class _Accumulator:
    hessian: torch.Tensor
    abs_max: torch.Tensor
    num_rows: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)


class StatsCollector:
    """Forward pre-hooks on linear modules that add each input batch into :class:`LayerStats`.

    ``modules`` maps names to modules; names sharing a module (q, k and v on one fused projection) share its
    statistics. A module's first positional argument must be its input ``x`` [..., in_features];
    ``sample_rows_per_call`` rows of each call (evenly spaced) are kept for output-error measurements. Without
    ``hessian`` only the cheap statistics are kept (the sum x x^T is what GPTQ-like methods need).
    """

    def __init__(self, modules: dict[str, nn.Module], hessian: bool = True, sample_rows_per_call: int = 64):
        self._acc: dict[int, _Accumulator] = {}
        self._names = {name: id(module) for name, module in modules.items()}
        self._rows = sample_rows_per_call
        self._hessian = hessian
        distinct = {id(module): module for module in modules.values()}
        self._handles = [module.register_forward_pre_hook(self._hook(key)) for key, module in distinct.items()]

    def _hook(self, key: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            acc = self._acc.get(key)
            if acc is None:
                k = x.shape[-1]
                acc = self._acc[key] = _Accumulator(
                    torch.zeros(k, k, device=x.device) if self._hessian else torch.zeros(0, device=x.device),
                    torch.zeros(k, device=x.device))
            if self._hessian:
                # float32 is plenty for a sum of a few thousand rows, and four times faster than float64 on a CPU.
                acc.hessian.addmm_(x.t(), x)
            acc.abs_max = torch.maximum(acc.abs_max, x.abs().amax(dim=0))
            acc.num_rows += x.shape[0]
            step = max(1, x.shape[0] // self._rows)
            acc.samples.append(x[::step][:self._rows].cpu())
        return hook

    def close(self) -> dict[str, LayerStats]:
        for handle in self._handles:
            handle.remove()
        stats = {key: LayerStats(acc.hessian.cpu(), acc.num_rows, acc.abs_max.cpu(), torch.cat(acc.samples))
                 for key, acc in self._acc.items()}
        return {name: stats[key] for name, key in self._names.items() if key in stats}


def collect_stats(modules: dict[str, nn.Module], run: Callable[[list[int]], object], chunks: Iterable[list[int]],
                  hessian: bool = True) -> dict[str, LayerStats]:
    """Run the model (``run(token_ids)``) over every chunk and return the statistics seen at each module."""
    collector = StatsCollector(modules, hessian)
    try:
        with torch.inference_mode():
            for chunk in chunks:
                run(chunk)
    finally:
        stats = collector.close()
    return stats
