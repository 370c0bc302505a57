"""The generated part of docs/plugins.md: each plugin kind's contract to the signature, read from the code.

For every kind: the contract class's members (signature, required or optional, docstring), the data types it takes
and returns (each field with its type, default and the comment above it in the source), the rules the conformance
suite checks, and a complete example: the component ``rtx plugins new`` writes, which passes the suite as written.

The blocks sit between ``<!-- generated: KIND -->`` and ``<!-- end generated -->`` markers; the rest of the file is
written by hand. ``python -m rtx_conformance.contract_docs docs/plugins.md`` rewrites the blocks, and
tests/test_docs_plugins.py fails when the file differs from what :func:`render_kind` gives, so a contract that
changes without its documentation fails CI.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from rtx_conformance.rules import RULES, rules_of
from rtxcore import contracts
from rtxcore.registry import KINDS

# Per kind: how the host builds a component, the data types of its contract, and the name of the example.
BUILT_AS = {
    "scheduler": "cls(config: SchedulerConfig, kv_cache: KVCacheAllocator)",
    "eviction_policy": "cls(capacity: int)",
    "sampler": "cls()",
    "quantizer": "cls()",
    "backend": "cls(options: BackendOptions)",
    "proposer": "cls(context: ProposerContext)",
    "logits_processor": "cls(context: LogitsProcessorContext)",
    "authenticator": "cls(context: AuthenticatorContext)",
}
DATA_TYPES = {
    "scheduler": ("SchedulerConfig", "SchedulerOutput", "KVCacheAllocator"),
    "eviction_policy": (),
    "sampler": ("SamplingBatch", "SamplerOutput"),
    "quantizer": ("QuantizedTensor", "LayerStats"),
    "backend": ("BackendOptions", "BackendCapabilities", "ForwardBatch"),
    "proposer": ("ProposerContext",),
    "logits_processor": ("LogitsProcessorContext", "RowContext"),
    "authenticator": ("AuthenticatorContext", "Credentials", "AuthenticatorExample", "AuthenticationFailed"),
}
EXAMPLE_NAMES = {"scheduler": "my-scheduler", "eviction_policy": "my-policy", "sampler": "my-sampler",
                 "quantizer": "my-int8", "backend": "my-backend", "proposer": "bigram", "logits_processor": "no-tokens",
                 "authenticator": "header-token"}
BEGIN = "<!-- generated: {kind} -->"
END = "<!-- end generated -->"


def render_kind(kind: str) -> str:
    """The generated block of one kind, markers included."""
    contract = KINDS[kind].contract
    parts = [BEGIN.format(kind=kind),
             "<!-- written by `python -m rtx_conformance.contract_docs docs/plugins.md`: edit the code, not this -->",
             "",
             f"#### Contract: `{contract.__module__}.{contract.__qualname__}`",
             "",
             f"Built as `{BUILT_AS[kind]}`. {_first_paragraph(contract)}".rstrip(),
             "",
             "| member | signature | required | what it must do |",
             "|---|---|---|---|"]
    parts += [_member_row(contract, name, member) for name, member in _members(contract)]
    for type_name in DATA_TYPES[kind]:
        parts += ["", *_data_type(getattr(contracts, type_name))]
    parts += ["", f"#### Rules `rtx plugins test` checks ({len(rules_of(kind))})", "",
              "| rule | what is checked |", "|---|---|"]
    parts += [f"| `{rule}` | {_cell(RULES[rule])} |" for rule in rules_of(kind)]
    parts += ["", *_example(kind), END]
    return "\n".join(parts)


def rewrite(text: str) -> str:
    """``text`` (docs/plugins.md) with every kind's block replaced by its rendering."""
    for kind in KINDS:
        begin = BEGIN.format(kind=kind)
        start = text.index(begin)
        end = text.index(END, start) + len(END)
        text = text[:start] + render_kind(kind) + text[end:]
    return text


def blocks(text: str) -> dict[str, str]:
    """The generated blocks found in ``text``, by kind."""
    found = {}
    for kind in KINDS:
        begin = BEGIN.format(kind=kind)
        if begin in text:
            start = text.index(begin)
            found[kind] = text[start:text.index(END, start) + len(END)]
    return found


# -- the contract class -------------------------------------------------------------------------------------------

def _members(cls: type) -> list[tuple[str, Any]]:
    """Public members the contract class defines itself (its base's too, but not object's or ABC's), in source
    order: methods, properties, class attributes."""
    order = {name: i for i, name in enumerate(_source_names(cls))}
    members = [(name, value) for name, value in vars(cls).items()
               if not name.startswith("_") or name in ("__init__", "__len__", "__contains__")]
    members = [(n, v) for n, v in members if n in order]
    return sorted(members, key=lambda item: order[item[0]])


def _source_names(cls: type) -> list[str]:
    """Names defined in the class body, in order (methods, properties and annotated or assigned attributes)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0]
    names = []
    for node in body.body if isinstance(body, ast.ClassDef) else []:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return names


def _member_row(cls: type, name: str, member: Any) -> str:
    abstract = name in getattr(cls, "__abstractmethods__", frozenset())
    if isinstance(member, property):
        signature = f"{name} -> {_annotation(member.fget, 'return')}"
        doc = inspect.getdoc(member)
        required = "required" if abstract else "optional"
        kind = "property"
    elif isinstance(member, (classmethod, staticmethod)):
        signature = f"{name}{_signature(member.__func__)}"
        doc = inspect.getdoc(member.__func__)
        required = "required" if abstract else "optional"
        kind = "classmethod" if isinstance(member, classmethod) else "staticmethod"
    elif inspect.isfunction(member):
        signature = f"{name}{_signature(member)}"
        # Its own docstring only: an __init__ without one would show object's.
        doc = inspect.cleandoc(member.__doc__ or "")
        required = "required" if abstract else ("the host calls it" if name == "__init__" else "optional")
        kind = ""
    else:
        annotation = cls.__annotations__.get(name, type(member).__name__)
        signature = f"{name}: {annotation} = {member!r}"
        doc = _docstring(_attribute_comment(cls, name))
        required = "optional"
        kind = "attribute"
    label = f"`{name}`" + (f" ({kind})" if kind else "")
    return f"| {label} | `{_cell(signature)}` | {required} | {_cell(_docstring(doc or ''))} |"


def _signature(fn: Any) -> str:
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.kind is not p.VAR_POSITIONAL else f"*{p.name}"
        if p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        if p.annotation is not p.empty:
            text += f": {p.annotation}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        params.append(text)
    returns = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation}"
    return f"({', '.join(params)}){returns}"


def _annotation(fn: Any, name: str) -> str:
    return str(getattr(fn, "__annotations__", {}).get(name, "Any"))


def _attribute_comment(cls: type, name: str) -> str:
    """The ``#:`` or ``#`` comment lines right above ``name = ...`` in the class body."""
    lines = inspect.getsource(cls).splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s+{name}\s*[:=]", line):
            return _comment_above(lines, i)
    return ""


def _comment_above(lines: list[str], index: int) -> str:
    comment: list[str] = []
    j = index - 1
    while j >= 0 and lines[j].strip().startswith("#"):
        comment.insert(0, lines[j].strip().lstrip("#:").strip())
        j -= 1
    return " ".join(comment)


def _first_paragraph(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    module_doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
    text = doc if doc and not doc.startswith(("Abstract", "Helper")) else module_doc
    return _docstring(text.split("\n\n")[0])


def _docstring(doc: str) -> str:
    """A docstring as one table cell: reST field lists in words, paragraphs joined."""
    text = " ".join(doc.split())
    text = re.sub(r":param (\w+):", r"`\1`:", text)
    text = re.sub(r":returns?:", "Returns:", text)
    text = re.sub(r":raises ([\w.]+):", r"Raises `\1`:", text)
    text = re.sub(r":(?:class|meth|func|data|attr|mod):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# -- data types ---------------------------------------------------------------------------------------------------

def _data_type(cls: type) -> list[str]:
    title = f"`{cls.__qualname__}`"
    doc = inspect.getdoc(cls)
    if doc and not doc.startswith(f"{cls.__name__}("):  # a dataclass's generated docstring says nothing
        title += f": {_docstring(doc)}"
    if dataclasses.is_dataclass(cls):
        lines = [title, "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for name, annotation, default, comment in _fields(cls):
            lines.append(f"| `{name}` | `{_cell(annotation)}` | {_cell(default)} | {_cell(comment)} |")
        properties = [(n, v) for n, v in vars(cls).items() if isinstance(v, property) and not n.startswith("_")]
        for name, prop in properties:
            lines.append(f"| `{name}` (property) | `{_cell(_annotation(prop.fget, 'return'))}` | | "
                         f"{_cell(_docstring(inspect.getdoc(prop) or ''))} |")
        return lines
    lines = [title, "", "| member | signature | what it does |", "|---|---|---|"]
    for name, member in _members(cls):
        if isinstance(member, property):
            signature = f"{name} -> {_annotation(member.fget, 'return')}"
            doc = inspect.getdoc(member)
        else:
            signature = f"{name}{_signature(member)}"
            doc = inspect.getdoc(member)
        lines.append(f"| `{name}` | `{_cell(signature)}` | {_cell(_docstring(doc or ''))} |")
    return lines


def _fields(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, annotation, default, comment) of each field, from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    fields = []
    for node in body.body if isinstance(body, ast.ClassDef) else []:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = ast.get_source_segment(source, node.annotation) or ""
        if annotation.startswith("ClassVar"):
            continue
        default = ""
        if node.value is not None:
            default = f"`{_default(ast.get_source_segment(source, node.value) or '')}`"
        comment = _docstring(_comment_above(lines, node.lineno - 1))
        fields.append((node.target.id, annotation, default, comment))
    return fields


def _default(text: str) -> str:
    factory = re.fullmatch(r"field\(default_factory=(?:lambda: )?(.+)\)", text, re.DOTALL)
    if factory is None:
        return " ".join(text.split())
    made = factory.group(1)
    return {"dict": "{}", "list": "[]"}.get(made, " ".join(made.split()))


# -- the example --------------------------------------------------------------------------------------------------

def _example(kind: str) -> list[str]:
    from rtxcore.cli.plugins_scaffold import render

    name = EXAMPLE_NAMES[kind]
    package = render(kind, name)
    module = next(path for path in package.files if path.endswith(f"/{kind}.py"))
    return ["<details><summary>A complete example: <code>" + module + "</code>, as <code>rtx plugins new "
            + f"{kind} {name}</code> writes it (it passes <code>rtx plugins test {name} --gates</code>)</summary>",
            "", "```python", package.files[module].rstrip("\n"), "```", "", "</details>"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m rtx_conformance.contract_docs docs/plugins.md\n")
        return 2
    path = Path(args[0])
    text = path.read_text()
    updated = rewrite(text)
    if updated != text:
        path.write_text(updated)
        sys.stdout.write(f"rewrote the generated blocks of {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
