"""Build hook: generate the gRPC modules from spec/rtx.proto before the package is built or installed.

All metadata lives in pyproject.toml; this file only adds code generation to ``build_py`` (wheels, sdists built into
wheels) and to ``editable_wheel`` / ``develop`` (``pip install -e .``). The generator is loaded by file path so that
nothing but the standard library and grpcio-tools (a build requirement) is needed here.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = Path(__file__).resolve().parent
GENERATED_PACKAGE = "rtxcore._generated"


def _generate_grpc_modules() -> None:
    spec = importlib.util.spec_from_file_location("_rtx_codegen", ROOT / "rtxcore" / "server" / "grpc" / "codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    if not codegen.is_current():
        codegen.generate()


class BuildPyWithProtos(build_py):
    def run(self):
        _generate_grpc_modules()
        # Listed only now: the folder does not exist before generation (it is not committed).
        if self.packages is not None and GENERATED_PACKAGE not in self.packages:
            self.packages.append(GENERATED_PACKAGE)
        super().run()


class DevelopWithProtos(develop):
    def run(self):
        _generate_grpc_modules()
        super().run()


cmdclass = {"build_py": BuildPyWithProtos, "develop": DevelopWithProtos}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 has no PEP 660 editable installs
    pass
else:
    class EditableWheelWithProtos(editable_wheel):
        def run(self):
            _generate_grpc_modules()
            super().run()

    cmdclass["editable_wheel"] = EditableWheelWithProtos

setup(cmdclass=cmdclass)
