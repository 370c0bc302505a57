"""benchmarks/structured_output.py --shape: random weights of a dummy shape that take another model's tokenizer."""

from __future__ import annotations

from rtxcore.models.dummy import SHAPES
from rtxcore.models.resolve import resolve_model
from tests.helpers.benchmark_scripts import benchmark_script


def test_a_shape_takes_the_tokenizer_and_its_vocabulary():
    default = resolve_model(None)
    with benchmark_script("structured_output") as module:
        source = module.ShapeWithTokenizer("llama-8b", default)
    assert source.config.vocab_size == default.config.vocab_size != SHAPES["llama-8b"].vocab_size
    assert source.config.eos_token_ids == default.config.eos_token_ids
    assert source.config.hidden_size == SHAPES["llama-8b"].hidden_size
    assert source.tokenizer().encode("{\"a\": 1}") == default.tokenizer().encode("{\"a\": 1}")
    assert SHAPES["llama-8b"].vocab_size == 128256  # the shape itself is left as it was
