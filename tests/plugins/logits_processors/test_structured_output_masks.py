"""The structured-output processor's masks on each device it runs on: after ``apply`` exactly the tokens llguidance
allows keep their scores, for ordinary rows, verification rows and rows that are not the step's first ones. A small
byte-level vocabulary stands in for a model's (no model is loaded), so the test also runs on the GPU machine."""

from __future__ import annotations

import pytest
import tokenizers
import torch

from rtx_plugins.logits_processors.structured_output import StructuredOutput
from rtxcore.contracts.logits_processor import LogitsProcessorContext, RowContext
from rtxcore.tokenizer.tokenizer import SpecialTokens, Tokenizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Letters, digits and JSON's punctuation as single tokens, some words as merged ones, and an end token.
WORDS = ['{"', '":', '"name', '"age', 'ada', 'bob', '12', '"}', ', "']
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _tokenizer() -> Tokenizer:
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges: list[tuple[str, str]] = []
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in WORDS:  # each word merged left to right, one merge per new prefix, in byte-level characters
        [(word, _)] = byte_level.pre_tokenize_str(text)
        for end in range(2, len(word) + 1):
            left, right = word[:end - 1], word[end - 1]
            if word[:end] not in vocab:
                merges.append((left, right))
                vocab[word[:end]] = len(vocab)
    vocab["</s>"] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    backend.pre_tokenizer = byte_level
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["</s>"])
    return Tokenizer(backend, SpecialTokens(eos="</s>"))


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _allowed(matcher) -> set[int]:
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    return {t for t in range(32 * len(words)) if (int(words[t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("device", DEVICES)
def test_masks_keep_exactly_the_allowed_tokens(tokenizer, device):
    vocab_size = tokenizer.backend.get_vocab_size() + 5  # padded embeddings past the vocabulary
    context = LogitsProcessorContext(tokenizer, vocab_size, [tokenizer.backend.token_to_id("</s>")],
                                     torch.device(device))
    processor = StructuredOutput(context)
    prepared = processor.prepare({"json": SCHEMA})
    encode = tokenizer.backend.encode
    fresh = processor.new_state(prepared, [])
    midway = processor.new_state(prepared, encode('{"name": "ada", "age": 1', add_special_tokens=False).ids)
    proposed = encode('{"name": "b', add_special_tokens=False).ids
    refused = processor.new_state(prepared, encode('{"', add_special_tokens=False).ids)
    # Rows 1, 2, 4, 5 of a step of 6: a plain row, a midway one, a verification row after proposed tokens, and a
    # row whose proposed token the grammar refuses (only the end of sequence is left to it).
    rows = [RowContext(1, fresh), RowContext(2, midway), RowContext(4, fresh, proposed),
            RowContext(5, refused, encode("12", add_special_tokens=False).ids)]
    expected = [_allowed(fresh.matcher), _allowed(midway.matcher)]
    probe = fresh.matcher.deep_copy()
    assert probe.try_consume_tokens(proposed) == len(proposed)
    expected += [_allowed(probe), set(context.eos_token_ids)]
    logits = torch.randn(6, vocab_size, device=device)
    before = logits.clone()

    processor.apply(logits, rows)

    logits, before = logits.cpu(), before.cpu()
    for row, allowed in zip((1, 2, 4, 5), expected):
        kept = {int(t) for t in torch.nonzero(torch.isfinite(logits[row]))}
        assert kept == allowed & set(range(vocab_size)), f"row {row}"
        assert torch.equal(logits[row][sorted(kept)], before[row][sorted(kept)])
        assert 0 < len(allowed) < vocab_size
    for row in (0, 3):
        assert torch.equal(logits[row], before[row]), f"row {row} is not the grammar's"
    # Verification rows leave the matchers where they were.
    assert _allowed(fresh.matcher) == expected[0]
