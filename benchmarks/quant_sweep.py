"""Time the weight-only quantized linear layers (``int8_linear``, ``int4_linear``) against bf16 cuBLAS
(``torch.nn.functional.linear``) and the bf16 Triton ``gemv`` on the projections of Llama-3.1-8B, on the GPU.

Each measurement captures CALLS_PER_GRAPH back-to-back calls in one CUDA graph and times its replays with CUDA
events (median of REPLAYS), as the engine's decode step runs them, so launch overhead is left out. The calls rotate
through enough copies of the weights (>= 4, >= 2x the L2 in total) that no call finds its weight in L2. Effective
bandwidth counts the bytes of the weight in its stored format (int4: the packed words, scales and zero points).

With ``--configs`` it times instead every GEMV launch configuration of a grid (rows per program, warps, vectors
per thread) that fits the kernel's register plan, pinned one at a time in place of the autotuner's choice, for rows of
x up to 8, and for int4 every configuration of the tensor-core GEMV (warps, 16-row tiles per warp): the data behind
the kernels' autotuning lists. Without it, M <= 8 also times int4's two GEMVs by name, "int4-fma" and "int4-mma",
beside what int4_linear runs by default ("int4": the tensor-core GEMV from 2 rows on).

Usage: python benchmarks/quant_sweep.py [summary.json] [--rows 1,4,16,64,256] [--group-size 128] [--shapes qkv,lm_head]
       [--configs]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}
CALLS_PER_GRAPH = 20
REPLAYS = 15
COPY_BW = 4.24e12  # bytes/s, device-to-device copy measured on the H200 (shared/ENVIRONMENT.md)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", nargs="?", help="write a JSON summary here")
    parser.add_argument("--rows", default="1,4,16,64,256", help="comma-separated M values (default: 1,4,16,64,256)")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size along K (default: 128)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--configs", action="store_true",
                        help="time every GEMV launch configuration of a grid instead (rows up to 8)")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.shapes = args.shapes.split(",")
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}")
    return args


def time_graph(fn, num_copies: int) -> float:
    """Median microseconds per call of ``fn(i)`` (i: which weight copy) over CALLS_PER_GRAPH calls in one graph."""
    for i in range(num_copies):  # warm-up, and autotuning, outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fn(i % num_copies)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def random_int8(n: int, k: int):
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    scale = torch.rand(n, device="cuda") / (64 * math.sqrt(k)) + 1e-4
    return weight, scale


def random_int4(n: int, k: int, group: int):
    # Random bits are random nibbles; the top one makes some words negative, as real packed weights do.
    packed = torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int32, device="cuda")
    scale = torch.rand(n, k // group, device="cuda") / (8 * math.sqrt(k)) + 1e-4
    zero = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, device="cuda")
    return packed, scale, zero


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def best_config(kernel) -> str:
    config = getattr(kernel, "best_config", None)
    if config is None:
        return ""
    tiles = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{tiles} warps={config.num_warps} stages={config.num_stages}"


def sweep_shape(name: str, n: int, k: int, rows: list[int], group: int, l2_bytes: int) -> list[dict]:
    from rtx_kernels import quant_fma_gemv, quant_matmul, quant_mma_gemv
    from rtx_kernels.gemv import gemv
    from rtx_kernels.quant_matmul import int4_linear, int8_linear
    from rtx_kernels.quant_reference import dequantize_int4, dequantize_int8

    dtype = torch.bfloat16
    weight_bytes = {"cublas": n * k * 2, "gemv": n * k * 2, "int8": n * k + n * 4,
                    "int4": n * k // 2 + n * (k // group) * 5}
    weight_bytes.update({f"{bits}-{path}": weight_bytes[bits] for bits in ("int8", "int4")
                         for path in ("gemm", "dequantize")})
    weight_bytes["int4-fma"] = weight_bytes["int4-mma"] = weight_bytes["int4"]

    def copies(nbytes: int) -> int:
        return max(4, math.ceil(2 * l2_bytes / nbytes))

    bf16 = [torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k) for _ in range(copies(weight_bytes["cublas"]))]
    int8 = [random_int8(n, k) for _ in range(copies(weight_bytes["int8"]))]
    int4 = [random_int4(n, k, group) for _ in range(copies(weight_bytes["int4"]))]
    # Correctness against the dequantized weight in bf16 cuBLAS, once per shape.
    deq8 = dequantize_int8(*int8[0], dtype=dtype)
    deq4 = dequantize_int4(*int4[0], group, dtype=dtype)

    results = []
    config4fma = config4mma = ""
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        err8 = relative_error(int8_linear(x, *int8[0]), F.linear(x, deq8))
        err4 = relative_error(int4_linear(x, *int4[0], group), F.linear(x, deq4))
        if max(err8, err4) > 2e-2:
            raise AssertionError(f"{name} M={m}: relative error int8 {err8:.1e}, int4 {err4:.1e}")
        errors = {"int8": err8, "int4": err4}
        timed = {"cublas": time_graph(lambda i, x=x: F.linear(x, bf16[i]), len(bf16))}
        if m <= 8:
            timed["gemv"] = time_graph(lambda i, x=x: gemv(x, bf16[i]), len(bf16))
            timed["int8"] = time_graph(lambda i, x=x: int8_linear(x, *int8[i]), len(int8))
            config8 = best_config(quant_fma_gemv._gemv_kernel)
            timed["int4"] = time_graph(lambda i, x=x: int4_linear(x, *int4[i], group), len(int4))
            mma_fits = quant_mma_gemv.fits(x, group)
            on_tensor_cores = quant_matmul._INT4_MMA and mma_fits and m >= quant_mma_gemv.MIN_M
            config4 = best_config(quant_mma_gemv._mma_gemv_kernel if on_tensor_cores else quant_fma_gemv._gemv_kernel)
            # Both int4 GEMVs by name, whichever int4_linear picked above ("int4").
            errors["int4-fma"] = relative_error(int4_linear(x, *int4[0], group, kernel="gemv"), F.linear(x, deq4))
            timed["int4-fma"] = time_graph(lambda i, x=x: int4_linear(x, *int4[i], group, kernel="gemv"), len(int4))
            config4fma = best_config(quant_fma_gemv._gemv_kernel)
            if mma_fits:
                errors["int4-mma"] = relative_error(int4_linear(x, *int4[0], group, kernel="mma"),
                                                    F.linear(x, deq4))
                timed["int4-mma"] = time_graph(lambda i, x=x: int4_linear(x, *int4[i], group, kernel="mma"),
                                               len(int4))
                config4mma = best_config(quant_mma_gemv._mma_gemv_kernel)
            if max(errors.values()) > 2e-2:
                raise AssertionError(f"{name} M={m}: relative errors {errors}")
        else:
            # Both large-M paths, to place DEQUANTIZE_MIN_M where one overtakes the other.
            for path in ("gemm", "dequantize"):
                def int8_call(i, x=x, path=path):
                    return int8_linear(x, *int8[i], kernel=path)

                def int4_call(i, x=x, path=path):
                    return int4_linear(x, *int4[i], group, kernel=path)

                errors[f"int8-{path}"] = relative_error(int8_call(0), F.linear(x, deq8))
                errors[f"int4-{path}"] = relative_error(int4_call(0), F.linear(x, deq4))
                timed[f"int8-{path}"] = time_graph(int8_call, len(int8))
                config8 = best_config(quant_matmul._gemm_kernel) if path == "gemm" else config8
                timed[f"int4-{path}"] = time_graph(int4_call, len(int4))
                config4 = best_config(quant_matmul._gemm_kernel) if path == "gemm" else config4
            if max(errors.values()) > 2e-2:
                raise AssertionError(f"{name} M={m}: relative errors {errors}")
        for method, us in timed.items():
            results.append({
                "matrix": name, "n": n, "k": k, "m": m, "method": method, "us": us,
                "weight_gbps": weight_bytes[method] / us / 1e3, "speedup_vs_cublas": timed["cublas"] / us,
                "config": {"int8": config8, "int4": config4, "int8-gemm": config8,
                           "int4-gemm": config4, "int4-fma": config4fma, "int4-mma": config4mma}.get(method, ""),
                "rel_err": errors.get(method),
            })
    return results


# The grid --configs walks: rows per program, warps (along K), vectors of words per thread and row.
CONFIG_GRID = {"block_n": (1, 2, 4, 8), "num_warps": (1, 2, 4, 8), "chunks": (1, 2)}


@contextlib.contextmanager
def pinned(kernel, config):
    """The autotuned ``kernel`` running ``config`` only (an autotuner with one config neither prunes nor times)."""
    saved = kernel.configs, kernel.cache
    kernel.configs, kernel.cache = [config], {}
    try:
        yield
    finally:
        kernel.configs, kernel.cache = saved


def sweep_configs(name: str, n: int, k: int, rows: list[int], group: int, l2_bytes: int) -> list[dict]:
    import triton
    from rtx_kernels import quant_fma_gemv, quant_mma_gemv
    from rtx_kernels.quant_fma_gemv import _gemv_config, _gemv_vec, _prune_gemv_configs
    from rtx_kernels.quant_matmul import int4_linear, int8_linear

    formats = {"int8": (random_int8, (), int8_linear, n * k + n * 4),
               "int4": (random_int4, (group,), int4_linear, n * k // 2 + n * (k // group) * 5)}
    results = []
    for method, (make, extra, linear, nbytes) in formats.items():
        weights = [make(n, k, *extra) for _ in range(max(4, math.ceil(2 * l2_bytes / nbytes)))]
        bits = 8 if method == "int8" else 4
        for m in (r for r in rows if r <= 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = linear(x, *weights[0], *extra, kernel="gemv")
            grid = [_gemv_config(*c) for c in itertools.product(*CONFIG_GRID.values())]
            fitting = _prune_gemv_configs(grid, {}, BITS=bits, VEC=_gemv_vec(bits, group),
                                          BLOCK_M=triton.next_power_of_2(m))
            for config in fitting:
                with pinned(quant_fma_gemv._gemv_kernel, config):
                    err = relative_error(linear(x, *weights[0], *extra, kernel="gemv"), ref)
                    us = time_graph(lambda i, x=x, w=weights: linear(x, *w[i], *extra, kernel="gemv"),
                                    len(weights))
                results.append({"matrix": name, "n": n, "k": k, "m": m, "method": method, "us": us,
                                "weight_gbps": nbytes / us / 1e3, "config": describe(config), "rel_err": err})
                wrong = " WRONG" if err > 2e-2 else ""
                print(f"{name} {method} M={m} {describe(config)}: {us:.2f} us, error {err:.1e}{wrong}", flush=True)
            if method == "int4" and quant_mma_gemv.fits(x, group):
                for config in quant_mma_gemv._GPU_CONFIGS:
                    with pinned(quant_mma_gemv._mma_gemv_kernel, config):
                        err = relative_error(linear(x, *weights[0], *extra, kernel="mma"), ref)
                        us = time_graph(lambda i, x=x, w=weights: linear(x, *w[i], *extra, kernel="mma"),
                                        len(weights))
                    label = " ".join(f"{key}={value}" for key, value in config.kwargs.items())
                    results.append({"matrix": name, "n": n, "k": k, "m": m, "method": "int4-mma", "us": us,
                                    "weight_gbps": nbytes / us / 1e3, "config": label, "rel_err": err})
                    wrong = " WRONG" if err > 2e-2 else ""
                    print(f"{name} int4-mma M={m} {label}: {us:.2f} us, error {err:.1e}{wrong}", flush=True)
    return results


def describe(config) -> str:
    return f"BLOCK_N={config.kwargs['BLOCK_N']} BLOCK_V={config.kwargs['BLOCK_V']} warps={config.num_warps}"


def main(argv=None) -> None:
    args = parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; x bf16, "
          f"int4 group {args.group_size}; {CALLS_PER_GRAPH} calls per graph, median of {REPLAYS} replays; "
          f"copy bandwidth {COPY_BW / 1e12:.2f} TB/s")
    results = []
    for name in args.shapes:
        n, k = SHAPES[name]
        sweep = sweep_configs if args.configs else sweep_shape
        results += sweep(name, n, k, args.rows, args.group_size, props.L2_cache_size)
        torch.cuda.empty_cache()  # the shape's weights, freed on return
    if args.configs:
        print(f"\n{'matrix':<10}{'M':>3}  {'method':<6}{'best us':>9}{'GB/s':>7}  best config")
        for (name, m, method), group_results in itertools.groupby(
                results, key=lambda r: (r["matrix"], r["m"], r["method"])):
            group_results = list(group_results)
            best = min(group_results, key=lambda r: r["us"])
            print(f"{name:<10}{m:>3}  {method:<6}{best['us']:>9.2f}{best['weight_gbps']:>7.0f}  {best['config']}")
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump({"device": props.name, "group_size": args.group_size, "configs": results}, f, indent=1)
        return

    print(f"\n{'matrix':<10}{'N':>7}{'K':>6}{'M':>5}  {'method':<7}{'us':>9}{'GB/s':>8}{'x cuBLAS':>10}  config")
    for r in results:
        print(f"{r['matrix']:<10}{r['n']:>7}{r['k']:>6}{r['m']:>5}  {r['method']:<7}{r['us']:>9.2f}"
              f"{r['weight_gbps']:>8.0f}{r['speedup_vs_cublas']:>10.2f}  {r['config']}")
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump({"device": props.name, "group_size": args.group_size, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
