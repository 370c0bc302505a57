"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization."""

from rtxcore.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE
from rtxcore.tokenizer.detokenizer import IncrementalDetokenizer
from rtxcore.tokenizer.tokenizer import SpecialTokens, Tokenizer

__all__ = ["DEFAULT_CHAT_TEMPLATE", "IncrementalDetokenizer", "SpecialTokens", "Tokenizer"]
