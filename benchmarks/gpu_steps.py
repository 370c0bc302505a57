"""The steps of benchmarks/gpu.py: for each, the commands it runs on a source tree (`rtx bench` runs, benchmark
scripts, GPU test files), and where their logs and JSON go.

Only the standard library is used here: gpu.py runs before anything is installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_1B = ["--model", "dummy:llama-1b", "--max-num-batched-tokens", "8192", "--max-model-len", "4096"]
# W7's prompts of 8,192 tokens and outputs of 128 need more than 4,096 positions.
LLAMA_1B_LONG = ["--model", "dummy:llama-1b", "--max-num-batched-tokens", "8192", "--max-model-len", "8448"]
LLAMA_8B = ["--model", "dummy:llama-8b", "--max-num-batched-tokens", "8192", "--max-model-len", "4096"]
KERNEL_TESTS = ["tests/kernels/test_kernels_attention.py", "tests/kernels/test_kernels_elementwise.py",
                "tests/kernels/test_kernels_gemv.py", "tests/kernels/test_kernels_row_copy.py",
                "tests/kernels/test_kernels_token_bitmask.py",
                "tests/plugins/logits_processors/test_structured_output_masks.py"]
QUANT_TESTS = ["tests/kernels/test_kernels_quant.py", "tests/kernels/test_kernels_quant_rows.py",
               "tests/kernels/test_kernels_fp8_matmul.py", "tests/plugins/quantizers/test_quantizer_int8_sq.py"]


@dataclass(slots=True)
class Tree:
    """One source tree and how its commands run: its python, environment and working folder."""

    label: str  # "after" for this tree, "before" for the --before tree; suffixes output files in A/B mode
    root: Path  # the tree's source
    cwd: Path  # where its commands run: the tree itself, or a neutral folder in A/B mode
    env: dict[str, str] = field(default_factory=dict)

    def rtx(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "rtxcore.cli.main", *args]

    def script(self, name: str, *args: str) -> list[str]:
        return [sys.executable, str(self.root / "benchmarks" / name), *args]

    def pytest(self, *paths: str) -> list[str]:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]


@dataclass(frozen=True, slots=True)
class Command:
    argv: list[str]
    log: str  # file name under $OUT
    json_path: Path | None = None  # the JSON the command writes, when it writes one


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    help: str
    commands: Callable[[Tree, Path, str, bool], list[Command]]  # (tree, out, suffix, hf) -> commands
    ab: bool = False  # can run in A/B mode: its commands are `rtx bench` runs whose JSON the A/B table reads


def _bench(name: str, workload: str, model: list[str], baseline: str | None = None, *extra: str):
    """An `rtx bench` step; ``baseline`` "hf" is dropped when the caller asks for no HF baseline."""
    def commands(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
        base = [] if baseline is None or (baseline == "hf" and not hf) else ["--baseline", baseline]
        path = out / f"{name}{suffix}.json"
        argv = tree.rtx("bench", "--workload", workload, *base, *model, *extra, "--json", str(path))
        return [Command(argv, f"{name}{suffix}.log", path)]
    return commands


def _alternating(switch: str, name: str, workload: str, *extra: str):
    """`rtx bench` on llama-8b with the boolean environment ``switch`` off and on, alternately, twice (one process
    each: the switches are read once per process)."""
    def commands(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
        runs = []
        for run in (1, 2):
            for value in ("0", "1"):
                for c in _bench(f"{name}{value}_run{run}", workload, LLAMA_8B, None, *extra)(tree, out, suffix, hf):
                    runs.append(Command(["env", f"{switch}={value}", *c.argv], c.log, c.json_path))
        return runs
    return commands


def _cb(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    return [c for seqs in (16, 32, 64) for c in _bench(f"W2_llama1b_cb_vs_static_{seqs}", "W2", LLAMA_1B, "static",
                                                       "--max-num-seqs", str(seqs))(tree, out, suffix, hf)]


def _w8b(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    return _bench("W8B_llama8b", "W8B", LLAMA_8B, "hf")(tree, out, suffix, hf)


def _quant(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    path = out / "quant_speed.json"
    return [Command(tree.pytest(*QUANT_TESTS), "quant_tests.log"),
            Command(tree.script("quant_speed.py", "--methods", "int4,int8,int8-sq,fp8", "--workloads", "W3,W1",
                                "--repeats", "3", "--json", str(path)), "quant_speed.log", path)]


def _fp8(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    """fp8's kernels (the activations' rounding, fused or not, and the Triton GEMM) at real shapes, the GEMM against
    cuBLAS's at 32-256 rows (fp8_gemm_sweep.py), then W2 on llama-8b with fp8 weights at 64 running, where decode
    products have 9-64 rows: in cuBLAS (the default) and in rtx_kernels.fp8_matmul, alternately, twice."""
    tests = tree.pytest("tests/kernels/test_kernels_quant_rows.py", "tests/kernels/test_kernels_fp8_matmul.py",
                        "tests/kernels/test_kernels_elementwise.py")
    sweep = out / "fp8_gemm_sweep.json"
    commands = [Command(tests, "fp8_kernel_tests.log"),
                Command(tree.script("fp8_gemm_sweep.py", "--json", str(sweep)), "fp8_gemm_sweep.log", sweep)]
    w2 = _alternating("RTX_FP8_TRITON_GEMM", "W2_llama8b_fp8_64_triton_gemm", "W2", "--quantization", "fp8",
                      "--max-num-seqs", "64")
    return commands + w2(tree, out, suffix, hf)


def _fp8_accumulation(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    """W8B on llama-8b with fp8 weights, its 256-row products in cuBLAS's default and fast accumulation
    (RTX_FP8_FAST_ACCUM=0/1), alternately, twice."""
    return _alternating("RTX_FP8_FAST_ACCUM", "W8B_llama8b_fp8_fast_accum", "W8B", "--quantization", "fp8")(
        tree, out, suffix, hf)


def _tiers(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    # Issue 35's measurement at its first size, one seed (about 5 minutes on an H100: one call holds it beside the
    # tests); run w4_tiers.py by hand with --seeds 1, 2 and --conversations 64 for the rest.
    path = out / "w4_tiers_llama1b.json"
    return [Command(tree.pytest("tests/kv"), "kv_tests.log"),
            Command(tree.script("w4_tiers.py", "--model", "dummy:llama-1b", "--conversations", "48", "--turns", "12",
                                "--new-tokens", "64", "--reply-tokens", "128", "--max-num-seqs", "16",
                                "--max-num-batched-tokens", "2048", "--configs", "roomy,offload,disk", "--seeds", "0",
                                "--json", str(path)), "w4_tiers.log", path)]


# The default model's weights on this machine (--model-file): its GGUF, carried over in parts.
MODEL_FILE: list[str] = []


def _spec(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    # The tests that need no default model, but preemption's only: each engine captures its graphs.
    tests = tree.pytest("tests/engine/test_speculative.py", "-k", "rejection or garbage or early or setting0")
    commands = [Command(tests, "spec_tests.log")]
    if MODEL_FILE:
        for name, extra in (("w6_default_bf16", []), ("w6_default_fp32", ["--dtype", "float32", "--temperatures",
                                                                          "0"])):
            path = out / f"{name}.json"
            commands.append(Command(tree.script("w6_speculative.py", "--model", MODEL_FILE[0], "--dtype", "bfloat16",
                                                *extra, "--json", str(path)), f"{name}.log", path))
        for workload in ("W6", "W6x8"):
            commands += _bench(f"{workload}_ngram", workload, ["--model", MODEL_FILE[0], "--speculative", "ngram"],
                               "plain")(tree, out, suffix, hf)
        path = out / "early_exit_quality.json"
        commands.append(Command(tree.script("early_exit_quality.py", "--model", MODEL_FILE[0], "--json", str(path)),
                                "early_exit_quality.log", path))
    path = out / "spec_overhead.json"
    commands.append(Command(tree.script("spec_overhead.py", "--json", str(path)), "spec_overhead.log", path))
    return commands


def _real(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    """The default model's real weights: greedy GPU == CPU in float32, W1 and W3 against HF eager (bf16), and fp8's
    perplexity against bf16's."""
    if not MODEL_FILE:  # main() refuses the step without one
        return []
    path = out / "greedy_real.json"
    commands = [Command(tree.script("gpu_checks.py", str(path), "greedy", MODEL_FILE[0]), "greedy_real.log", path)]
    for workload in ("W1", "W3"):
        commands += _bench(f"{workload}_smollm2", workload, ["--model", MODEL_FILE[0]], "hf")(tree, out, suffix, hf)
    path = out / "fp8_quality.json"
    commands.append(Command(tree.script("fp8_quality.py", "--model", MODEL_FILE[0], "--json", str(path)),
                            "fp8_quality.log", path))
    return commands


def _guided(tree: Tree, out: Path, suffix: str, hf: bool) -> list[Command]:
    """Structured output against free generation: first where the forward pass sets the step time (llama-8b's
    shape, random weights, the default model's tokenizer), then on the default model's weights, the guided batch
    with the tokens its grammar forces proposed beside the same batch proposing nothing (--compare-plain)."""
    if not MODEL_FILE:  # main() refuses the step without one
        return []
    path = out / f"guided_llama8b{suffix}.json"
    commands = [Command(tree.script("structured_output.py", "--model", MODEL_FILE[0], "--shape", "llama-8b", "--device",
                                    "cuda", "--batch", "32", "--tokens", "64", "--runs", "5", "--json", str(path)),
                        f"guided_llama8b{suffix}.log", path)]
    for tokens in ("64", "256"):
        path = out / f"guided_{tokens}{suffix}.json"
        commands.append(Command(tree.script("structured_output.py", "--model", MODEL_FILE[0], "--device", "cuda",
                                            "--batch", "32", "--tokens", tokens, "--runs", "5",
                                            "--grammar-proposals", "on", "--compare-plain", "--json", str(path)),
                                f"guided_{tokens}{suffix}.log", path))
    return commands


STEPS: dict[str, Step] = {s.name: s for s in (
    Step("install", "nothing more than the install every call starts with (for commands run by hand afterwards)",
         lambda tree, out, suffix, hf: []),
    Step("tests", "the Triton kernel tests (attention, elementwise, GEMV, row copy, token bitmask) at real shapes on "
                  "the GPU, and the structured-output processor's masks there",
         lambda tree, out, suffix, hf: [Command(tree.pytest(*KERNEL_TESTS), "kernel_tests.log")]),
    Step("greedy", "greedy tokens on the GPU (CUDA graphs and eager) == the CPU's, default model's shape, fp32",
         lambda tree, out, suffix, hf: [Command(tree.script("gpu_checks.py", str(out / "greedy.json"), "greedy"),
                                                "greedy.log", out / "greedy.json")]),
    Step("decode", "greedy == CPU, then a decode step's graph replay and engine step at batch 1 and 256 (llama-1b)",
         lambda tree, out, suffix, hf: [Command(tree.script("gpu_checks.py", str(out / "decode.json"), "decode"),
                                                "decode.log", out / "decode.json")]),
    Step("kernels", "a batch-1 decode graph replay of llama-1b (W3's step), kernel by kernel under the torch profiler",
         lambda tree, out, suffix, hf: [Command(tree.script("gpu_checks.py", str(out / "decode_kernels.json"),
                                                            "kernels"), "decode_kernels.log",
                                                out / "decode_kernels.json")]),
    Step("w1", "W1 on llama-1b against HF eager (static batching)", _bench("W1_llama1b", "W1", LLAMA_1B, "hf"),
         ab=True),
    Step("w3", "W3 on llama-1b against HF eager, and the weight-read floor",
         _bench("W3_llama1b", "W3", LLAMA_1B, "hf"), ab=True),
    Step("cb", "W2 on llama-1b, continuous against static batching at 16, 32 and 64 running", _cb, ab=True),
    Step("w8b", "W8B on llama-8b (bf16) against HF eager", _w8b, ab=True),
    Step("w7", "W7 long context (8,192-token prompts) on llama-1b against HF eager, with TTFT and the prefill "
               "attention's FLOP/s", _bench("W7_llama1b", "W7", LLAMA_1B_LONG, "hf"), ab=True),
    Step("real", "the default model's real weights (--model-file): greedy == CPU in float32, W1 and W3 against HF "
                 "eager, fp8's perplexity against bf16's (fp8_quality.py)", _real),
    Step("guided", "structured output (--model-file): a batch of 32 JSON-schema requests against the same batch "
                   "free, on llama-8b's shape with the default model's tokenizer, then on the default model's "
                   "weights with the grammar's forced tokens proposed and without",
         _guided),
    Step("quant", "quantized kernel tests, then W3 and W1 on llama-8b for bf16, int4, int8, int8-sq and fp8 "
                  "(quant_speed.py, medians of three)", _quant),
    Step("fp8", "fp8's kernel tests, the Triton fp8 GEMM against cuBLAS at 32-256 rows (fp8_gemm_sweep.py), then W2 "
                "on llama-8b with fp8 weights at 64 running, its GEMMs of 9-64 rows in cuBLAS and in the Triton kernel "
                "(RTX_FP8_TRITON_GEMM=0/1), alternately, twice", _fp8),
    Step("fp8acc", "W8B on llama-8b with fp8 weights, cuBLAS's default and fast accumulation (RTX_FP8_FAST_ACCUM=0/1), "
                   "alternately, twice", _fp8_accumulation),
    Step("tiers", "the KV tier tests, then W4 on llama-1b at 48 conversations of 12 turns, roomy against the offload "
                  "and disk configurations, seed 0 (w4_tiers.py)", _tiers),
    Step("spec", "speculative decoding: its engine tests, W6 on the default model's weights (--model-file), early-"
                 "exit quality, and a verification step's cost for k = 1..8 on llama-8b with a llama-1b draft", _spec),
)}
DEFAULT_STEPS = ["tests", "greedy", "w3", "w1", "cb", "w8b"]
