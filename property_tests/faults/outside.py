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
        LineChange("specaudit.engines.eqspec", "done = torch.zeros_like(lengths, dtype=torch.bool) | (max_new_tokens <= 1)",
                   "done = torch.zeros_like(lengths, dtype=torch.bool) | (max_new_tokens <= 1) | "
                   "(tokens[:, 0] == (-1 if eos_token_id is None else eos_token_id))"),
    )


OUTSIDE_FAULTS: tuple[type[FaultEngine], ...] = (PromptsCutAtLimit, OutputSliceByPadValue, LeadingEosFinished)

EXPECTED_OUTSIDE_CLASS: dict[str, str] = {
    "prompts_cut_at_limit": "prompt_truncated",
    "output_slice_by_pad_value": "pad_as_content",
    "leading_eos_finished": "pad_as_content",  # the padding (= EOS) read as a finished row
}
