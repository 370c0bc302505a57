"""The ``sla-lanes`` scheduler plugin: lanes with targets, admission control, aging, preemption and brownout."""

from rtxcore.hookspecs import hookimpl
from rtx_plugins.schedulers.sla_lanes.scheduler import SLALanesScheduler

__all__ = ["SLALanesScheduler"]


@hookimpl
def register_schedulers(register) -> None:
    register("sla-lanes", SLALanesScheduler)
