"""Structured outputs in an audit: whether each output satisfies its constraint, and which grammar mistake
explains a token that differs from the constrained reference.

| class                    | decided by              | the check |
|--------------------------|-------------------------|-----------|
| `constraint_violation`   | `constraint-check`      | the returned text is not a sentence of the constraint (a finished output) or not a prefix of one (an output cut at its budget): the JSON does not parse, the regex does not match, no choice is it, the grammar refuses it (engines/constraints/check.py). A finding of its own, beside any token divergence, and checked where no reference runs |
| `constraint_unmasked`    | `constraint-replay`     | at the first differing token the engine's token is one the grammar forbids there, and it is the argmax of the logits under every other processor of the request, unmasked: no mask was applied at that position (a bonus token left unmasked) |
| `constraint_mask_offset` | `constraint-replay`     | the engine's token (forbidden there, or admitted but not the masked choice) is the argmax of the logits under the mask of the position before: the mask applied one position late (the bitmask rows shifted) |
| `constraint_state`       | `constraint-replay`     | the engine's token is one the grammar forbids after the row's own output, and neither replay above makes it: the grammar state is not the output's (rejected draft tokens left in it, not rolled back: a state ahead of the output) |

A token the grammar admits but the reference did not choose, and that the mask of the position before does not
make, is left to the noise-band ruling, as any other.

Under sampling (`sampled_constraint_findings`) there is no reference token to compare: each sample's output is
checked against its constraint (`constraint_violation`), and its first token the grammar forbids after the
sample's own output (a token the masked target gives probability 0) is placed by where it sits in its step
(the engine's step offsets) and whether the grammar admits it one position earlier. The faults leave these
marks: an unmasked bonus token sits at offset k alone (the other positions are masked); a mask one position
late never touches offset 0 (verify position 0 keeps its own mask) and admits its token one position earlier;
a state left ahead of the output (rejected drafts kept) puts forbidden tokens anywhere, offset 0 included. So the
class named for a run is `constraint_unmasked` when every such token is a bonus token, `constraint_mask_offset`
when none sits at offset 0 and every one is admitted one position earlier, else `constraint_state`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specaudit.engines.constraints.check import output_bytes, violation
from specaudit.engines.constraints.matcher import ConstraintError, allowed_after, grammar_start, marker_ids, mask, masks_along
from specaudit.engines.requests import RequestParams, process
from specaudit.engines.requests.reference import RequestResult
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.records.serialize import divergence_to_json
from specaudit.equivalence.rulings.record import finding

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


def violation_finding(index: int, params: RequestParams, tokens: Sequence[int], stop_ids: Sequence[int],
                      tokenizer: Any, prompt: Sequence[int] = ()) -> Divergence | None:
    """`constraint_violation` when the output's bytes (its `tokens` read through the grammar engine's own
    vocabulary, `output_bytes`) do not satisfy `params.constraint`; None when they do. Under a reasoning end
    marker only the tokens after it are the grammar's (`grammar_start`, the marker looked for in `prompt` too);
    an output whose reasoning never ended has nothing the grammar judges."""
    if params.constraint is None or tokenizer is None:
        return None
    try:
        start = grammar_start(marker_ids(params.constraint, tokenizer), prompt, tokens)
        if start is None:
            return None
        tokens = list(tokens[start:])
        data, finished = output_bytes(tokens, tokenizer, stop_ids)
        why = violation(params.constraint, data, finished)
    except ConstraintError as exc:
        return finding(index, None, "constraint_violation", "constraint-check", f"cannot check: {exc}", {})
    if why is None:
        return None
    return finding(index, len(tokens) - 1 if tokens else None, "constraint_violation", "constraint-check", why,
                    {"constraint": params.constraint.describe(), "text": data[-200:].decode("utf-8", errors="replace"),
                     "finished": finished}, detected_by="constraint")


def constraint_cause(index: int, params: RequestParams, reference: RequestResult, returned: Sequence[int],
                     stop_ids: Sequence[int], tokenizer: Any, prompt: Sequence[int] = (),
                     penalty_scope: str = "output", admitted_too: bool = False) -> Divergence | None:
    """Which grammar mistake explains the first token that differs from the reference (module table), or
    None (no constraint, the token is one the grammar admits there, or no logits to replay). "Unmasked" is the
    row under every other processor of the request (its logit bias, penalties, banned words: `process` with the
    grammar skipped), so an unmasked bonus token under a logit bias is the biased argmax; `prompt` is what the
    penalties count (with `penalty_scope`). `admitted_too`: a token the grammar admits there is replayed under
    the mask of the position before too (asked only after the noise band ruled the token structural: below
    float64 an admitted token may be a flip)."""
    if params.constraint is None or reference.allowed is None or reference.logits is None:
        return None
    ref = reference.tokens
    agree = next((i for i, (a, b) in enumerate(zip(ref, returned)) if a != b), None)
    if agree is None or agree >= len(reference.allowed) or agree >= reference.logits.shape[0]:
        return None
    token, allowed = int(returned[agree]), reference.allowed[agree]
    admitted = 0 <= token < allowed.shape[0] and bool(allowed[token])
    if admitted and not admitted_too:
        return None  # admitted: the noise band rules it
    raw = process(reference.logits[agree], prompt, ref[:agree], params, stop_ids, penalty_scope,
                  skip="constraint").greedy  # [V] every processor but the grammar
    evidence = {"constraint": params.constraint.describe(), "position": agree}
    if not admitted and int(raw.argmax()) == token:  # (an admitted argmax is the masked argmax too)
        return finding(index, agree, "constraint_unmasked", "constraint-replay",
                        f"token {token} at position {agree} is one the grammar forbids there, and the argmax of the "
                        "unmasked logits: no grammar mask was applied at that position", evidence, ref[agree], token)
    vocab = raw.shape[0]
    for shift, label in ((-1, "before"),):  # a state ahead of the output is `constraint_state` (tokens kept)
        upto = agree + shift
        if upto < 0 or upto > len(ref):
            continue
        try:
            other = allowed_after(params.constraint, tokenizer, vocab, stop_ids, ref[:upto], prompt)
        except ConstraintError:
            other = None
        if other is not None and bool(other.any()) and int(mask(raw, other).argmax()) == token:
            return finding(index, agree, "constraint_mask_offset", "constraint-replay",
                            f"token {token} at position {agree} is "
                            + ("not the grammar's choice there" if admitted else "forbidden by the grammar there")
                            + f", and the argmax under the mask of the position {label} it: the mask was applied one "
                            "position off",
                            {**evidence, "offset": shift}, ref[agree], token)
    if admitted:  # a token the grammar admits, no mask replay makes it: the noise band rules it
        return None
    return finding(index, agree, "constraint_state", "constraint-replay",
                    f"token {token} at position {agree} is one the grammar forbids after the row's own output, and "
                    "neither the unmasked logits nor a neighbouring position's mask choose it: the grammar state was "
                    "not the output's (rejected draft tokens left in it)", evidence, ref[agree], token)


def _first_forbidden(params: RequestParams, prompt: Sequence[int], tokens: Sequence[int], stop_ids: Sequence[int],
                     tokenizer: Any, vocab_size: int) -> int | None:
    """The position of the output's first token its grammar forbids after the output before it, or None."""
    assert params.constraint is not None
    masks = masks_along(params.constraint, tokenizer, vocab_size, stop_ids, tokens, prompt=prompt)
    return next((j for j, (token, allowed) in enumerate(zip(tokens, masks))
                 if not (0 <= token < allowed.shape[0] and bool(allowed[token]))), None)


def sampled_constraint_findings(samples: Sequence[tuple[Sequence[int], Sequence[int]]],
                                requests: Sequence[RequestParams], offsets: Sequence[Sequence[int]] | None,
                                draft_tokens: int | None, stop_ids: Sequence[int], tokenizer: Any,
                                vocab_size: int) -> Divergence | None:
    """The sampled audit's structured-output findings (module docstring): per sample its `constraint_violation`
    (`violation_finding`) and its first forbidden token with the marks that place it; the class named for the
    run (None where no token is forbidden). None when no request carries a constraint."""
    if not any(r.constraint is not None for r in requests):
        return None
    violations, forbidden = [], []
    for index, ((prompt, tokens), params) in enumerate(zip(samples, requests)):
        if params.constraint is None:
            continue
        found = violation_finding(index, params, tokens, stop_ids, tokenizer, prompt)
        if found is not None:
            violations.append(found)
        position = _first_forbidden(params, prompt, tokens, stop_ids, tokenizer, vocab_size)
        if position is None:
            continue
        token = int(tokens[position])
        before = (allowed_after(params.constraint, tokenizer, vocab_size, stop_ids, tokens[:position - 1], prompt)
                  if position >= 1 else None)
        offset = int(offsets[index][position]) if offsets is not None and position < len(offsets[index]) else None
        forbidden.append({"sample": index, "position": position, "token": token, "step_offset": offset,
                          "admitted_one_position_earlier": before is not None and 0 <= token < before.shape[0]
                          and bool(before[token])})
    cls, reason = None, ""
    if forbidden:
        offsets_seen = [f["step_offset"] for f in forbidden]
        known = all(o is not None for o in offsets_seen)
        if known and draft_tokens and all(o == draft_tokens for o in offsets_seen):
            cls, reason = "constraint_unmasked", (f"every one of the {len(forbidden)} first forbidden tokens is a bonus "
                                                  f"token (step offset {draft_tokens}): the bonus position is not masked")
        elif known and 0 not in offsets_seen and all(f["admitted_one_position_earlier"] for f in forbidden):
            cls, reason = "constraint_mask_offset", (f"the {len(forbidden)} first forbidden tokens sit at verify positions "
                                                     "after the first, each admitted by the mask one position earlier: "
                                                     "the masks applied one position late")
        else:
            at_zero = sum(1 for o in offsets_seen if o == 0)
            cls, reason = "constraint_state", (f"{len(forbidden)} first forbidden tokens, {at_zero} at a step's first "
                                               "position (masked there with the step's starting state) and not all "
                                               "explained by a bonus or a shifted mask: the grammar state is not the "
                                               "output's (rejected draft tokens left in it)")
    return {"constrained_samples": sum(1 for r in requests if r.constraint is not None),
            "violations": len(violations), "violation_findings": [divergence_to_json(v) for v in violations[:10]],
            "forbidden_samples": len(forbidden), "forbidden_tokens": forbidden[:20],
            "class": cls, "reason": reason, "fix": CONSTRAINT_FIXES.get(cls) if cls else None}


def constraint_refusal(spec: str, constraints: Sequence[Any], *, dialect: str | None, recording: bool,
                       takes_constraints: bool, verb: str = "decode") -> str | None:
    """Why engine `spec` would drop one of `constraints`, or None: a server whose dialect cannot carry it, a
    recording (what was asked of it is unknown), an in-process engine that declares no `takes_constraints`."""
    from specaudit.engines.constraints.fields import dialect_refusal

    if not constraints:
        return None
    if dialect is not None:
        for constraint in constraints:
            why = dialect_refusal(dialect, constraint)
            if why is not None:
                return f"{spec}: cannot send the {constraint.kind} constraint: {why}"
        return None
    if recording:
        return (f"engine {spec}: a recording says nothing of the constraint it was {verb}d under: audit the "
                "engine itself")
    if not takes_constraints:
        return (f"engine {spec} takes no structured-output constraint (it declares no `takes_constraints`): it "
                f"would {verb} unconstrained")
    return None
