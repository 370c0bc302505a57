"""The ``rtx`` command. Errors a user can fix print one line and exit with code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from rtxcore import __version__
from rtxcore.cli.common import merge_model_argument
from rtxcore.errors import RtxError

EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth saying: not for a switch, a ``None`` or an
    empty list, and not where the help already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [])
                or "default" in text.lower()):
            return action.help
        return f"{text} (default: %(default)s)"


class _ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)  # the subcommands' too: add_parser passes kwargs on
        super().__init__(*args, **kwargs)
        self._intermixing = False

    def error(self, message: str) -> NoReturn:  # argparse prints usage plus the error; we keep it to one line
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # one of the two passes of parse_known_intermixed_args, below
            return super().parse_known_args(args, namespace)
        if len(self._get_positional_actions()) > 1:
            # ``rtx generate MODEL --max-tokens 8 PROMPT``: parsed in one pass, the optional MODEL would get nothing
            # and PROMPT the model's name. The options first, then the positionals from what is left.
            self._intermixing = True
            try:
                parsed, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixing = False
        else:
            parsed, extras = super().parse_known_args(args, namespace)
        merge_model_argument(self, parsed)
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    from rtxcore.cli import (
        bench,
        chaos,
        chat,
        gates,
        generate,
        loadgen,
        plan,
        plugins,
        presets,
        pull,
        quantize,
        run_batch,
        sbom,
        serve,
        sign,
    )

    parser = _ArgumentParser(prog="rtx", description="rtx-serve: LLM inference runtime and serving stack")
    parser.add_argument("--version", action="version", version=f"rtx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)
    for module in (generate, chat, serve, run_batch, pull, plugins, bench, loadgen, plan, gates, chaos, quantize, sign,
                   sbom, presets):
        module.add_parser(sub)
    presets.add_preset_option_to_engine_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rtxcore.cli.presets import parse_with_preset

    parser = build_parser()
    try:
        # Inside the try: a preset that cannot be read or has a wrong key is a one-line error like any other.
        args = parse_with_preset(parser, argv)
        status = args.run(args) or 0
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return status
    except BrokenPipeError:
        # The reader went away (`rtx plugins list | head`): stop quietly as a tool killed by SIGPIPE would, and send
        # what is still buffered nowhere, or the interpreter reports the same error again as it exits.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except RtxError as exc:
        sys.stderr.write(f"rtx: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("rtx: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
