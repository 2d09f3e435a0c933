"""Audit one engine on one pair: run it, compare with the reference, attribute each divergence.

`audit_engine` returns one run record of `audit.json` (see DESIGN.md): counts, the largest logit
error, per-prompt comparisons and a list of divergences, each with its kind and evidence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines import reference_memo
from specaudit.engines.limits import eos_ids
from specaudit.engines.reference import ReferenceDecoder, greedy_decode
from specaudit.engines.trace import Trace
from specaudit.engines.models.zoo import ModelPair, float64_copy
from specaudit.equivalence import rulings, speculation
from specaudit.equivalence.diagnosis.core import Diagnoser, note_shared_mechanisms
from specaudit.equivalence.draft_fidelity import DraftPrecision, departure_floor, draft_divergence, first_draft_mismatches
from specaudit.equivalence.isolate import Isolation, failure_finding, isolatable, isolate_failures
from specaudit.equivalence.compare import LOGIT_TOLERANCE, compare_tokens, logit_error, replay_logits
from specaudit.equivalence.rulings import Ruler
from specaudit.equivalence.run_context import Reruns, RunContext


class Reference:
    """Reference outputs and logits for one (pair, dtype, prompts, max_new_tokens, eos), computed once (and kept
    where `SPECAUDIT_REFERENCE_MEMO` names a folder: engines/reference_memo.py)."""

    def __init__(self, pair: ModelPair, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> None:
        started = time.perf_counter()
        kept = kept_reference_path(pair, prompts, max_new_tokens, eos_token_id)
        run = reference_memo.read_run(kept, pair.target.device)
        self.kept = run is not None  # read back, not decoded here
        if run is None:
            decoder = ReferenceDecoder(pair.target, record_logits=True)  # the oracle: plain greedy decoding
            run = (decoder.generate(prompts, max_new_tokens, eos_token_id), decoder.last_trace.logits)
            reference_memo.keep_run(kept, run)
        self.outputs: list[list[int]] = run[0]
        self.logits: list[torch.Tensor | None] = run[1]
        self.seconds = time.perf_counter() - started  # shared by every run of the pair and dtype


def kept_reference_path(pair: ModelPair, prompts: list[list[int]], max_new_tokens: int | list[int],
                        eos_token_id: Any) -> Path | None:
    """Where the reference memo keeps this reference (None: no memo)."""
    folder = reference_memo.memo_folder()
    if folder is None:
        return None
    target = pair.target
    request = reference_memo.request_digest(prompts, max_new_tokens, eos_ids(eos_token_id), target.device)
    return reference_memo.run_path(folder, f"audit-{pair.name}", target, request, reference_memo.environment_key(target))


def accepted_histogram(trace: Trace | None) -> list[int] | None:
    if trace is None or not trace.draft_tokens:
        return None
    counts = [0] * (trace.draft_tokens + 1)
    for step in trace.steps:
        if step.kind == "prefill":
            continue
        for accepted in step.accepted_counts:
            counts[min(accepted, trace.draft_tokens)] += 1
    return counts


def trace_summary(trace: Trace | None) -> dict[str, Any] | None:
    if trace is None or not hasattr(trace, "totals"):
        return None
    summary = trace.totals()
    summary["accepted_histogram"] = accepted_histogram(trace)
    return summary


MAX_CONTINUATIONS = 16  # numerical flips judged past, per prompt


@dataclass
class Continuation:
    """The reference continued on the engine's own prefix after a numerical flip: what a correct decoder
    in the audit dtype chooses after each of the engine's prefixes, up to the engine's next difference."""

    after: int  # the position of the numerical flip judged past
    position: int  # the engine's next difference from a correct decoder on its own prefix
    tokens: list[int]  # the engine's tokens before `position`, then the correct choice there (none: it stops)


def next_difference(choices: list[int], engine_out: list[int], after: int, max_new_tokens: int,
                    eos_token_id: Any) -> Continuation | None:
    """The first position past `after` where the engine leaves what a correct decoder does on the engine's
    own prefix: `choices[j]` is the audit-dtype target's choice after `engine_out[:j]` (one uncached pass
    along the engine's output, one row more than the output). A correct decoder stops after an EOS and at
    `max_new_tokens`; None when the engine agrees to its end."""
    stops = set(eos_ids(eos_token_id))
    for j in range(after + 1, len(engine_out) + 1):
        if engine_out[j - 1] in stops or j >= max_new_tokens:  # a correct decoder ends here
            return None if j == len(engine_out) else Continuation(after, j, list(engine_out[:j]))
        if j == len(engine_out):  # the engine ends where a correct decoder goes on
            return Continuation(after, j, list(engine_out[:j]) + [choices[j]])
        if choices[j] != engine_out[j]:
            return Continuation(after, j, list(engine_out[:j]) + [choices[j]])
    return None


def audit_engine(
    engine: Any,
    pair: ModelPair,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    dtype: str,
    reference: Reference | None = None,
    replay_target: PreTrainedModel | None = None,
    engine_name: str = "engine",
    batch_size: int | None = None,
    device: str | None = None,
    engine_dtype: str | None = None,
    logit_tolerance: float | None = None,
    bundle_dir: Any = None,
    context: RunContext | None = None,
    rerun: Reruns | None = None,
    pad_token_id: int | None = None,
    draft_tokens: int | None = None,
    diagnosis: str = "full",
    diagnosis_budget: float | None = None,
    replay_draft: PreTrainedModel | None = None,
) -> dict[str, Any]:
    """Run `engine` on `prompts` and return its run record.

    Every divergence is ruled by `equivalence/rulings/` (one `Ruler` for every dtype; a black-box engine,
    `engine.black_box`: recordings, live servers, with a noise band declared by `engine_dtype` /
    `logit_tolerance` or measured from its log-probabilities). With `bundle_dir`, every divergence is
    also written there as a self-contained repro bundle (`equivalence/blackbox/bundles.py`).

    `context` (`equivalence/run_context.py`) runs the engine again for the crash isolation and the
    diagnosis and makes the plain run of the three-way rulings: the configured plain engine, or below
    float64, for an in-process engine with a `batch_size`, the plain control (`batched`) when a flip
    needs it. Without one, the audited engine object itself is run again, or `rerun(indices,
    pad_token_id)` gives the diagnosis fresh engines.

    `replay_target` is the target in float64 (for the near-tie replay); in a float64 audit the
    pair's own target serves. `reference` may be shared between engines of the same pair/dtype.

    When `generate` raises, the prompts that make it fail are found by bisection
    (`equivalence/isolate.py`) with `context.run_subset(indices)`: each is a failure finding in `failures`, and every other prompt is judged as usual.

    `diagnosis`: "full" (checks, replays and re-runs of the engine), "quick" (no re-runs: a class
    the checks and replays decide, else `unknown` with what a re-run would have tried) or "off" (none:
    a search for failing cases that only needs the rulings); `replay_draft`: the draft in float64, for
    the draft check below float64 (default: a float64 copy of the pair's draft);
    `diagnosis_budget`: seconds after which the diagnosis starts no more re-runs. The run's `timing`
    says how its time split between the engine, the shared reference, the precision controls, the
    diagnosis's replays and its re-runs.
    """
    if context is None:
        context = RunContext(pair, [list(p) for p in prompts], max_new_tokens, eos_token_id, dtype, batch_size,
                             engine=engine, reruns=rerun,
                             options={} if pad_token_id is None else {"pad_token_id": pad_token_id})
    if reference is None:
        reference = Reference(pair, prompts, max_new_tokens, eos_token_id)
    if replay_target is None:
        replay_target = pair.target if dtype == "float64" else float64_copy(pair.target)
    if hasattr(engine, "record_logits"):
        engine.record_logits = True
    started = time.perf_counter()
    isolation = None
    try:
        outputs = engine.generate([list(p) for p in prompts], max_new_tokens, eos_token_id)
        trace = getattr(engine, "last_trace", None)
    except Exception as exc:
        if not isolatable(exc) or len(prompts) < 1:
            raise
        isolation = isolate_failures(context.run_subset, len(prompts), exc)
        if not any(out is not None for out in isolation.outputs):
            raise  # every prompt fails: the run failed
        outputs, trace = [out if out is not None else [] for out in isolation.outputs], None
    seconds = time.perf_counter() - started
    if len(outputs) != len(prompts):
        raise ValueError(f"engine returned {len(outputs)} outputs for {len(prompts)} prompts")
    refused = getattr(engine, "last_failures", None) or []  # a server's requests that errored, per prompt
    if refused and isolation is None:
        isolation = Isolation(list(outputs), [failure_finding(int(i), exc) for i, exc in refused], 0)
    failed = {f["prompt_index"] for f in isolation.failures} if isolation is not None else set()
    engine_logits = getattr(trace, "logits", None) or [None] * len(prompts)
    tolerance = LOGIT_TOLERANCE.get(dtype)
    band, engine_logprobs = None, None
    if getattr(engine, "black_box", False):
        engine_logprobs = getattr(engine, "last_logprobs", None) or None
        band = rulings.noise_band(dtype, engine_dtype, logit_tolerance, engine_logprobs,
                                   [[int(t) for t in o] for o in outputs], reference.outputs, reference.logits)
    # in float64 every mismatch is a bug; below it, and for black-box engines in any dtype, precision is
    # measured on the run (rulings/ruler.py)
    ruler = Ruler(dtype, pair.target, replay_target, band)

    comparisons, divergences = [], []
    continued_references: dict[int, list[int]] = {}  # id(divergence) -> the reference it was judged against
    worst_error: float | None = None
    for index, (prompt, ref_out, eng_out) in enumerate(zip(prompts, reference.outputs, outputs)):
        eng_out = [int(t) for t in eng_out]
        comparison = compare_tokens(index, ref_out, eng_out)
        if index in failed:  # a failure finding, not a comparison
            comparison.exact, comparison.first_divergence, comparison.failed = False, None, True
            comparisons.append(comparison)
            continue
        error_so_far, same_dtype, replay = None, None, None
        if engine_logits[index] is not None:
            # replay along the engine's own output, in the audit dtype: what its step should have seen
            replay = replay_logits(pair.target, prompt, eng_out)
            error, where = logit_error(engine_logits[index], replay)
            if not comparison.exact:
                upto = comparison.first_divergence + 1
                error_so_far, _ = logit_error(engine_logits[index][:upto], replay[:upto])
                if comparison.first_divergence < replay.shape[0]:  # the audit dtype on the common prefix
                    same_dtype = replay[comparison.first_divergence]
            comparison.max_logit_error, comparison.worst_logit_position = error, where
            if error is not None:
                worst_error = error if worst_error is None else max(worst_error, error)
        comparisons.append(comparison)
        if not comparison.exact:
            entry = None
            if engine_logprobs and engine_logprobs[index] and comparison.first_divergence < len(engine_logprobs[index]):
                entry = engine_logprobs[index][comparison.first_divergence]
            record = rulings.divergence(
                index, comparison.first_divergence, ref_out, eng_out, reference.logits[index], trace, dtype, ruler,
                prompt, pair.tokenizer, "tokens", comparison.max_logit_error, error_so_far, band, entry, same_dtype)
            divergences.append(record)
            # past a numerical flip, judge on: a correct decoder continued on the engine's own prefix says
            # what it chooses from there, so a bug that shows after a rounding flip is still seen
            along = None  # [n + 1, V] audit-dtype logits after each prefix of the engine's output
            for _ in range(MAX_CONTINUATIONS):
                if record["kind"] != "numerical" or record["engine_token"] is None:
                    break
                if along is None:
                    along = replay_logits(pair.target, prompt, eng_out + [0])
                continued = next_difference(along.argmax(-1).tolist(), eng_out, int(record["position"]),
                                            max_new_tokens, eos_token_id)
                if continued is None:
                    break
                position = continued.position
                entry = (engine_logprobs[index][position] if engine_logprobs and engine_logprobs[index]
                         and position < len(engine_logprobs[index]) else None)
                record = rulings.divergence(
                    index, position, continued.tokens, eng_out, along, trace, dtype, ruler, prompt, pair.tokenizer,
                    "tokens", comparison.max_logit_error, None, band, entry,
                    along[position] if position < along.shape[0] else None)
                record["continued_after"] = continued.after  # judged against a correct decoder from that prefix
                continued_references[id(record)] = continued.tokens
                divergences.append(record)
        elif tolerance is not None and comparison.max_logit_error is not None and comparison.max_logit_error > tolerance:
            divergences.append(rulings.divergence(
                index, comparison.worst_logit_position, ref_out, eng_out, reference.logits[index], trace, dtype,
                ruler, prompt, pair.tokenizer, "logits", comparison.max_logit_error))

    # the plain run: a configured plain engine, or the plain control made only when a flip needs it
    plain = context.plain(any(d["kind"] == "structural" for d in divergences), band is not None)
    plain_outputs = plain.get("outputs") if plain is not None else None
    if plain_outputs is not None:  # three-way rulings: reference, plain run (the plain control), speculative run
        for divergence in divergences:
            index = divergence["prompt_index"]
            judged_against = continued_references.get(id(divergence), reference.outputs[index])
            rulings.plain_rule(divergence, judged_against, plain_outputs[index])

    if (trace is not None and getattr(trace, "proposals_from_draft_model", False)
            and getattr(pair, "draft", None) is not None):
        diverged = {d["prompt_index"] for d in divergences}
        draft, accept = pair.draft, None
        if dtype != "float64":  # the float64 draft chooses; a proposal within the precision's reach passes
            draft = replay_draft if replay_draft is not None else float64_copy(pair.draft)
            draft_precision, floors = DraftPrecision(dtype, pair.draft, draft), {}

            def accept(row: int, start: int, choice: int, proposal: int) -> bool:
                sequence = list(prompts[row]) + [int(t) for t in outputs[row]]
                if row not in floors:  # how far the draft in this dtype strays from float64 on this row
                    floors[row] = departure_floor(pair.draft, draft, sequence)
                return draft_precision.admits(sequence[:start], choice, proposal, floors[row])

        for index, mismatch in sorted(first_draft_mismatches(trace, draft, prompts, outputs, diverged, accept).items()):
            divergences.append(draft_divergence(index, mismatch, trace))

    diagnosed_at = time.perf_counter()
    diagnoser = None
    if diagnosis != "off" and any(d["kind"] == "structural" for d in divergences):
        # name the bug of every structural divergence (equivalence/diagnosis/core.py); the run context
        # runs a fresh engine for its experiments
        diagnoser = Diagnoser(
            prompts=[list(p) for p in prompts], references=[list(r) for r in reference.outputs],
            outputs=[[int(t) for t in o] for o in outputs], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
            pad_token_id=pad_token_id if pad_token_id is not None else getattr(pair, "pad_token_id", None),
            trace=trace, engine_logits=list(engine_logits), target=pair.target, draft=getattr(pair, "draft", None),
            run=context if context.can_rerun else None,
            batch_size=batch_size, draft_tokens=draft_tokens or getattr(trace, "draft_tokens", 0) or 0,
            ruler=ruler if dtype != "float64" else None,
            replay_target=replay_target if dtype != "float64" else None,
            replay_draft=replay_draft if dtype != "float64" else None,
            reference_logits=list(reference.logits), logit_paths=[list(r) for r in reference.outputs], mode=diagnosis,
            observe_inputs=not getattr(engine, "black_box", False),
            deadline=None if diagnosis_budget is None else time.monotonic() + diagnosis_budget)
        originals = diagnoser.references
        for divergence in divergences:
            if divergence["kind"] == "structural":
                index = divergence["prompt_index"]
                if id(divergence) in continued_references:  # diagnosed against the reference it was judged by,
                    head = continued_references[id(divergence)]  # decoded on to the end of the budget
                    left = max_new_tokens - len(head)
                    whole = head if left <= 0 or not head or head[-1] in eos_ids(eos_token_id) else head + greedy_decode(
                        pair.target, list(prompts[index]) + head, left, eos_token_id)[0]
                    diagnoser.references = [whole if i == index else r for i, r in enumerate(originals)]
                divergence["diagnosis"] = diagnoser.diagnose(divergence)
                diagnoser.references = originals
        note_shared_mechanisms(divergences)
    diagnosis_seconds = time.perf_counter() - diagnosed_at
    timing = {
        "engine": seconds,
        "reference": getattr(reference, "seconds", None),  # shared by the runs of one pair and dtype
        "controls": ruler.seconds,  # the rulings' float64 and same-dtype replays
        "plain_control": (plain or {}).get("seconds"),  # shared by the runs of one batch composition
        # the diagnosis's checks and replays: everything it did but re-run the engine
        "replays": (diagnosis_seconds - diagnoser.rerun_seconds - diagnoser.observe_seconds
                    if diagnoser is not None else 0.0),
        "reruns": diagnoser.rerun_seconds if diagnoser is not None else 0.0,
        "observation": diagnoser.observe_seconds if diagnoser is not None else 0.0,  # the hooked re-runs
        "diagnosis": diagnosis_seconds,  # replays, re-runs and observation included
        "diagnosis_mode": diagnosis,
    }

    structural = sum(d["kind"] == "structural" for d in divergences)
    describe = getattr(engine, "describe", None)
    evidence = speculation.of_run(engine, trace)
    run_record = {
        "engine": engine_name,
        "pair": pair.name,
        "batch_size": batch_size,
        "dtype": dtype,
        "device": device or str(pair.target.device),
        "num_prompts": len(prompts),
        "exact_matches": sum(c.exact for c in comparisons),
        "equivalent": structural == 0 and not failed,
        "structural_divergences": structural,
        "numerical_divergences": len(divergences) - structural,
        "max_logit_error": worst_error,
        "logit_tolerance": tolerance,
        "seconds": seconds,
        "tokens_generated": sum(len(o) for o in outputs),
        "error": None,
        "trace": trace_summary(trace),
        "prompts": [c.to_dict() for c in comparisons],
        "divergences": divergences,
        "noise_band": band.to_dict() if band is not None else None,
        "speculation": evidence,
        "speculation_observed": speculation.observed(evidence),
        "plain_engine": None if plain is None else rulings.plain_summary(
            plain["engine"], reference.outputs, plain_outputs, [[int(t) for t in o] for o in outputs], divergences,
            plain.get("description"), plain.get("speculation"), plain.get("error")),
        "engine_description": describe() if callable(describe) else None,
        "failures": isolation.failures if isolation is not None else [],
        "isolation": None if isolation is None else {"reruns": isolation.reruns, "notes": isolation.notes},
        "timing": timing,
    }
    if bundle_dir is not None and divergences:
        from specaudit.equivalence.blackbox.bundles import write_bundles

        write_bundles(bundle_dir, run_record, prompts, reference.outputs, outputs, engine_logprobs,
                      max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    return run_record
