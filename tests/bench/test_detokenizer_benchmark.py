"""benchmarks/detokenizer.py: its two ways are the detokenizer with and without the library's stream."""

from __future__ import annotations

from rtxcore.models.resolve import resolve_model
from rtxcore.tokenizer import IncrementalDetokenizer
from tests.helpers.benchmark_scripts import benchmark_script


def test_by_hand_takes_the_stream_away_and_gives_it_back():
    tokenizer = resolve_model(None).tokenizer()
    with benchmark_script("detokenizer") as module:
        prompt = tokenizer.encode(module.PROMPT)
        output = tokenizer.encode(module.MIXED, add_special_tokens=False)
        module.by_hand(tokenizer, True)
        assert tokenizer.decode_stream([], True) is None
        assert IncrementalDetokenizer(tokenizer, prompt)._stream is None
        assert module.per_token_us(tokenizer, prompt, output) > 0  # it checks the text against a full decode
        module.by_hand(tokenizer, False)
        assert IncrementalDetokenizer(tokenizer, prompt)._stream is not None
        assert module.per_token_us(tokenizer, prompt, output) > 0
