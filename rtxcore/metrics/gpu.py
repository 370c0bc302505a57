"""GPU utilisation and memory for ``/metrics``, read from NVML (the ``nvidia-ml-py`` package) at each scrape.

The series exist only where NVML answers with at least one GPU: on a machine without one they are absent, not zero,
so that a dashboard or an alert can tell "idle" from "not measured". NVML counts every process on the GPU, which is
what an operator sizing a node wants; ``torch.cuda`` would see this process only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

FAMILIES = ("rtx_gpu_utilization_ratio", "rtx_gpu_memory_used_bytes", "rtx_gpu_memory_total_bytes")


class GpuCollector(Collector):
    def __init__(self, nvml: Any, handles: list[Any]):
        self.nvml, self.handles = nvml, handles

    def collect(self) -> Iterator[GaugeMetricFamily]:
        util = GaugeMetricFamily(FAMILIES[0], "Share of the last sample period in which a kernel ran "
                                 "on the GPU (NVML; every process on it).", labels=["gpu"])
        used = GaugeMetricFamily(FAMILIES[1], "GPU memory in use (NVML; every process on it).",
                                 labels=["gpu"])
        total = GaugeMetricFamily(FAMILIES[2], "GPU memory in all.", labels=["gpu"])
        for index, handle in enumerate(self.handles):
            try:
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except self.nvml.NVMLError as exc:  # a GPU fallen off the bus: leave it out of this scrape
                log.warning("NVML could not read GPU %d: %s", index, exc)
                continue
            util.add_metric([str(index)], rates.gpu / 100.0)
            used.add_metric([str(index)], float(memory.used))
            total.add_metric([str(index)], float(memory.total))
        yield from (util, used, total)


def register_gpu_metrics(registry: CollectorRegistry) -> bool:
    """Add the GPU series to ``registry`` where NVML finds a GPU; says whether it did."""
    try:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:  # no driver, no GPU: nothing to export
        return False
    if not handles:
        return False
    registry.register(GpuCollector(pynvml, handles))
    return True
