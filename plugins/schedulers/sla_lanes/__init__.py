"""The ``sla-lanes`` scheduler plugin: lanes with targets, admission control, aging, preemption and brownout."""

from rtx_plugins.schedulers.sla_lanes.scheduler import SLALanesScheduler
from rtxcore.hookspecs import hookimpl

__all__ = ["SLALanesScheduler"]


@hookimpl
def register_schedulers(register) -> None:
    register("sla-lanes", SLALanesScheduler)
