"""Chaos drills that end or restart the server (rtxcore/chaos/drills.py), in their short form: SIGTERM in a burst,
SIGKILL during a journal compaction, a tensor-parallel rank killed. Every accepted request completes exactly once."""

from __future__ import annotations

from rtxcore.chaos.drills import run_drill


def _passed(name: str):
    result = run_drill(name)
    assert result.passed, result.to_json()
    return result


def test_sigterm_in_a_burst_drains_every_accepted_request():
    result = _passed("sigterm-burst")
    assert "8 of 8 finished during the drain" in result.notes
    assert result.refusals > 0 and result.completed == 10  # the 2 sent while draining, served after the restart


def test_sigkill_during_compaction_resumes_every_stream_once():
    result = _passed("kill-during-compaction")
    # Every stream was running at the kill, and each finished after the restart with every event once.
    assert result.completed == 8 and "8 of 8 streams running at the kill" in result.notes, result.notes
    assert any("journal.log.tmp" in note for note in result.notes), result.notes


def test_a_killed_rank_fails_liveness_and_the_restart_resumes_every_request_once():
    result = _passed("worker-killed")
    assert result.completed == 8 and "worker rank 1" in result.notes[0]
