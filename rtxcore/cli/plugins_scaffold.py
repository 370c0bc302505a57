"""``rtx plugins new KIND NAME``: write a plugin package that passes ``rtx plugins test NAME --gates`` as generated.

The package is ``rtx-NAME`` (import name ``rtx_NAME``): a ``pyproject.toml`` with the entry point, the component with
every method of its kind's contract and the hook that registers it, a test that runs the conformance suite on it, and
a README. The files are rendered from the templates in ``rtxcore/scaffold/`` (``$name``-style placeholders), shipped
as package data.
"""

from __future__ import annotations

import argparse
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path

from rtxcore.cli.common import output_dir
from rtxcore.errors import ConfigError
from rtxcore.registry import KINDS, load_plugins

TEMPLATES = Path(__file__).resolve().parents[1] / "scaffold"
# A registered name that also makes a distribution name (rtx-NAME) and an import name (rtx_NAME).
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


@dataclass(frozen=True, slots=True)
class KindScaffold:
    # The class name's suffix, after the registered name in CamelCase.
    class_suffix: str
    # The kind in words, for docstrings and the README.
    words: str
    plural: str
    # How a user picks the component, for the README.
    usage: str


SCAFFOLDS: dict[str, KindScaffold] = {
    "scheduler": KindScaffold("Scheduler", "scheduler", "schedulers", "rtx serve --scheduler {name}"),
    "eviction_policy": KindScaffold("Policy", "KV-cache eviction policy", "eviction policies",
                                    "rtx serve --eviction-policy {name}"),
    "sampler": KindScaffold("Sampler", "sampler", "samplers", "rtx serve --sampler {name}"),
    "quantizer": KindScaffold("Quantizer", "weight quantizer", "quantizers",
                              "rtx quantize --method {name} ...   # or rtx serve --quantization {name}"),
    "backend": KindScaffold("Backend", "execution backend", "backends", "rtx serve --backend {name}"),
    "proposer": KindScaffold("Proposer", "speculative-decoding proposer", "proposers",
                             "rtx serve --speculative {name}"),
    "logits_processor": KindScaffold("Processor", "logits processor", "logits processors",
                                     "# a request sends \"logits_processors\": {{\"{name}\": [13, 42]}}"),
    "authenticator": KindScaffold("Authenticator", "authenticator", "authenticators",
                                  "# serve.toml: [auth] authenticators = [\"{name}\"]; rtx serve --config serve.toml"),
}


@dataclass(frozen=True, slots=True)
class Package:
    # The folder the package goes in (the distribution name).
    folder: str
    # Path inside the folder -> text.
    files: dict[str, str]


def add_new_parser(psub) -> None:
    n = psub.add_parser("new", help="write a new plugin package, ready to test and publish",
                        description="Write the package rtx-NAME: pyproject.toml with the entry point, the component "
                                    "with every method of its kind's contract, a test that runs the conformance "
                                    "suite on it, and a README. It passes `rtx plugins test NAME --gates` as written.")
    n.add_argument("kind", choices=list(KINDS), metavar="KIND", help=f"one of {', '.join(KINDS)}")
    n.add_argument("name", type=_name, metavar="NAME",
                   help="the name it registers under (lower case, digits and dashes: fifo, greedy-only)")
    n.add_argument("--output-dir", type=output_dir, default=Path("."),
                   help="where the package's folder goes (default: the current directory)")
    n.set_defaults(run=run_new)


def run_new(args: argparse.Namespace) -> int:
    package = render(args.kind, args.name)
    if not args.output_dir.is_dir():
        raise ConfigError(f"--output-dir {str(args.output_dir)!r} is not a directory")
    root = args.output_dir / package.folder
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or --output-dir")
    taken = load_plugins().components.get((args.kind, args.name))
    if taken is not None:  # installed beside it, the new package's registration would be refused
        raise ConfigError(f"{args.kind.replace('_', ' ')} {args.name!r} is already registered by {taken.package}; "
                          "choose another name")
    for relative, text in package.files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sys.stdout.write(f"wrote {root}/\n" + "".join(f"  {relative}\n" for relative in package.files))
    sys.stdout.write(f"next: pip install -e '{root}[test]' && rtx plugins test {args.name} --gates\n")
    return 0


def render(kind: str, name: str) -> Package:
    """The files of the package of a ``kind`` component registered as ``name``."""
    scaffold = SCAFFOLDS[kind]
    package = "rtx_" + name.replace("-", "_")
    distribution = f"rtx-{name}"
    words = scaffold.words
    article = "an" if words[0] in "aeiou" else "a"
    values = {
        "name": name, "kind": kind, "module": kind, "package": package, "distribution": distribution,
        "class_name": "".join(part.capitalize() for part in name.split("-")) + scaffold.class_suffix,
        "kind_words": words, "kind_plural": scaffold.plural, "kind_article": article,
        "kind_article_title": article.capitalize(), "contract": KINDS[kind].contract_name,
        "hook": KINDS[kind].hook, "usage": scaffold.usage.format(name=name), "rtx_version": _rtx_version(),
        "first_rule": _first_rule(kind),
    }
    files = {
        "pyproject.toml": "pyproject.toml.tmpl",
        "README.md": "README.md.tmpl",
        f"{package}/__init__.py": "__init__.py.tmpl",
        f"{package}/{kind}.py": f"{kind}.py.tmpl",
        "tests/test_conformance.py": "test_conformance.py.tmpl",
    }
    return Package(distribution, {path: _fill(template, values) for path, template in files.items()})


def _fill(template: str, values: dict[str, str]) -> str:
    return string.Template((TEMPLATES / template).read_text()).substitute(values)


def _name(text: str) -> str:
    if not NAME_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: a name is lower-case letters, digits and single dashes, "
                                         "starting with a letter (fifo, greedy-only)")
    return text


def _rtx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rtx-serve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.1.0"


def _first_rule(kind: str) -> str:
    """A rule of the kind to show in the README; the conformance suite (an extra) may not be installed."""
    try:
        from rtx_conformance.rules import rules_of
    except ImportError:
        return f"{kind}.builds"
    return next(rule for rule in rules_of(kind) if not rule.endswith((".builds", ".api")))
