"""The engine's own step-time profile (rtxcore.capacity.step_time.StepTimeRecorder) and the spread the simulation
draws steps' times from."""

from __future__ import annotations

import random
import statistics

import pytest

from rtxcore.capacity.step_time import (
    DECODE,
    OTHER,
    RECORDER_MIN_SAMPLES,
    SPREAD_QUANTILES,
    StepTimeRecorder,
    draw_ratio,
)


def record(recorder: StepTimeRecorder, steps: list[tuple], idle_every: int = 0) -> None:
    """Feed schedules as an engine would: each (tokens, seconds[, rows]) step back to back, and with ``idle_every``
    an empty schedule followed by a long wait for work every so many steps."""
    now = 0.0
    for i, (tokens, seconds, *rows) in enumerate(steps):
        recorder.observe(now, tokens, *rows)
        now += seconds
        if idle_every and i % idle_every == idle_every - 1:
            recorder.observe(now, 0)
            now += 100.0  # waiting for a request: never a step's time
    recorder.observe(now, 0)


def test_the_recorder_learns_the_line_and_its_spread_and_skips_idle_gaps():
    rng = random.Random(3)
    steps = []
    for _ in range(3000):
        tokens = rng.randint(1, 256)
        steps.append((tokens, (0.05 + 0.002 * tokens) * rng.choice((0.8, 1.0, 1.2))))
    recorder = StepTimeRecorder()
    record(recorder, steps, idle_every=7)
    assert recorder.ready
    base, per_token = recorder.model.coefficients()
    assert base == pytest.approx(0.05, rel=0.15) and per_token == pytest.approx(0.002, rel=0.1)
    spread = recorder.spread()
    assert len(spread) == len(SPREAD_QUANTILES)
    # Three equally likely ratios: the outer quantiles are theirs, the median the middle one.
    assert spread[0] == pytest.approx(0.8, abs=0.05) and spread[-1] == pytest.approx(1.2, abs=0.05)
    assert spread[SPREAD_QUANTILES.index(0.5)] == pytest.approx(1.0, abs=0.05)


def test_the_recorder_learns_what_each_request_of_a_step_costs_beyond_its_tokens():
    """Decode steps (a token per request) and prefill chunks (many tokens, few requests), as an engine mixes them:
    the row-aware fit separates the two costs, where a fit on tokens alone would charge decode rows as tokens."""
    rng = random.Random(5)
    steps = []
    for _ in range(3000):
        rows = rng.randint(1, 16)
        tokens = rows if rng.random() < 0.6 else rows - 1 + rng.randint(16, 128)
        steps.append((tokens, (0.05 + 0.004 * rows + 0.001 * tokens) * rng.choice((0.9, 1.0, 1.1)), rows))
    recorder = StepTimeRecorder()
    record(recorder, steps)
    base, per_row, per_token = recorder.coefficients()
    assert base == pytest.approx(0.05, rel=0.1) and per_row == pytest.approx(0.004, rel=0.1)
    assert per_token == pytest.approx(0.001, rel=0.1)
    assert recorder.predict(1, 1) == pytest.approx(0.055, rel=0.05)
    # Without rows (or with every step the same shape) it cannot separate them: tokens alone, no per-row part.
    plain = StepTimeRecorder()
    record(plain, [(tokens, seconds) for tokens, seconds, _ in steps])
    assert plain.coefficients()[1] == 0.0 and plain.coefficients()[2] > 0


def test_the_recorder_is_not_ready_before_it_has_seen_enough_steps():
    recorder = StepTimeRecorder()
    record(recorder, [(10, 0.1)] * (RECORDER_MIN_SAMPLES - 5))
    assert not recorder.ready
    record(recorder, [(10, 0.1)] * 10)
    # Every step seen is in the spread, taken against the profile as it now stands.
    assert recorder.ready and recorder.spread() == pytest.approx((1.0,) * len(SPREAD_QUANTILES))


def test_draws_from_a_spread_follow_its_quantiles():
    spread = tuple(0.5 + q for q in SPREAD_QUANTILES)  # ratio = 0.5 + u between the outer quantiles
    rng = random.Random(0)
    draws = [draw_ratio(spread, rng.random()) for _ in range(20000)]
    assert statistics.median(draws) == pytest.approx(1.0, abs=0.02)
    assert min(draws) == pytest.approx(spread[0]) and max(draws) == pytest.approx(spread[-1])
    assert draw_ratio((), 0.3) == 1.0


def test_decode_steps_are_learnt_by_batch_size_where_the_line_misses_them():
    """Decode steps whose time does not follow the line through the mix (small batches cheaper, as matrix products
    change kernels with the batch): each batch size's own mean stands in for the line once it has enough steps,
    and a profile carrying them gives the simulation those times, the line for the rest."""
    from rtxcore.capacity.profile import StepTimeProfile

    rng = random.Random(7)
    decode = {1: 0.030, 2: 0.034, 3: 0.038, 4: 0.060, 5: 0.064}
    steps = []
    for _ in range(3000):
        if rng.random() < 0.7:
            rows = rng.randint(1, 5)
            steps.append((rows, decode[rows] * rng.choice((0.95, 1.0, 1.05)), rows))
        else:
            rows = rng.randint(1, 5)
            tokens = rows - 1 + rng.randint(32, 128)
            steps.append((tokens, 0.05 + 0.004 * rows + 0.001 * tokens, rows))
    recorder = StepTimeRecorder()
    record(recorder, steps)
    learnt = recorder.decodes.seconds()
    assert set(learnt) == set(decode)
    for rows, seconds in decode.items():
        assert learnt[rows] == pytest.approx(seconds, rel=0.05)
        assert recorder.predict(rows, rows) == pytest.approx(seconds, rel=0.05)
    base, per_row, per_token = recorder.coefficients()
    # The line is the prefill steps' own: decodes, which it no longer predicts, do not pull it.
    assert base == pytest.approx(0.05, rel=0.02) and per_row == pytest.approx(0.004, rel=0.05)
    assert per_token == pytest.approx(0.001, rel=0.02)
    line_miss = max(abs(seconds - (base + rows * (per_row + per_token))) for rows, seconds in decode.items())
    assert line_miss > 0.005, "the line alone would have done"
    # Decode steps' ratios are to their own size's mean: their spread's middle is the noise, not the line's miss.
    spread = recorder.spread(DECODE)
    assert 0.9 <= spread[SPREAD_QUANTILES.index(0.1)] and spread[SPREAD_QUANTILES.index(0.9)] <= 1.1
    profile = StepTimeProfile(base, per_token, per_row_s=per_row, decode_s=learnt)
    assert profile.seconds(2, 2) == learnt[2]
    assert profile.seconds(7, 7) == pytest.approx(base + 7 * (per_row + per_token))  # a size never seen: the line
    assert profile.seconds(40, 2) == pytest.approx(base + 2 * per_row + 40 * per_token)  # a prefill chunk


def test_decode_steps_and_the_others_keep_their_own_spreads_and_a_profile_draws_each_from_its_own():
    """Decodes that keep to their batch size's mean, prefill steps that stray far from the line (a tenth at half of
    it, as a step kind the line misses would): one spread for both would give decodes the prefills' low tail."""
    from rtxcore.capacity.profile import StepTimeProfile

    rng = random.Random(11)
    steps = []
    for _ in range(4000):
        rows = rng.randint(1, 4)
        if rng.random() < 0.7:
            steps.append((rows, 0.03 * rng.choice((0.95, 1.0, 1.05)), rows))
        else:
            tokens = rows - 1 + rng.randint(32, 128)
            slow = 0.5 if rng.random() < 0.1 else 1.0
            steps.append((tokens, (0.05 + 0.002 * rows + 0.001 * tokens) * slow, rows))
    recorder = StepTimeRecorder()
    record(recorder, steps)
    tenth = SPREAD_QUANTILES.index(0.05)
    decode, other, every = recorder.spread(DECODE), recorder.spread(OTHER), recorder.spread()
    assert decode[tenth] >= 0.9 and other[tenth] <= 0.7 and every[0] <= 0.7
    assert len(decode) == len(other) == len(SPREAD_QUANTILES)
    # A profile with both: a decode step draws from the decodes', a prefill step from the others'.
    profile = StepTimeProfile(0.05, 0.001, spread=other, decode_s={2: 0.03}, decode_spread=decode)
    draws = [profile.draw(2, u / 1000, 2) / 0.03 for u in range(1000)]
    assert min(draws) == pytest.approx(decode[0]) and max(draws) == pytest.approx(decode[-1])
    prefill = [profile.draw(64, u / 1000, 2) / profile.seconds(64, 2) for u in range(1000)]
    assert min(prefill) == pytest.approx(other[0])
    # Without a decode spread (a profile from before, or no decodes seen) every step draws from the one spread.
    assert StepTimeProfile(0.05, 0.001, spread=other, decode_s={2: 0.03}).draw(2, 0.0, 2) == pytest.approx(
        0.03 * other[0])
    # A kind with too few steps has no spread of its own yet.
    few = StepTimeRecorder()
    record(few, [(40, 0.1, 2)] * 200 + [(2, 0.03, 2)] * 10)
    assert few.spread(DECODE) == () and len(few.spread(OTHER)) == len(SPREAD_QUANTILES)


def test_a_profile_file_keeps_its_decode_times_and_refuses_bad_ones(tmp_path):
    import json

    from rtxcore.capacity.profile import StepTimeProfile
    from rtxcore.errors import ConfigError

    decode_spread = tuple(0.9 + 0.01 * i for i in range(len(SPREAD_QUANTILES)))
    profile = StepTimeProfile(0.05, 0.001, per_row_s=0.002, decode_s={1: 0.03, 4: 0.06}, decode_spread=decode_spread)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_json()))
    loaded = StepTimeProfile.load(path)
    assert loaded.decode_s == {1: 0.03, 4: 0.06} and loaded.seconds(4, 4) == 0.06
    assert loaded.decode_spread == decode_spread
    path.write_text(json.dumps({**profile.to_json(), "decode_spread": [1.0, 0.5]}))
    with pytest.raises(ConfigError, match="spread"):
        StepTimeProfile.load(path)
    path.write_text(json.dumps({**profile.to_json(), "decode_s": {"0": 0.03}}))
    with pytest.raises(ConfigError, match="decode_s"):
        StepTimeProfile.load(path)


def test_the_spread_is_against_the_profile_as_it_stands_not_the_predictions_steps_had_when_they_ran():
    """Decodes that got faster (a slower neighbour went away): the profile follows within a few hundred steps, and
    the spread of the steps kept is against it. Against the predictions each step had when it ran, the first few
    hundred would hold the profile's lag (ratios down to 0.75), and a simulation drawing from that spread would run
    every step faster than the profile it multiplies."""
    rng = random.Random(13)
    steps = [(2, 0.04 * rng.choice((0.98, 1.0, 1.02)), 2) for _ in range(3000)]
    steps += [(2, 0.03 * rng.choice((0.98, 1.0, 1.02)), 2) for _ in range(2000)]
    recorder = StepTimeRecorder()
    record(recorder, steps)
    assert recorder.predict(2, 2) == pytest.approx(0.03, rel=0.03)
    spread = recorder.spread(DECODE)
    assert spread[0] >= 0.95 and spread[-1] <= 1.05
    drawn = statistics.fmean(draw_ratio(spread, (i + 0.5) / 1000) for i in range(1000))
    assert drawn == pytest.approx(1.0, abs=0.02)
