"""What a drill counts: a stream that repeats an event, skips one, ends early or differs from the undisturbed run is
caught (the drills' verdicts rest on this)."""

from __future__ import annotations

from rtxcore.chaos import harness
from rtxcore.chaos.harness import DrillResult
from rtxcore.chaos.load import Stream


def stream(index: int, events: list[tuple[int, list[int]]], finished: bool = True) -> Stream:
    s = Stream(index, 4, req_id=f"r{index}")
    s.events = [(i, {"token_ids": t, "finished": False}) for i, t in events]
    if finished:
        s.events[-1][1]["finished"] = True
    return s


def test_tally_catches_duplicates_gaps_cuts_and_wrong_tokens(monkeypatch):
    monkeypatch.setattr(harness, "reference_tokens", lambda base_url, index, max_tokens: [1, 2, 3, 4])
    result = DrillResult("t")
    streams = [stream(0, [(1, [1, 2]), (2, [3, 4])]),  # right
               stream(1, [(1, [1, 2]), (2, [3]), (2, [3]), (3, [4])]),  # an event twice
               stream(2, [(1, [1, 2]), (3, [3, 4])]),  # a gap
               stream(3, [(1, [1, 2])], finished=False),  # never finished
               stream(4, [(1, [1, 2]), (2, [3, 5])])]  # other tokens
    harness.tally(result, streams, "http://unused")
    assert (result.accepted, result.completed, result.lost) == (5, 2, 1)  # the gap's tokens happen to be right
    assert (result.duplicated_events, result.missing_events, result.wrong_tokens) == (1, 1, 2)
    assert not result.passed
