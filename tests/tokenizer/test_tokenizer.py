"""Tokenizer and IncrementalDetokenizer on the real default model, checked against Hugging Face transformers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtxcore.errors import InvalidRequestError, ModelLoadError
from rtxcore.models.gguf import GGUFCheckpoint
from rtxcore.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    IncrementalDetokenizer,
    SpecialTokens,
    Tokenizer,
)

pytestmark = pytest.mark.model

TRICKY = [
    "",
    " ",
    "Hello world",
    " Hello world",
    "Hello  world\n\n\n   tabs\t\there\r\nend",
    "naïve café — “quotes” ‘single’ … ½ ∑ ∞",
    "😀🎉👩‍👩‍👧‍👦 emoji with ZWJ 🇫🇷 flags",
    "日本語のテキストと中文文本，还有한국어",
    "Ελληνικά, русский, עברית, العربية",
    "1234567890 3.14159 1e-10 2024-11-29 0x1F",
    "    indented code:\n        return x**2  # comment",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start <im_start|> |im_start|>",
    "don't can't I'm we'll they've she'd it's",
    "ALL CAPS and MiXeD CaSe",
    "\u200b\u00a0\u2028 odd spaces",
    "a" * 300,
    " " * 50 + "x",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you? 😀"},
    ],
    [{"role": "user", "content": "multi\nline\n\n  content <b>html</b> & \"quotes\""}],
]


# SmolLM2's vocabulary lacks 21 of the 256 byte tokens, so text using those bytes cannot round-trip (transformers
# drops them too): six control characters, and the UTF-8 lead bytes 0xF1 / 0xF2 of U+40000..U+BFFFF (the rest are
# never valid UTF-8).
MISSING_BYTES = [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]
ENCODABLE_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, blacklist_characters="\x04\x06\x13\x14\x16\x1d",
                                       blacklist_categories=("Cs",)), max_size=80)


@pytest.fixture(scope="module")
def checkpoint(default_model_file: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(default_model_file)


@pytest.fixture(scope="module")
def tok(checkpoint: GGUFCheckpoint) -> Tokenizer:
    return checkpoint.tokenizer()


@pytest.fixture(scope="module")
def hf_tok(default_model_file: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_file.parent, gguf_file=default_model_file.name)


# -- encoding and decoding -----------------------------------------------------------------------------------


def test_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, [2])
    assert not tok.add_bos_token
    assert tok.all_special_ids == list(range(17))  # the 17 control tokens of the vocabulary
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.id_to_token(10_000_000) is None
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.hf
def test_ids_equal_transformers_on_pydoc_topics(tok: Tokenizer, hf_tok: Any) -> None:
    docs = list(topics.values())
    assert len(docs) == 79
    ours = tok.encode_batch(docs)
    for name, doc, ids in zip(topics, docs, ours):
        assert ids == hf_tok.encode(doc), f"pydoc topic {name!r} tokenizes differently"
        assert ids == tok.encode(doc)


@pytest.mark.hf
@pytest.mark.parametrize("text", TRICKY)
def test_ids_equal_transformers_on_tricky_text(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_missing_byte_tokens(tok: Tokenizer) -> None:
    from rtxcore.tokenizer.gguf_vocab import bytes_to_unicode

    spelled = bytes_to_unicode()
    assert [b for b in range(256) if tok.token_to_id(spelled[b]) is None] == MISSING_BYTES


def test_special_tokens_in_text_are_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


@pytest.mark.hf
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_ids_equal_transformers_on_random_text(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ENCODABLE_TEXT)
def test_decode_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.hf
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=30))
def test_decode_equals_transformers_on_random_ids(tok: Tokenizer, hf_tok: Any, ids: list[int]) -> None:
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.hf
def test_from_hf_dir_matches(tok: Tokenizer, hf_tok: Any, tmp_path: Path) -> None:
    hf_tok.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert (from_dir.bos_token_id, from_dir.eos_token_ids, from_dir.add_bos_token) == (1, [2], False)
    assert from_dir.chat_template == tok.chat_template
    for text in TRICKY + list(topics.values())[:5]:
        assert from_dir.encode(text) == tok.encode(text)


def test_from_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_add_bos_flag_is_honoured(checkpoint: GGUFCheckpoint) -> None:
    meta = dict(checkpoint.metadata, **{"tokenizer.ggml.add_bos_token": True})
    with_bos = Tokenizer.from_gguf(meta)
    assert with_bos.add_bos_token
    assert with_bos.encode("Hi") == [1, *with_bos.encode("Hi", add_special_tokens=False)]


def test_unsupported_tokenizer_model(checkpoint: GGUFCheckpoint) -> None:
    meta = dict(checkpoint.metadata, **{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelLoadError, match="'rwkv' is not supported"):
        Tokenizer.from_gguf(meta)


# -- chat templates ------------------------------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]],
                                           add_generation_prompt: bool) -> None:
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_errors_are_request_errors(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="failed on these messages"):
        tok.apply_chat_template([{"role": "user", "content": None}])  # the template concatenates content
    with pytest.raises(InvalidRequestError, match="must be a list"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\] lacks a string 'role'"):
        tok.apply_chat_template([{"content": "hi"}])


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, tok.special_tokens, chat_template=template)


def test_template_helpers(tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{{ bos_token }}{{ m | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    custom = _with_template(tok, template)
    out = custom.apply_chat_template([{"role": "user", "content": "<b>é</b>"}] * 3)
    assert out == '<|im_start|>{"role": "user", "content": "<b>é</b>"}' * 2 + "4"
    with pytest.raises(InvalidRequestError, match="no tools here"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="chat template is invalid"):
        _with_template(tok, "{% for m in messages %}").apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(tok: Tokenizer) -> None:
    evil = _with_template(tok, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_default_template_when_model_has_none(tok: Tokenizer) -> None:
    plain = _with_template(tok, None)
    assert plain.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert plain.apply_chat_template(messages) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert plain.apply_chat_template(messages, add_generation_prompt=False) == "System: Be brief.\n\nUser: Hi\n\n"
    assert "Assistant" in DEFAULT_CHAT_TEMPLATE


# -- incremental detokenizer ---------------------------------------------------------------------------------

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
    """Each step decodes a short window, not the whole output (the prefix/read offset technique)."""
    windows: list[int] = []

    class CountingTokenizer(Tokenizer):
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
    assert len(windows) <= 2 * len(ids) + 2
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


def test_special_tokens_dataclass() -> None:
    s = SpecialTokens(bos="<s>", eos="</s>")
    assert s.as_template_vars() == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": None}
