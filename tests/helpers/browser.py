"""Headless Chromium (Debian's ``chromium``) for the dashboard tests: the page as the browser left it, and the
figures it shows. Without Chromium the tests skip, except in CI (``CI`` set), where scripts/setup.sh installs it and
its absence fails."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from tests.helpers import REPO

ARTIFACTS = REPO / "test-artifacts"


def find_chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: scripts/setup.sh installs Debian's chromium package for this test")
        pytest.skip("chromium is not installed (Debian's chromium package; scripts/setup.sh installs it)")
    return path


def browse(chromium: str, url: str, tmp_path, *args: str) -> str:
    """Load ``url`` with 5 s of virtual time for its scripts; Chromium's stdout (the DOM with ``--dump-dom``)."""
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
                           "--virtual-time-budget=5000", *args, url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


class _Figures(HTMLParser):
    def __init__(self):
        super().__init__()
        self.values: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-key" in a and "data-value" in a:
            self.values[a["data-key"]] = a["data-value"]


def shown_figures(dom: str) -> dict[str, str]:
    """data-key -> data-value (the raw number behind the text) of every element of the page that has both."""
    parser = _Figures()
    parser.feed(dom)
    return parser.values


def histogram_quantile(q: float, counts: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts by upper bound (math.inf for +Inf), written
    again here so that the page's and the server's versions are checked against a third."""
    buckets = sorted(counts.items())
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            return lower if le == math.inf else lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = le, cum
    return lower
