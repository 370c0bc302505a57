"""The ``draft`` proposer: a smaller model of the same vocabulary proposes greedily, run by the target's backend
(same device and dtype) with a paged KV cache of its own.

Per request the draft keeps a shadow sequence: the tokens whose KV is in its cache. Before proposing, it keeps the
part of that sequence the request still agrees with (the proposals the target accepted), computes the tokens it has
not seen in one pass, then runs one batched decode step per further token.

Options: ``draft_model`` (required: a name or path as ``--model`` takes, e.g. ``dummy:llama-1b``) and ``num_kv_blocks``
(default: as many tokens as the target's cache, within what the device has left).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.contracts.scheduler import SchedulerOutput
from rtxcore.engine.batch_builder import build_step
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.kv.manager import KVCacheManager
from rtxcore.request import Request


class DraftProposer(Proposer):
    def __init__(self, context: ProposerContext):
        super().__init__(context)
        options = dict(context.options)
        name = options.pop("draft_model", None)
        blocks = options.pop("num_kv_blocks", None)
        if options:
            raise ConfigError(f"unknown draft option {sorted(options)[0]!r} (options: draft_model, num_kv_blocks)")
        if not name:
            raise ConfigError("the draft proposer needs a draft model: --draft-model NAME (e.g. dummy:llama-1b)")
        if context.load_model is None:
            raise ConfigError("this engine cannot load a draft model")
        self.backend = context.load_model(str(name))
        target_vocab = context.backend.model_config.vocab_size
        if self.backend.model_config.vocab_size != target_vocab:
            raise ConfigError(f"draft model {name} has a vocabulary of {self.backend.model_config.vocab_size} "
                              f"tokens, the target {target_vocab}: a draft must share the target's vocabulary")
        block_size = context.block_size
        if blocks is None:
            per_block = self.backend.kv_cache_bytes_per_token() * block_size
            blocks = min(context.num_kv_blocks, max(2, self.backend.available_kv_cache_bytes() // per_block))
        num_blocks = int(blocks)
        self.backend.allocate_kv_cache(num_blocks, block_size)
        policy = context.registry.create("eviction_policy", "lru", num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, block_size, policy, enable_prefix_caching=False)
        self.draft_model = str(name)
        # Per request: the tokens whose KV the draft's cache holds, as a request of its own.
        self._shadows: dict[str, Request] = {}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"method": "draft model, greedy", "options": ["draft_model", "num_kv_blocks"]}

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {req.req_id: [] for req in reqs}
        left = {req.req_id: k for req, k in zip(reqs, num_tokens)}
        step = SchedulerOutput()
        for req in reqs:
            shadow = self._catch_up(req)
            n = len(shadow.all_token_ids) - shadow.num_computed_tokens
            if self.kv_cache.allocate(shadow, n):
                step.scheduled.append(shadow)
                step.num_scheduled_tokens.append(n)
            else:  # no room: forget this request's draft state rather than take others'
                self.finish(req)
        while step.scheduled:
            plan = build_step(step, self.kv_cache.block_table, self.context.block_size, {})
            tokens = self.backend.execute(plan.batch).argmax(dim=-1).tolist()
            for shadow, n in zip(plan.reqs, plan.num_tokens):
                shadow.num_computed_tokens += n
            step = SchedulerOutput()
            for shadow, token in zip(plan.sampling_reqs, tokens):
                shadow.all_token_ids.append(token)
                proposals[shadow.req_id].append(token)
                left[shadow.req_id] -= 1
                if left[shadow.req_id] > 0 and self.kv_cache.allocate(shadow, 1):
                    step.scheduled.append(shadow)
                    step.num_scheduled_tokens.append(1)
        return [proposals[req.req_id] for req in reqs]

    def _catch_up(self, req: Request) -> Request:
        """The request's shadow, holding the KV of the longest prefix the draft computed that the request still
        has, and its sequence set to the request's."""
        tokens = req.all_token_ids
        shadow = self._shadows.get(req.req_id)
        if shadow is None:
            shadow = self._shadows[req.req_id] = Request(req.req_id, req.prompt_token_ids, req.params)
            shadow.all_token_ids = list(tokens)
            return shadow
        computed, seen = shadow.num_computed_tokens, shadow.all_token_ids
        valid = 0
        limit = min(computed, len(tokens))
        # Usually only the last few tokens (its own proposals) can differ: compare the common length at once first.
        if tokens[:limit] == seen[:limit]:
            valid = limit
        else:
            while valid < limit and tokens[valid] == seen[valid]:
                valid += 1
        # At least the last token is computed again: its logits give the first proposal.
        shadow.num_computed_tokens = min(valid, len(tokens) - 1)
        shadow.all_token_ids = list(tokens)
        return shadow

    def finish(self, req: Request) -> None:
        shadow = self._shadows.pop(req.req_id, None)
        if shadow is not None:
            self.kv_cache.free(shadow)


@hookimpl
def register_proposers(register: Register) -> None:
    register("draft", DraftProposer)
