"""The serving config file (``rtx serve --config FILE``, TOML): lanes, scheduler options, brownout, tenants,
authentication and speculative decoding.

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

    [auth]                      # see rtxcore.server.serving.authentication
    authenticators = ["api-key", "jwt"]
    [auth.jwt]                  # the jwt authenticator's settings (rtx_plugins.authenticators.jwt_bearer)
    jwks_file = "/etc/rtx/jwks.json"

    [speculative]               # see SpeculativeConfig; flags (--speculative, ...) override these
    method = "ngram"
    num_speculative_tokens = 4
    adaptive = true
    min_acceptance = 0.1
    disable_batch_size = 32     # false: no limit
    grammar_proposals = true    # propose what grammars force; leave it out for "where steps run serially anyway"

    [speculative.options]       # the proposer's own settings (--speculative-option KEY=VALUE)
    prompt_lookup_max = 3
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import ConfigError
from rtxcore.lanes import DEFAULT_LANES, LaneSpec, parse_lanes
from rtxcore.server.serving.authentication import AuthSettings

_SECTIONS = ("lanes", "scheduler", "brownout", "tenants", "auth", "speculative", "logits_processors")
# [speculative] settings (SpeculativeConfig's fields): the types TOML may give each, and those in words.
_SPECULATIVE_SETTINGS: dict[str, tuple[tuple[type, ...], str]] = {
    "method": ((str,), "a proposer name (a string)"),
    "num_speculative_tokens": ((int,), "an integer"),
    "adaptive": ((bool,), "true or false"),
    "min_acceptance": ((int, float), "a number"),
    "disable_batch_size": ((int,), "an integer or false"),
    "grammar_proposals": ((bool,), "true or false"),
    "options": ((dict,), "a table ([speculative.options])"),
}


@dataclass(slots=True)
class ServeConfigFile:
    lanes: dict[str, LaneSpec] = field(default_factory=lambda: dict(DEFAULT_LANES))
    # Goes to SchedulerConfig.options (brownout under the "brownout" key).
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    # The [tenants] tables, read by TenantRegistry.from_config.
    tenants: dict[str, Any] = field(default_factory=dict)
    # The [auth] table: which authenticators, with their settings.
    auth: AuthSettings = field(default_factory=AuthSettings)
    # The [speculative] table; None without one. Command-line flags override it (rtxcore.cli.speculation).
    speculative: SpeculativeConfig | None = None
    # The [logits_processors.NAME] tables: each processor's options. --logits-processor-option overrides them.
    logits_processors: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The file these settings came from, for messages; None without one.
    path: str | None = None


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
    speculative = _parse_speculative(data["speculative"], path) if "speculative" in data else None
    processors = data.get("logits_processors", {})
    for name, table in processors.items():
        if not isinstance(table, dict):
            raise ConfigError(f"[logits_processors] {name} in {path} must be a table ([logits_processors.{name}]) "
                              f"of that processor's options, got {table!r}")
    return ServeConfigFile(parse_lanes(data.get("lanes")), options, data.get("tenants", {}),
                           AuthSettings.from_table(data.get("auth")), speculative, processors, str(path))


def _parse_speculative(table: dict[str, Any], path: str | Path) -> SpeculativeConfig:
    unknown = set(table) - set(_SPECULATIVE_SETTINGS)
    if unknown:
        raise ConfigError(f"unknown setting {sorted(unknown)[0]!r} in [speculative] of {path} "
                          f"(settings: {', '.join(_SPECULATIVE_SETTINGS)})")
    settings = dict(table)
    # TOML has no null: false turns the batch-size limit off.
    if settings.get("disable_batch_size") is False:
        settings["disable_batch_size"] = None
    for name, value in settings.items():
        types, expected = _SPECULATIVE_SETTINGS[name]
        if value is None:
            continue
        # bool is an int to Python, never to a reader of the file.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"[speculative] {name} in {path} must be {expected}, got {value!r}")
    try:
        return SpeculativeConfig(**settings)
    except ConfigError as exc:
        raise ConfigError(f"[speculative] in {path}: {exc}") from None
