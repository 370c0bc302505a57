"""W5 (online mixed lanes) scaled to this 2-core CPU, as the lane tests and the queueing model's live check run it."""

from __future__ import annotations

from rtxcore.bench.loadgen import LaneProfile, LengthRange
from tests.helpers import REPO

W5_CONFIG = REPO / "benchmarks" / "w5_cpu.toml"
# W5's mix (10% realtime with short prompts, 60% standard, 30% bulk with long prompts), lengths scaled to 2 cores.
W5_LANES = (
    LaneProfile("realtime", 0.1, LengthRange(16, 32), LengthRange(8, 16)),
    LaneProfile("standard", 0.6, LengthRange(32, 96), LengthRange(16, 32)),
    LaneProfile("bulk", 0.3, LengthRange(96, 192), LengthRange(32, 64)),
)
# What benchmarks/w5_cpu.toml asks of the engine besides lanes: a batch the size of the closed-loop clients and a
# step budget that keeps a step near half a second on 2 cores (128 tokens: a 256-token step took over a second on
# some of the machines CI runs on, longer than realtime's whole target allows for two steps).
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 16, 128
SERVER_ARGS = ("--scheduler", "sla-lanes", "--config", str(W5_CONFIG), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--no-grpc")
