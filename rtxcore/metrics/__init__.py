"""Observability: Prometheus metrics (``docs/metrics.md``) and per-request timelines (log lines and spans)."""

from rtxcore.metrics.engine_metrics import EngineMetrics
from rtxcore.metrics.timeline import RequestTimeline

__all__ = ["EngineMetrics", "RequestTimeline"]
