"""A plugin author's path with rtx-serve installed from its wheel, not from this checkout.

rtx-serve is built as a wheel and installed (not editable) into a fresh virtual environment, next to the example
plugin package and a package written by ``rtx plugins new`` for every plugin kind, each built as a wheel too. From
another directory, ``rtx plugins test --gates`` passes for all of them, and a package whose module raises at import
fails the run, named in the table, the JSON and the JUnit report.

The environment borrows torch, transformers, the default model and the other third-party packages from the test's
own (a ``.pth`` file naming a folder of links to them, rtx-serve's and the example package's own files left out), so
that nothing is downloaded; everything of rtx-serve comes from the wheel, which the test checks. The gates run with
the wheel's own ``gates.toml`` scaled down (smaller workloads, the tiny model for latency, a latency target no
machine misses): what is under test is the path, not this machine's speed, and CI has minutes, not a quarter hour.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from rtxcore.registry import KINDS
from tests.helpers import REPO

# One package per kind, by the name it registers under.
SCAFFOLDS = {"scheduler": "my-scheduler", "eviction_policy": "fifo", "sampler": "my-sampler",
             "quantizer": "my-int8", "backend": "my-backend", "proposer": "bigram", "logits_processor": "no-tokens",
             "authenticator": "header-token"}
EXAMPLE = {"2q": "eviction_policy", "typical": "sampler"}
BROKEN = "broken-at-import"
# What the wheel is built from: the package folders and the build files.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "rtxcore", "plugins", "kernels", "conformance", "spec")
# Borrowed from this environment: anything but rtx-serve's and the example package's own files.
NOT_BORROWED = re.compile(r"(rtx_serve|rtx_example_plugins|__editable__|_rtx|rtxcore|rtx_plugins|rtx_kernels|"
                          r"rtx_conformance).*|.*\.pth")
# The gates file for the run: the wheel's own, with these values.
SCALED_GATES = {
    "latency": {"model": '"dummy:tiny"', "num_requests": "2", "prompt_len": "16", "output_len": "8"},
    "cache": {"num_conversations": "2", "num_turns": "2", "min_new_tokens": "8", "max_new_tokens": "16",
              "output_len": "8", "min_hit_rate": "0.3"},
    "quality": {"num_tokens": "32"},
}


@dataclass(frozen=True, slots=True)
class WheelEnv:
    python: Path
    rtx: Path
    site_packages: Path
    # A directory outside the checkout, where the commands run.
    elsewhere: Path

    def run(self, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RTX_PLUGINS", "VIRTUAL_ENV")}
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.elsewhere, env=env)


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> WheelEnv:
    root = tmp_path_factory.mktemp("wheel-env")
    # The wheel is built from a copy, so that the build leaves nothing in the checkout.
    source = root / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "_generated", "*.egg-info", "build")
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, source / name, **(
            {"ignore": ignore} if (REPO / name).is_dir() else {}))
    dist = root / "dist"
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(source))

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site_packages = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True,
        text=True, check=True).stdout.strip())
    # Named site-packages like any, which hypothesis takes for third-party code: it harvests constants from the
    # source of every module it takes for the user's own, which for torch and transformers takes minutes.
    borrowed = root / "borrowed" / "site-packages"
    borrowed.mkdir(parents=True)
    ours = Path(sysconfig.get_path("purelib"))
    for entry in ours.iterdir():
        if not NOT_BORROWED.fullmatch(entry.name):
            (borrowed / entry.name).symlink_to(entry)
    (site_packages / "borrowed.pth").write_text(f"{borrowed}\n")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", *map(str, dist.glob("rtx_serve-*.whl")))
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return WheelEnv(python, venv / "bin" / "rtx", site_packages, elsewhere)


@pytest.fixture(scope="module")
def plugin_wheels(wheel_env, tmp_path_factory) -> Path:
    """Every scaffold, the example package and the broken one, written by the environment's `rtx plugins new`,
    built as wheels and installed."""
    packages = tmp_path_factory.mktemp("packages")
    writes = [["plugins", "new", kind, name, "--output-dir", str(packages)] for kind, name in
              [*SCAFFOLDS.items(), ("sampler", BROKEN)]]
    # One process writes them all, through the command's own entry point.
    code = "import sys; from rtxcore.cli.main import main; sys.exit(max(main(a) for a in %r))" % (writes,)
    proc = wheel_env.run(wheel_env.python, "-c", code, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module = packages / f"rtx-{BROKEN}" / f"rtx_{BROKEN.replace('-', '_')}" / "sampler.py"
    module.write_text(module.read_text() + '\nraise RuntimeError("broken on purpose")\n')
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"),
                           str(packages)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dist = tmp_path_factory.mktemp("plugin-dist")
    folders = sorted(packages.iterdir()) + [REPO / "examples" / "rtx-example-plugins"]
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), *map(str, folders))
    _pip("--python", str(wheel_env.python), "install", "--no-deps", "--no-index", *map(str, dist.glob("*.whl")))
    return packages


def test_rtx_serve_comes_from_the_wheel_with_its_spec_files(wheel_env):
    code = ("import json, rtxcore, rtx_conformance, rtx_plugins; from rtxcore.spec_files import spec_path; "
            "print(json.dumps([rtxcore.__file__, rtx_conformance.__file__, rtx_plugins.__file__, "
            "str(spec_path('gates.toml')), str(spec_path('openapi.yaml'))]))")
    proc = wheel_env.run(wheel_env.python, "-c", code)
    assert proc.returncode == 0, proc.stderr
    for path in json.loads(proc.stdout):
        assert Path(path).is_relative_to(wheel_env.site_packages), path
        assert Path(path).exists()
    # Every package of the checkout is in the wheel ([tool.setuptools] lists them one by one).
    folders = {"rtxcore": "rtxcore", "plugins": "rtx_plugins", "kernels": "rtx_kernels",
               "conformance": "rtx_conformance"}
    missing = [f"{folder}/{init.parent.relative_to(REPO / folder)}" for folder, name in folders.items()
               for init in (REPO / folder).rglob("__init__.py")
               if not (wheel_env.site_packages / name / init.relative_to(REPO / folder)).exists()]
    assert not missing, f"packages missing from the wheel (add them to pyproject.toml): {missing}"


def test_every_scaffold_and_the_example_pass_with_gates(wheel_env, plugin_wheels):
    gates = wheel_env.elsewhere / "gates.toml"
    gates.write_text(_scaled((wheel_env.site_packages / "rtxcore" / "spec" / "gates.toml").read_text()))
    report = wheel_env.elsewhere / "report.json"
    names = [*SCAFFOLDS.values(), *EXAMPLE]
    proc = wheel_env.run(wheel_env.rtx, "plugins", "test", *names, "--gates", "--gates-file", str(gates),
                         "--report", "json", "--report-file", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    components = {c["name"]: c for c in data["components"]}
    assert data["passed"] and data["gates_run"] and components.keys() == set(names)
    for kind, name in SCAFFOLDS.items():
        assert (components[name]["kind"], components[name]["package"]) == (kind, f"rtx-{name}")
    for name, c in components.items():
        assert c["contract"] == "pass" and c["num_rules"]["failed"] == c["num_rules"]["skipped"] == 0, c
        assert {g["status"] for g in c["gates"].values()} <= {"pass", "n/a"}, (name, c["gates"])
    # Every gate ran for some component, and the broken package, of another distribution, is listed but not tested.
    assert {g for c in components.values() for g, cell in c["gates"].items() if cell["status"] == "pass"} == {
        "latency", "cache", "quality"}
    assert f"NOT LOADED plugin {BROKEN} (rtx-{BROKEN})" in proc.stdout


def test_a_package_that_raises_at_import_fails_the_run_naming_it(wheel_env, plugin_wheels):
    # The wheel's own gates file, found with no --gates-file (the run fails on the broken plugin, not on the file).
    report = wheel_env.elsewhere / "broken.json"
    proc = wheel_env.run(wheel_env.rtx, "plugins", "test", BROKEN, "--gates", "--report", "json", "--report-file",
                         str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith(f"FAILED plugin {BROKEN} "))
    assert f"(rtx-{BROKEN}): [plugin.loads]" in line and "RuntimeError: broken on purpose" in line, line
    data = json.loads(report.read_text())
    assert not data["passed"] and data["not_found"] == [BROKEN]
    component = data["components"][0]
    assert (component["name"], component["loaded"]) == (BROKEN, False)
    assert "RuntimeError: broken on purpose" in component["failures"][0]
    junit = wheel_env.elsewhere / "broken.xml"
    proc = wheel_env.run(wheel_env.rtx, "plugins", "test", BROKEN, "--report", "junit", "--report-file", str(junit))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [(case.get("name"), f.get("message")) for case in ET.parse(junit).getroot().iter("testcase")
                for f in case.iter("failure")]
    assert len(failures) == 1 and failures[0][0] == f"test_loads[plugin:{BROKEN}]", failures
    assert failures[0][1].startswith("[plugin.loads]") and "broken on purpose" in failures[0][1]


def test_every_kind_has_a_scaffold():
    assert SCAFFOLDS.keys() == KINDS.keys()


def _scaled(text: str) -> str:
    """``gates.toml`` with the values of :data:`SCALED_GATES` in their sections, and every latency target at a
    minute."""
    for section, values in SCALED_GATES.items():
        start = re.search(rf"(?m)^\[{section}\]$", text).start()
        for key, value in values.items():
            text = text[:start] + re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text[start:], count=1)
    return re.sub(r"(?m)^p99_itl_ms = .*$", "p99_itl_ms = 60000.0", text)
