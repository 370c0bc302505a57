"""The speculative-decoding options of the commands that load a model (``--speculative`` and the rest), read over
the config file's ``[speculative]`` table where there is one (``rtx serve --config``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING, Any

from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from rtxcore.engine.speculation.speculator import ProposerStats
    from rtxcore.server.serve_config import ServeConfigFile

# The range SpeculativeConfig accepts, checked by argparse so that the error names the flag.
MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS = 1, 16
# --grammar-proposals, as SpeculativeConfig.grammar_proposals.
GRAMMAR_PROPOSALS = {"auto": None, "on": True, "off": False}


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    d = SpeculativeConfig()
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", default=None, metavar="METHOD",
                   help="proposer plugin that guesses the next tokens of every request for the model to verify in "
                        "one pass (ngram, draft, layer-skip or an installed one); greedy output stays the same. "
                        "Default: none (requests that bring a prediction still speculate)")
    s.add_argument("--num-speculative-tokens", type=num_speculative_tokens, default=None, metavar="N",
                   help=f"most tokens proposed per request per step, {MIN_SPECULATIVE_TOKENS}-"
                        f"{MAX_SPECULATIVE_TOKENS} (default: {d.num_speculative_tokens})")
    s.add_argument("--draft-model", default=None, metavar="NAME",
                   help="the model of --speculative draft, by the names --model takes (its option draft_model)")
    s.add_argument("--speculative-option", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="a setting of the proposer (repeatable), e.g. prompt_lookup_max=3 for ngram or layers=0-11 "
                        "for layer-skip; integers, decimals and true/false are read as such")
    s.add_argument("--no-speculative-adaptive", action="store_true",
                   help="always propose --num-speculative-tokens (default: each request's count follows how many "
                        "of its proposals are accepted)")
    s.add_argument("--grammar-proposals", choices=sorted(GRAMMAR_PROPOSALS), default=None,
                   help="propose the tokens a structured-output request's grammar forces (keys, quotes, brackets) "
                        "and verify them in one step; output stays the same. auto (the default): where steps run "
                        "one after another anyway, on a CPU or with --speculative")


def num_speculative_tokens(text: str) -> int:
    """An integer in [1, 16] (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not MIN_SPECULATIVE_TOKENS <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"{text!r} is not in [{MIN_SPECULATIVE_TOKENS}, {MAX_SPECULATIVE_TOKENS}]")
    return value


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, value)``, the value read by :func:`option_value` (argparse type)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(c.isspace() for c in key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if not raw.strip():
        raise argparse.ArgumentTypeError(f"{text!r} has no value after '='")
    return key, option_value(raw.strip())


def option_text(value: Any) -> str:
    """A value written so that :func:`option_value` reads it back the same (a bool as true/false, not Python's
    True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def option_value(raw: str) -> Any:
    """A proposer option's value as the config file would give it: ``true``/``false`` a bool, ``3`` an int, ``0.5``
    a float, anything else (``0-11,15``, a model name) the string itself. ``nan`` and ``inf`` stay strings: no
    setting wants them, and a plugin's check of a string says more than one of a number that compares false."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        number = float(raw)
    except ValueError:
        return raw
    return number if math.isfinite(number) else raw


def speculative_config(args: argparse.Namespace, config_file: ServeConfigFile | None = None) -> SpeculativeConfig:
    """The command line's speculative settings over the config file's ``[speculative]`` table: a flag that is given
    wins. The file's options belong to its method: they are dropped when ``--speculative`` names another.

    :raises ConfigError: a contradiction between flags, or a method no installed plugin registers (the message
        names where it came from and lists the registered proposers).
    """
    in_file = config_file.speculative if config_file is not None else None
    base = in_file if in_file is not None else SpeculativeConfig()
    method = args.speculative if args.speculative is not None else base.method
    options = dict(base.options) if method == base.method else {}
    given = dict(args.speculative_option)
    if args.draft_model is not None:
        if given.get("draft_model", args.draft_model) != args.draft_model:
            raise ConfigError("--draft-model and --speculative-option draft_model=... name different models: give "
                              "one of them")
        given["draft_model"] = args.draft_model
    if given and method is None:
        flag = "--draft-model" if args.draft_model is not None else "--speculative-option"
        raise ConfigError(f"{flag} sets an option of a proposer: it needs --speculative METHOD")
    options.update(given)
    if method is not None:
        where = (f"[speculative] method in {config_file.path}" if args.speculative is None and config_file is not None
                 else "--speculative")
        _check_registered(method, where)
    return dataclasses.replace(
        base, method=method, options=options,
        num_speculative_tokens=(args.num_speculative_tokens if args.num_speculative_tokens is not None
                                else base.num_speculative_tokens),
        adaptive=False if args.no_speculative_adaptive else base.adaptive,
        grammar_proposals=(GRAMMAR_PROPOSALS[args.grammar_proposals] if args.grammar_proposals is not None
                           else base.grammar_proposals))


def _check_registered(method: str, where: str) -> None:
    """Fail before the model loads (seconds to minutes) rather than after, when the engine builds its proposer."""
    from rtxcore.registry import load_plugins

    try:
        load_plugins().get("proposer", method)
    except PluginError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def speculative_cli_args(args: argparse.Namespace) -> list[str]:
    """The speculative options of ``args`` as command-line arguments (to start ``rtx serve`` with the same ones)."""
    out: list[str] = []
    for flag, value in (("--speculative", args.speculative), ("--num-speculative-tokens", args.num_speculative_tokens),
                        ("--draft-model", args.draft_model), ("--grammar-proposals", args.grammar_proposals)):
        if value is not None:
            out += [flag, str(value)]
    for key, value in args.speculative_option:
        out += ["--speculative-option", f"{key}={option_text(value)}"]
    if args.no_speculative_adaptive:
        out.append("--no-speculative-adaptive")
    return out


def stats_since(before: ProposerStats, now: ProposerStats) -> ProposerStats:
    """What a proposer did between two readings of its counters (a bench run without its warm-up)."""
    from rtxcore.engine.speculation.speculator import ProposerStats

    return ProposerStats(now.num_proposed_tokens - before.num_proposed_tokens,
                         now.num_accepted_tokens - before.num_accepted_tokens,
                         now.num_verifications - before.num_verifications,
                         [n - b for n, b in zip(now.accepted_runs, before.accepted_runs)])


def describe_stats(method: str, stats: ProposerStats) -> str:
    """How a proposer fared, in one line, for the summaries of ``rtx generate`` and ``rtx bench``."""
    if not stats.num_proposed_tokens:
        return f"speculative {method}: nothing proposed"
    return (f"speculative {method}: acceptance rate {stats.acceptance_rate:.1%} ({stats.num_accepted_tokens} of "
            f"{stats.num_proposed_tokens} proposed tokens), mean accepted length {stats.mean_accepted_length:.2f} "
            f"tokens per verification (the model's own token included; {stats.num_verifications} verifications)")
