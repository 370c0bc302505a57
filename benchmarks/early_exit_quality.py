"""What a subset of the model's layers predicts, on a held-out text, against the full model: how often its greedy
token agrees (what layer-skip's acceptance rests on), and, for early exit at each confidence threshold, the share of
tokens that exit early and the perplexity of the text under the resulting distribution (the quality cost).

A position exits early when the subset's top probability reaches the threshold; its distribution is then the
subset's, otherwise the full model's. Teacher-forced over the whole text, one pass each.

    python benchmarks/early_exit_quality.py [--model M] [--subsets 0-15 0-19 default] [--thresholds 0.9 0.8 0.6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

import torch

from rtx_plugins.proposers.layer_skip import default_layers, parse_layers
from rtxcore.bench.engine import build_engine
from rtxcore.bench.workloads import GROUNDED_TEXT
from rtxcore.cli.bench import machine_description
from rtxcore.contracts.backend import ForwardBatch
from rtxcore.engine.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--subsets", nargs="+", default=["0-9", "0-14", "0-19", "0-24", "default"])
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.95, 0.9, 0.8, 0.6, 0.4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = build_engine(EngineConfig(model=args.model))
    core = engine.core
    text = resources.files("rtxcore.bench").joinpath("texts", GROUNDED_TEXT).read_text(encoding="utf-8")
    tokens = core.tokenizer.encode(text)
    block_size = core.config.block_size
    block_ids = list(range(1, -(-len(tokens) // block_size) + 1))
    targets = torch.tensor(tokens[1:])

    def batch() -> ForwardBatch:
        return ForwardBatch.prefill(tokens, block_ids, block_size, torch.arange(len(tokens) - 1))

    with torch.inference_mode():
        full = torch.log_softmax(core.backend.execute(batch()).float().cpu(), dim=-1)
        full_nll = -full.gather(1, targets[:, None]).squeeze(1)
        rows = []
        for name in args.subsets:
            layers = (default_layers(core.model_config.num_layers) if name == "default"
                      else parse_layers(name, core.model_config.num_layers))
            sub = torch.log_softmax(core.backend.execute_layers(batch(), layers).float().cpu(), dim=-1)
            agree = (sub.argmax(-1) == full.argmax(-1)).float().mean().item()
            confidence = sub.exp().amax(-1)
            sub_nll = -sub.gather(1, targets[:, None]).squeeze(1)
            row = {"layers": name, "num_layers": len(layers), "greedy_agreement": agree, "thresholds": []}
            for t in args.thresholds:
                exits = confidence >= t
                nll = torch.where(exits, sub_nll, full_nll)
                row["thresholds"].append({"threshold": t, "exit_share": exits.float().mean().item(),
                                          "ppl": nll.mean().exp().item(),
                                          "agreement_when_exiting": (sub.argmax(-1) == full.argmax(-1))[exits]
                                          .float().mean().item() if exits.any() else None})
            rows.append(row)
    full_ppl = full_nll.mean().exp().item()
    print(f"# python benchmarks/early_exit_quality.py {' '.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_description()}; "
          f"{len(tokens)} tokens of {GROUNDED_TEXT}")
    print(f"full model: perplexity {full_ppl:.3f}")
    print(f"{'layers':>8} {'n':>3} {'agree':>6} | " + " | ".join(f"t={t:.2f} exit% ppl (+)" for t in args.thresholds))
    for r in rows:
        cells = [f"{c['exit_share']:5.0%} {c['ppl']:6.2f} (+{c['ppl'] - full_ppl:.2f})" for c in r["thresholds"]]
        print(f"{r['layers']:>8} {r['num_layers']:3d} {r['greedy_agreement']:6.1%} | " + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_description(), "full_ppl": full_ppl, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
