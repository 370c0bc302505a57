"""The serving side's part of time to first token (rtxcore.capacity.serving_path): what a server records, what a
profile keeps of it and what the simulation does with it."""

from __future__ import annotations

import json

import pytest

from rtxcore.capacity.profile import StepTimeProfile
from rtxcore.capacity.serving_path import PATH_MIN_SAMPLES, ServingPathRecorder
from rtxcore.capacity.simulation import Arrival, simulate
from rtxcore.capacity.step_time import SPREAD_QUANTILES
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ConfigError

SERVED = EngineConfig(scheduler="fcfs", num_kv_blocks=64,
                      scheduling=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256))


def test_the_recorder_keeps_quantiles_of_each_part():
    path = ServingPathRecorder()
    for i in range(PATH_MIN_SAMPLES - 1):
        path.observe(0.010 + 0.001 * i, 0.002)
    assert not path.ready
    path.observe(-1e-7, 0.002)  # two threads' clocks a hair apart: 0, not negative
    assert path.ready
    ingress = path.quantiles("ingress")
    assert len(ingress) == len(SPREAD_QUANTILES) and ingress == tuple(sorted(ingress))
    assert ingress[0] == 0.0 and ingress[-1] == pytest.approx(0.010 + 0.001 * (PATH_MIN_SAMPLES - 2))
    assert set(path.quantiles("delivery")) == {0.002}


def test_each_request_reaches_the_engine_an_ingress_late_and_counts_a_delivery_more():
    """Requests far apart (no queueing): every TTFT is the prefill step plus the two fixed parts; without a serving
    path the same arrivals give the prefill step alone."""
    plain = StepTimeProfile(0.010, 0.0001)
    with_path = StepTimeProfile(0.010, 0.0001, ingress=(0.030,) * len(SPREAD_QUANTILES),
                                delivery=(0.004,) * len(SPREAD_QUANTILES))
    arrivals = [Arrival(2.0 * i, "standard", 50, 3) for i in range(20)]
    prefill = plain.seconds(50)
    assert simulate(SERVED, plain, arrivals).lanes["standard"].ttft_s == pytest.approx([prefill] * len(arrivals))
    assert simulate(SERVED, with_path, arrivals).lanes["standard"].ttft_s == pytest.approx(
        [prefill + 0.034] * len(arrivals))


def test_a_profile_file_keeps_the_serving_path_and_per_request_cost_and_refuses_a_bad_one(tmp_path):
    ramp = tuple(0.001 * (i + 1) for i in range(len(SPREAD_QUANTILES)))
    profile = StepTimeProfile(0.010, 0.0001, "given", (), ramp, ramp, per_row_s=0.002)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_json()))
    assert StepTimeProfile.load(path) == profile
    path.write_text(json.dumps({**profile.to_json(), "ingress": list(reversed(ramp))}))
    with pytest.raises(ConfigError, match="ingress must be 13 non-negative, non-decreasing seconds"):
        StepTimeProfile.load(path)
