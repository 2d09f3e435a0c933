"""A test tokenizer for request parameters, and the tiny pair that uses it.

Each token id reads as its hex digits and a dot ("9d."): printable, several characters a token, so a stop
string can start inside one token and end inside the next (the byte tokenizer makes U+FFFD of the tiny
model's random bytes).
"""

from __future__ import annotations

from specaudit.engines.models import zoo


class HexTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{i:x}." for i in ids)


def hex_pair():
    """tiny-llama in float64 with `HexTokenizer` as its tokenizer."""
    pair = zoo.load_pair("tiny-llama", dtype="float64")
    pair.tokenizer = HexTokenizer()
    return pair
