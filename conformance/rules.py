"""The rules of each plugin kind's contract, by name. A broken rule fails with a message that starts with its name,
so a plugin author sees at once which promise the plugin did not keep.

Every kind has two rules besides its own: ``<kind>.builds`` (the class builds from what the host gives it) and
``<kind>.api`` (its methods return the documented types and raise nothing the contract does not allow). The suite
reports an exception that escapes a plugin, wherever it comes from, under one of those two.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from rtx_conformance import check_timeout

RULES: dict[str, str] = {
    # any plugin (an entry point), before it has components
    "plugin.loads": "the entry point's module imports and its hooks register their components without raising",
    # schedulers
    "scheduler.builds": "cls(config, kv_cache) builds a Scheduler without raising",
    "scheduler.api": "schedule() returns a SchedulerOutput, num_waiting and num_running are ints, and no method "
                     "raises (add_request may refuse with AdmissionRefused)",
    "scheduler.token_budget": "a step never schedules more tokens than max_num_batched_tokens",
    "scheduler.max_num_seqs": "no more than max_num_seqs requests run at once",
    "scheduler.kv_capacity": "every scheduled request holds KV space for its computed plus scheduled tokens",
    "scheduler.kv_protocol": "the KV-cache manager is used as documented (lookup_prefix, allocate, free)",
    "scheduler.no_duplicates": "a request is scheduled at most once per step",
    "scheduler.known_tokens": "a step computes at least one token and never past a request's known tokens",
    "scheduler.no_drop": "every queued request stays accounted for (waiting or running) until it finishes",
    "scheduler.finished_stay_out": "a finished or aborted request is never scheduled again and holds no KV space",
    "scheduler.preemption": "a preempted request holds no KV space, restarts from 0 and is not scheduled that step",
    "scheduler.progress": "every admitted request finishes under a finite workload (no stall, bounded steps, merge "
                          "windows of at most a second in a row)",
    "scheduler.admission": "a refused request comes with a reason and a positive retry-after, holds no KV space and "
                           "is never scheduled",
    # eviction policies
    "eviction.builds": "cls(capacity) builds an EvictionPolicy without raising",
    "eviction.api": "evict() returns a block id (int) or None, len() an int, `in` a bool, and no call raises",
    "eviction.only_candidates": "evict() returns only a current candidate, never an in-use or pinned block",
    "eviction.evicts_when_asked": "evict() returns a candidate whenever there is one, and None only when none",
    "eviction.tracks_candidates": "len(policy) and `block in policy` follow the calls: add() makes a candidate, "
                                  "remove(), forget() and evict() end one, nothing else does",
    "eviction.bounded_metadata": "metadata stays within O(capacity) however long the policy runs",
    # samplers
    "sampler.builds": "cls() builds a Sampler without raising",
    "sampler.api": "sample() returns a SamplerOutput and target_probs() None or a [rows, vocab] tensor, without "
                   "raising",
    "sampler.output_shape": "one int64 token id per row, each within the vocabulary",
    "sampler.greedy_argmax": "a greedy row (temperature 0) gets the argmax of its logits (every row does, for a "
                             "sampler that declares greedy_only)",
    "sampler.allowed_set": "a sampled token is always inside the row's top-k / top-p / min-p set",
    "sampler.seeded_reproducible": "a seeded row gives the same tokens for the same seed, whatever else is batched",
    "sampler.logprobs": "returned log-probabilities are the raw model's log-softmax at the chosen tokens",
    "sampler.target_is_truncation": "a declared target distribution is softmax(logits/T) on a subset of the "
                                    "allowed set that keeps the argmax, renormalized",
    "sampler.distribution": "draws follow the target distribution (chi-square goodness of fit)",
    "sampler.temperature": "a higher temperature spreads the draws: their entropy at T=2 exceeds that at T=0.5",
    "sampler.filters": "top-k, top-p and min-p each narrow the draws to fewer tokens than the unfiltered row's, "
                       "and leave more than one where their set keeps several likely tokens",
    "sampler.seed": "the seed picks the draws: rows seeded differently do not all draw the same token",
    # quantizers
    "quantizer.builds": "cls() builds a Quantizer without raising",
    "quantizer.api": "quantize() returns a QuantizedTensor, dequantize() and linear() tensors, without raising",
    "quantizer.declares_bound": "max_relative_error is declared, positive and below 1",
    "quantizer.error_bound": "||W - dequantize(quantize(W))|| / ||W|| <= max_relative_error on Gaussian weights",
    "quantizer.shape": "the quantized tensor records the method name, shape and dtype; dequantize restores them",
    "quantizer.round_trip": "save (safetensors plus JSON meta) and load give back a tensor that dequantizes "
                            "identically",
    "quantizer.linear": "linear() from the stored form keeps the output within twice max_relative_error of the exact "
                        "product, in x's dtype and shape",
    "quantizer.fake_quantize": "fake_quantize(W) equals dequantize(quantize(W)) and passes the gradient through "
                               "unchanged (quantization-aware training)",
    "quantizer.fusable": "weights quantized apart and stacked along their outputs (q|k|v) dequantize as the stacked "
                         "weights: every tensor's first dimension is the outputs, but input_* tensors, shared",
    "quantizer.rounded_rows": "where rounded_rows() names a form for an input, linear() given the input rounded so "
                              "returns the same bits as given the input itself (naming none meets it)",
    # backends
    "backend.builds": "cls(options) builds an ExecutionBackend without raising",
    "backend.api": "load, allocate_kv_cache and execute run without raising; execute returns a [rows, vocab] tensor",
    "backend.logits_match": "logits match the reference (Hugging Face transformers, same weights) within tolerance",
    "backend.greedy_tokens": "greedy tokens equal the reference's",
    "backend.capabilities": "capabilities() returns BackendCapabilities without building the backend",
    # proposers
    "proposer.api": "propose(), confidences() and finish() raise nothing",
    "proposer.builds": "cls(context) builds a Proposer from the ProposerContext of a small engine",
    "proposer.output_shape": "propose() returns a list of one list per request, each of at most num_tokens[i] ints",
    "proposer.request_unchanged": "propose(), confidences() and finish() leave every request as they found it",
    "proposer.confidences": "confidences(req) is None or one probability in [0, 1] per token of the request's "
                            "latest proposal",
    "proposer.finish": "finish() takes any request, one never proposed for included, and a request can be proposed "
                       "for again after it",
    "proposer.greedy_unchanged": "greedy output with the proposer speculating equals greedy output without "
                                 "speculation",
    # logits processors
    "logits_processor.api": "new_state(), apply() and advance() raise nothing; prepare() only ValueError",
    "logits_processor.example_args": "describe() declares example_args: a non-empty list of arguments a request "
                                     "may give the processor",
    "logits_processor.builds": "cls(context) builds a LogitsProcessor from a LogitsProcessorContext (the default "
                               "model's, with its tokenizer, where prepare() asks for one)",
    "logits_processor.prepare": "prepare() takes every example argument and refuses a wrong one with ValueError, "
                                "never another exception",
    "logits_processor.rows_only": "apply() changes the logits in place at the given rows only, each as it would "
                                  "alone, keeping their shape and dtype",
    "logits_processor.valid_logits": "after apply() every given row keeps a finite logit, and none is NaN or +inf",
    "logits_processor.apply_pure": "apply() does not advance a state: the same call twice gives the same logits",
    "logits_processor.proposed_rows": "a row after proposed tokens scores as a state advanced over them, and leaves "
                                      "its state as it found it",
    "logits_processor.forced_tokens": "forced_tokens() gives at most the tokens asked for, each one apply() allows "
                                      "after those before it, and leaves its state as it found it",
    "logits_processor.advance": "advance() takes the tokens the processor's own logits choose (their argmax), step "
                                "after step",
    "logits_processor.resume": "new_state(prepared, tokens) scores as a new state advanced over the same tokens",
    "logits_processor.independent_states": "states from one prepared argument are independent: advancing one "
                                           "leaves another as new",
    "logits_processor.finish": "finish() takes any state: never applied, applied or advanced",
    "logits_processor.engine": "a greedy request with each example completes through the engine, every output "
                               "token one the processor allows there",
    # authenticators
    "authenticator.builds": "cls(context) builds an Authenticator from its example's AuthenticatorContext",
    "authenticator.api": "authenticate() returns a tenant name or None and raises nothing but AuthenticationFailed "
                         "(with a reason)",
    "authenticator.example": "example() returns an AuthenticatorExample with credentials it accepts, each proving "
                             "one of the context's tenants",
    "authenticator.accepts": "each accepted example proves its tenant",
    "authenticator.refuses": "refused examples and junk (malformed headers, other schemes, random, altered or "
                             "oversized tokens, certificates of unknown tenants) prove no tenant",
    "authenticator.reason_without_secret": "a refusal's reason, which the server logs, never repeats the token or "
                                           "key presented",
    "authenticator.nothing_presented": "credentials with nothing in them get None (not its kind), not a refusal",
}


# A plugin kind -> the prefix of its rules' names.
RULE_PREFIX: dict[str, str] = {
    "scheduler": "scheduler", "eviction_policy": "eviction", "sampler": "sampler", "quantizer": "quantizer",
    "backend": "backend", "proposer": "proposer", "logits_processor": "logits_processor",
    "authenticator": "authenticator", "plugin": "plugin",
}


def rules_of(kind: str) -> list[str]:
    """The rules of one plugin kind, in the order of :data:`RULES`."""
    prefix = RULE_PREFIX[kind] + "."
    return [rule for rule in RULES if rule.startswith(prefix)]


def kind_rule(kind: str, rule: str) -> str:
    """``"builds"`` or ``"api"`` of ``kind``: ``kind_rule("eviction_policy", "api") == "eviction.api"``."""
    return f"{RULE_PREFIX[kind]}.{rule}"


class ContractViolation(AssertionError):
    """A plugin broke one rule of its kind's contract."""

    def __init__(self, rule: str, detail: str):
        if rule not in RULES:
            raise KeyError(f"unknown conformance rule {rule!r}")
        self.rule = rule
        self.detail = detail
        super().__init__(f"[{rule}] {RULES[rule]}: {detail}")


def require(ok: bool, rule: str, detail: str) -> None:
    """Raise :class:`ContractViolation` for ``rule`` unless ``ok``; ``detail`` says what was observed."""
    if not ok:
        raise ContractViolation(rule, detail)


def build(kind: str, cls: type, *args: Any) -> Any:
    """``cls(*args)``, as the host builds a component of ``kind``; what it raises breaks ``<kind>.builds``."""
    try:
        return cls(*args)
    except Exception as exc:
        raise ContractViolation(kind_rule(kind, "builds"),
                                f"{cls.__name__}(...) raised {describe_exception(exc, cls)}") from exc


def describe_exception(exc: BaseException, cls: type | None = None) -> str:
    """``"KeyError: 5 (at rtx_fifo/eviction_policy.py:31 in evict)"``: the exception and the innermost line of the
    plugin's own package it went through (of ``cls``'s top-level package; the innermost line at all without one)."""
    # A check's time limit raises from its signal handler: the line that matters is the one it interrupted.
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != check_timeout.__file__]
    root = _package_dir(cls) if cls is not None else None
    mine = [f for f in frames if root is not None and Path(f.filename).resolve().is_relative_to(root)]
    frame = (mine or frames or [None])[-1]
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if frame is None:
        return text
    path = Path(frame.filename)
    shown = path.resolve().relative_to(root.parent) if mine and root is not None else Path(*path.parts[-2:])
    return f"{text} (at {shown}:{frame.lineno} in {frame.name})"


def _package_dir(cls: type) -> Path | None:
    module = sys.modules.get(cls.__module__.split(".")[0])
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    return path.parent if path.name == "__init__.py" else path
