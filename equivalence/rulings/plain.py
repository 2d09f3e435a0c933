"""The plain control: the reference, a plain run of the same engine, and the speculative run.

A server in bfloat16 flips near-ties against the float32 reference whether it speculates or not: its
kernels round differently. A noise band measured or declared from the outside cannot always tell
such a flip from a speculation bug. A plain run of the same engine (the same model served without
speculation, `--plain-engine ENGINE` or `recorded:FILE` recorded from one) can: it is the paper's own
test (speculative against plain decoding on one engine), joined to the reference.

For each token divergence of the speculative run from the reference, at position p with token t:

- the plain run also diverges first at p, with the same t (or ends at p exactly as the speculative run
  does): the difference is the engine's precision, not speculation or batching. It is ruled
  `numerical`, `decided_by: "plain-control"`, whatever the noise band said (kept as `band_kind`);
- otherwise it is ruled as before (its `decided_by` is the control that ruled it), with the plain run's
  token at p beside it (`plain_token`).

Every divergence of such a run carries `plain_token` (None where the plain output ended before p)
and `plain_first_divergence` (None where the plain output equals the reference's).

Under a structured-output constraint the reference also masks the logits with the grammar it believes
the server applies (its grammar engine and options). The plain run is then the proof that it is the
server's (`rule_processed`): a divergence the plain engine makes identically, whose engine token the
reference's grammar forbids at that position (or an ending it does not admit), is `reference_mismatch`:
the server's grammar admits what the reference's does not, with or without speculation. That is neither
the engine's bug nor its precision: the prompt is not judged, and the audit is not shown equivalent until
the reference is given the server's settings (docs/structured.md). Any other identical divergence is
ruled by `rule` (the engine's precision).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from specaudit.equivalence.records import ABSENT, Divergence
from specaudit.equivalence.rulings.outputs import departs_at, first_divergence, token_at


def is_token_divergence(divergence: Divergence) -> bool:
    """Whether `divergence` is one of tokens (not of logits, nor a finding of a report check)."""
    return divergence.detected_by == "tokens"


def rule(divergence: Divergence, reference: list[int], plain: list[int]) -> Divergence:
    """`divergence` with the plain run's evidence beside it, its kind overruled when the plain run makes the
    same divergence (see the module docstring)."""
    position = int(divergence.position)  # type: ignore[arg-type]  # a token divergence has a position
    plain_token = token_at(plain, position)
    plain_first = first_divergence(reference, plain)
    evidence = dict(divergence.evidence)
    same = is_token_divergence(divergence) and departs_at(reference, plain, position, divergence.engine_token)
    if same:
        shown = "ends" if plain_token is None else f"makes token {plain_token}"
        evidence.update(band_kind=divergence.kind, band_reason=evidence.get("reason"), reason=(
            f"the plain engine (no speculation) also diverges first here and {shown} at position {position}, as the "
            "speculative run does: the engine's precision, not speculation or batching"), decided_by="plain-control")
        # a cause named for a structural ruling no longer applies
        return replace(divergence, plain_token=plain_token, plain_first_divergence=plain_first, evidence=evidence,
                       kind="numerical", decided_by="plain-control", diagnosis=ABSENT)
    where = ("equals the reference" if plain_first is None
             else f"diverges first at position {plain_first}")
    evidence["plain_engine"] = (f"the plain engine makes {'no token' if plain_token is None else f'token {plain_token}'} "
                                f"at position {position} and {where}: this divergence is the speculative run's own")
    return replace(divergence, plain_token=plain_token, plain_first_divergence=plain_first, evidence=evidence)


REFERENCE_MISMATCH = "reference_mismatch"


def rule_processed(divergence: Divergence, reference: list[int], plain: list[int], forbidden: bool) -> Divergence:
    """`rule` for a run under request parameters (see the module docstring): a divergence the plain run
    makes identically is `reference_mismatch` where the reference's grammar `forbidden` the engine's token
    there, else ruled by `rule`."""
    if not is_token_divergence(divergence) or divergence.position is None:
        return divergence
    band_kind = divergence.kind
    ruled = rule(divergence, reference, plain)
    if ruled.decided_by != "plain-control" or not forbidden:
        return ruled
    ruled = replace(ruled, evidence={**ruled.evidence, "band_kind": band_kind})
    return _mismatch(ruled, "the plain engine (no speculation) makes the same divergence, to a token (or an ending) "
                            "the reference's grammar forbids there: the server's grammar admits it (another grammar "
                            "engine or other options than the reference's), with or without speculation")


def rule_violation(finding: Divergence, output: list[int], plain: list[int]) -> Divergence:
    """A constraint violation read from the engine's output, made identically by the plain engine: the
    server's grammar accepts what the reference's does not (a reference mismatch)."""
    if output != plain:
        return finding
    return _mismatch(finding, "the plain engine (no speculation) returns the same tokens: the server's grammar accepts "
                              "what the reference's rejects, with or without speculation")


def _mismatch(divergence: Divergence, reason: str) -> Divergence:
    evidence = dict(divergence.evidence)
    evidence.setdefault("band_kind", divergence.kind)
    evidence.update(reason=reason, decided_by="plain-control")
    # not the engine's: no cause of its own is named
    return replace(divergence, evidence=evidence, kind=REFERENCE_MISMATCH, decided_by="plain-control",
                   diagnosis=ABSENT)


def summary(name: str, reference_outputs: list[list[int]], plain_outputs: list[list[int]] | None,
            outputs: list[list[int]], divergences: list[Divergence], description: Any = None,
            speculation: dict[str, Any] | None = None, error: str | None = None) -> dict[str, Any]:
    """The run's `plain_engine` record: how the plain run compares with the reference and with the
    speculative run."""
    record: dict[str, Any] = {"engine": name, "error": error, "description": description,
                              "speculation": speculation}
    if plain_outputs is None:
        return record
    plain_first = [first_divergence(r, p) for r, p in zip(reference_outputs, plain_outputs)]
    spec_first = [first_divergence(r, o) for r, o in zip(reference_outputs, outputs)]
    diverging = [i for i, first in enumerate(spec_first) if first is not None]
    same = [i for i in diverging
            if departs_at(reference_outputs[i], plain_outputs[i], spec_first[i], token_at(outputs[i], spec_first[i]))]
    record.update({
        "exact_matches": sum(first is None for first in plain_first),
        "num_prompts": len(plain_outputs),
        "speculative_divergences": len(diverging),
        "same_as_plain": len(same),
        "ruled_numerical_by_plain": sum(d.decided_by == "plain-control" and d.kind == "numerical"
                                        for d in divergences),
        "reference_mismatches": sum(d.kind == REFERENCE_MISMATCH for d in divergences),
        "outputs": plain_outputs,
    })
    return record
