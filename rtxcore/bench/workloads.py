"""The standard benchmark workloads (docs/workloads.md): random-token prompts with fixed output lengths, and W6's
input-grounded prompts (a real text to copy out with edits) for speculative decoding."""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

from rtxcore.errors import InvalidRequestError
from rtxcore.tokenizer import Tokenizer

# The most requests a run builds: far beyond any workload here (1 to 256) or published run, and still a few GB of
# host memory. Without a bound, a typo (--num-requests 99999999999999) grew the request list until memory ran out.
MAX_NUM_REQUESTS = 1_000_000
# And the most prompt tokens in all: every prompt is built before the run as a list of Python ints, about 36 bytes a
# token, so 100M is about 3.6 GB (W7's 8192-token prompts reach it at 12,207 requests, W1's 128 at 781,250).
MAX_PROMPT_TOKENS = 100_000_000
# W6's prompts are a text's, not drawn: the 774-token report and a task, within this many tokens.
GROUNDED_PROMPT_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    description: str
    # Also measure the prefill attention's achieved FLOP/s (rtxcore.bench.attention_flops), on a GPU.
    measures_prefill_attention: bool = False

    @property
    def max_num_requests(self) -> int:
        """The most requests of this workload one run may build (:data:`MAX_NUM_REQUESTS`,
        :data:`MAX_PROMPT_TOKENS`)."""
        return min(MAX_NUM_REQUESTS, MAX_PROMPT_TOKENS // (self.prompt_len[1] or GROUNDED_PROMPT_TOKENS))


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("W1", 256, (128, 128), (256, 256), "offline-fixed: 256 requests, prompt 128, output 256"),
    Workload("W2", 256, (100, 1024), (100, 1024), "offline-mixed: 256 requests, prompt and output in [100, 1024]"),
    Workload("W3", 1, (128, 128), (256, 256), "single-stream: one request, prompt 128, output 256"),
    Workload("W7", 32, (8192, 8192), (128, 128), "long context: 32 requests, prompt 8192, output 128", True),
    Workload("W8B", 256, (128, 128), (128, 128), "llama-8b peer shape: 256 requests, prompt 128, output 128"),
    # Prompt lengths are the text's; output exactly 256 tokens.
    Workload("W6", 1, (0, 0), (256, 256), "input-grounded: one request to copy out a 774-token report, output 256"),
    Workload("W6x8", 8, (0, 0), (256, 256), "input-grounded, a batch of 8 (each asks for a different section)"),
    Workload("cpu", 64, (32, 256), (64, 256), "CPU variant: 64 requests, prompt 32-256, output 64-256"),
    Workload("cpu-small", 16, (16, 64), (16, 48), "smoke size: 16 requests, prompt 16-64, output 16-48"),
)}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


# W6's document, and what each of its requests asks for (the first is W6's single request).
GROUNDED_TEXT = "harbour_report.txt"
GROUNDED_TASKS = (
    "Copy the report out exactly, from its title on.",
    "Copy out section 4 (Slipway and winch) exactly, then section 6.",
    "Copy out section 3 (Piers) exactly, then section 2.",
    "Copy out section 6 (Actions) exactly, then the summary.",
    "Copy out section 2 (Breakwater) exactly, then section 5.",
    "Copy out section 5 (Lighthouse) exactly, then section 3.",
    "Copy out the summary exactly, then section 4.",
    "Copy out sections 1 and 2 exactly.",
)


def grounded_prompts(tokenizer: Tokenizer, num_requests: int) -> list[list[int]]:
    """W6's prompts: the report followed by a task that makes the answer quote it."""
    text = resources.files("rtxcore.bench").joinpath("texts", GROUNDED_TEXT).read_text(encoding="utf-8")
    return [tokenizer.encode(f"{text}\n\nTask: {GROUNDED_TASKS[i % len(GROUNDED_TASKS)]}\n\nAnswer:\n")
            for i in range(num_requests)]


def make_requests(workload: str | Workload, vocab_size: int, seed: int = 0, num_requests: int | None = None,
                  tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    """:param tokenizer: the model's, for workloads of real text (W6)."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    if w.name.startswith("W6"):
        if tokenizer is None:
            raise InvalidRequestError(f"workload {w.name} is real text: it needs a model with a tokenizer",
                                      param="workload")
        return [BenchRequest(ids, w.output_len[0]) for ids in grounded_prompts(tokenizer, num_requests or
                                                                                 w.num_requests)]
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
