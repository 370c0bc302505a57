"""The Tokenizer on the real default model, checked against Hugging Face transformers (the incremental detokenizer:
test_detokenizer.py)."""

from __future__ import annotations

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
    SpecialTokens,
    Tokenizer,
)
from tests.helpers.smollm2_text import ENCODABLE_TEXT, MISSING_BYTES

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


@pytest.mark.hf
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_continue_final_message_equals_transformers(tok: Tokenizer, hf_tok: Any,
                                                    messages: list[dict[str, str]]) -> None:
    for last in ("The answer is", "Trailing space and newline \n"):  # the second is stripped by neither template
        convo = [*messages, {"role": "assistant", "content": last}]
        expected = hf_tok.apply_chat_template(convo, tokenize=False, continue_final_message=True)
        assert tok.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True) == expected


def test_continue_final_message_finds_content_a_template_strips(tok: Tokenizer) -> None:
    trimming = _with_template(tok, "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}")
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Well, \n"}]
    assert trimming.apply_chat_template(convo, False, continue_final_message=True) == "<user>Hi</s><assistant>Well,"
    for bad in ("", "   ", None):
        with pytest.raises(InvalidRequestError, match="needs a last message with text"):
            trimming.apply_chat_template([*convo[:1], {"role": "assistant", "content": bad}], False, True)
    hiding = _with_template(tok, "{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="does not write the last message's content"):
        hiding.apply_chat_template(convo, False, continue_final_message=True)


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
    # A template of one's own (--chat-template) can fail in arithmetic too: a request error, not a traceback.
    with pytest.raises(InvalidRequestError, match="ZeroDivisionError"):
        _with_template(tok, "{{ 1 / 0 }}").apply_chat_template([{"role": "user", "content": "x"}])


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


def test_special_tokens_dataclass() -> None:
    s = SpecialTokens(bos="<s>", eos="</s>")
    assert s.as_template_vars() == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": None}
