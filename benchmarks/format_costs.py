"""Decode cost of each quantization format at a model's layer shapes: the table `rtx quantize --plan --format-costs
FILE` plans with (rtxcore.quant.format_costs). Run it on the device that will serve; it needs only the model's shapes,
so a random-weight model of the same shape stands in (`dummy:smollm2-135m` for the default model).

Usage: python benchmarks/format_costs.py [--model dummy:smollm2-135m] [--formats int4,int8,fp8] [--device cuda]
       --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from rtxcore.cli.bench import machine_description
from rtxcore.models.resolve import resolve_model
from rtxcore.quant.format_costs import FLOAT, decode_shapes, measure, shape_key
from rtxcore.registry import load_plugins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--formats", default="int4,int4-g64,int4-g32,int4-gptq,int4-awq,int8,int8-sq,fp8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    registry = load_plugins()
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in registry.names("quantizer")]
    if unknown:
        parser.error(f"unknown format(s): {', '.join(unknown)}")
    config = resolve_model(args.model).config
    shapes = decode_shapes(config)
    costs = measure(shapes, formats, lambda name: registry.create("quantizer", name), args.device)
    table = {**costs.to_json(), "model": args.model, "machine": machine_description(),
             "command": "python benchmarks/format_costs.py " + " ".join(sys.argv[1:]),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    with open(args.out, "w") as fh:
        json.dump(table, fh, indent=1)
    keys = [shape_key(s) for s in shapes]
    print(f"# {table['command']}\n# {table['date']} on {table['machine']}; microseconds per one-row product")
    print(f"{'format':12}" + "".join(f"{k:>14}" for k in keys) + f"{'layer sum':>14}")
    for fmt in [FLOAT, *formats]:
        row = costs.seconds[fmt]
        total = sum(row[k] for k in keys)
        print(f"{fmt:12}" + "".join(f"{row[k] * 1e6:14.2f}" for k in keys) + f"{total * 1e6:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
