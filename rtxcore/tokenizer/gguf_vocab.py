"""Rebuilding a ``tokenizers.Tokenizer`` from the vocabulary a GGUF file stores as metadata.

A GGUF carries no ``tokenizer.json``: only the tokens, their types, the merges and a name for the pre-tokenizer
(``tokenizer.ggml.pre``). What is built here reproduces, token for token, what Hugging Face transformers builds
from the same file (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), which is the reference the
tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from rtxcore.errors import ModelLoadError

# llama.cpp's token types (``tokenizer.ggml.token_type``).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ``tokenizer.ggml.pre`` -> the split regex its merges were learned with. A name not listed here ("gpt2",
# "smollm", "starcoder", ...) gets GPT-2's own regex, as in transformers.
#
# Note on "smollm": llama.cpp isolates every digit first (``\p{N}``, then GPT-2's regex), as SmolLM2's own
# tokenizer.json does (``Digits(individual_digits=True)``); transformers' GGUF loader does not. The vocabulary has no
# multi-digit tokens, so this only shows on runs of spaces before a digit: "a  1" is [a, Ġ, Ġ, 1] here and
# [a, ĠĠ, 1] in llama.cpp (17 of the 79 pydoc topics differ). We follow transformers, the reference the tests
# compare with; mapping "smollm" to ``\p{N}`` isolation would follow llama.cpp and the original tokenizer instead.
GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@dataclass(slots=True)
class GGUFVocab:
    """What a GGUF's metadata says about its tokenizer, beyond the backend itself."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    # Every id that ends generation: eos, then llama.cpp's end-of-turn / end-of-message ids when they differ.
    eos_token_ids: list[int]
    chat_template: str | None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_at(tokens: Sequence[str], metadata: Mapping[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(f"GGUF tokenizer: tokenizer.ggml.{key} = {token_id} is outside the vocabulary "
                             f"of {len(tokens)} tokens")
    return tokens[token_id]


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The eos id, then the end-of-turn and end-of-message ids llama.cpp also stops on."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids


def _byte_level_bpe(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    merges: Sequence[str] | None = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("GGUF tokenizer: a byte-level BPE vocabulary (gpt2) needs tokenizer.ggml.merges")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Real tokens are already spelled in the byte alphabet; added ones ("<|im_start|>", "<think>") may not be.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                     fuse_unk=False)
    backend = tokenizers.Tokenizer(bpe)
    split = GGUF_PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    token_types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or ()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the
    # vocabulary past what the embedding holds.
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    # llama.cpp matches user-defined tokens ("<think>") whole in any text; without this BPE would cut them up.
    known = backend.get_vocab(with_added_tokens=True)
    user_defined = [AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in known]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


# ``tokenizer.ggml.model`` -> builder. Sentencepiece ("llama") and unigram ("t5") vocabularies are not built yet.
_BUILDERS: dict[str, Callable[[Mapping[str, Any]], tokenizers.Tokenizer]] = {"gpt2": _byte_level_bpe}


def set_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None,
                       add_bos: bool, add_eos: bool) -> None:
    """Make ``encode(..., add_special_tokens=True)`` add BOS / EOS exactly when the model asks for them."""
    # The tokens actually added: None where the model does not ask for one or the vocabulary lacks it.
    bos = bos if add_bos and bos is not None and backend.token_to_id(bos) is not None else None
    eos = eos if add_eos and eos is not None and backend.token_to_id(eos) is not None else None
    single = f"{bos + ':0 ' if bos is not None else ''}$A:0{' ' + eos + ':0' if eos is not None else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos is not None else ''} $B:1{' ' + eos + ':1' if eos is not None else ''}"
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def mark_special(backend: tokenizers.Tokenizer, *tokens: str | None) -> None:
    """Treat the named special tokens (bos, eos, ...) as special even if the vocabulary did not mark them."""
    present = [AddedToken(t, normalized=False, special=True) for t in tokens
               if t is not None and backend.token_to_id(t) is not None]
    if present:
        backend.add_special_tokens(present)


def build_gguf_vocab(metadata: Mapping[str, Any]) -> GGUFVocab:
    """Build the tokenizer described by a GGUF's ``tokenizer.*`` metadata.

    :raises ModelLoadError: the file has no tokenizer, or one of a kind not supported.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(_BUILDERS)})")
    backend = builder(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    bos, eos, unk, pad = (_token_at(tokens, metadata, key) for key in
                          ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"))
    mark_special(backend, bos, eos, unk, pad)
    # llama.cpp's default: sentencepiece vocabularies get BOS unless told otherwise, byte-level ones do not.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    set_post_processor(backend, bos, eos, add_bos, add_eos)
    return GGUFVocab(backend=backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
                     eos_token_ids=gguf_eos_token_ids(metadata),
                     chat_template=metadata.get("tokenizer.chat_template"))
