"""The demo's character tokenizers, built locally (nothing downloaded)."""

from __future__ import annotations

import string
from collections.abc import Sequence


class CharTokenizer:
    """A character tokenizer built locally (nothing downloaded): pad 0, eos 1, then characters.

    It is what the demo and the tests use; any object with ``encode``, ``decode``,
    ``eos_token_id`` and ``pad_token_id`` works in its place (see :func:`load_tokenizer`).
    """

    alphabet = string.ascii_lowercase + " .,:?!'-"
    lowercase = True   # upper case is read as lower case

    def __init__(self) -> None:
        self.pad_token_id = 0
        self.eos_token_id = 1
        self._ids = {c: i + 2 for i, c in enumerate(self.alphabet)}
        self._chars = {i: c for c, i in self._ids.items()}
        self.vocab_size = len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        text = text.lower() if self.lowercase else text
        return [self._ids[c] for c in text if c in self._ids]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._chars.get(int(i), "") for i in ids)


class ArithmeticTokenizer(CharTokenizer):
    """Pad 0, eos 1, then ``0123456789+-= `` (one token a character; vocabulary 16)."""

    alphabet = "0123456789+-= "
    lowercase = False
