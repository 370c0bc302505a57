"""`rtx sbom`: a CycloneDX SBOM of the installed environment that lists the serving dependencies."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from importlib.metadata import version
from urllib.parse import quote

from tests.helpers import REPO
from tests.helpers.server import RTX


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_sbom_lists_the_serving_dependencies(tmp_path):
    out = tmp_path / "sbom.json"
    result = subprocess.run([RTX, "sbom", "--out", str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    sbom = json.loads(out.read_text())
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
    components = {normalize(c["name"]): c for c in sbom["components"]}
    assert f"{len(components)} components written to {out}" in result.stderr

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    serving = {normalize(re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0]) for dep in declared}
    assert {"torch", "starlette", "uvicorn", "grpcio", "prometheus-client"} <= serving
    for name in serving | {"rtx-serve"}:
        assert name in components, f"{name} is missing from the SBOM"
        assert components[name]["version"] == version(name)
    for name in serving:
        # purl percent-encodes a local version's "+" (torch 2.13.0+cpu).
        assert components[name]["purl"] == f"pkg:pypi/{name}@{quote(version(name))}"
