"""What an output's tokens say against the references before any logit is read.

Each rule here is written once and called by every ruling and check that asks it: the greedy audit's plain
control (plain.py), the served rulings (served.py) and the diagnosis's checks (diagnosis/checks.py).
"""

from __future__ import annotations

from typing import Sequence

from specaudit.equivalence.compare import matched_prefix
from specaudit.equivalence.rulings.thresholds import OTHER_REFERENCE_TOKENS


def first_divergence(reference: Sequence[int], output: Sequence[int]) -> int | None:
    """Where `output` first differs from `reference` (an output differs where it ends); None when equal."""
    agree = matched_prefix(reference, output)
    return None if agree == len(reference) == len(output) else agree


def token_at(tokens: Sequence[int], position: int | None) -> int | None:
    """The token at `position`; None where the tokens have ended (or no position is given)."""
    return tokens[position] if position is not None and position < len(tokens) else None


def departs_at(reference: Sequence[int], other: Sequence[int], position: int, token: int | None) -> bool:
    """Whether `other` makes the divergence (`position`, `token`; None: it ends there) from `reference`."""
    return first_divergence(reference, other) == position and token_at(other, position) == token


def other_references_matched(index: int, references: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The other prompts whose reference `output` is, with `OTHER_REFERENCE_TOKENS` past where it leaves its own."""
    own = references[index]
    position = first_divergence(own, output)
    if position is None or len(output) - position < OTHER_REFERENCE_TOKENS:
        return []
    mine = list(output)
    return [j for j, reference in enumerate(references) if j != index and list(reference) == mine]
