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

from typing import Any

from specaudit.equivalence.rulings.outputs import departs_at, first_divergence, token_at


def is_token_divergence(divergence: dict[str, Any]) -> bool:
    """Whether `divergence` is one of tokens (not of logits, nor a finding of a report check)."""
    return divergence.get("detected_by", "tokens") == "tokens"


def rule(divergence: dict[str, Any], reference: list[int], plain: list[int]) -> None:
    """Add the plain run's evidence to one divergence (in place) and overrule its kind when the
    plain run makes the same divergence (see the module docstring)."""
    position = int(divergence["position"])
    plain_token = token_at(plain, position)
    plain_first = first_divergence(reference, plain)
    divergence["plain_token"] = plain_token
    divergence["plain_first_divergence"] = plain_first
    evidence = divergence.setdefault("evidence", {})
    same = is_token_divergence(divergence) and departs_at(reference, plain, position, divergence.get("engine_token"))
    if same:
        evidence["band_kind"] = divergence["kind"]
        evidence["band_reason"] = evidence.get("reason")
        shown = "ends" if plain_token is None else f"makes token {plain_token}"
        evidence["reason"] = (f"the plain engine (no speculation) also diverges first here and {shown} at position "
                              f"{position}, as the speculative run does: the engine's precision, not speculation "
                              "or batching")
        divergence["kind"] = "numerical"
        divergence["decided_by"] = evidence["decided_by"] = "plain-control"
        divergence.pop("diagnosis", None)  # a cause named for a structural ruling no longer applies
        return
    where = ("equals the reference" if plain_first is None
             else f"diverges first at position {plain_first}")
    evidence["plain_engine"] = (f"the plain engine makes {'no token' if plain_token is None else f'token {plain_token}'} "
                                f"at position {position} and {where}: this divergence is the speculative run's own")


REFERENCE_MISMATCH = "reference_mismatch"


def rule_processed(divergence: dict[str, Any], reference: list[int], plain: list[int], forbidden: bool) -> None:
    """`rule` for a run under request parameters (see the module docstring): a divergence the plain run
    makes identically is `reference_mismatch` where the reference's grammar `forbidden` the engine's token
    there, else ruled by `rule`."""
    if not is_token_divergence(divergence) or divergence.get("position") is None:
        return
    band_kind = divergence["kind"]
    rule(divergence, reference, plain)
    if divergence.get("decided_by") != "plain-control" or not forbidden:
        return
    divergence["evidence"]["band_kind"] = band_kind
    _mismatch(divergence, "the plain engine (no speculation) makes the same divergence, to a token (or an ending) "
                          "the reference's grammar forbids there: the server's grammar admits it (another grammar "
                          "engine or other options than the reference's), with or without speculation")


def rule_violation(finding: dict[str, Any], output: list[int], plain: list[int]) -> None:
    """A constraint violation read from the engine's output, made identically by the plain engine: the
    server's grammar accepts what the reference's does not (a reference mismatch)."""
    if output != plain:
        return
    _mismatch(finding, "the plain engine (no speculation) returns the same tokens: the server's grammar accepts "
                       "what the reference's rejects, with or without speculation")


def _mismatch(divergence: dict[str, Any], reason: str) -> None:
    evidence = divergence.setdefault("evidence", {})
    evidence.setdefault("band_kind", divergence["kind"])
    evidence["reason"] = reason
    divergence["kind"] = REFERENCE_MISMATCH
    divergence["decided_by"] = evidence["decided_by"] = "plain-control"
    divergence.pop("diagnosis", None)  # not the engine's: no cause of its own is named


def summary(name: str, reference_outputs: list[list[int]], plain_outputs: list[list[int]] | None,
            outputs: list[list[int]], divergences: list[dict[str, Any]], description: Any = None,
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
        "ruled_numerical_by_plain": sum(d.get("decided_by") == "plain-control" and d["kind"] == "numerical"
                                        for d in divergences),
        "reference_mismatches": sum(d["kind"] == REFERENCE_MISMATCH for d in divergences),
        "outputs": plain_outputs,
    })
    return record
