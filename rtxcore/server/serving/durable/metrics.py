"""Prometheus families of the journal and of resumed requests, read from their counters at each scrape (nothing is
counted twice, and the per-token path pays nothing for them). Registered only on a server with a state dir."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from rtxcore.server.serving.durable.registry import DurableRequests

# (family, help, how to read it); every counter has the model label only.
_FAMILIES: tuple[tuple[str, str, Callable[[DurableRequests], int]], ...] = (
    ("rtx_journal_records", "Records appended to the request journal.", lambda d: d.journal.stats.num_records),
    ("rtx_journal_fsyncs", "fsync calls on the request journal (one covers every record written before it: group "
                           "commit).", lambda d: d.journal.stats.num_fsyncs),
    ("rtx_journal_compactions", "Rewrites of the request journal dropping requests past retention.",
     lambda d: d.journal.stats.num_compactions),
    ("rtx_journal_corrupt_records", "Damaged journal records skipped when the journal was read at start (a torn "
                                    "last record is cut off and not counted).",
     lambda d: d.journal.stats.num_corrupt_records),
    ("rtx_journal_resumed_requests", "Unfinished requests resumed from the journal at start.",
     lambda d: d.stats.num_resumed),
    ("rtx_stream_resumes", "GET /v1/streams/{id} and gRPC Resume calls that attached to a request.",
     lambda d: d.stats.num_stream_resumes),
    ("rtx_idempotent_replays", "POST generations attached to an earlier request by their Idempotency-Key.",
     lambda d: d.stats.num_idempotent_replays),
)
FAMILY_NAMES = tuple(name for name, _, _ in _FAMILIES)


class DurableCollector:
    def __init__(self, durable: DurableRequests, model_name: Callable[[], str]):
        self.durable = durable
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name, doc, read in _FAMILIES:
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model_name()], read(self.durable))
            yield family


def register(registry: CollectorRegistry, durable: DurableRequests, model_name: Callable[[], str]) -> None:
    registry.register(DurableCollector(durable, model_name))
