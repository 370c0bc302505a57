"""benchmarks/gpu.py on the CPU: step selection, argument errors, the commands each step runs, and the A/B tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.benchmark_scripts import benchmark_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu():
    with benchmark_script("gpu") as module:
        yield module


def bench_payload(tokens_per_s: float, ms: float, base: float | None = 4000.0) -> dict:
    results = [{"label": "rtx engine", "tokens_per_s": tokens_per_s, "ms_per_token_per_request": ms}]
    if base is not None:
        results.append({"label": "hf eager (static)", "tokens_per_s": base, "ms_per_token_per_request": 60.0})
    return {"command": "rtx bench --workload W1", "date": "2026-12-01 10:00 UTC", "machine": "NVIDIA H200",
            "results": results, "ratio_vs_baseline": tokens_per_s / base if base else None}


def test_default_steps_and_explicit_order(gpu, tmp_path):
    assert gpu.parse_args(["--out", str(tmp_path)]).steps == gpu.DEFAULT_STEPS
    assert gpu.parse_args(["w3", "w1", "--out", str(tmp_path)]).steps == ["w3", "w1"]
    assert set(gpu.DEFAULT_STEPS) <= set(gpu.STEPS)


@pytest.mark.parametrize("argv, message", [
    (["w9"], "unknown step(s): w9"),
    (["w1", "--runs", "0"], "--runs must be at least 1"),
    (["w1", "--before", "/nonexistent"], "not a source tree"),
    (["tests", "--before", "BEFORE"], "cannot run in A/B mode"),
    (["w1", "--before", "."], "this very tree"),
])
def test_argument_errors(gpu, tmp_path, capsys, argv, message):
    before = tmp_path / "before"
    before.mkdir()
    (before / "pyproject.toml").write_text("")
    argv = [str(before) if a == "BEFORE" else str(REPO) if a == "." else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        gpu.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_b_accepts_bench_steps(gpu, tmp_path):
    (tmp_path / "pyproject.toml").write_text("")
    args = gpu.parse_args(["w1", "w3", "--before", str(tmp_path), "--runs", "3"])
    assert args.before == tmp_path and args.runs == 3
    assert {s.name for s in gpu.STEPS.values() if s.ab} >= {"w1", "w3"}


def test_bench_step_commands(gpu, tmp_path):
    tree = gpu.Tree("before", tmp_path / "tree", tmp_path / "run")
    (w1,) = gpu.STEPS["w1"].commands(tree, tmp_path, "_before_1", True)
    assert w1.argv[1:4] == ["-m", "rtxcore.cli.main", "bench"]
    assert w1.argv[w1.argv.index("--workload") + 1] == "W1"
    assert w1.argv[w1.argv.index("--baseline") + 1] == "hf"
    assert w1.argv[w1.argv.index("--model") + 1] == "dummy:llama-1b"
    assert w1.json_path == tmp_path / "W1_llama1b_before_1.json"
    assert w1.log == "W1_llama1b_before_1.log"
    (no_hf,) = gpu.STEPS["w3"].commands(tree, tmp_path, "", False)
    assert "--baseline" not in no_hf.argv
    cb = gpu.STEPS["cb"].commands(tree, tmp_path, "", False)
    assert [c.argv[c.argv.index("--max-num-seqs") + 1] for c in cb] == ["16", "32", "64"]
    assert all(c.argv[c.argv.index("--baseline") + 1] == "static" for c in cb)  # not an HF baseline: kept
    (checks,) = gpu.STEPS["greedy"].commands(tree, tmp_path, "", True)
    assert checks.argv[1] == str(tmp_path / "tree" / "benchmarks" / "gpu_checks.py")


def test_steps_name_files_that_exist(gpu, tmp_path):
    tree = gpu.Tree("after", REPO, REPO)
    for step in gpu.STEPS.values():
        for c in step.commands(tree, tmp_path, "", True):
            for arg in c.argv[1:]:
                if arg.endswith(".py") and "/" in arg:
                    assert (REPO / arg).is_file(), f"{step.name}: {arg}"


def test_runs_alternate_and_swap_order(gpu):
    assert gpu.run_order(1) == [(1, "before"), (1, "after")]
    assert gpu.run_order(3) == [(1, "before"), (1, "after"), (2, "after"), (2, "before"), (3, "before"),
                                (3, "after")]


def test_a_b_table(gpu):
    rows = gpu.ab_rows([("before", 1, bench_payload(90000.0, 0.90)), ("after", 1, bench_payload(99000.0, 0.81)),
                        ("after", 2, bench_payload(101000.0, 0.79)), ("before", 2, bench_payload(92000.0, 0.92))])
    summary = gpu.ab_summary(rows)
    assert summary["medians"]["before"] == {"runs": 2, "tokens_per_s": 91000.0, "ms_per_token": pytest.approx(0.91)}
    assert summary["after_vs_before"]["tokens_per_s"] == pytest.approx(100000 / 91000)
    assert summary["after_vs_before"]["ms_per_token"] == pytest.approx(0.80 / 0.91)
    text = gpu.ab_markdown("W1_llama1b", "rtx bench --workload W1", rows)
    assert "| before | 1 | 2026-12-01 10:00 UTC | 90,000.0 | 0.900 | 4,000.0 | 22.50x |" in text
    assert "- after / before: tokens/s 1.099x, ms/token 0.879x" in text
    assert "- machine: NVIDIA H200" in text


def test_a_b_table_without_baseline_or_second_tree(gpu):
    rows = gpu.ab_rows([("after", 1, bench_payload(1000.0, 1.0, base=None))])
    assert "after_vs_before" not in gpu.ab_summary(rows)
    assert "| after | 1 | 2026-12-01 10:00 UTC | 1,000.0 | 1.000 | - | - |" in gpu.ab_markdown("W3", "rtx", rows)


def test_guided_step_measures_a_forward_bound_shape_first(gpu, tmp_path):
    tree = gpu.Tree("after", tmp_path / "tree", tmp_path / "run")
    gpu.MODEL_FILE[:] = ["/root/smol.gguf"]
    try:
        shape, *default_model = gpu.STEPS["guided"].commands(tree, tmp_path, "", True)
    finally:
        gpu.MODEL_FILE[:] = []
    # llama-8b's random weights take the GGUF's tokenizer: a grammar needs one and dummy shapes have none.
    assert shape.argv[shape.argv.index("--shape") + 1] == "llama-8b"
    assert shape.argv[shape.argv.index("--model") + 1] == "/root/smol.gguf"
    assert [c.argv[c.argv.index("--tokens") + 1] for c in default_model] == ["64", "256"]
    assert all("--shape" not in c.argv and "--compare-plain" in c.argv for c in default_model)


def test_fp8_step_alternates_the_gemm_switch(gpu, tmp_path):
    tree = gpu.Tree("after", REPO, REPO)
    tests, sweep, *runs = gpu.STEPS["fp8"].commands(tree, tmp_path, "", True)
    assert "tests/kernels/test_kernels_fp8_matmul.py" in tests.argv
    assert sweep.argv[1].endswith("benchmarks/fp8_gemm_sweep.py")
    assert sweep.json_path == tmp_path / "fp8_gemm_sweep.json"
    assert [c.argv[:2] for c in runs] == [["env", f"RTX_FP8_TRITON_GEMM={g}"] for g in "0101"]
    assert all(c.argv[c.argv.index("--quantization") + 1] == "fp8" and "--baseline" not in c.argv for c in runs)
    # The kernel runs products of up to 64 rows: W2 at 64 running, where decode steps have that many.
    assert all(c.argv[c.argv.index("--workload") + 1] == "W2" and c.argv[c.argv.index("--max-num-seqs") + 1] == "64"
               for c in runs)
    assert len({c.json_path for c in runs}) == 4


def test_fp8acc_step_alternates_the_accumulation_switch(gpu, tmp_path):
    runs = gpu.STEPS["fp8acc"].commands(gpu.Tree("after", REPO, REPO), tmp_path, "", True)
    assert [c.argv[:2] for c in runs] == [["env", f"RTX_FP8_FAST_ACCUM={f}"] for f in "0101"]
    assert all(c.argv[c.argv.index("--workload") + 1] == "W8B" and c.argv[c.argv.index("--quantization") + 1] == "fp8"
               for c in runs)
    assert len({c.json_path for c in runs}) == 4
