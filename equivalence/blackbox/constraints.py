"""Structured outputs in an audit: whether each output satisfies its constraint, and which grammar mistake
explains a token that differs from the constrained reference.

| class                    | decided by              | the check |
|--------------------------|-------------------------|-----------|
| `constraint_violation`   | `constraint-check`      | the returned text is not a sentence of the constraint (a finished output) or not a prefix of one (an output cut at its budget): the JSON does not parse, the regex does not match, no choice is it, the grammar refuses it (engines/constraints/check.py). A finding of its own, beside any token divergence, and checked where no reference runs |
| `constraint_unmasked`    | `constraint-replay`     | at the first differing token the engine's token is one the grammar forbids there, and it is the argmax of the unmasked logits: no mask was applied at that position (a bonus token left unmasked) |
| `constraint_mask_offset` | `constraint-replay`     | the engine's token is the argmax of the logits under the mask of the position before: the mask applied one position late (the bitmask rows shifted) |
| `constraint_state`       | `constraint-replay`     | the engine's token is one the grammar forbids after the row's own output, and neither replay above makes it: the grammar state is not the output's (rejected draft tokens left in it, not rolled back: a state ahead of the output) |

A token the grammar admits but the reference did not choose is left to the noise-band ruling, as any other.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specaudit.engines.constraints.check import output_bytes, violation
from specaudit.engines.constraints.matcher import ConstraintError, allowed_after, mask
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import RequestResult

CONSTRAINT_CLASSES = ("constraint_violation", "constraint_unmasked", "constraint_mask_offset", "constraint_state")
CONSTRAINT_FIXES = {
    "constraint_violation": "Apply the request's grammar mask to every sampled position (each verified draft "
                            "position and the bonus token) and end a request only where the grammar accepts.",
    "constraint_unmasked": "Mask every position a token is taken from with the grammar, the bonus (or recovered) "
                           "token's position included.",
    "constraint_mask_offset": "Mask verify position i with the grammar state after the first i draft tokens: "
                              "one bitmask per position, in order.",
    "constraint_state": "After verification roll the grammar matcher back over the rejected draft tokens "
                        "(rollback(k)) before it takes the recovered or bonus token.",
}


def _finding(index: int, position: int | None, cls: str, decided_by: str, reason: str, evidence: dict[str, Any],
             reference_token: int | None = None, engine_token: int | None = None,
             detected_by: str = "tokens") -> dict[str, Any]:
    return {"prompt_index": index, "position": position, "reference_token": reference_token,
            "engine_token": engine_token, "kind": "structural", "decided_by": decided_by,
            "detected_by": detected_by, "evidence": {"reason": reason, **evidence},
            "diagnosis": {"class": cls, "evidence": reason, "named_by": decided_by, "tried": []}}


def violation_finding(index: int, params: RequestParams, tokens: Sequence[int], stop_ids: Sequence[int],
                      tokenizer: Any) -> dict[str, Any] | None:
    """`constraint_violation` when the output's bytes (its `tokens` read through the grammar engine's own
    vocabulary, `output_bytes`) do not satisfy `params.constraint`; None when they do."""
    if params.constraint is None or tokenizer is None:
        return None
    try:
        data, finished = output_bytes(tokens, tokenizer, stop_ids)
        why = violation(params.constraint, data, finished)
    except ConstraintError as exc:
        return _finding(index, None, "constraint_violation", "constraint-check", f"cannot check: {exc}", {})
    if why is None:
        return None
    return _finding(index, len(tokens) - 1 if tokens else None, "constraint_violation", "constraint-check", why,
                    {"constraint": params.constraint.describe(), "text": data[-200:].decode("utf-8", errors="replace"),
                     "finished": finished}, detected_by="constraint")


def constraint_cause(index: int, params: RequestParams, reference: RequestResult, returned: Sequence[int],
                     stop_ids: Sequence[int], tokenizer: Any) -> dict[str, Any] | None:
    """Which grammar mistake explains the first token that differs from the reference (module table), or
    None (no constraint, the token is one the grammar admits there, or no logits to replay)."""
    if params.constraint is None or reference.allowed is None or reference.logits is None:
        return None
    ref = reference.tokens
    agree = next((i for i, (a, b) in enumerate(zip(ref, returned)) if a != b), None)
    if agree is None or agree >= len(reference.allowed) or agree >= reference.logits.shape[0]:
        return None
    token, allowed = int(returned[agree]), reference.allowed[agree]
    if 0 <= token < allowed.shape[0] and bool(allowed[token]):
        return None  # admitted: the noise band rules it
    raw = reference.logits[agree].to(torch.float64)  # [V]
    evidence = {"constraint": params.constraint.describe(), "position": agree}
    if int(raw.argmax()) == token:
        return _finding(index, agree, "constraint_unmasked", "constraint-replay",
                        f"token {token} at position {agree} is one the grammar forbids there, and the argmax of the "
                        "unmasked logits: no grammar mask was applied at that position", evidence, ref[agree], token)
    vocab = raw.shape[0]
    for shift, label in ((-1, "before"),):  # a state ahead of the output is `constraint_state` (tokens kept)
        upto = agree + shift
        if upto < 0 or upto > len(ref):
            continue
        try:
            other = allowed_after(params.constraint, tokenizer, vocab, stop_ids, ref[:upto])
        except ConstraintError:
            other = None
        if other is not None and bool(other.any()) and int(mask(raw, other).argmax()) == token:
            return _finding(index, agree, "constraint_mask_offset", "constraint-replay",
                            f"token {token} at position {agree} is forbidden by the grammar there, and the argmax "
                            f"under the mask of the position {label} it: the mask was applied one position off",
                            {**evidence, "offset": shift}, ref[agree], token)
    return _finding(index, agree, "constraint_state", "constraint-replay",
                    f"token {token} at position {agree} is one the grammar forbids after the row's own output, and "
                    "neither the unmasked logits nor a neighbouring position's mask choose it: the grammar state was "
                    "not the output's (rejected draft tokens left in it)", evidence, ref[agree], token)
