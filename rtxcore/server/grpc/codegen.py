"""Generate the gRPC modules from ``spec/rtx.proto`` into the package ``rtxcore._generated``.

Generated code is never committed. ``setup.py`` runs :func:`generate` at build and install time (editable installs
too); :func:`ensure_generated` is the safety net at run time: it regenerates when the modules are missing or were
made from another version of the proto (after a ``git pull``, say).

This module imports nothing but the standard library at load time, so ``setup.py`` can load it by file path before
the project's dependencies exist.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # .../rtxcore
PROTO_FILE = _PACKAGE_ROOT.parent / "spec" / "rtx.proto"
GENERATED_DIR = _PACKAGE_ROOT / "_generated"
MODULES = ("rtx_pb2.py", "rtx_pb2.pyi", "rtx_pb2_grpc.py")
_STAMP = "PROTO_SHA256"


def proto_digest(proto: Path = PROTO_FILE) -> str:
    return hashlib.sha256(proto.read_bytes()).hexdigest()


def is_current(proto: Path = PROTO_FILE, out_dir: Path = GENERATED_DIR) -> bool:
    """True when every generated module exists and was made from this exact proto."""
    init = out_dir / "__init__.py"
    if not init.exists() or not all((out_dir / name).exists() for name in MODULES):
        return False
    if not proto.exists():  # an installed wheel ships the generated code but not the spec
        return True
    match = re.search(rf'^{_STAMP} = "([0-9a-f]+)"$', init.read_text(), re.MULTILINE)
    return match is not None and match.group(1) == proto_digest(proto)


def ensure_generated() -> None:
    """Regenerate ``rtxcore._generated`` if it is missing or stale; call before importing it."""
    if not is_current():
        generate()


def generate(proto: Path = PROTO_FILE, out_dir: Path = GENERATED_DIR) -> None:
    """Run protoc (from grpcio-tools) on ``proto`` and install the modules into ``out_dir`` atomically enough
    that concurrent processes never import a half-written file."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError("the gRPC modules must be generated from spec/rtx.proto but grpcio-tools is not "
                           "installed: pip install grpcio-tools (or reinstall rtx-serve)") from exc
    if not proto.exists():
        raise RuntimeError(f"cannot generate the gRPC modules: {proto} does not exist")

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".rtx-protoc-") as tmp:
        args = ["grpc_tools.protoc", f"-I{proto.parent}", f"-I{_well_known_protos()}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto} (see its messages above)")
        grpc_module = Path(tmp) / "rtx_pb2_grpc.py"
        # protoc writes `import rtx_pb2 as rtx__pb2`, which only works with the output folder on sys.path.
        grpc_module.write_text(re.sub(r"^import rtx_pb2 as ", "from . import rtx_pb2 as ",
                                      grpc_module.read_text(), flags=re.MULTILINE))
        init = Path(tmp) / "__init__.py"
        init.write_text('"""Generated from spec/rtx.proto by rtxcore/server/grpc/codegen.py; do not edit or '
                        f'commit."""\n\n{_STAMP} = "{proto_digest(proto)}"\n')
        # The stamp goes last: a reader that sees the new stamp sees the new modules.
        for name in (*MODULES, "__init__.py"):
            os.replace(Path(tmp) / name, out_dir / name)
    shutil.rmtree(out_dir / "__pycache__", ignore_errors=True)


def _well_known_protos() -> str:
    import grpc_tools

    return str(Path(grpc_tools.__file__).parent / "_proto")
