"""SLA lanes: the classes of service a request can ask for, each with latency targets and a bounded queue.

Lanes are a core notion because the server (validation, tenant entitlements, ``GET /v1/lanes``), the metrics and
the scheduler all speak of them; only a lane-aware scheduler (``sla-lanes``) acts on the targets. Under ``fcfs``
a request's lane is recorded and labelled in metrics, and nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from rtxcore.errors import ConfigError

# Every lane, most urgent first; the order is the scheduling priority.
LANE_NAMES = ("realtime", "standard", "bulk")
DEFAULT_LANE = "standard"


@dataclass(frozen=True, slots=True)
class LaneSpec:
    name: str
    # Time to first token a request of this lane is promised; admission refuses work predicted to miss it.
    ttft_target_s: float
    # Inter-token latency promised while the request streams.
    itl_target_s: float
    # Requests queued (admitted, not yet running) beyond which new ones are refused at once.
    max_queue: int
    # Aging bound: a request waiting this long is served before any lane's newer work, so no lane starves.
    max_wait_s: float
    # Lanes whose running requests this lane may preempt when it has no room.
    preempts: tuple[str, ...] = ()

    @property
    def priority(self) -> int:
        """0 for the most urgent lane."""
        return LANE_NAMES.index(self.name)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "priority": self.priority, "ttft_target_s": self.ttft_target_s,
                "itl_target_s": self.itl_target_s, "max_queue": self.max_queue, "max_wait_s": self.max_wait_s,
                "preempts": list(self.preempts)}


# Targets sized for the default model on a small CPU; a GPU deployment sets tighter ones in its config file.
DEFAULT_LANES: dict[str, LaneSpec] = {
    "realtime": LaneSpec("realtime", ttft_target_s=1.0, itl_target_s=0.25, max_queue=32, max_wait_s=5.0,
                         preempts=("bulk",)),
    "standard": LaneSpec("standard", ttft_target_s=4.0, itl_target_s=0.5, max_queue=128, max_wait_s=30.0),
    "bulk": LaneSpec("bulk", ttft_target_s=30.0, itl_target_s=2.0, max_queue=256, max_wait_s=120.0),
}


def parse_lanes(table: Mapping[str, Any] | None) -> dict[str, LaneSpec]:
    """Lane specs from a config file's ``[lanes.<name>]`` tables, each overriding the defaults it names.

    :raises ConfigError: an unknown lane or field, or a value out of range.
    """
    lanes = dict(DEFAULT_LANES)
    settable = {f.name for f in fields(LaneSpec)} - {"name"}
    for name, values in (table or {}).items():
        if name not in LANE_NAMES:
            raise ConfigError(f"unknown lane {name!r} in [lanes] (lanes are: {', '.join(LANE_NAMES)})")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[lanes.{name}] must be a table")
        unknown = set(values) - settable
        if unknown:
            raise ConfigError(f"unknown setting {sorted(unknown)[0]!r} in [lanes.{name}] "
                              f"(settings: {', '.join(sorted(settable))})")
        changes = dict(values)
        if "preempts" in changes:
            preempts = changes["preempts"]
            if not isinstance(preempts, list) or not all(isinstance(lane, str) for lane in preempts):
                raise ConfigError(f"[lanes.{name}] preempts must be a list of lane names, got {preempts!r}")
            changes["preempts"] = tuple(preempts)
        lanes[name] = replace(lanes[name], **changes)
    for spec in lanes.values():
        _check_lane(spec)
    return lanes


def _check_lane(spec: LaneSpec) -> None:
    where = f"[lanes.{spec.name}]"
    for name in ("ttft_target_s", "itl_target_s", "max_wait_s"):
        value = getattr(spec, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            raise ConfigError(f"{where} {name} must be a positive number of seconds, got {value!r}")
    if not isinstance(spec.max_queue, int) or isinstance(spec.max_queue, bool) or spec.max_queue < 1:
        raise ConfigError(f"{where} max_queue must be an integer >= 1, got {spec.max_queue!r}")
    for other in spec.preempts:
        if other not in LANE_NAMES or LANE_NAMES.index(other) <= spec.priority:
            raise ConfigError(f"{where} preempts {other!r}: a lane may only preempt lanes below it "
                              f"({', '.join(LANE_NAMES[spec.priority + 1:]) or 'none'})")


def check_lane_name(lane: str, param: str = "lane") -> str:
    """``lane`` if it names a lane, else an :class:`~rtxcore.errors.InvalidRequestError` naming the choices."""
    from rtxcore.errors import InvalidRequestError

    if lane not in LANE_NAMES:
        raise InvalidRequestError(f"unknown lane {lane!r}; lanes are {', '.join(LANE_NAMES)}", param=param)
    return lane
