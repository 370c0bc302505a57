"""The standard benchmark workloads (shared/WORKLOADS.md): random-token prompts with fixed output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rtxcore.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    description: str


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("W1", 256, (128, 128), (256, 256), "offline-fixed: 256 requests, prompt 128, output 256"),
    Workload("W2", 256, (100, 1024), (100, 1024), "offline-mixed: 256 requests, prompt and output in [100, 1024]"),
    Workload("W3", 1, (128, 128), (256, 256), "single-stream: one request, prompt 128, output 256"),
    Workload("W8B", 256, (128, 128), (128, 128), "llama-8b peer shape: 256 requests, prompt 128, output 128"),
    Workload("cpu", 64, (32, 256), (64, 256), "CPU variant: 64 requests, prompt 32-256, output 64-256"),
    Workload("cpu-small", 16, (16, 64), (16, 48), "smoke size: 16 requests, prompt 16-64, output 16-48"),
)}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(workload: str | Workload, vocab_size: int, seed: int = 0, num_requests: int | None = None
                  ) -> list[BenchRequest]:
    w = get_workload(workload) if isinstance(workload, str) else workload
    rng = random.Random(seed)
    # Ids near the ends of the vocabulary are often special tokens; random text-like ids avoid them.
    low, high = min(100, vocab_size // 4), vocab_size - 1 - min(100, vocab_size // 4)
    out = []
    for _ in range(num_requests or w.num_requests):
        n_prompt = rng.randint(*w.prompt_len)
        n_out = rng.randint(*w.output_len)
        out.append(BenchRequest([rng.randint(low, high) for _ in range(n_prompt)], n_out))
    return out


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}",
                                  param="workload") from None
