"""The incremental detokenizer's two ways of decoding: the tokenizers library's stream (the default) against the
windows decoded from Python that it falls back to.

    python benchmarks/detokenizer.py [--model M] [--device cpu|cuda] [--batch 32] [--tokens 128] [--runs 5]
        [--json PATH]

Part 1, the detokenizer alone: microseconds per token for the same output (a report of ``rtxcore/bench/texts`` and
a line of accented, CJK and emoji text, with a chat prompt before it), fed token by token, both ways alternating.
Part 2, the engine: tokens/s of a batch of ``--batch`` greedy requests of ``--tokens`` tokens each (EOS ignored) on
``--model`` in one engine, both ways alternating (the engine's tokenizer without its stream for the other). Every
running request's new token is detokenized every step, so where the host sets the step time (a small model on a
GPU) this is part of it. Figures are medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from rtxcore.bench.engine import build_engine, generate
from rtxcore.engine.config import EngineConfig
from rtxcore.models.resolve import resolve_model
from rtxcore.sampling_params import SamplingParams
from rtxcore.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = (Path(__file__).resolve().parent.parent / "rtxcore" / "bench" / "texts" / "harbour_report.txt").read_text()
MIXED = " Naïve café — 日本語のテキスト, 中文文本 and 한국어 🙂🎉🇫🇷 ½ ∑."
PROMPT = "<|im_start|>user\nSummarise the report.<|im_end|>\n<|im_start|>assistant\n"


def _no_stream(context_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
    return None


def by_hand(tokenizer: Tokenizer, on: bool) -> None:
    """Take the library's stream from ``tokenizer`` (the detokenizer then decodes its windows itself), or give it
    back."""
    if on:
        tokenizer.decode_stream = _no_stream  # type: ignore[method-assign]
    else:
        vars(tokenizer).pop("decode_stream", None)


def per_token_us(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> float:
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.update([t]) for t in output) + detok.flush()
    elapsed = time.perf_counter() - start
    if text != tokenizer.decode(output):
        raise SystemExit("the detokenizer's text differs from a full decode")
    return elapsed / len(output) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args()

    tokenizer = resolve_model(args.model).tokenizer()
    if tokenizer is None:
        raise SystemExit(f"{args.model}: the model has no tokenizer")
    prompt, output = tokenizer.encode(PROMPT), tokenizer.encode(TEXT + MIXED, add_special_tokens=False)
    alone: dict[str, list[float]] = {"stream": [], "by_hand": []}
    for _ in range(args.runs):
        for way in alone:
            by_hand(tokenizer, way == "by_hand")
            alone[way].append(per_token_us(tokenizer, prompt, output))
    by_hand(tokenizer, False)

    engine = build_engine(EngineConfig(model=args.model, device=args.device))
    engine_tokenizer = engine.core.output_processor.tokenizer
    prompts = [engine_tokenizer.encode(f"<|im_start|>user\nWrite about topic {i}.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def tokens_per_s() -> float:
        start = time.perf_counter()
        results = generate(engine, prompts, params)
        elapsed = time.perf_counter() - start
        return sum(len(r.token_ids) for r in results) / elapsed

    rates: dict[str, list[float]] = {"stream": [], "by_hand": []}
    for way in rates:  # warm-up: kernels, graphs
        by_hand(engine_tokenizer, way == "by_hand")
        tokens_per_s()
    for run in range(args.runs):
        for way in (("stream", "by_hand") if run % 2 == 0 else ("by_hand", "stream")):
            by_hand(engine_tokenizer, way == "by_hand")
            rates[way].append(tokens_per_s())
    by_hand(engine_tokenizer, False)

    us = {way: statistics.median(v) for way, v in alone.items()}
    tok_s = {way: statistics.median(v) for way, v in rates.items()}
    report = {"model": engine.core.source.name, "device": str(engine.core.backend.device), "batch": args.batch,
              "tokens": args.tokens, "output_tokens_detokenized": len(output),
              "us_per_token": {way: round(v, 2) for way, v in us.items()},
              "engine_tok_s": {way: round(v, 1) for way, v in tok_s.items()},
              "engine_ratio_stream_over_by_hand": round(tok_s["stream"] / tok_s["by_hand"], 3),
              "runs": {"us_per_token": alone, "engine_tok_s": rates}}
    text = json.dumps(report)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
