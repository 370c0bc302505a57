"""``--logits-processor-option NAME.KEY=VALUE``: a logits processor's settings on the command line, over the config
file's ``[logits_processors.NAME]`` tables (``rtx serve --config``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rtxcore.cli.speculation import key_value, option_text

if TYPE_CHECKING:
    from rtxcore.server.serve_config import ServeConfigFile


def add_processor_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--logits-processor-option", action="append", type=processor_option, default=[],
                       metavar="NAME.KEY=VALUE",
                       help="a setting of a logits processor (repeatable), e.g. structured_output.mask_threads=4; "
                            "integers, decimals and true/false are read as such")


def processor_option(text: str) -> tuple[str, str, Any]:
    """``NAME.KEY=VALUE`` -> ``(name, key, value)``, the value read as ``--speculative-option``'s (argparse type)."""
    target, value = key_value(text)
    name, dot, key = target.rpartition(".")
    if not dot or not name or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME.KEY=VALUE (a processor's name, a dot, its option)")
    return name, key, value


def processor_options(args: argparse.Namespace,
                      config_file: ServeConfigFile | None = None) -> dict[str, dict[str, Any]]:
    """Each processor's options: the config file's, with the command line's given over them key by key.

    :raises ConfigError: a processor that is not installed or an option it does not take, found before the model
        loads (seconds to minutes) rather than after it.
    """
    options = {name: dict(table) for name, table in (config_file.logits_processors if config_file else {}).items()}
    for name, key, value in args.logits_processor_option:
        options.setdefault(name, {})[key] = value
    if options:
        from rtxcore.engine.logits_processing import check_processor_options
        from rtxcore.registry import load_plugins

        check_processor_options(load_plugins(), options)
    return options


def processor_cli_args(args: argparse.Namespace) -> list[str]:
    """The flags again (to start ``rtx serve`` with the same ones)."""
    out: list[str] = []
    for name, key, value in args.logits_processor_option:
        out += ["--logits-processor-option", f"{name}.{key}={option_text(value)}"]
    return out
