"""The proposer contract, on the tiny random-weight model (``dummy:tiny``, float32 on the CPU), checked two ways.

Directly: the proposer is built as the engine builds it, ``cls(ProposerContext(...))`` over a small engine's
backend, KV cache and registry, and asked for tokens between that engine's steps, for running requests of several
lengths, with and without a caller's prediction, ``k`` from 1 to 16. Its answers must have the contract's shape and
leave every request as it found it; ``finish`` must take any request.

Through the engine: greedy output with the proposer speculating must equal greedy output without speculation, on
prompts where proposals are accepted and refused, with ``max_tokens`` and a stop token ending requests inside accepted
runs, and requests bringing a prediction in the same batches (the built-in ``assisted`` proposes for those, next to
the proposer under test, as in a server).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from rtx_conformance.rules import ContractViolation, require
from rtxcore.contracts.backend import ExecutionBackend
from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.engine.components import make_backend
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.models.resolve import resolve_model
from rtxcore.registry import ComponentRecord, PluginRegistry
from rtxcore.request import Request
from rtxcore.sampling_params import SamplingParams

TARGET_MODEL = "dummy:tiny"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 256
MAX_MODEL_LEN = 512
# Most tokens the engine asks a proposer for per request (SpeculativeConfig's upper bound).
MAX_K = 16
# Tokens proposed per request per step in the greedy comparison.
NUM_SPECULATIVE_TOKENS = 5
# early_exit_threshold of the requests that ask for early exit.
EARLY_EXIT_THRESHOLD = 0.5
# Every this many tokens, a prediction differs from the output.
PREDICTION_EDIT_EVERY = 5
# Request fields a proposer may change: the cache that ``Request.output_token_ids`` fills as it is read.
_MUTABLE_FIELDS = frozenset({"_output_token_ids"})


def target_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(model=TARGET_MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                        num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN, **overrides)


def harness_engine(registry: PluginRegistry) -> LLM:
    """The engine whose requests a proposer is asked about directly. It never speculates itself (one running request
    reaches disable_batch_size), so its requests come to the proposer as the engine's own would: none holds a
    proposal, and one bringing a prediction still counts as bringing it."""
    return LLM(target_config(speculative=SpeculativeConfig(disable_batch_size=1)), registry=registry)


def proposer_options(record: ComponentRecord) -> dict[str, Any]:
    """A proposer that declares a ``draft_model`` option (``describe()["options"]``) gets the target model itself as
    its draft: the only model the suite can count on."""
    declared = record.capabilities().get("options", ())
    return {"draft_model": TARGET_MODEL} if "draft_model" in declared else {}


def build_proposer(record: ComponentRecord, engine: LLM, registry: PluginRegistry) -> Proposer:
    core = engine.core
    context = ProposerContext(core.backend, core.config.block_size, core.kv_cache.num_blocks, core.max_model_len,
                              registry, core.kv_cache.block_table,
                              load_model=partial(_load_model, core.config, registry),
                              options=proposer_options(record))
    try:
        proposer = record.cls(context)
    except Exception as exc:
        raise ContractViolation("proposer.builds", f"{type(exc).__name__}: {exc}") from exc
    require(isinstance(proposer, Proposer), "proposer.builds", f"cls(context) made a {type(proposer).__name__}")
    return proposer


def _load_model(config: EngineConfig, registry: PluginRegistry, name: str) -> ExecutionBackend:
    """As the engine loads a draft model: by the names --model takes, on the target's backend, device and dtype."""
    source = resolve_model(name)
    backend = make_backend(dataclasses.replace(config, model=name, quantization=None), registry, source)
    backend.load(source)
    return backend


# -- direct checks ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ProposeCase:
    prompts: tuple[tuple[int, ...], ...]
    # Per request, whether it brings a prediction (``draft_token_ids``): plain decoding's own output with every
    # PREDICTION_EDIT_EVERY-th token changed, so that a proposer following it has tokens to propose and to recover
    # after.
    predicted: tuple[bool, ...]
    # Per request, whether it asks for early exit (``early_exit_threshold``): a proposer giving confidences computes
    # them for such a request.
    early_exit: tuple[bool, ...]
    # Per request, the most tokens asked for in each round.
    num_tokens: tuple[int, ...]
    # Tokens each request decodes before the first round; each round then asks, and decodes one more token.
    num_decoded: int = 2
    num_rounds: int = 3


def run_propose_case(record: ComponentRecord, engine: LLM, registry: PluginRegistry,
                     case: ProposeCase) -> int:
    """:returns: tokens proposed over every round."""
    proposer = build_proposer(record, engine, registry)
    predictions = [_predict(engine, prompt, case.num_decoded + case.num_rounds + MAX_K) if predicted else None
                   for prompt, predicted in zip(case.prompts, case.predicted)]
    reqs = _start(engine, case.prompts, predictions, case.num_decoded)
    for req, early_exit in zip(reqs, case.early_exit):
        if early_exit:
            # Set once admitted: the harness engine, which never speculates, refuses early exit at admission; the
            # proposer is asked about the request as a speculating engine would ask about it.
            req.params = dataclasses.replace(req.params, early_exit_threshold=EARLY_EXIT_THRESHOLD)
    num_proposed = 0
    try:
        for _ in range(case.num_rounds):
            proposals = propose_checked(proposer, engine, reqs, case.num_tokens)
            num_proposed += sum(len(p) for p in proposals)
            engine.step()
        for req in reqs:
            finish_checked(proposer, req)
    finally:
        _stop(engine, reqs)
    return num_proposed


def run_finish_case(record: ComponentRecord, engine: LLM, registry: PluginRegistry) -> None:
    """finish() for a request never proposed for, then for one that was, which is then proposed for again (a
    request that stopped speculating for a while starts again)."""
    proposer = build_proposer(record, engine, registry)
    prompts = ((5, 6, 7, 8, 5, 6, 7), tuple(range(40, 75)))
    reqs = _start(engine, prompts, [_predict(engine, prompts[0], 16), None], num_decoded=3)
    try:
        finish_checked(proposer, reqs[1])
        propose_checked(proposer, engine, reqs, (4, 4))
        finish_checked(proposer, reqs[0])
        engine.step()
        propose_checked(proposer, engine, reqs[:1], (4,))
        for req in reqs:
            finish_checked(proposer, req)
    finally:
        _stop(engine, reqs)


def propose_checked(proposer: Proposer, engine: LLM, reqs: Sequence[Request],
                    num_tokens: Sequence[int]) -> list[list[int]]:
    """Ask as the engine asks (room made in the target's cache first for a proposer that writes it), then check the
    answer's shape and that no request changed."""
    if proposer.writes_target_kv:
        for req, k in zip(reqs, num_tokens):
            if not engine.core.kv_cache.allocate(req, 1 + k):
                raise RuntimeError("the harness's KV cache is too small for its own requests")
    before = [snapshot(req) for req in reqs]
    proposals = proposer.propose(list(reqs), list(num_tokens))
    check_proposals(proposals, num_tokens)
    for req, tokens in zip(reqs, proposals):
        check_confidences(proposer, req, tokens)
    for req, was in zip(reqs, before):
        check_unchanged(req, was, "propose() or confidences()")
    return proposals


def finish_checked(proposer: Proposer, req: Request) -> None:
    before = snapshot(req)
    try:
        proposer.finish(req)
    except Exception as exc:
        raise ContractViolation("proposer.finish", f"finish({req.req_id!r}) raised {type(exc).__name__}: "
                                                   f"{exc}") from exc
    check_unchanged(req, before, "finish()")


def check_proposals(proposals: object, num_tokens: Sequence[int]) -> None:
    rule = "proposer.output_shape"
    if not isinstance(proposals, list):
        raise ContractViolation(rule, f"propose() returned a {type(proposals).__name__}, not a list")
    require(len(proposals) == len(num_tokens), rule,
            f"{len(proposals)} proposals for {len(num_tokens)} requests")
    for i, (tokens, k) in enumerate(zip(proposals, num_tokens)):
        require(isinstance(tokens, list), rule, f"request {i}: a {type(tokens).__name__}, not a list")
        require(len(tokens) <= k, rule, f"request {i}: {len(tokens)} tokens where at most {k} were asked for")
        for token in tokens:
            # The engine takes a proposal up to its first non-int: a numpy integer would silently propose nothing.
            require(isinstance(token, int) and not isinstance(token, bool), rule,
                    f"request {i}: token {token!r} ({type(token).__name__}) is not an int (numpy arrays give ints "
                    f"through .tolist())")


def check_confidences(proposer: Proposer, req: Request, proposal: list[int]) -> None:
    """What early exit reads right after a proposal: None, or the proposer's probability of each proposed token."""
    rule = "proposer.confidences"
    confidences = proposer.confidences(req)
    if confidences is None:
        return
    if not isinstance(confidences, list):
        raise ContractViolation(rule, f"request {req.req_id!r}: a {type(confidences).__name__}, not a list")
    require(len(confidences) == len(proposal), rule,
            f"request {req.req_id!r}: {len(confidences)} confidences for {len(proposal)} proposed tokens")
    for p in confidences:
        require(isinstance(p, float) and 0.0 <= p <= 1.0, rule,
                f"request {req.req_id!r}: confidence {p!r} is not a probability (a float in [0, 1])")


def snapshot(req: Request) -> dict[str, Any]:
    return {f.name: copy.deepcopy(getattr(req, f.name)) for f in dataclasses.fields(req)
            if f.name not in _MUTABLE_FIELDS}


def check_unchanged(req: Request, before: dict[str, Any], call: str) -> None:
    changed = [name for name, value in before.items() if getattr(req, name) != value]
    require(not changed, "proposer.request_unchanged",
            f"{call} changed request {req.req_id!r}: " + "; ".join(
                f"{name} {_short(before[name])} -> {_short(getattr(req, name))}" for name in changed))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _start(engine: LLM, prompts: Sequence[Sequence[int]], predictions: Sequence[Sequence[int] | None],
           num_decoded: int) -> list[Request]:
    """Add the requests and step until each has decoded ``num_decoded`` tokens: running, KV computed for all but
    its last token, as the engine leaves a request between steps."""
    params = SamplingParams(max_tokens=MAX_MODEL_LEN // 2, temperature=0.0, ignore_eos=True)
    reqs: list[Request] = []
    try:
        for p, d in zip(prompts, predictions):
            req_id = engine.add_request(list(p), params, draft_token_ids=list(d) if d is not None else None)
            reqs.append(engine.core.requests[req_id])
        while any(req.num_output_tokens < num_decoded for req in reqs):
            engine.step()
    except BaseException:
        _stop(engine, reqs)  # the engine is shared by every proposer's checks: leave it idle
        raise
    return reqs


def _predict(engine: LLM, prompt: Sequence[int], num_tokens: int) -> list[int]:
    [plain] = engine.generate([list(prompt)], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return edit_prediction(plain.token_ids, PREDICTION_EDIT_EVERY, engine.core.model_config.vocab_size)


def edit_prediction(tokens: Sequence[int], every: int, vocab_size: int) -> list[int]:
    """``tokens`` with every ``every``-th one changed (``every`` 1: none; the prediction is exact)."""
    return [_other_token(t, vocab_size) if every > 1 and i % every == every - 1 else t for i, t in enumerate(tokens)]


def _other_token(token: int, vocab_size: int) -> int:
    return token + 1 if token + 1 < vocab_size else 3


def _stop(engine: LLM, reqs: Sequence[Request]) -> None:
    for req in reqs:
        engine.abort(req.req_id)


# -- greedy output through the engine ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GreedyRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    # Stop on the token plain decoding gives at this output position (a stop token inside an accepted run).
    stop_at: int | None = None
    # Bring a prediction: plain decoding's output with every n-th token changed (1 changes none: it is exact).
    predict_every: int | None = None


def greedy_requests(vocab_size: int, seed: int = 0) -> tuple[GreedyRequest, ...]:
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab_size) for _ in range(n))

    pattern = (17, 42, 99, 256, 7) * 6
    return (
        GreedyRequest(pattern, 40),                       # the prompt repeats: prompt lookup finds continuations
        GreedyRequest(tokens(45), 37),
        GreedyRequest((9,) * 20, 30),                     # plain decoding settles into a loop
        GreedyRequest(tokens(70), 20),                    # several KV blocks
        GreedyRequest(pattern[:23], 40, stop_at=13),
        GreedyRequest(tokens(23), 32, predict_every=4),   # a prediction that is wrong in places
        GreedyRequest(tokens(12), 24, predict_every=1),   # an exact prediction: max_tokens ends an accepted run
        GreedyRequest(tokens(5), 1),                      # nothing to speculate: the one token is the model's
        GreedyRequest(tokens(5), 2),
    )


@dataclass(frozen=True, slots=True)
class GreedyReference:
    requests: tuple[GreedyRequest, ...]
    params: tuple[SamplingParams, ...]
    predictions: tuple[tuple[int, ...] | None, ...]
    # Plain decoding's output tokens and finish reason per request.
    outputs: tuple[tuple[list[int], str | None], ...]


def greedy_reference(registry: PluginRegistry) -> GreedyReference:
    """Plain decoding's outputs (no request speculates); the stop tokens and predictions derive from a first plain
    run."""
    engine = LLM(target_config(), registry=registry)
    vocab_size = engine.core.model_config.vocab_size
    requests = greedy_requests(vocab_size)
    first = run_greedy(engine, [r.prompt for r in requests],
                       [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests],
                       [None] * len(requests))
    params, predictions = [], []
    for r, (tokens, _) in zip(requests, first):
        stop = [tokens[r.stop_at]] if r.stop_at is not None else []
        params.append(SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop))
        predictions.append(None if r.predict_every is None else
                           tuple(edit_prediction(tokens, r.predict_every, vocab_size)))
    # Without the predictions: the engine would speculate from them (with the built-in assisted proposer).
    outputs = run_greedy(engine, [r.prompt for r in requests], params, [None] * len(requests))
    return GreedyReference(requests, tuple(params), tuple(predictions), tuple(outputs))


@dataclass(frozen=True, slots=True)
class GreedyRun:
    num_proposed: int
    num_accepted: int
    acceptance_rate: float
    mean_accepted_length: float


def run_greedy_with(record: ComponentRecord, registry: PluginRegistry, reference: GreedyReference) -> GreedyRun:
    spec = SpeculativeConfig(method=record.name, num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
                             options=proposer_options(record))
    try:
        engine = LLM(target_config(speculative=spec), registry=registry)
    except Exception as exc:
        raise ContractViolation("proposer.builds", f"the engine could not build it: {type(exc).__name__}: "
                                                   f"{exc}") from exc
    try:
        outputs = run_greedy(engine, [r.prompt for r in reference.requests], reference.params,
                             reference.predictions)
    except Exception as exc:
        raise ContractViolation("proposer.greedy_unchanged", f"speculating with it, the engine failed: "
                                                             f"{type(exc).__name__}: {exc}") from exc
    for i, (got, expected) in enumerate(zip(outputs, reference.outputs)):
        require(got == expected, "proposer.greedy_unchanged",
                f"request {i} ({_describe(reference.requests[i])}): {_first_difference(got, expected)}")
    stats = engine.core.speculator.stats[record.name]
    return GreedyRun(stats.num_proposed_tokens, stats.num_accepted_tokens, stats.acceptance_rate,
                     stats.mean_accepted_length)


def run_greedy(engine: LLM, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               predictions: Sequence[Sequence[int] | None]) -> list[tuple[list[int], str | None]]:
    """Every request in one continuous batch; each one's output tokens and finish reason."""
    ids = [engine.add_request(list(p), sp, draft_token_ids=list(d) if d is not None else None)
           for p, sp, d in zip(prompts, params, predictions)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                reasons[out.req_id] = out.finish_reason
    return [(tokens[i], reasons.get(i)) for i in ids]


def _describe(r: GreedyRequest) -> str:
    parts = [f"prompt of {len(r.prompt)} tokens", f"max_tokens {r.max_tokens}"]
    if r.stop_at is not None:
        parts.append("a stop token")
    if r.predict_every is not None:
        parts.append("a prediction")
    return ", ".join(parts)


def _first_difference(got: tuple[list[int], str | None], expected: tuple[list[int], str | None]) -> str:
    (tokens, reason), (want, want_reason) = got, expected
    for i, (a, b) in enumerate(zip(tokens, want)):
        if a != b:
            return f"output token {i} is {a}, without speculation {b}"
    if len(tokens) != len(want):
        return f"{len(tokens)} output tokens, without speculation {len(want)}"
    return f"finish reason {reason!r}, without speculation {want_reason!r}"

