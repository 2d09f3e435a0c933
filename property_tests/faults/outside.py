"""Faults from outside the zoo: three bug shapes of real published code (the paper's own EQSPEC and
EXSPEC, github.com/eBay/spec_dec), planted as line edits of EQSPEC.

The zoo's faults were written together with the diagnosis; these were found in code that was not.
None of them shows on the hunts' short synthetic prompts with a pad id that differs from EOS, so
they are audited on prompt sets that hold their trigger (`OUTSIDE_CASES`): a prompt past 512 tokens,
a pad id first and inside a prompt, a pad id equal to EOS beside prompts of different lengths.
Each must be diagnosed by its cause (`EXPECTED_OUTSIDE_CLASS`), never by the symptom it leaves
(a wrong first token, 33 tokens for 32, rows that end after one token).
"""

from __future__ import annotations

import collections
import random
from typing import Any

from specaudit.testing.faults.mutation import FaultEngine, LineChange

PROMPT_LIMIT = 512  # the cut of `PromptsCutAtLimit` (the published code cuts at 1024)


class PromptsCutAtLimit(FaultEngine):
    """Prompts cut to their first 512 tokens: `start_batch` keeps `prompts[r][:512]` (the published
    code tokenizes with `truncation=True, max_length=1024`)."""

    changes = (
        LineChange("specaudit.engines.eqspec", "tokens, lengths = ragged.left_pad([prompts[r] for r in rows], pad_id, target.device)",
                   f"tokens, lengths = ragged.left_pad([prompts[r][:{PROMPT_LIMIT}] for r in rows], pad_id, target.device)"),
    )


class OutputSliceByPadValue(FaultEngine):
    """Output slice found by pad-id equality: the new tokens are taken from the row's sequence after
    its count of non-pad prompt tokens, so a prompt holding the pad id hands its last tokens to the
    output (the published EQSPEC's `first_non_pad + input_lengths`)."""

    changes = (
        LineChange("specaudit.engines.eqspec", "return state, StepResult(record, [[t] for t in first_list], logits, finished)",
                   "return state, StepResult(record, [prompts[r][sum(t != pad_id for t in prompts[r]):] + [t] "
                   "for r, t in zip(rows, first_list)], logits, finished)"),
    )


class LeadingEosFinished(FaultEngine):
    """A row whose first column is the EOS id counted as finished: `start_batch` ends every row that
    starts with EOS, so with the pad id equal to EOS each left-padded row ends after its first token
    (the published code marks a row done when any of its tokens, padding included, is EOS)."""

    changes = (
        LineChange("specaudit.engines.eqspec",
                   "first_list, done_list = first.tolist(), done.tolist()",
                   "done = done | (tokens[:, 0] == (-1 if eos_token_id is None else eos_token_id))\n"
                   "first_list, done_list = first.tolist(), done.tolist()"),
    )


OUTSIDE_FAULTS: tuple[type[FaultEngine], ...] = (PromptsCutAtLimit, OutputSliceByPadValue, LeadingEosFinished)

EXPECTED_OUTSIDE_CLASS: dict[str, str] = {
    "prompts_cut_at_limit": "prompt_truncated",
    "output_slice_by_pad_value": "pad_as_content",
    "leading_eos_finished": "pad_as_content",  # the padding (= EOS) read as a finished row
}


PAD, EOS = 256, 258  # tiny-llama's pad and EOS ids


def _content(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


# each fault's trigger among ordinary prompts, and the pad id the engine is given
OUTSIDE_CASES: dict[str, tuple[list[list[int]], int]] = {
    "prompts_cut_at_limit": ([_content(1, 5), _content(2, PROMPT_LIMIT + 20), _content(3, 7)], PAD),
    "output_slice_by_pad_value": ([[PAD] + _content(4, 4) + [PAD] + _content(5, 3), _content(6, 6), _content(7, 3)], PAD),
    "leading_eos_finished": ([_content(8, 3), _content(9, 7), _content(10, 5)], EOS),  # the pad id is EOS
}


def audit_outside_fault(fault: type[FaultEngine], max_new_tokens: int = 6) -> dict[str, Any]:
    """The audit's run record of `fault` on its case (tiny-llama, float64, batch size 4, k = 3),
    with re-runs of fresh fault engines for the diagnosis's experiments."""
    from specaudit.equivalence.audit import RunSettings, audit_engine
    from specaudit.equivalence.run_context import wrapped
    from specaudit.testing import models

    prompts, pad = OUTSIDE_CASES[fault.slug()]
    pair = models.pair("tiny-llama", "float64")

    def build(pad_id: int) -> FaultEngine:
        return fault(pair.target, pair.draft, batch_size=4, draft_tokens=3, pad_token_id=pad_id)

    def rerun(indices: list[int], pad_token_id: int | None, around: Any = None) -> list[list[int]]:
        engine = build(pad if pad_token_id is None else pad_token_id)
        return wrapped(engine.generate, around)([prompts[i] for i in indices], max_new_tokens, EOS)

    return audit_engine(build(pad), pair, prompts, RunSettings(max_new_tokens=max_new_tokens, eos_token_id=EOS, dtype="float64", engine_name=fault.slug(), batch_size=4, pad_token_id=pad),
                        rerun=rerun)


def table_row(name: str, expected: str, run: dict[str, Any]) -> str:
    """`| bug | expected | exact | diagnosed (count) | deciding evidence (count) |` for reports/faults.md."""
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    classes = collections.Counter(d["diagnosis"]["class"] for d in structural)
    decided = collections.Counter((d["diagnosis"]["class"], d["diagnosis"].get("named_by") or "nothing decided")
                                  for d in structural)
    evidence = "; ".join(f"`{c}`: {e} ({n})" for (c, e), n in decided.most_common())
    failures = run.get("failures") or []
    if failures:
        evidence += f"; {len(failures)} prompt(s) made it fail: " + ", ".join(
            f"{f['prompt_index']} ({f['reason'].split(':')[0]})" for f in failures)
    diagnosed = ", ".join(f"`{c}` {n}" for c, n in classes.most_common()) or "-"
    return f"| {name} | {expected} | {run['exact_matches']}/{run['num_prompts']} | {diagnosed} | {evidence} |"


if __name__ == "__main__":  # python -m specaudit.testing.faults.outside: the rows of reports/faults.md
    for outside in OUTSIDE_FAULTS:
        print(table_row(outside.summary(), f"`{EXPECTED_OUTSIDE_CLASS[outside.slug()]}`", audit_outside_fault(outside)),
              flush=True)
