"""The engine's side of speculative decoding: ask proposers for tokens after a step, keep what the next step's
target pass agrees with, and count it all.

Verification needs no sampler of its own. A request verifying ``k`` proposed tokens gets ``k + 1`` logits rows, each
sampled by the engine's sampler exactly as a plain step would sample it (its penalties see the proposed tokens before
it). The proposed token of row ``j`` is accepted when row ``j`` drew it, which happens with the target's probability
of it; on the first miss, that row's draw is the target's own token, distributed as the target's distribution without
the refused token: rejection sampling with a point-mass proposal, so outputs keep the target's distribution and a
greedy request gets the very tokens plain decoding would give.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rtxcore.contracts.proposer import Proposer
from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.engine.output_processor import OutputProcessor
from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.engine.speculation.acceptance import AcceptanceTracker
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.kv.manager import KVCacheManager
from rtxcore.request import Request

log = logging.getLogger("rtx.speculation")

# The proposer of requests that bring their own tokens.
ASSISTED = "assisted"
# Where the tokens a request's grammar forces are counted (no plugin: the logits processor gives them).
GRAMMAR = "grammar"
# Most forced tokens proposed at once: a JSON key and its punctuation fit; longer runs go on in the next step.
MAX_FORCED = 16
# Largest accepted length the histogram counts separately.
MAX_RUN = 16


@dataclass(slots=True)
class ProposerStats:
    """Counters per proposer since start-up (what the rtx_spec_* metrics export)."""

    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    # accepted_runs[n]: verifications that accepted n proposed tokens.
    accepted_runs: list[int] = field(default_factory=lambda: [0] * (MAX_RUN + 1))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted proposals plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposers: dict[str, Proposer], kv_cache: KVCacheManager,
                 vocab_size: int, max_model_len: int, allowed: Callable[[], bool] = lambda: True,
                 forced_tokens: Callable[[Request, int], list[int]] | None = None):
        """:param proposers: by name: the configured method's (if any) and ``assisted``.
        :param allowed: False while speculation is off for everyone (brownout).
        :param forced_tokens: the tokens a request's logits processors force next (at most a number of them); None:
            grammars propose nothing."""
        self.config = config
        self.proposers = proposers
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.allowed = allowed
        self.tracker = AcceptanceTracker(config.num_speculative_tokens, config.min_acceptance, config.adaptive)
        self.stats: dict[str, ProposerStats] = {name: ProposerStats() for name in proposers}
        self.forced_tokens = forced_tokens
        if forced_tokens is not None:
            self.stats[GRAMMAR] = ProposerStats()
        # Which proposer each request's pending proposal came from.
        self._proposed_by: dict[str, str] = {}
        # Running requests that bring their own tokens, and those whose grammar may force some: with none of either
        # and no method, nothing speculates.
        self.num_assisted = 0
        self._forcing_ids: set[str] = set()
        # Tokens emitted by early exit since start-up.
        self.num_early_exits = 0

    @property
    def active(self) -> bool:
        """Whether any request may speculate now."""
        return self.config.method is not None or self.num_assisted > 0 or bool(self._forcing_ids)

    def on_add(self, req: Request, num_running: int) -> None:
        if self._forcing(req):
            self._forcing_ids.add(req.req_id)
        if req.draft_token_ids:
            self.num_assisted += 1
        if req.draft_token_ids or req.req_id in self._forcing_ids:
            # Verified with the prompt itself: the first output token can already come with predicted or forced ones.
            # Not a method's guesses: a proposer sees a request only once it has run.
            self.propose([req], num_running, guesses=bool(req.draft_token_ids))

    def on_finish(self, req: Request) -> None:
        self._forcing_ids.discard(req.req_id)
        if req.draft_token_ids:
            self.num_assisted -= 1
        self._proposed_by.pop(req.req_id, None)
        name = self._proposer_name(req)
        if name is not None:
            self.proposers[name].finish(req)
        self.tracker.forget(req.req_id)

    def _forcing(self, req: Request) -> bool:
        return self.forced_tokens is not None and req.logits is not None and bool(req.logits.forcing)

    # -- after a step: propose --------------------------------------------------------------------------------------

    def propose(self, reqs: Sequence[Request], num_running: int, guesses: bool = True) -> None:
        """Give each running request of ``reqs`` (those that just sampled) its proposed tokens for the next step:
        what its grammar forces where it forces anything, else (with ``guesses``) its proposer's guess."""
        for req in reqs:
            req.spec_token_ids = []  # a proposal left unverified (the step had no room for it) is stale now
        if not self.allowed():
            return
        # A large batch keeps the device busy without guesses; forced tokens are no guess and still save steps.
        guess = guesses and (self.config.disable_batch_size is None or num_running < self.config.disable_batch_size)
        groups: dict[str, tuple[list[Request], list[int]]] = {}
        for req in reqs:
            if req.status.finished or not req.speculative:
                continue
            room = min(req.params.max_tokens - req.num_output_tokens - 1,  # the target's own token comes on top
                       self.max_model_len - req.num_tokens)
            if room <= 0:
                continue
            if self.forced_tokens is not None and req.req_id in self._forcing_ids:
                forced = self._valid_prefix(self.forced_tokens(req, min(room, MAX_FORCED)))
                if forced:
                    req.spec_token_ids = forced
                    self._proposed_by[req.req_id] = GRAMMAR
                    continue
            name = self._proposer_name(req)
            if name is None or not guess:
                continue
            k = min(self.tracker.k(req.req_id), room)
            if k <= 0:
                continue
            if self.proposers[name].writes_target_kv and not self.kv_cache.allocate(req, 1 + k):
                continue  # no room in the target's cache for the proposed positions: decode plainly
            group = groups.setdefault(name, ([], []))
            group[0].append(req)
            group[1].append(k)
        for name, (group_reqs, ks) in groups.items():
            proposals = self.proposers[name].propose(group_reqs, ks)
            for req, k, tokens in zip(group_reqs, ks, proposals):
                tokens = self._valid_prefix(tokens[:k])
                if tokens:
                    req.spec_token_ids = tokens
                    self._proposed_by[req.req_id] = name

    def _proposer_name(self, req: Request) -> str | None:
        return ASSISTED if req.draft_token_ids else self.config.method

    def _valid_prefix(self, tokens: list[int]) -> list[int]:
        for i, token in enumerate(tokens):
            if not (isinstance(token, int) and 0 <= token < self.vocab_size):
                return tokens[:i]
        return list(tokens)

    # -- in the step: verify -----------------------------------------------------------------------------------------

    def verify(self, reqs: list[Request], num_rows: list[int], sampled: SamplerOutput,
               output_processor: OutputProcessor) -> list[RequestOutput]:
        """Apply a verification step's samples: each request keeps its accepted proposed tokens and the target's
        next token, as far as its stop conditions let it; the KV of refused positions is given back.

        :param num_rows: logits rows per request (1 + proposed tokens verified), in row order."""
        token_ids = sampled.token_ids.tolist()
        runs: list[list[int]] = []  # per request, the rows whose tokens it emits
        row = 0
        for req, m in zip(reqs, num_rows):
            proposed = req.spec_token_ids[:m - 1]
            accepted = 0
            while accepted < len(proposed) and token_ids[row + accepted] == proposed[accepted]:
                accepted += 1
            exited = self._exited_early(req, proposed, accepted)
            if exited:
                # Early exit: the confident drafted tokens stand; the row after the last of them gives the next.
                for i in range(accepted, accepted + exited):
                    token_ids[row + i] = proposed[i]
                accepted += exited
            runs.append(list(range(row, row + accepted + 1)))
            if proposed:
                # The refused positions' KV stays in the blocks until later steps overwrite it.
                req.num_computed_tokens -= len(proposed) - accepted
                self._record(req, len(proposed), accepted)
            req.spec_token_ids = []
            row += m
        row_reqs = [req for req, m in zip(reqs, num_rows) for _ in range(m)]
        logprobs = output_processor.row_logprobs(row_reqs, token_ids, sampled)
        return _apply_runs(reqs, runs, token_ids, logprobs, output_processor)

    def _exited_early(self, req: Request, proposed: list[int], accepted: int) -> int:
        """How many proposed tokens after the ``accepted`` ones stand by early exit: those the draft was at least
        ``early_exit_threshold`` sure of, up to the first it was not."""
        threshold = req.params.early_exit_threshold
        if threshold is None or accepted == len(proposed):
            return 0
        proposer = self.proposers.get(self._proposed_by.get(req.req_id, ""))
        confidences = proposer.confidences(req) if proposer is not None else None
        if not confidences:
            return 0
        n = 0
        while accepted + n < min(len(proposed), len(confidences)) and confidences[accepted + n] >= threshold:
            n += 1
        self.num_early_exits += n
        return n

    def supports_early_exit(self) -> bool:
        """Whether the configured proposer gives its confidences (layer-skip does)."""
        method = self.config.method
        return method is not None and type(self.proposers[method]).confidences is not Proposer.confidences

    def _record(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        name = self._proposed_by.get(req.req_id) or self._proposer_name(req)
        if name is None:
            return
        if name == ASSISTED:
            req.num_accepted_draft_tokens += num_accepted
            req.num_rejected_draft_tokens += num_proposed - num_accepted
        stats = self.stats[name]
        stats.num_proposed_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_verifications += 1
        stats.accepted_runs[min(num_accepted, MAX_RUN)] += 1
        if name == GRAMMAR:
            return  # the proposer's count adapts to its own guesses, not to what a grammar forced
        if self.tracker.record(req.req_id, num_proposed, num_accepted):
            # Plain decoding for a while: what the proposer keeps for the request (a draft's cache) is freed now.
            self.proposers[name].finish(req)


def _apply_runs(reqs: list[Request], runs: list[list[int]], token_ids: list[int],
                logprobs: list[list[TokenLogprob] | None] | None,
                output_processor: OutputProcessor) -> list[RequestOutput]:
    """Feed each request its run of tokens one position at a time (a request that stops inside its run drops the
    rest), then merge each request's outputs into one. Host lists only: this runs once per position of a run."""
    merged: dict[str, list[RequestOutput]] = {}
    live = list(range(len(reqs)))
    position = 0
    while live:
        rows = [runs[i][position] for i in live]
        outs = output_processor.apply([reqs[i] for i in live], [token_ids[row] for row in rows],
                                      [logprobs[row] for row in rows] if logprobs is not None else None)
        # A request the token failed (the detokenizer raised, or nothing was left to sample) has no output here:
        # matched by id, not by position, and it stops.
        going_on = set()
        for out in outs:
            merged.setdefault(out.req_id, []).append(out)
            if not out.finished:
                going_on.add(out.req_id)
        live = [i for i in live if reqs[i].req_id in going_on and position + 1 < len(runs[i])]
        position += 1
    return [_merge(parts) for parts in merged.values()]


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [lp for part in parts for lp in (part.logprobs or [])]
    return RequestOutput(last.req_id, [t for part in parts for t in part.new_token_ids],
                         "".join(part.new_text for part in parts), last.finished, last.finish_reason,
                         last.stop_reason, logprobs, last.num_prompt_tokens, last.num_output_tokens,
                         last.num_cached_tokens, last.timings, last.num_accepted_prediction_tokens,
                         last.num_rejected_prediction_tokens)
