"""Time fp8 products at decode sizes on the GPU: ``torch._scaled_mm`` (cuBLAS, row-wise scales; the engine's path,
and beside it cuBLAS's fast-accumulation mode, the engine's under ``RTX_FP8_FAST_ACCUM=1``) against
``rtx_kernels.fp8_matmul`` with its own launch shape and, with ``--sweep``, the fastest of 28 others, on llama-8b's
four projections (qkv 6144x4096, o 4096x4096, gate|up 28672x4096, down 4096x14336).

Operands are random e4m3 with random float32 row and channel scales. Each figure is the median of
``triton.testing.do_bench_cudagraph`` (calls replayed from a CUDA graph, as in the decode graphs); GB/s counts the
weight's bytes, read once a call. The Triton product and cuBLAS's fast-accumulation one are checked against cuBLAS's
default (relative error of the whole output) before they are timed.

Usage: python benchmarks/fp8_gemm_sweep.py [--rows 32,64,128,256] [--sweep] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict

import torch
from triton.testing import do_bench_cudagraph

from rtx_kernels.fp8_matmul import LaunchShape, fp8_matmul, launch_shape

FP8 = torch.float8_e4m3fn
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SWEEP = [LaunchShape(bm, bn, bk, stages, warps)
         for bm, bn, bk, stages, warps in itertools.product((64, 128), (64, 128, 256), (128, 256), (4, 6), (4, 8))
         if (bm + bn) * bk * stages <= 220 * 1024]  # shared memory for the pipelined tiles


def _operands(m: int, n: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(FP8)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(FP8)
    x_scale = torch.rand(m, 1, device="cuda", generator=gen) + 0.5
    w_scale = torch.rand(n, device="cuda", generator=gen) + 0.5
    return x, x_scale, w, w_scale


def _us(fn) -> float:
    return do_bench_cudagraph(fn) * 1000


def measure(m: int, name: str, sweep: bool) -> dict:
    n, k = PROJECTIONS[name]
    x, x_scale, w, w_scale = _operands(m, n, k)

    def cublas(fast_accum: bool = False):
        return torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum)

    ref = cublas().float()
    own = launch_shape(n, k)
    out = fp8_matmul(x, x_scale, w, w_scale).float()
    row = {"rows": m, "projection": name, "n": n, "k": k, "cublas_us": _us(cublas),
           "cublas_fast_accum_us": _us(lambda: cublas(True)),
           "triton_us": _us(lambda: fp8_matmul(x, x_scale, w, w_scale)), "launch_shape": asdict(own),
           "relative_error": ((out - ref).norm() / ref.norm()).item(),
           "fast_accum_relative_error": ((cublas(True).float() - ref).norm() / ref.norm()).item()}
    if sweep:
        timed = [(_us(lambda s=s: fp8_matmul(x, x_scale, w, w_scale, shape=s)), s) for s in SWEEP]
        best_us, best = min(timed, key=lambda t: t[0])
        row["sweep_best_us"] = best_us
        row["sweep_best"] = asdict(best)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="32,64,128,256", help="comma-separated row counts (default 32,64,128,256)")
    parser.add_argument("--sweep", action="store_true", help="also time 28 other launch shapes, report the best")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        layer = {"cublas_us": 0.0, "cublas_fast_accum_us": 0.0, "triton_us": 0.0}
        for name in PROJECTIONS:
            row = measure(m, name, args.sweep)
            results.append(row)
            for key in layer:
                layer[key] += row[key]
            best = f", best of sweep {row['sweep_best_us']:.1f} {row['sweep_best']}" if args.sweep else ""
            gbs = row["n"] * row["k"] / 1e3
            print(f"{m:4d} rows {name:8s} cuBLAS {row['cublas_us']:6.1f} us ({gbs / row['cublas_us']:5.0f} GB/s), "
                  f"fast-acc. {row['cublas_fast_accum_us']:6.1f} us, "
                  f"Triton {row['triton_us']:6.1f} us ({gbs / row['triton_us']:5.0f} GB/s), "
                  f"rel. error {row['relative_error']:.1e} (fast-acc. {row['fast_accum_relative_error']:.1e}){best}",
                  flush=True)
        print(f"{m:4d} rows, a layer: cuBLAS {layer['cublas_us']:.1f} us, "
              f"fast-acc. {layer['cublas_fast_accum_us']:.1f} us, Triton {layer['triton_us']:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
