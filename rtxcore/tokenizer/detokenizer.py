"""Turning a stream of generated token ids into a stream of text, with stop strings.

Two things make this more than ``decode(new_ids)``:

* Byte-level BPE tokens can end in the middle of a UTF-8 character, and decoders that strip a leading space
  (sentencepiece) decode a token differently at the start of a sequence. So each step decodes a short window that
  starts a few tokens back (``_prefix_offset``) and emits only what the window adds past the text already emitted
  (``_read_offset``), holding everything back while the window ends in an incomplete character. This is the
  technique of vLLM's and TGI's incremental detokenizers: each step costs O(window), not O(output). The
  ``tokenizers`` library runs it in Rust (``Tokenizer.decode_stream``), one call per token, and :meth:`update`
  then costs half as much (2.9 against 5.9 µs a token on a 2-core Xeon; ``benchmarks/detokenizer.py``): every
  running request pays it every step, and on a GPU, where a small model's step is host work, that was a fifth of
  the tokens/s (docs/benchmarks.md). The offsets here follow what the stream emits; a run of invalid bytes (which
  it would hold forever), a flush, and a stream that fails are decoded by hand, below, and a new stream starts at
  the offsets that leaves.
* A stop string can arrive split over several tokens. The tail of the text that could still grow into a stop string
  is held back, so a streamed delta never contains text that a later match would cut off.
"""

from __future__ import annotations

from collections.abc import Sequence

from rtxcore.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded in front of the first output token, so it decodes as it does in context.
_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character spans at most 3 bytes, hence at most 3 tokens. A window still ending in U+FFFD
# after this many pending tokens holds invalid bytes (garbage output), which are released so that the window, and
# the cost of a step, stay bounded.
_MAX_PENDING_TOKENS = 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output as it is generated.

    Concatenating every :meth:`update` delta and the final :meth:`flush` gives :attr:`text`, which equals
    ``tokenizer.decode(output_ids)``, cut at the first stop string when one appears.

    :param prompt_token_ids: the prompt; its last few tokens give the first output tokens their context.
    :param stop: strings that end the output when they appear in it. The first one to *complete* wins.
    :param include_stop_str_in_output: keep the stop string at the end of the output instead of cutting it.
    :param skip_special_tokens: leave special tokens (eos, ``<|im_end|>``) out of the text.
    :param min_tokens: stop strings are looked for only from the update that brings the output past this many
        tokens (vLLM's rule: a stop string may then end in that update's text, wherever it began).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # An empty stop string would match before any text at all; it means "no stop string".
        self._stop = [s for s in dict.fromkeys(stop) if s]
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in self._stop), default=0)
        # Text that could be the start of a stop string only matters when the stop string will be cut off.
        self._max_hold = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self._recent_len = max(longest - 1, 0)
        self._min_tokens = min_tokens
        self._num_output_tokens = 0

        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt given as token ids may end inside a character; the output must not complete it, or its first
        # bytes would decode differently than in decode(output_ids). Such a prompt gives no context.
        if tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text: str | None = None  # decode(tokens[prefix:read]), cached between steps
        # The library's decoder, in step with the offsets above: it has seen every token up to len(_tokens).
        self._stream = tokenizer.decode_stream(context, skip_special_tokens)
        self._held = ""  # decoded text held back because it may begin a stop string
        # The end of the emitted text, where a stop string may have begun when nothing is held back
        # (include_stop_str_in_output).
        self._recent = ""
        self._text_parts: list[str] = []
        self._finished = False
        self.stop_reason: str | None = None
        """The stop string that ended the output, or None."""

    @property
    def text(self) -> str:
        """The output text finalized so far (everything returned by :meth:`update` and :meth:`flush`)."""
        if len(self._text_parts) > 1:  # join once, so that reading this every step stays cheap
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def finished_by_stop(self) -> bool:
        return self.stop_reason is not None

    @property
    def finished(self) -> bool:
        """True after a stop string or :meth:`flush`; later updates return ''."""
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they finalize (possibly '')."""
        if self._finished or not new_token_ids:
            return ""
        self._num_output_tokens += len(new_token_ids)
        if self._stream is None:
            self._tokens.extend(new_token_ids)
            return self._emit(self._decode_step(force=False))
        text, by_hand = self._stream_step(new_token_ids)
        return self._emit(text + self._decode_step(force=False) if by_hand else text)

    def flush(self) -> str:
        """End the output (it finished for another reason than a stop string) and return what was held back.

        An incomplete character at the very end comes out as U+FFFD, as in a full decode. The last tokens can
        still complete a stop string, which then cuts the output as usual.
        """
        if self._finished:
            return ""
        out = self._emit(self._decode_step(force=True))
        if not self._finished:
            out += self._held
            self._text_parts.append(self._held)
            self._held = ""
            self._finished = True
        return out

    # -- internals -------------------------------------------------------------------------------------------

    def _stream_step(self, new_token_ids: Sequence[int]) -> tuple[str, bool]:
        """The text the library's decoder gives for the new tokens, the offsets moved past it, and whether the
        tokens after it are left to the decoding by hand (they are in ``_tokens`` either way)."""
        stream, tokens = self._stream, self._tokens
        assert stream is not None
        parts: list[str] = []
        for i, token in enumerate(new_token_ids):
            tokens.append(token)
            try:
                chunk = stream.step(token)
            except Exception:  # its window disagreed with itself (see _advance): decode by hand from here on
                self._stream = None
                tokens.extend(new_token_ids[i + 1:])
                return "".join(parts), True
            if chunk is not None:
                parts.append(chunk)
                self._mark_read(len(tokens))
        text = parts[0] if len(parts) == 1 else "".join(parts)
        # Invalid bytes past the limit: released by hand, and the stream restarted after them.
        return text, len(tokens) - self._read_offset > _MAX_PENDING_TOKENS

    def _decode_step(self, force: bool) -> str:
        """Text the tokens past ``_read_offset`` add, or '' while they end in an incomplete character."""
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._window_prefix_text()
        full = self._decode(self._prefix_offset, len(self._tokens))
        if full.endswith(_REPLACEMENT) and not force:
            if len(self._tokens) - self._read_offset <= _MAX_PENDING_TOKENS:
                return ""
            return self._release_invalid(full, prefix_text)
        return self._advance(len(self._tokens), full, prefix_text)

    def _release_invalid(self, full: str, prefix_text: str) -> str:
        """Emit a long run of invalid bytes up to a split point the bytes still to come cannot change.

        Only the last three tokens can hold an incomplete character. A split is safe when decoding the two sides
        apart gives the same text as decoding them together, and the right side decodes to some text: skipped
        special tokens alone would hide that later bytes can still join the left side's last character.
        """
        end = len(self._tokens)
        for split in range(end - 1, max(self._read_offset, end - 4), -1):
            head, tail = self._decode(self._prefix_offset, split), self._decode(split, end)
            if tail and head + tail == full:
                return self._advance(split, head, prefix_text)
        return ""  # no safe split (a decoder that rewrites sequence starts): wait, exactness over speed

    def _advance(self, read_offset: int, text: str, prefix_text: str) -> str:
        """Mark tokens up to ``read_offset`` (which decode to ``text`` from the window start) as emitted."""
        # Decoders agree across windows when both start at the same token; if one ever does not, emitting
        # nothing is safer than emitting a wrong slice.
        delta = text[len(prefix_text):] if text.startswith(prefix_text) else ""
        self._mark_read(read_offset)
        if self._stream is not None:
            self._restart_stream()
        return delta

    def _mark_read(self, read_offset: int) -> None:
        self._read_offset = read_offset
        # The next window starts a few tokens before the new read offset: enough context for decoders that treat
        # a sequence's first token specially, and a window as short as the tokens still pending allow.
        self._prefix_offset = max(read_offset - _CONTEXT_TOKENS, self._prefix_offset)
        self._prefix_text = None
        # Keep the token list from growing with the output: nothing before the window is decoded again.
        if self._prefix_offset > 4 * _MAX_PENDING_TOKENS:
            del self._tokens[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _restart_stream(self) -> None:
        """A new library decoder at the offsets the decoding by hand left, fed the tokens still pending; where it
        would emit any of them (which that decoding held back), decoding stays by hand."""
        self._stream = self._tokenizer.decode_stream(self._tokens[self._prefix_offset:self._read_offset],
                                                     self._skip_special)
        try:
            if self._stream is not None and any(self._stream.step(t) is not None
                                                for t in self._tokens[self._read_offset:]):
                self._stream = None
        except Exception:
            self._stream = None

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._prefix_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._tokens[start:end], self._skip_special)

    def _emit(self, new_text: str) -> str:
        """Cut the held-back plus new text at a stop string, or hold back a tail that may begin one."""
        text = self._held + new_text
        # Before min_tokens stop strings are not looked for, but the tail that may begin one is still held back, so
        # that one completed by the first token past the minimum cuts text not yet emitted.
        if self._num_output_tokens > self._min_tokens:
            window = self._recent + text
            # Only a stop string ending in the new text: one ending earlier was found a step earlier, or came before
            # the minimum.
            match = self._first_stop(window, len(self._recent) + len(self._held))
            if match is not None:
                start, stop = match
                out = window[len(self._recent):start + len(stop) if self._include_stop else start]
                self.stop_reason = stop
                self._finished = True
                self._held = ""
                self._text_parts.append(out)
                return out
        hold = self._stop_prefix_len(text)
        out, self._held = text[:len(text) - hold], text[len(text) - hold:]
        if out:
            self._text_parts.append(out)
            self._recent = (self._recent + out)[-self._recent_len:] if self._recent_len else ""
        return out

    def _first_stop(self, text: str, end_after: int) -> tuple[int, str] | None:
        """The first stop string in ``text`` that ends after its first ``end_after`` characters."""
        # Earliest end, so that one big update stops where token-by-token updates would have; on a tie the
        # longest (earliest start) stop string wins.
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = text.find(s, max(end_after - len(s) + 1, 0))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with (shorter than that string)."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stop):
                return k
        return 0
