"""The ``rtx`` command. Errors a user can fix print one line and exit with code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from rtxcore import __version__
from rtxcore.errors import RtxError

EXIT_USAGE = 2


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage plus the error; we keep it to one line
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from rtxcore.cli import bench, chat, generate, loadgen, plugins, presets, pull, quantize, sbom, serve, sign

    parser = _ArgumentParser(prog="rtx", description="rtx-serve: LLM inference runtime and serving stack")
    parser.add_argument("--version", action="version", version=f"rtx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)
    for module in (generate, chat, serve, pull, plugins, bench, loadgen, quantize, sign, sbom, presets):
        module.add_parser(sub)
    presets.add_preset_option_to_engine_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rtxcore.cli.presets import parse_with_preset

    parser = build_parser()
    try:
        # Inside the try: a preset that cannot be read or has a wrong key is a one-line error like any other.
        args = parse_with_preset(parser, argv)
        return args.run(args) or 0
    except RtxError as exc:
        sys.stderr.write(f"rtx: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("rtx: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
