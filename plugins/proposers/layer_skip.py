"""The ``layer-skip`` proposer (self-speculation): the target model drafts for itself through a subset of its own
layers and its own LM head: no second model, no training, no memory of its own.

The draft writes its layers' K/V into the target's cache at the proposed positions (the engine makes room for them
first); the verifying pass writes every layer there again, and for accepted tokens the draft's layers compute the same
values, so the cache ends as plain decoding would leave it.

Option ``layers``: the layers the draft runs, as ranges and indices (``"0-11,15,20-29"``); or ``exit_layer`` N: the
first N layers, an early exit. Default: every other layer of the middle half and every layer outside it, which keeps
the first and last layers that matter most to the final norm and LM head.

With this proposer, a request's ``early_exit_threshold`` emits the drafted tokens the draft is that sure of as they
are: early exit as a decoding strategy, faster at a measured cost in quality (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rtxcore.contracts.backend import ForwardBatch
from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.request import Request


def parse_layers(spec: Any, num_layers: int) -> list[int]:
    """``"0-11,15"`` or a list of ints -> sorted distinct layer indices, each checked against ``num_layers``."""
    if isinstance(spec, str):
        layers: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            first, _, last = part.partition("-")
            try:
                lo, hi = int(first), int(last or first)
            except ValueError:
                raise ConfigError(f"layer-skip layers: {part!r} is not an index or a range like 0-11") from None
            layers.update(range(lo, hi + 1))
    elif isinstance(spec, (list, tuple)) and all(isinstance(i, int) for i in spec):
        layers = set(spec)
    else:
        raise ConfigError(f"layer-skip layers must be a string like '0-11,15' or a list of ints, got {spec!r}")
    if not layers or min(layers) < 0 or max(layers) >= num_layers:
        raise ConfigError(f"layer-skip layers must be within 0-{num_layers - 1}, got {spec!r}")
    return sorted(layers)


def default_layers(num_layers: int) -> list[int]:
    quarter = num_layers // 4
    middle = range(quarter, num_layers - quarter)
    return [i for i in range(num_layers) if i not in middle or (i - quarter) % 2 == 0]


class LayerSkipProposer(Proposer):
    writes_target_kv = True

    def __init__(self, context: ProposerContext):
        super().__init__(context)
        backend = context.backend
        if not backend.capabilities().layer_subset:
            raise ConfigError(f"layer-skip needs a backend that runs a subset of the model's layers; "
                              f"{type(backend).__name__} does not")
        num_layers = backend.model_config.num_layers
        options = dict(context.options)
        spec, exit_layer = options.pop("layers", None), options.pop("exit_layer", None)
        if options:
            raise ConfigError(f"unknown layer-skip option {sorted(options)[0]!r} (options: layers, exit_layer)")
        if spec is not None and exit_layer is not None:
            raise ConfigError("layer-skip takes layers or exit_layer, not both")
        if exit_layer is not None:
            try:
                n = int(exit_layer)
            except (TypeError, ValueError):
                raise ConfigError(f"layer-skip exit_layer must be an integer, got {exit_layer!r}") from None
            if not 1 <= n < num_layers:
                raise ConfigError(f"layer-skip exit_layer must be in [1, {num_layers - 1}], got {n}")
            self.layers = list(range(n))
        else:
            self.layers = parse_layers(spec, num_layers) if spec is not None else default_layers(num_layers)
        # Per request: the draft's probability of each token of its latest proposal (for early exit).
        self._confidences: dict[str, list[float]] = {}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"method": "self-speculation through a subset of the target's layers", "options": ["layers",
                                                                                                    "exit_layer"]}

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in reqs]
        active = list(range(len(reqs)))
        # Round r feeds each request its latest token at its position and reads the next one.
        inputs = [req.all_token_ids[-1] for req in reqs]
        positions = [len(req.all_token_ids) - 1 for req in reqs]
        block_tables = self.context.block_table_of([req.req_id for req in reqs])
        block_size = self.context.block_size
        # Early exit needs the draft's probability of each token it proposes; plain self-speculation does not.
        want_confidence = any(req.params.early_exit_threshold is not None for req in reqs)
        confidences: list[list[float]] = [[] for _ in reqs]
        while active:
            ids = [inputs[i] for i in active]
            pos = torch.tensor([positions[i] for i in active], dtype=torch.int64)
            table = torch.from_numpy(block_tables[active])
            rows = torch.arange(len(active))
            slots = table[rows, pos // block_size].to(torch.int64) * block_size + pos % block_size
            batch = ForwardBatch(
                input_ids=torch.tensor(ids, dtype=torch.int64), positions=pos,
                query_start_loc=list(range(len(active) + 1)), seq_lens=(pos + 1).tolist(), block_tables=table,
                slot_mapping=slots, logits_indices=rows, block_size=block_size, num_decodes=len(active))
            logits = self.context.backend.execute_layers(batch, self.layers)
            if want_confidence:
                best, top = logits.softmax(dim=-1).max(dim=-1)
                tokens = top.tolist()
                for i, p in zip(active, best.tolist()):
                    confidences[i].append(p)
            else:
                tokens = logits.argmax(dim=-1).tolist()
            still = []
            for i, token in zip(active, tokens):
                proposals[i].append(token)
                inputs[i], positions[i] = token, positions[i] + 1
                if len(proposals[i]) < num_tokens[i]:
                    still.append(i)
            active = still
        for req, conf in zip(reqs, confidences):
            if conf:
                self._confidences[req.req_id] = conf
            else:
                self._confidences.pop(req.req_id, None)
        return proposals

    def confidences(self, req: Request) -> list[float] | None:
        return self._confidences.get(req.req_id)

    def finish(self, req: Request) -> None:
        self._confidences.pop(req.req_id, None)


@hookimpl
def register_proposers(register: Register) -> None:
    register("layer-skip", LayerSkipProposer)
