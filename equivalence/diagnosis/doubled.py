"""A bonus token emitted twice, replayed for an engine without a trace.

A speculative step that keeps every draft token ends with one bonus token, the target's choice after
them. An engine that emits that bonus twice puts a token into the output that no forward pass chose:
the divergence is a copy of the token before it (or, when the reference happens to repeat there too,
the first token the doubled row computes wrong later), so no replay of the target with shifted
positions or masks chooses it, and what follows depends on what the engine did with the copy. Each
way is a hypothesis:

- `hole`: the copy never fed, but counted in the row's length: the next token numbered one past it;
  the caches cut back to the entries each step kept;
- `count`: the same, the caches cut back to the row's length as the engine counts it (copies
  included): every doubled step leaves one more entry of a rejected draft token in them;
- `kept`: both copies fed (an engine that feeds its own output back);
- `dropped`: one copy fed and counted (the copy only in the answer).

The row is rebuilt as a cached engine would run it, along the engine's own output: the prompt as the
prefill (token 0 its choice); each step feeds the draft the pending token and its first k - 1
proposals (the k-th when every one is kept), feeds the target the pending token and the k proposals,
keeps the proposals equal to the output, then the target's token, and when all k were kept, the same
token again. Every token fed to the target is a slot with its position and the cache entries it saw;
the target is replayed over the slots in one pass, teacher-forced: each new token judged by the logits
of the slot that chose it (a copy by the slot that chose the bonus it repeats), so the replay chooses
the engine's token at a copy and must go on agreeing after it (`replay.explain_tokens` judges the
window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specaudit.equivalence.diagnosis.forward import GrowingReplay
from specaudit.equivalence.diagnosis.replay import Hypothesis, RowContext

MODES = {
    "hole": "the bonus token emitted twice when a step keeps every draft token (steps rebuilt from the draft "
            "model's proposals), the copy counted in the row's positions but never fed",
    "count": "the bonus token emitted twice when a step keeps every draft token (steps rebuilt from the draft "
             "model's proposals), the copy counted in the row's positions and in the length its caches are cut "
             "back to, never fed",
    "kept": "the bonus token emitted twice when a step keeps every draft token (steps rebuilt from the draft "
            "model's proposals), both copies fed",
    "dropped": "the bonus token emitted twice when a step keeps every draft token (steps rebuilt from the draft "
               "model's proposals), one copy fed and counted",
}
MECHANISM = "the bonus token emitted twice"


@dataclass
class _Cache:
    """One model's cached row: every token ever fed (a slot: token, position, the slots it saw) and the
    slots still in the cache."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seen: list[list[int]] = field(default_factory=list)  # per slot: the earlier slots its query saw
    alive: list[int] = field(default_factory=list)

    def feed(self, tokens: list[int], start: int) -> list[int]:
        """Feed `tokens` at positions start.. in one pass; their slots."""
        before, fed = list(self.alive), []
        for j, token in enumerate(tokens):
            self.seen.append(before + fed)
            fed.append(len(self.tokens))
            self.tokens.append(token)
            self.positions.append(start + j)
        self.alive += fed
        return fed

    def crop(self, length: int) -> None:
        del self.alive[length:]

    def inputs(self, upto: int) -> tuple[list[int], list[int], torch.Tensor]:
        """ids, positions and the visibility [L, L] (key j seen by query i) of the first `upto` slots."""
        allowed = torch.eye(upto, dtype=torch.bool)
        for i in range(upto):
            allowed[i, self.seen[i]] = True
        return self.tokens[:upto], self.positions[:upto], allowed


def doubled_bonus_inputs(draft: Any, k: int, prompt: list[int], output: list[int], end: int,
                         mode: str) -> tuple[Any, ...] | None:
    """(ids, positions, allowed, rows) of the target's slots under `mode` through the query of new token
    `end`; `rows[j]` is the slot whose logits chose new token j. None when no step up to `end` keeps every
    draft token (nothing doubled: the plain replay says it) or the draft refuses the positions."""
    return _rebuild(draft, k, prompt, output, end, mode)[0]


@torch.no_grad()
def _rebuild(draft: Any, k: int, prompt: list[int], output: list[int], end: int,
             mode: str) -> tuple[tuple[Any, ...] | None, bool]:
    """`doubled_bonus_inputs`, and whether a step up to `end` doubled its bonus."""
    n = len(prompt)
    target, drafted = _Cache(), _Cache()
    target.feed(list(prompt), 0)
    drafted.feed(list(prompt), 0)
    rows = [n - 1]  # token 0: the prefill's choice
    pending, position, done, doubled = [output[0]], n, 1, False
    drafting = GrowingReplay(draft)  # the draft's slots only grow: each pass feeds the new ones
    while done <= end and done < len(output):
        length = n + done  # the row's length as the engine counts it, the pending token(s) included
        proposals: list[int] = []
        for j in range(k):  # the draft fed the pending token(s), then each proposal but the last
            if j == 0:
                drafted.feed(pending, position)
            else:
                drafted.feed([proposals[-1]], position + len(pending) + j - 1)
            logits = drafting.last(*drafted.inputs(len(drafted.tokens)))
            if logits is None:
                return None, doubled
            proposals.append(int(logits.argmax()))
        entries = len(target.alive)
        fed = target.feed(pending + proposals, position)
        accepted = 0
        while accepted < k and done + accepted < len(output) and proposals[accepted] == output[done + accepted]:
            accepted += 1
        rows += fed[len(pending) - 1:len(pending) + accepted]  # the slots that chose the accepted tokens, the bonus
        bonus = output[done + accepted] if done + accepted < len(output) else None
        done += accepted + 1
        copy = accepted == k and done < len(output)
        if copy:  # every draft token kept: the bonus again, chosen by the same slot
            doubled = True
            rows.append(rows[-1])
            done += 1
        keep = (length if mode == "count" else entries + len(pending)) + accepted
        target.crop(keep)
        drafted.crop(keep)
        if accepted == k:  # the draft never fed its last proposal
            drafted.feed([proposals[-1]], position + len(pending) + k - 1)
        # the next pending token's position: after the fed and kept ones, one further past an unfed copy
        position += len(pending) + accepted + (1 if copy and mode in ("hole", "count") else 0)
        pending = [bonus, bonus] if copy and mode == "kept" else [bonus]
    if not doubled or len(rows) <= end:
        return None, doubled
    rows = rows[:end + 1]
    ids, positions, allowed = target.inputs(max(rows) + 1)
    return (ids, positions, allowed, rows), True


def doubled_bonus_hypotheses(prompt: list[int], output: list[int], q: int, row: RowContext) -> list[Hypothesis]:
    """The ways a doubled bonus can go on (see the module), for the logits of new tokens up to `q`. None
    where the output repeats no token up to `q`: a doubled bonus before the divergence shows as one (the
    output equals the reference before it, and the divergence itself is a copy or comes after one)."""
    if row.draft is None or not row.draft_tokens or q == 0:
        return []
    if not any(output[j] == output[j - 1] for j in range(1, min(q + 1, len(output)))):
        return []
    none_doubled: list[bool] = []  # the modes agree until the first doubled step: none in one, none in any

    def build(mode: str) -> tuple[Any, ...] | None:
        if none_doubled:
            return None
        built, doubled = _rebuild(row.draft, row.draft_tokens, prompt, output, q, mode)
        if not doubled:
            none_doubled.append(True)
        return built

    return [Hypothesis("acceptance_rule", text, lambda mode=mode: build(mode), MECHANISM)
            for mode, text in MODES.items()]
