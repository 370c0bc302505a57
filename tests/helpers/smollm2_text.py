"""What the default model's vocabulary can and cannot spell, for property tests of its tokenizer."""

from hypothesis import strategies as st

# SmolLM2's vocabulary lacks 21 of the 256 byte tokens, so text using those bytes cannot round-trip (transformers
# drops them too): six control characters, and the UTF-8 lead bytes 0xF1 / 0xF2 of U+40000..U+BFFFF (the rest are
# never valid UTF-8).
MISSING_BYTES = [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]
ENCODABLE_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, blacklist_characters="\x04\x06\x13\x14\x16\x1d",
                                       blacklist_categories=("Cs",)), max_size=80)
