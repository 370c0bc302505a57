"""Progress on stderr: whole lines at most every ``interval_s`` and a last one when stderr is not a terminal (pod
logs), a tqdm bar on a terminal, nothing when disabled."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import termios
import time

import pytest

from rtxcore.cli import progress as progress_module
from rtxcore.cli.progress import Progress

LINE = re.compile(r"^weights: (\d+)/20 \((\d+)%\) \d+\.\ds elapsed(, ETA \d+\.\ds)?$")


class Clock:
    """time.monotonic for the module under test, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    return clock


def test_lines_when_not_a_terminal_at_most_one_per_interval_and_the_last(capsys, clock):
    progress = Progress("weights", interval_s=2.0)
    for done in range(1, 21):  # one unit every 0.5 s: 10 s in all
        progress(done, 20)
        clock.now += 0.5
    lines = capsys.readouterr().err.splitlines()
    # The clock starts at the first report (t=0): lines at t=2, 4, 6 and 8, then the last one at t=9.5.
    assert [LINE.match(line).group(1) for line in lines] == ["5", "9", "13", "17", "20"], lines
    # 4 units in the 2 s since the first report: 15 left take 7.5 s.
    assert lines[0] == "weights: 5/20 (25%) 2.0s elapsed, ETA 7.5s"
    assert lines[-1] == "weights: 20/20 (100%) 9.5s elapsed"
    assert "\r" not in "".join(lines)


def test_the_last_line_is_printed_once_and_later_calls_are_ignored(capsys, clock):
    progress = Progress("weights", interval_s=60)
    progress(1, 20)
    progress(20, 20)
    progress(20, 20)  # a source that reports its end twice
    assert capsys.readouterr().err == "weights: 20/20 (100%) 0.0s elapsed\n"


def test_a_tiny_interval_on_the_real_clock(capsys):
    progress = Progress("weights", interval_s=0.02)
    start = time.monotonic()
    for done in range(1, 21):
        time.sleep(0.005)
        progress(done, 20)
    elapsed = time.monotonic() - start
    lines = capsys.readouterr().err.splitlines()
    assert all(LINE.match(line) for line in lines), lines
    assert lines[-1].startswith("weights: 20/20 (100%)")
    assert 2 <= len(lines) <= elapsed / 0.02 + 2, lines


def test_disabled_prints_nothing(capsys):
    progress = Progress("weights", enabled=False, interval_s=0)
    for done in range(1, 21):
        progress(done, 20)
    assert capsys.readouterr().err == ""


def test_write_prints_other_text_as_a_line(capsys):
    progress = Progress("layers", interval_s=60)
    progress(1, 4)
    progress.write("rtx quantize: a layer fell back")
    progress(4, 4)
    assert capsys.readouterr().err.splitlines() == ["rtx quantize: a layer fell back",
                                                    "layers: 4/4 (100%) 0.0s elapsed"]


def _on_a_terminal(monkeypatch, columns: int) -> str:
    """What 20 reports show on a pseudo-terminal ``columns`` wide."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with open(follower, "w") as terminal, open(leader, "rb", buffering=0) as screen:
        monkeypatch.setattr("sys.stderr", terminal)
        progress = Progress("weights", unit="tensor", interval_s=60)
        for done in range(1, 21):
            progress(done, 20)
        terminal.flush()
        shown = b""
        while select.select([screen], [], [], 0.2)[0]:
            shown += screen.read(65536)
    return shown.decode()


def test_a_bar_with_rate_and_eta_on_a_terminal(monkeypatch):
    shown = _on_a_terminal(monkeypatch, 100)
    assert "\r" in shown and "weights: 100%" in shown and "20/20" in shown and "tensor/s" in shown, shown
    assert "<00:00" in shown  # the ETA
    assert shown.endswith("\n"), shown  # the finished bar stays on screen, its line ended


def test_a_terminal_of_unknown_width_gets_lines(monkeypatch):
    """tqdm would draw nothing at all on a terminal that says it has 0 columns."""
    assert _on_a_terminal(monkeypatch, 0).splitlines() == ["weights: 20/20 (100%) 0.0s elapsed"]


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        Progress("weights", interval_s=-1)


def test_duration_formats():
    assert [progress_module._duration(s) for s in (3.14, 59.94, 59.96, 61, 3725)] == [
        "3.1s", "59.9s", "1m00s", "1m01s", "1h02m"]


def test_a_closed_or_missing_stderr_is_not_a_terminal():
    closed = io.StringIO()
    closed.close()
    assert not progress_module._is_terminal(closed) and not progress_module._is_terminal(None)
    assert not progress_module._is_terminal(io.StringIO())
