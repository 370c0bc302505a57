"""benchmarks/structured_output.py --shape: random weights of a dummy shape that take another model's tokenizer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from rtxcore.models.dummy import SHAPES
from rtxcore.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]


def test_a_shape_takes_the_tokenizer_and_its_vocabulary():
    spec = importlib.util.spec_from_file_location("rtx_bench_structured_output", REPO / "benchmarks" /
                                                  "structured_output.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        default = resolve_model(None)
        source = module.ShapeWithTokenizer("llama-8b", default)
    finally:
        del sys.modules[spec.name]
    assert source.config.vocab_size == default.config.vocab_size != SHAPES["llama-8b"].vocab_size
    assert source.config.eos_token_ids == default.config.eos_token_ids
    assert source.config.hidden_size == SHAPES["llama-8b"].hidden_size
    assert source.tokenizer().encode("{\"a\": 1}") == default.tokenizer().encode("{\"a\": 1}")
    assert SHAPES["llama-8b"].vocab_size == 128256  # the shape itself is left as it was
