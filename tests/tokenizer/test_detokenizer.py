"""IncrementalDetokenizer on the real default model's tokenizer: every property holds on both of its decoding paths,
the tokenizers library's stream (the default) and the windows decoded by hand (what the stream falls back to)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtxcore.models.gguf import GGUFCheckpoint
from rtxcore.tokenizer import IncrementalDetokenizer, Tokenizer
from rtxcore.tokenizer.tokenizer import DecodeStream
from tests.helpers.smollm2_text import ENCODABLE_TEXT, MISSING_BYTES

pytestmark = pytest.mark.model


class ByHand(Tokenizer):
    """The same tokenizer without the library's stream: the detokenizer decodes its windows itself."""

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> DecodeStream | None:
        return None


@pytest.fixture(scope="module")
def model_tok(default_model_file: Path) -> Tokenizer:
    return GGUFCheckpoint(default_model_file).tokenizer()


@pytest.fixture(scope="module", params=["stream", "by hand"])
def tok(request: pytest.FixtureRequest, model_tok: Tokenizer) -> Tokenizer:
    return model_tok if request.param == "stream" else ByHand(model_tok.backend, model_tok.special_tokens)


PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
SPLIT_TEXT = "Emoji 😀🎉🇫🇷 and 日本語, naïve ½ — ok."


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] = ()) -> list[str]:
    """Feed ``ids`` in pieces of the given sizes (1 when they run out); return every delta, flush included."""
    deltas, i, sizes = [], 0, list(chunks)
    while i < len(ids) and not detok.finished:
        n = max(1, sizes.pop(0)) if sizes else 1
        deltas.append(detok.update(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def test_split_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode(SPLIT_TEXT)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test text should split a character across tokens"
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas = _stream(detok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == SPLIT_TEXT
    assert detok.stop_reason is None and not detok.finished_by_stop


def _token_stream_strategy(tok_ids: list[int]) -> st.SearchStrategy[list[int]]:
    # Whole-vocabulary ids plus, much more often than uniform sampling would, the byte pieces of split characters
    # and special tokens.
    return st.lists(st.one_of(st.integers(0, 49151), st.sampled_from(tok_ids), st.integers(0, 16)), max_size=40)


@pytest.fixture(scope="module")
def split_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(SPLIT_TEXT)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip_special=st.booleans())
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, split_ids: list[int], data: st.DataObject,
                                           skip_special: bool) -> None:
    ids = data.draw(_token_stream_strategy(split_ids))
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=40))
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip_special)
    deltas = _stream(detok, ids, chunks)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip_special)


@pytest.fixture(scope="module")
def byte_ids(tok: Tokenizer) -> list[int]:
    from rtxcore.tokenizer.gguf_vocab import bytes_to_unicode

    spelled = bytes_to_unicode()
    return [tok.token_to_id(spelled[b]) for b in range(256) if b not in MISSING_BYTES]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_invalid_byte_runs_stay_exact(tok: Tokenizer, byte_ids: list[int], data: st.DataObject) -> None:
    """Long runs of single-byte tokens (invalid UTF-8 mixed with characters in progress) still add up exactly."""
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_ids[128:]), st.sampled_from(byte_ids)), max_size=60))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=60))
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(detok, ids, chunks)) == tok.decode(ids)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ENCODABLE_TEXT, chunks=st.lists(st.integers(1, 4), max_size=30))
def test_valid_text_never_streams_replacement_chars(tok: Tokenizer, text: str, chunks: list[int]) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok, []), ids, chunks)
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas[:-1]) or "\ufffd" in text


@pytest.mark.parametrize("stop, expected", [
    ("日本", "Emoji 😀🎉🇫🇷 and "),       # a unicode stop string, split over byte tokens
    ("🎉🇫", "Emoji 😀"),                # spans several tokens and splits an emoji flag pair
    ("naïve ½", "Emoji 😀🎉🇫🇷 and 日本語, "),
    ("ok.", "Emoji 😀🎉🇫🇷 and 日本語, naïve ½ — "),
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(tok: Tokenizer, stop: str, expected: str, include: bool) -> None:
    ids = tok.encode(SPLIT_TEXT)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["never", stop], include_stop_str_in_output=include)
    deltas = _stream(detok, ids)
    want = expected + stop if include else expected
    assert "".join(deltas) == detok.text == want
    assert detok.finished_by_stop and detok.stop_reason == stop
    assert detok.update(ids[:3]) == "" and detok.flush() == ""


def test_stop_string_prefix_is_released_when_it_does_not_match(tok: Tokenizer) -> None:
    ids = tok.encode("The end is near. The end")
    detok = IncrementalDetokenizer(tok, [], stop=["The end!"])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "The end is near. The end"
    assert not detok.finished_by_stop
    # "The end" could still have become "The end!" until the stream ended: only flush() releases it.
    assert deltas[-1] == "The end"


def test_first_stop_to_complete_wins(tok: Tokenizer) -> None:
    ids = tok.encode("abcdef")
    for chunks in ([1] * len(ids), [len(ids)]):  # token by token, and all at once
        detok = IncrementalDetokenizer(tok, [], stop=["bcdef", "cd"])
        assert "".join(_stream(detok, ids, chunks)) == "ab" and detok.stop_reason == "cd"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_count_from_min_tokens(tok: Tokenizer, include: bool) -> None:
    """Token by token, a stop string ends the output only if it ends in the text of a token past the first
    min_tokens (vLLM's rule), wherever it began."""
    ids = tok.encode("one, two, three, four, five", add_special_tokens=False)
    full = tok.decode(ids)
    for min_tokens in range(len(ids) + 2):
        detok = IncrementalDetokenizer(tok, [], stop=[", "], include_stop_str_in_output=include,
                                       min_tokens=min_tokens)
        streamed = "".join(_stream(detok, ids))
        # The first ", " that ends past the text of the first min_tokens tokens.
        before = len(tok.decode(ids[:min_tokens]))
        at = full.find(", ", max(before - 1, 0))
        if at < 0:
            assert streamed == full and not detok.finished_by_stop, min_tokens
        else:
            assert streamed == detok.text == full[:at + 2 if include else at], min_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_string_property(tok: Tokenizer, data: st.DataObject) -> None:
    """Streamed text equals the full decode cut at the first stop string, and nothing streamed is ever cut."""
    text = data.draw(st.text(alphabet="ab é😀日 \n", min_size=1, max_size=40))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 4))]
    other = data.draw(st.text(alphabet="ab é😀日", min_size=1, max_size=3))
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40))
    ids = tok.encode(text, add_special_tokens=False)

    detok = IncrementalDetokenizer(tok, [], stop=[stop, other], include_stop_str_in_output=include)
    deltas = _stream(detok, ids, chunks)
    streamed = "".join(deltas)

    full = tok.decode(ids)
    hits = [(full.find(s) + len(s), full.find(s), s) for s in (stop, other) if s in full]
    assert hits, "the stop string is taken from the text"
    end, begin, first = min(hits)
    assert detok.stop_reason == first
    assert streamed == detok.text == (full[:end] if include else full[:begin])


def test_update_cost_does_not_grow_with_output(tok: Tokenizer) -> None:
    """Each step decodes a short window, not the whole output (the prefix/read offset technique); with the library's
    stream nothing is decoded here but the prompt's context."""
    windows: list[int] = []
    streamed = not isinstance(tok, ByHand)

    class CountingTokenizer(type(tok)):  # type: ignore[misc]
        def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
            token_ids = list(token_ids)
            windows.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    counting = CountingTokenizer(tok.backend, tok.special_tokens)
    text = " ".join(topics.values())[:20_000]
    ids = tok.encode(text)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting, tok.encode(PROMPT), stop=["no such stop string"])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert max(windows) <= 16
    assert len(windows) <= (1 if streamed else 2 * len(ids) + 2)
    assert len(detok._tokens) < 100  # the token list is trimmed as the window moves on

    # Garbage output (a run of lone continuation bytes) does not make the window grow either.
    windows.clear()
    garbage = [tok.token_to_id("Ģ")] * 500
    detok = IncrementalDetokenizer(counting, [])
    assert "".join(_stream(detok, garbage)) == "\ufffd" * 500
    assert max(windows) <= 24


def test_special_tokens_kept_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>")
    assert "".join(_stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids)) == "Hi<|im_end|>"
    assert "".join(_stream(IncrementalDetokenizer(tok, []), ids)) == "Hi"


class FailingStream(DecodeStream):
    """The library's stream, failing at its ``fail_at``-th step (as it does where its window disagrees with itself)."""

    def __init__(self, backend: Any, context_ids: Sequence[int], skip_special_tokens: bool, fail_at: int):
        super().__init__(backend, context_ids, skip_special_tokens)
        self.steps, self.fail_at = 0, fail_at

    def step(self, token_id: int) -> str | None:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("Invalid prefix encountered")
        return super().step(token_id)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_failing_stream_hands_over_exactly(model_tok: Tokenizer, split_ids: list[int], data: st.DataObject) -> None:
    """When the library's stream raises, decoding goes on by hand from the offsets it left: nothing lost or doubled."""
    fail_at = data.draw(st.integers(1, 30))
    streams: list[FailingStream] = []

    class Failing(Tokenizer):
        def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> DecodeStream | None:
            streams.append(FailingStream(self.backend, context_ids, skip_special_tokens, fail_at))
            return streams[-1]

    tok = Failing(model_tok.backend, model_tok.special_tokens)
    ids = data.draw(_token_stream_strategy(split_ids))
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=40))
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    assert "".join(_stream(detok, ids, chunks)) == detok.text == tok.decode(ids)
    if len(ids) >= fail_at and len(streams) == 1:
        assert detok._stream is None  # it failed, and the rest was decoded by hand

