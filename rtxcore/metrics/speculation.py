"""The rtx_spec_* families: the speculator's counters per proposer, exported as Prometheus counters and the
accepted-length histogram by the increments since the previous reading (each step and idle tick)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from rtxcore.engine.speculation.speculator import ProposerStats, Speculator
from rtxcore.metrics.prometheus import Families


@dataclass(slots=True)
class _Series:
    """One proposer's children, and its counters as last exported."""

    proposed: Counter
    accepted: Counter
    verifications: Counter
    accepted_length: Histogram
    exported: ProposerStats = field(default_factory=ProposerStats)


class SpeculationMetrics:
    def __init__(self, families: Families, model_name: str):
        self._families = families
        self._model_name = model_name
        self._speculator: Speculator | None = None
        # By proposer name; made when a speculator is first seen, so every proposer's series exists from the
        # start at 0 (a rate over a series that appears late misses its first increase).
        self._series: dict[str, _Series] = {}

    def update(self, speculator: Speculator) -> None:
        """Bring the families up to ``speculator``'s counters. Costs O(proposers) plus one histogram observation per
        verification since the previous call."""
        if speculator is not self._speculator:  # first call, or another engine: its counts so far are all new
            self._speculator = speculator
            self._series.clear()
        for name, stats in speculator.stats.items():
            series = self._series.get(name)
            if series is None:
                series = self._series[name] = self._bind(name)
            self._export(series, stats)

    def relabel(self, model_name: str) -> None:
        """Export under another model label (the families were cleared): every count so far goes out again."""
        self._model_name = model_name
        self._speculator = None
        self._series.clear()

    def _bind(self, name: str) -> _Series:
        f, model = self._families, self._model_name
        return _Series(f.spec_proposed_tokens.labels(model, name), f.spec_accepted_tokens.labels(model, name),
                       f.spec_verifications.labels(model, name), f.spec_accepted_length.labels(model, name))

    @staticmethod
    def _export(series: _Series, stats: ProposerStats) -> None:
        done = series.exported
        # The speculator counts all three at each verification: unchanged verifications, nothing new (most steps).
        if stats.num_verifications == done.num_verifications:
            return
        for counter, now, before in ((series.proposed, stats.num_proposed_tokens, done.num_proposed_tokens),
                                     (series.accepted, stats.num_accepted_tokens, done.num_accepted_tokens),
                                     (series.verifications, stats.num_verifications, done.num_verifications)):
            if now > before:
                counter.inc(now - before)
        for accepted, (now, before) in enumerate(zip(stats.accepted_runs, done.accepted_runs)):
            for _ in range(now - before):
                series.accepted_length.observe(accepted)
        series.exported = ProposerStats(stats.num_proposed_tokens, stats.num_accepted_tokens,
                                        stats.num_verifications, list(stats.accepted_runs))
