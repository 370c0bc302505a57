"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular expression, a list of
choices or an EBNF/Lark grammar, by llguidance.

Why llguidance rather than xgrammar (``benchmarks/grammar_engines.py``, measured 2026-12-02 on this machine): it
enforces or plainly refuses every JSON-schema keyword tried, with messages fit for an HTTP 400, where xgrammar
silently ignores ``allOf``, ``uniqueItems``, ``not`` and ``if``; it compiles in 1-3 ms where xgrammar took 0.1 s per
``pattern`` field (a second for forty: a cheap way to stall a small server); it imports in 10 ms without
transformers; and it rolls back and checks proposed tokens, which speculative decoding needs. xgrammar's masks are
faster per token (4 µs against 16 µs per request per step), which is small beside a model step.

Per request the state is a matcher copied from a template compiled once per grammar (llguidance keeps no cache of
its own; copies share the template's lexer, which is built lazily, so a warm template also makes copies faster).
Each step fills every row's mask in one call that releases the GIL, then applies all masks at once (one kernel
on a GPU, numpy's unpacking on the CPU).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import numpy as np
import torch

from rtxcore.contracts.logits_processor import (
    LogitsProcessor,
    LogitsProcessorContext,
    RequestArgumentError,
    RowContext,
)
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import Register, hookimpl

# Compiled grammars kept for reuse, most recently used first out last.
_TEMPLATES = 256
# How llguidance's errors for a token its grammar does not allow read (llguidance 1.x): one the grammar refuses, and
# one after the grammar has ended.
_REFUSED = ("doesn't satisfy the grammar", "parser stopped")
# JSON as small models should write it: one space after ':' and ',', no other whitespace. With whitespace free, a
# 135M model can fill its whole budget with newlines inside an object and never close it.
_JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, eq=False)
class GrammarState:
    matcher: llg.LLMatcher


class StructuredOutput(LogitsProcessor):
    stateful = True

    def __init__(self, context: LogitsProcessorContext):
        super().__init__(context)
        self._lock = threading.Lock()
        self._tokenizer: llg.LLTokenizer | None = None
        self._templates: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._executor: llg.LLExecutor | None = None
        self.mask_threads = _mask_threads(context.device, context.options.get("mask_threads"))
        # The bitmask kernel's compiled launches (rtx_kernels.launch), kept across steps.
        self._launches: dict = {}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"engine": f"llguidance {getattr(llg, '__version__', '')}".strip(),
                "kinds": ["json", "json_object", "regex", "choice", "grammar"],
                "example_args": [{"regex": "[a-c]{1,4}"}, {"choice": ["yes", "no"]}],
                # Threads that fill a step's token masks (llguidance's executor): 1 on a CPU, 2 where there are
                # at least 4 cores.
                "options": ["mask_threads"]}

    # -- admission (any thread) ------------------------------------------------------------------------------------

    def prepare(self, args: Any) -> llg.LLMatcher:
        if not isinstance(args, dict) or len(args) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        [(kind, value)] = args.items()
        grammar = _grammar(kind, value)
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                return template
        tokenizer = self._llg_tokenizer()
        # Never raises on a bad grammar: the matcher is born in its error state, with the reason. Releases the GIL.
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        with self._lock:
            self._templates[grammar] = template
            while len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        return template

    def _llg_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                tokenizer = self.context.tokenizer
                if tokenizer is None:
                    raise ValueError("the model has no tokenizer to build a grammar's token masks with")
                self._tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.context.vocab_size,
                                                  eos_token=list(self.context.eos_token_ids))
            return self._tokenizer

    # -- the engine's thread ---------------------------------------------------------------------------------------

    def new_state(self, prepared: llg.LLMatcher, output_token_ids: Sequence[int]) -> GrammarState:
        matcher = prepared.deep_copy()
        if output_token_ids:  # resumed after a restart: the grammar's place is rebuilt from the journal's tokens
            matcher.consume_tokens(list(output_token_ids))
        return GrammarState(matcher)

    def forced_tokens(self, state: GrammarState, max_tokens: int) -> list[int]:
        # llguidance's fast-forward tokens: the canonical tokenization of the bytes the grammar forces (a key, a
        # quote and a colon), stopping short of a token the next free bytes could merge with.
        matcher = state.matcher
        if matcher.is_error() or matcher.is_stopped():
            return []
        return matcher.compute_ff_tokens()[:max_tokens]

    def advance(self, state: GrammarState, token_ids: Sequence[int]) -> None:
        # A refused token (a stop token with ignore_eos, a token an early exit kept) leaves the matcher in its
        # error state; apply() then allows only the end of the sequence.
        matcher = state.matcher
        matcher.consume_tokens(list(token_ids))
        if matcher.is_error():
            _raise_if_gave_up(matcher)

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        words = (logits.shape[1] + 31) // 32
        row_bytes = 4 * words
        # One buffer for the masks and, after them, the logits rows they go to: on a GPU one copy carries both.
        packed = torch.empty(len(rows) * (words + 1), dtype=torch.int32, pin_memory=logits.device.type == "cuda")
        bitmask = packed[:len(rows) * words].view(len(rows), words)
        plain: list[tuple[llg.LLMatcher, int]] = []
        for i, r in enumerate(rows):
            matcher = r.state.matcher
            if matcher.is_error():
                _raise_if_gave_up(matcher)
                self._only_stop(bitmask[i])
            elif not r.proposed:
                plain.append((matcher, i))
            else:
                # A verification row: the mask after the proposed tokens; past one the grammar refuses, the row's
                # sample can never be kept (the target's own token at the refusal is grammar-valid, so it differs).
                taken = matcher.try_consume_tokens(list(r.proposed))
                if taken == len(r.proposed):
                    matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
                else:
                    self._only_stop(bitmask[i])
                matcher.rollback(taken)
        if plain:
            self._executor_for().unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, len(rows))
            for matcher, _ in plain:
                if matcher.is_error():  # a limit met while computing the mask
                    _raise_if_gave_up(matcher)
        self._apply_bitmask(logits, [r.row for r in rows], packed, bitmask)

    def _only_stop(self, row: torch.Tensor) -> None:
        row.zero_()
        for token in self.context.eos_token_ids:
            bit = 1 << (token % 32)
            row[token // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # the word is a signed int32

    def _executor_for(self) -> llg.LLExecutor:
        if self._executor is None:
            self._executor = llg.LLExecutor(self.mask_threads)
        return self._executor

    def _apply_bitmask(self, logits: torch.Tensor, rows: list[int], packed: torch.Tensor,
                       bitmask: torch.Tensor) -> None:
        """``bitmask`` is the masks' view at the start of ``packed``, whose tail may carry the rows (GPU only)."""
        if logits.device.type == "cpu":
            # numpy unpacks the forbidden bits in one pass: 3.4 ms against 4.1 ms for a byte table's gather, for 32
            # rows of a 49k vocabulary on a 2-core Xeon.
            forbidden = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            _fill_rows(logits, rows, torch.from_numpy(forbidden).view(torch.bool)[:, :logits.shape[1]])
            return
        # On a GPU the engine's thread pays per launch: one copy and one kernel (rtx_kernels.token_bitmask),
        # imported here so that a CPU engine never imports Triton for it.
        from rtx_kernels.token_bitmask import apply_token_bitmask

        every_row = rows == list(range(len(rows)))
        if not every_row:
            packed.numpy()[bitmask.numel():] = rows
        apply_token_bitmask(logits, packed.to(logits.device, non_blocking=True), len(rows), bitmask.shape[1],
                            not every_row, self._launches)


def _raise_if_gave_up(matcher: llg.LLMatcher) -> None:
    """For a matcher in its error state: RequestArgumentError unless a refused token put it there. Any other error is
    llguidance giving up on a grammar it accepted (a resource limit met mid-way): the request then fails as its
    client's error naming the grammar's field (rtxcore.engine.faults) rather than ending quietly with what came
    before."""
    error = matcher.get_error()
    if not any(refused in error for refused in _REFUSED):
        raise RequestArgumentError(f"the grammar engine gave up on this grammar: {error.splitlines()[0]}")


def _fill_rows(logits: torch.Tensor, rows: list[int], forbidden: torch.Tensor) -> None:
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def _mask_threads(device: torch.device, option: Any) -> int:
    """Threads that fill a step's masks: the ``mask_threads`` option, else the default below."""
    if option is not None:
        if isinstance(option, bool) or not isinstance(option, int) or option < 1:
            raise ConfigError(f"structured_output option mask_threads must be a positive integer, got {option!r}")
        return option
    # Measured on the GPU machine (16 cores, an H100; a batch of 32 JSON-schema requests on a host-bound model,
    # docs/benchmarks.md): guided/free 0.490x with one thread, 0.494x with two, 0.476x with four and 0.453x with
    # eight. Masks of a few dozen rows are too short to pay for waking more threads; on a small CPU the model's
    # own kernels need the cores, and one thread it is.
    return 1 if device.type == "cpu" or (os.cpu_count() or 1) < 4 else 2


def _grammar(kind: str, value: Any) -> str:
    """llguidance's grammar text for one kind of structured output; ValueError names what is wrong."""
    if kind == "json":
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise ValueError("json must be a JSON Schema object")
        return llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_LAYOUT)
    if kind == "json_object":
        if value is not True:
            raise ValueError("json_object must be true")
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("regex must be a non-empty string")
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        # The choices as one lexeme (a Lark terminal) rather than llguidance's "choice", a rule with one alternative
        # per choice: its parser keeps an item per alternative, and past 2,000 choices it gives up after the first
        # token. The lexer takes 50,000 choices in 0.2 s. JSON strings are Lark's string literals.
        return llg.grammar_from("lark", "start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, value)))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("grammar must be the text of an EBNF (GBNF) or Lark grammar")
        return llg.grammar_from("grammar", value)
    raise ValueError(f"unknown kind {kind!r}")


@hookimpl
def register_logits_processors(register: Register) -> None:
    register("structured_output", StructuredOutput)
