"""Holey replays (`equivalence/diagnosis/replay.py`, `holey_replay_inputs`): where rejected draft slots are
masked from every later query ("counted", "counted_padding"), a step's proposals after its first rejection are
never seen by a kept token, so the rebuild stops drafting there. The replay it gives is the one that drafts
every proposal, to the bit, in fewer draft passes.
"""

from __future__ import annotations

import pytest
import torch

from specaudit.equivalence.diagnosis import replay
from specaudit.testing import models


def drafted_in_full(draft, k: int, prompt: list[int], output: list[int], end: int, mode: str, padding: int):
    """The rebuild drafting all k proposals of every step (ids, positions, allowed, rows)."""
    slots = [(t, True) for t in prompt] + [(output[0], True)]
    done = 1
    while done < end:
        proposals: list[int] = []
        for _ in range(k):
            ids, positions, allowed = replay._holey_inputs(slots + [(t, True) for t in proposals], mode, padding)
            proposals.append(int(replay.replay_all(draft, ids, positions, allowed)[-1].argmax()))
        accepted = 0
        while accepted < k and done + accepted < len(output) and proposals[accepted] == output[done + accepted]:
            accepted += 1
        slots += [(t, True) for t in proposals[:accepted]] + [(t, False) for t in proposals[accepted:]]
        done += accepted
        if done < len(output):
            slots.append((output[done], True))
            done += 1
    kept_at = [i for i, (_, kept) in enumerate(slots) if kept]
    rows = [kept_at[len(prompt) - 1 + j] for j in range(end + 1)]
    return (*replay._holey_inputs(slots[: rows[-1] + 1], mode, padding), rows)


def counting_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `replay_all` call from now on appends 1 to the list returned."""
    passes: list[int] = []
    original = replay.replay_all
    monkeypatch.setattr(replay, "replay_all", lambda model, *a: passes.append(1) or original(model, *a))
    return passes


@pytest.mark.parametrize("mode, padding", [("counted", 0), ("counted_padding", 3)])
def test_a_step_stops_drafting_at_its_first_rejection(mode: str, padding: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pair = models.pair("tiny-llama")
    prompt = list(models.prompts()[8])
    output = models.reference("tiny-llama")[0][8][:16]
    k, end = 4, 12
    passes = counting_passes(monkeypatch)
    full = drafted_in_full(pair.draft, k, prompt, output, end, mode, padding)
    passes_in_full = len(passes)
    passes.clear()
    built = replay.holey_replay_inputs(pair.draft, k, prompt, output, end, mode, padding)
    monkeypatch.undo()

    assert built is not None
    ids, positions, allowed, rows = built
    assert (positions, rows) == (full[1], full[3]) and torch.equal(allowed, full[2])
    seen = allowed[rows[-1]].nonzero().flatten().tolist()  # the slots the last query sees: the kept ones
    assert [ids[i] for i in seen] == [full[0][i] for i in seen]
    # the target's logits at the rows of the new tokens: identical, only the ids of unseen holes differ
    logits = replay.replay_all(pair.target, ids, positions, allowed)[rows]
    assert torch.equal(logits, replay.replay_all(pair.target, *full[:3])[rows])
    assert len(passes) < passes_in_full, (len(passes), passes_in_full)
