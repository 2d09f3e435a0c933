"""Two recordings of the same prompts, compared token by token (`specaudit diff A.jsonl B.jsonl`).

This is the comparison of a speculative run with a plain run of the same server: no model is
needed. Line i of A is matched with the line of B that has the same prompt ids (in order, for a
prompt that appears more than once); a prompt found in only one of them is reported as missing.

With a target (`--pair P` or `--target PATH`), each prompt where A and B differ is also decoded by
the reference, and each recording's first divergence from it is ruled as the audit rules a
black-box engine (`equivalence/rulings/`): the band declared with `--engine-dtype` /
`--logit-tolerance`, else measured from that recording's own log-probabilities, else the reference
dtype's own noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from specaudit.engines.adapters.recorded import RecordedLine
from specaudit.equivalence.compare import matched_prefix


@dataclass
class PromptDiff:
    index: int  # line index in A (or in B for a prompt only B has)
    prompt_length: int
    position: int | None  # first position where A and B differ; None when equal
    a_token: int | None = None
    b_token: int | None = None
    missing_from: str | None = None  # "A" or "B" when the prompt is in only one recording
    rulings: dict[str, Any] = field(default_factory=dict)  # "A"/"B" -> ruling against the reference


def pair_lines(a: list[RecordedLine], b: list[RecordedLine]) -> tuple[list[tuple[int, RecordedLine, RecordedLine]],
                                                                   list[PromptDiff]]:
    """(A's index, A's line, B's line) for every prompt in both; a PromptDiff for each one-sided prompt."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, line in enumerate(b):
        by_prompt.setdefault(tuple(line.prompt_ids), []).append(index)
    matched, missing = [], []
    for index, line in enumerate(a):
        queue = by_prompt.get(tuple(line.prompt_ids))
        if queue:
            matched.append((index, line, b[queue.pop(0)]))
        else:
            missing.append(PromptDiff(index, len(line.prompt_ids), 0, missing_from="B"))
    for key, queue in by_prompt.items():
        for index in queue:
            missing.append(PromptDiff(index, len(key), 0, missing_from="A"))
    return matched, missing


def diff_recordings(a: list[RecordedLine], b: list[RecordedLine]) -> tuple[list[PromptDiff], int]:
    """Every prompt's comparison (equal ones included) and the number of prompts compared."""
    matched, missing = pair_lines(a, b)
    diffs = []
    for index, line_a, line_b in matched:
        out_a, out_b = line_a.output_ids, line_b.output_ids
        if out_a == out_b:
            diffs.append(PromptDiff(index, len(line_a.prompt_ids), None))
            continue
        position = matched_prefix(out_a, out_b)
        diffs.append(PromptDiff(index, len(line_a.prompt_ids), position,
                                out_a[position] if position < len(out_a) else None,
                                out_b[position] if position < len(out_b) else None))
    return diffs + missing, len(matched)


def rule_against_reference(diffs: list[PromptDiff], a: list[RecordedLine], b: list[RecordedLine], target: Any,
                           dtype: str, max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                           engine_dtype: str | None = None, logit_tolerance: float | None = None) -> dict[str, Any]:
    """Decode each differing prompt with the reference and rule each recording's first divergence
    from it. Returns the bands used, per recording."""
    from specaudit.engines.models.zoo import float64_copy
    from specaudit.engines.reference import ReferenceDecoder
    from specaudit.equivalence.rulings import Ruler, band_evidence, noise_band

    differing = [d for d in diffs if d.position is not None and d.missing_from is None]
    matched = {index: (line_a, line_b) for index, line_a, line_b in pair_lines(a, b)[0]}
    if not differing:
        return {}
    prompts = [matched[d.index][0].prompt_ids for d in differing]
    decoder = ReferenceDecoder(target, record_logits=True)
    reference_outputs = decoder.generate(prompts, max_new_tokens, eos_token_id)
    reference_logits = decoder.last_trace.logits
    exact = target if dtype == "float64" else float64_copy(target)  # the oracle that rules each side's flip
    bands = {}
    for side, pick in (("A", 0), ("B", 1)):
        lines = [matched[d.index][pick] for d in differing]
        outputs = [line.output_ids for line in lines]
        logprobs = [line.logprobs for line in lines]
        band = noise_band(dtype, engine_dtype, logit_tolerance, logprobs if any(logprobs) else None,
                                   outputs, reference_outputs, reference_logits)
        bands[side] = band.to_dict()
        ruler = Ruler(dtype, target, exact, band)
        for d, output, per_token, ref_out, logits in zip(differing, outputs, logprobs, reference_outputs,
                                                         reference_logits):
            if output == ref_out:
                d.rulings[side] = {"kind": None, "reason": "agrees with the reference"}
                continue
            position = matched_prefix(ref_out, output)
            ref_token = ref_out[position] if position < len(ref_out) else None
            eng_token = output[position] if position < len(output) else None
            entry = per_token[position] if per_token and position < len(per_token) else None
            prompt = matched[d.index][pick].prompt_ids
            kind, evidence = ruler.rule(prompt, ref_out, output, position)
            evidence.update(band_evidence(band, evidence, eng_token, ref_token, entry))
            d.rulings[side] = {"kind": kind, "position": position, "reference_token": ref_token,
                               "engine_token": eng_token, "evidence": evidence, "reason": evidence["reason"]}
    return bands
