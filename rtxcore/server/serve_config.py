"""The serving config file (``rtx serve --config FILE``, TOML): lanes, scheduler options, brownout and tenants.

    [lanes.realtime]            # any field of rtxcore.lanes.LaneSpec; unnamed lanes keep their defaults
    ttft_target_s = 0.5

    [scheduler]                 # options of the scheduler plugin (sla-lanes: merge_window_s)
    merge_window_s = 0.002

    [brownout]                  # sla-lanes' brownout ladder (see its BrownoutConfig)
    exit_after_s = 10

    [tenants.acme]              # see rtxcore.server.serving.tenants
    key_env = "ACME_KEY"
    lanes = ["standard", "bulk"]
    requests_per_second = 5
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtxcore.errors import ConfigError
from rtxcore.lanes import DEFAULT_LANES, LaneSpec, parse_lanes

_SECTIONS = ("lanes", "scheduler", "brownout", "tenants")


@dataclass(slots=True)
class ServeConfigFile:
    lanes: dict[str, LaneSpec] = field(default_factory=lambda: dict(DEFAULT_LANES))
    # Goes to SchedulerConfig.options (brownout under the "brownout" key).
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    # The [tenants] tables, read by TenantRegistry.from_config.
    tenants: dict[str, Any] = field(default_factory=dict)


def load_serve_config(path: str | Path | None) -> ServeConfigFile:
    """:raises ConfigError: unreadable, not TOML, or an unknown section or setting (named in the message)."""
    if path is None:
        return ServeConfigFile()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section [{sorted(unknown)[0]}] in {path} (sections: {', '.join(_SECTIONS)})")
    for section in _SECTIONS:
        if not isinstance(data.get(section, {}), dict):
            raise ConfigError(f"[{section}] in {path} must be a table")
    options = dict(data.get("scheduler", {}))
    if "brownout" in data:
        options["brownout"] = data["brownout"]
    return ServeConfigFile(parse_lanes(data.get("lanes")), options, data.get("tenants", {}))
