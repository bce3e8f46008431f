"""``genjax.tokenizer``: the public name of :mod:`genjax.io.tokenizer` (tokenizers, chat
templates)."""

from genjax.io.tokenizer import SPECIAL_TOKEN_KEYS, Tokenizer, from_pretrained

__all__ = ["SPECIAL_TOKEN_KEYS", "Tokenizer", "from_pretrained"]
