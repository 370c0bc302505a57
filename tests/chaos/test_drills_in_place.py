"""Chaos drills whose server keeps running through the fault (rtxcore/chaos/drills.py), in their short form: a
plugin failing some requests, the journal's disk full then freed, fsync stalls, a host tier too small, a storm of
disconnecting clients."""

from __future__ import annotations

import pytest

from rtxcore.chaos.drills import run_drill


def _passed(name: str):
    result = run_drill(name)
    if result.skipped:
        pytest.skip(result.skipped)
    assert result.passed, result.to_json()
    assert result.accepted > 0 and result.healthy_after
    return result


def test_a_plugin_failing_one_request_in_four_fails_those_alone():
    result = _passed("plugin-fault")
    assert result.failed_by_design == 2 and result.completed == 6
    assert result.recovery_s == 0  # never unready: nothing else noticed


def test_a_full_journal_disk_refuses_new_requests_until_freed_and_loses_nothing():
    result = _passed("disk-full")
    # Requests sent while full were refused (and sent again), the server was unready meanwhile, and every one of
    # the 8 running + 3 late requests completed; the journal replayed what clients had seen.
    assert result.refusals > 0 and result.recovery_s > 0 and result.completed == 11


def test_fsync_stalls_slow_admission_and_fail_nothing():
    result = _passed("slow-fsync")
    assert result.completed == 12 and result.refusals == 0


def test_a_host_tier_too_small_evicts_and_requests_go_on():
    result = _passed("host-tier-full")
    assert result.completed == 16


def test_a_storm_of_disconnecting_clients_frees_their_kv_and_spares_the_rest():
    result = _passed("disconnect-storm")
    assert result.completed == 4 and "aborts 12" in result.notes[0]
