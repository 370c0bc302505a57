"""The tokenizer of a model: text <-> token ids, and chat messages -> prompt text.

A thin layer over the Rust ``tokenizers`` library; transformers is never imported at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from rtxcore.errors import ModelLoadError
from rtxcore.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, check_chat_template, render_chat_template
from rtxcore.tokenizer.gguf_vocab import build_gguf_vocab, mark_special, set_post_processor


@dataclass(slots=True, frozen=True)
class SpecialTokens:
    """The named special tokens, spelled as in the vocabulary; chat templates see them as ``bos_token`` etc."""

    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    pad: str | None = None

    def as_template_vars(self) -> dict[str, str | None]:
        return {"bos_token": self.bos, "eos_token": self.eos, "unk_token": self.unk, "pad_token": self.pad}


class DecodeStream:
    """The ``tokenizers`` library's own incremental decoder (``tokenizers.decoders.DecodeStream``, given context ids
    since 0.22) bound to one backend: the prefix/read-offset technique in Rust, one call per token."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: tokenizers.Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool):
        self._backend = backend
        self._stream = tokenizers.decoders.DecodeStream(list(context_ids), skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """Raises where the library's window does not decode consistently (the caller then decodes by itself)."""
        return self._stream.step(self._backend, token_id)


class Tokenizer:
    """Encode, decode and apply the chat template of one model.

    Build one with :meth:`from_gguf` or :meth:`from_hf_dir`; the constructor takes a ready backend.
    """

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokens, *,
                 chat_template: str | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self._special = special
        self._chat_template = chat_template
        eos_id = backend.token_to_id(special.eos) if special.eos is not None else None
        ids = ([eos_id] if eos_id is not None else []) + [i for i in eos_token_ids if i != eos_id]
        self._eos_token_ids: list[int] = list(dict.fromkeys(ids))
        self._bos_token_id = backend.token_to_id(special.bos) if special.bos is not None else None
        # Asked of the backend rather than stored: its post-processor is what really adds (or not) the BOS.
        empty = backend.encode("", add_special_tokens=True).ids
        self._add_bos = bool(empty) and empty[0] == self._bos_token_id
        special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        named = (backend.token_to_id(t) for t in (special.bos, special.eos, special.unk, special.pad) if t)
        self._all_special_ids = sorted(special_ids | {i for i in named if i is not None})

    # -- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's metadata (``GGUFCheckpoint.metadata``).

        :raises ModelLoadError: no tokenizer in the metadata, or a kind not supported.
        """
        vocab = build_gguf_vocab(metadata)
        special = SpecialTokens(bos=vocab.bos_token, eos=vocab.eos_token, unk=vocab.unk_token, pad=vocab.pad_token)
        return cls(vocab.backend, special, chat_template=vocab.chat_template, eos_token_ids=vocab.eos_token_ids)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory: ``tokenizer.json`` plus ``tokenizer_config.json``.

        The chat template is read from ``chat_template.jinja`` or ``chat_template.json`` when present (newer
        checkpoints), else from ``tokenizer_config.json``. ``generation_config.json``'s eos ids also end generation.

        :raises ModelLoadError: no ``tokenizer.json`` (slow-only tokenizers are not supported), or unreadable files.
        """
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{root}: no tokenizer.json (only 'fast' Hugging Face tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises bare Exception subclasses
            raise ModelLoadError(f"{tokenizer_file}: cannot be read as a tokenizer: {exc}") from None
        config = _read_json(root / "tokenizer_config.json")
        tokens_map = _read_json(root / "special_tokens_map.json")
        special = SpecialTokens(**{name: _token_content(config.get(f"{name}_token", tokens_map.get(f"{name}_token")))
                                   for name in ("bos", "eos", "unk", "pad")})
        mark_special(backend, special.bos, special.eos, special.unk, special.pad)
        # As transformers does: an explicit flag in the config overrides tokenizer.json's post-processor.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            set_post_processor(backend, special.bos, special.eos, bool(config.get("add_bos_token", False)),
                               bool(config.get("add_eos_token", False)))
        generation_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(backend, special, chat_template=_hf_chat_template(root, config),
                   eos_token_ids=generation_eos or ())

    def save(self, directory: str | Path) -> None:
        """Write the files :meth:`from_hf_dir` reads (tokenizer.json, tokenizer_config.json,
        generation_config.json), so a model converted from another format keeps its tokenizer."""
        root = Path(directory)
        self._backend.save(str(root / "tokenizer.json"))
        config: dict[str, Any] = {f"{name}_token": token for name, token in
                                  (("bos", self._special.bos), ("eos", self._special.eos), ("unk", self._special.unk),
                                   ("pad", self._special.pad)) if token is not None}
        config["add_bos_token"] = self._add_bos
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False),
                                                    encoding="utf-8")
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": self._eos_token_ids}, indent=1),
                                                     encoding="utf-8")

    # -- vocabulary ------------------------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding and offsets)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: eos first, then end-of-turn ids the model also uses."""
        return list(self._eos_token_ids)

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(text)`` starts with BOS."""
        return self._add_bos

    @property
    def special_tokens(self) -> SpecialTokens:
        return self._special

    @property
    def all_special_ids(self) -> list[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out, sorted."""
        return list(self._all_special_ids)

    def id_to_token(self, token_id: int) -> str | None:
        """The token as spelled in the vocabulary (byte-level vocabularies spell a space 'Ġ'); None if unknown."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # -- text ------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their ids.

        :param add_special_tokens: add BOS (and EOS) when the model's flags say so; off for text that continues
            a prompt.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once, in parallel in the Rust library."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; bytes that do not form complete UTF-8 become U+FFFD."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> DecodeStream | None:
        """An incremental decoder after ``context_ids`` (decoded for context, never returned): ``step(id)`` gives
        the text that id completes, or None while it ends in an incomplete character. A subclass without one
        returns None, and :class:`IncrementalDetokenizer` then decodes its windows with :meth:`decode`."""
        return DecodeStream(self._backend, context_ids, skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The model's chat template source (None: it has none, and :data:`DEFAULT_CHAT_TEMPLATE` is used)."""
        return self._chat_template

    def use_chat_template(self, source: str) -> None:
        """Render chats with ``source`` instead of the model's own template (``--chat-template``)."""
        check_chat_template(source)
        self._chat_template = source

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_vars: Mapping[str, Any] | None = None) -> str:
        """Render ``messages`` as prompt text, as transformers' ``apply_chat_template(tokenize=False)`` would.

        :param continue_final_message: leave the last message open for the model to continue (see
            :func:`render_chat_template`).
        :param template_vars: extra variables for the template (``tools``, ``enable_thinking``, ...).
        :raises InvalidRequestError: malformed messages, or the template rejects or fails on them.
        """
        return render_chat_template(self._chat_template or DEFAULT_CHAT_TEMPLATE, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self._special.as_template_vars(),
                                    continue_final_message=continue_final_message, template_vars=template_vars)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self._special.bos!r}, eos={self._special.eos!r}, "
                f"add_bos={self._add_bos}, chat_template={'yes' if self._chat_template else 'default'})")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one called "default" is what apply_chat_template uses.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
