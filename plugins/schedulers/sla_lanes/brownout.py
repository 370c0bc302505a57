"""Brownout: an ordered ladder of degradation steps the scheduler climbs under overload and descends after it.

The controller watches one number, the *pressure*: how close the lanes brownout protects (every lane but the
lowest) are to missing their targets, as the predicted time to first token over its target, or the predicted step
time over the tightest inter-token target of the lanes streaming now. 1.0 means "just meets it".

Hysteresis keeps it from oscillating: it climbs one level after the pressure has stayed at or above
``enter_pressure`` for ``enter_after_s``, and steps down one level after it has stayed below ``exit_pressure``
(well under ``enter_pressure``) for the exit hold; in between it holds. The exit hold starts at ``exit_after_s``
and doubles (up to 8x) each time the controller has to climb again soon after stepping down, so a load that only
fits while shed settles at its level instead of flapping; a calm spell at level 0 resets it, and so does an idle
engine (no request waiting or running): with no load left there is nothing to flap about, and a server that has
drained must not keep shedding for minutes because an earlier load once flapped.

The ladder ends by pausing speculative decoding, where the engine speculates: verifying proposals spends compute
on tokens that may be refused, which an overloaded engine needs for accepted work (without a proposer the ladder
stops at shrinking the prefill chunk). Shedding the standard lane as well would refuse work that admission control
can still place, so it is not a brownout step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Mapping

from rtxcore.errors import ConfigError
from rtxcore.sampling_params import is_finite_number, is_int

log = logging.getLogger("rtx.brownout")

# The ladder, in the order it is climbed. Each level adds the next step.
STEPS = ("shed_new_bulk", "cap_bulk_max_tokens", "shrink_prefill_chunk", "pause_speculation")
# Most the exit hold grows to, as a multiple of exit_after_s.
_MAX_EXIT_BACKOFF = 8


@dataclass(slots=True)
class BrownoutConfig:
    enabled: bool = True
    enter_pressure: float = 1.0
    exit_pressure: float = 0.5
    enter_after_s: float = 1.0
    exit_after_s: float = 5.0
    # Pressure is re-evaluated at most this often (it walks the running requests).
    interval_s: float = 0.1
    # cap_bulk_max_tokens: bulk requests stop after this many output tokens (or the next one, if already past).
    bulk_max_tokens: int = 32
    # shrink_prefill_chunk: prompt tokens computed per step, so decodes keep their inter-token latency.
    prefill_chunk: int = 64
    # Highest level used (0 turns brownout off; at most len(STEPS)).
    max_level: int = len(STEPS)

    @classmethod
    def from_options(cls, table: Mapping[str, Any] | None) -> BrownoutConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(table or {}) - known
        if unknown:
            raise ConfigError(f"unknown setting {sorted(unknown)[0]!r} in [brownout] "
                              f"(settings: {', '.join(sorted(known))})")
        for f in fields(cls):  # the annotations are strings (postponed evaluation): "bool", "float", "int"
            if f.name in (table or {}):
                _check_type(f"[brownout] {f.name}", table[f.name], str(f.type))  # type: ignore[index]
        config = cls(**(table or {}))
        if not 0 < config.exit_pressure < config.enter_pressure:
            raise ConfigError("[brownout] needs 0 < exit_pressure < enter_pressure, got "
                              f"{config.exit_pressure} and {config.enter_pressure}")
        for name in ("enter_after_s", "exit_after_s", "interval_s"):
            if getattr(config, name) < 0:
                raise ConfigError(f"[brownout] {name} must be >= 0, got {getattr(config, name)}")
        for name in ("bulk_max_tokens", "prefill_chunk"):
            if getattr(config, name) < 1:
                raise ConfigError(f"[brownout] {name} must be >= 1, got {getattr(config, name)}")
        if not 0 <= config.max_level <= len(STEPS):
            raise ConfigError(f"[brownout] max_level must be in [0, {len(STEPS)}], got {config.max_level}")
        if not config.enabled:
            config.max_level = 0
        return config


def _check_type(name: str, value: Any, kind: str) -> None:
    """:raises ConfigError: ``value`` is not of ``kind`` ("bool", "int" or "float": an int does for a float; a bool,
    though an int to Python, does for neither, nor does a NaN or an infinity)."""
    if kind == "bool":
        ok = isinstance(value, bool)
    else:
        ok = is_int(value) if kind == "int" else is_finite_number(value)
    if not ok:
        wanted = {"bool": "true or false", "int": "an integer"}.get(kind, "a number")
        raise ConfigError(f"{name} must be {wanted}, got {value!r}")


class BrownoutController:
    def __init__(self, config: BrownoutConfig):
        self.config = config
        self.level = 0
        self.pressure = 0.0
        self.cause = ""
        # Level changes so far, as (time, new level, cause): what metrics and tests read.
        self.transitions: list[tuple[float, int, str]] = []
        self._above_since: float | None = None
        self._below_since: float | None = None
        self._last_change = float("-inf")
        self._last_step_down = float("-inf")
        # Current exit hold (see the module docstring).
        self.exit_hold_s = config.exit_after_s

    @property
    def steps(self) -> tuple[str, ...]:
        return STEPS[:self.level]

    def active(self, step: str) -> bool:
        return STEPS.index(step) < self.level

    def update(self, now: float, pressure: float, cause: str, idle: bool = False) -> int | None:
        """Feed the current pressure (``idle``: the engine has no request at all); returns the new level when it
        changes, else None."""
        c = self.config
        self.pressure, self.cause = pressure, cause
        if idle:
            self.exit_hold_s = c.exit_after_s
        if pressure >= c.enter_pressure:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            # One level per enter_after_s of sustained pressure, so a burst does not jump straight to the top.
            if (self.level < c.max_level and now - self._above_since >= c.enter_after_s
                    and now - self._last_change >= c.enter_after_s):
                return self._change(now, self.level + 1)
        elif pressure < c.exit_pressure:
            self._above_since = None
            if self._below_since is None:
                self._below_since = now
            if self.level == 0 and now - self._below_since >= 4 * self.exit_hold_s:
                self.exit_hold_s = c.exit_after_s  # calm for a while: forget past flapping
            if (self.level > 0 and now - self._below_since >= self.exit_hold_s
                    and now - self._last_change >= self.exit_hold_s):
                return self._change(now, self.level - 1)
        else:  # the dead band between the thresholds: hold the level
            self._above_since = self._below_since = None
        return None

    def seconds_to_leave(self, now: float) -> float:
        """A lower bound on when the current level can be left: what a shed request is told to wait."""
        return max(self.exit_hold_s - (now - (self._below_since or now)), 1.0)

    def _change(self, now: float, level: int) -> int:
        if level > self.level and now - self._last_step_down < 2 * self.exit_hold_s:
            # Climbing right after stepping down: the load only fits while shed, so hold longer next time. Once
            # per step down: the levels climbed after it are the same flap, not more of them.
            self.exit_hold_s = min(2 * self.exit_hold_s, _MAX_EXIT_BACKOFF * self.config.exit_after_s)
            self._last_step_down = float("-inf")
        if level < self.level:
            self._last_step_down = now
        before, self.level, self._last_change = self.level, level, now
        step = STEPS[max(level, before) - 1]
        verb = "entering" if level > before else "leaving"
        log.warning("brownout level %d -> %d (%s %s): pressure %.2f, %s", before, level, verb, step, self.pressure,
                    self.cause)
        self.transitions.append((now, level, self.cause))
        return level
