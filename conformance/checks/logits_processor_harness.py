"""What the logits-processor checks run on: the models a processor is built for (the tiny random-weight model, or
the default model where ``prepare()`` asks for a tokenizer), a processor built with its example arguments prepared,
and the calls that turn a processor's exception into the rule it breaks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rtx_conformance.rules import ContractViolation, describe_exception, require
from rtxcore.contracts.logits_processor import LogitsProcessor, LogitsProcessorContext, RowContext
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.models.resolve import resolve_model
from rtxcore.registry import ComponentRecord, PluginRegistry

TINY_MODEL = "dummy:tiny"


class Models:
    """The models the checks use, each loaded on first need and kept for the session: ``dummy:tiny`` for processors
    that need no tokenizer, the default model for those whose ``prepare()`` asks for one."""

    def __init__(self, registry: PluginRegistry):
        self.registry = registry
        self._contexts: dict[bool, LogitsProcessorContext] = {}
        self._engines: dict[bool, LLM] = {}
        # Processor name -> whether it needs a tokenizer.
        self._needs_tokenizer: dict[str, bool] = {}
        # Processor name -> its harness: one instance serves every check, as one serves every request of an engine.
        self._harnesses: dict[str, Harness] = {}

    def context(self, tokenizer: bool) -> LogitsProcessorContext:
        if tokenizer not in self._contexts:
            source = resolve_model(None if tokenizer else TINY_MODEL)
            tok = source.tokenizer()
            eos = tok.eos_token_ids if tok is not None else source.config.eos_token_ids
            self._contexts[tokenizer] = LogitsProcessorContext(tok, source.config.vocab_size, list(eos),
                                                               torch.device("cpu"))
        return self._contexts[tokenizer]

    def engine(self, tokenizer: bool) -> LLM:
        if tokenizer not in self._engines:
            config = EngineConfig(model=None if tokenizer else TINY_MODEL, device="cpu",
                                  dtype="auto" if tokenizer else "float32", num_kv_blocks=64, max_model_len=512)
            self._engines[tokenizer] = LLM(config, registry=self.registry)
        return self._engines[tokenizer]

    def needs_tokenizer(self, record: ComponentRecord) -> bool:
        """Whether ``prepare()`` of an example, on the tiny model's context, refuses for want of a tokenizer."""
        if record.name not in self._needs_tokenizer:
            processor = build(record, self.context(tokenizer=False))
            needs = False
            for args in example_args(record):
                try:
                    processor.prepare(args)
                except ValueError as exc:
                    needs = needs or "tokenizer" in str(exc)
                except Exception:  # the prepare check reports it, on the context the processor is tested with
                    pass
            self._needs_tokenizer[record.name] = needs
        return self._needs_tokenizer[record.name]

    def harness(self, record: ComponentRecord) -> Harness:
        if record.name not in self._harnesses:
            self._harnesses[record.name] = make_harness(record, self)
        return self._harnesses[record.name]


@dataclass(frozen=True, slots=True)
class Harness:
    """A processor built for the checks, with its example arguments and what prepare() made of each."""

    record: ComponentRecord
    processor: LogitsProcessor
    examples: list[Any]
    prepared: list[Any]
    # True: built on the default model's context (prepare() asks for a tokenizer); the engine check runs on that
    # model too.
    tokenizer: bool

    @property
    def vocab_size(self) -> int:
        return self.processor.context.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.processor.context.eos_token_ids

    def new_state(self, index: int, rule: str, output_token_ids: Sequence[int] = ()) -> Any:
        return call_checked(rule, "new_state", self.processor.new_state, self.prepared[index], list(output_token_ids))

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext], rule: str) -> None:
        call_checked(rule, "apply", self.processor.apply, logits, list(rows))

    def advance(self, state: Any, token_ids: Sequence[int], rule: str) -> None:
        call_checked(rule, "advance", self.processor.advance, state, list(token_ids))

    def scores(self, state: Any, logits: torch.Tensor, rule: str) -> torch.Tensor:
        """``logits`` (one row) as apply() leaves them for a plain row of ``state``; ``logits`` is left alone."""
        out = logits.clone().unsqueeze(0)
        self.apply(out, [RowContext(0, state)], rule)
        return out[0]


def example_args(record: ComponentRecord) -> list[Any]:
    rule = "logits_processor.example_args"
    cls: type[LogitsProcessor] = record.cls
    try:
        described = cls.describe()
    except Exception as exc:
        raise ContractViolation(rule, f"describe() raised {type(exc).__name__}: {exc}") from exc
    examples = described.get("example_args") if isinstance(described, dict) else None
    if not isinstance(examples, list) or not examples:
        raise ContractViolation(rule, f"describe() has no example_args (got {examples!r}): declare a list of "
                                      f"arguments a request may give, describe() returning {{'example_args': [...]}}")
    return examples


def build(record: ComponentRecord, context: LogitsProcessorContext) -> LogitsProcessor:
    try:
        processor = record.cls(context)
    except Exception as exc:
        raise ContractViolation("logits_processor.builds", f"{type(exc).__name__}: {exc}") from exc
    require(isinstance(processor, LogitsProcessor), "logits_processor.builds",
            f"cls(context) made a {type(processor).__name__}")
    return processor


def make_harness(record: ComponentRecord, models: Models) -> Harness:
    examples = example_args(record)
    tokenizer = models.needs_tokenizer(record)
    processor = build(record, models.context(tokenizer))
    prepared = [call_checked("logits_processor.prepare", f"prepare({short(args)})", processor.prepare, args)
                for args in examples]
    return Harness(record, processor, examples, prepared, tokenizer)


def random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 2


# -- direct checks ------------------------------------------------------------------------------------------------


def call_checked(rule: str, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; what it raises breaks ``rule``, the line saying where it was raised (the innermost frame: the
    processor's own code)."""
    try:
        return fn(*args)
    except ContractViolation:
        raise
    except Exception as exc:
        raise ContractViolation(rule, f"{what} raised {describe_exception(exc)}") from exc


def short(value: Any) -> str:
    text = "an object()" if type(value) is object else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

