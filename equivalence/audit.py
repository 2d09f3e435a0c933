"""Audit one engine on one pair: run it, compare with the reference, attribute each divergence.

`audit_engine` returns one run record of `audit.json` (see DESIGN.md): counts, the largest logit
error, per-prompt comparisons and a list of divergences, each with its kind and evidence.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
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
from specaudit.equivalence.blackbox import requests_run
from specaudit.equivalence.diagnosis.core import PROVENANCE, Diagnoser, note_shared_mechanisms
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.diagnosis.observe import INPUT_CLASSES, watch_for
from specaudit.equivalence.acceptance.run import acceptance_of_run, load_baseline
from specaudit.equivalence.draft_fidelity import draft_divergence, first_draft_mismatches
from specaudit.equivalence.isolate import Isolation, failure_finding, isolatable, isolate_failures
from specaudit.equivalence.compare import compare_tokens, logit_error, replay_logits
from specaudit.equivalence.rulings.thresholds import LOGIT_TOLERANCE
from specaudit.equivalence.rulings import DraftPrecision, Ruler, departure_floor
from specaudit.equivalence.records import ABSENT, Diagnosis, Divergence
from specaudit.equivalence.records.serialize import divergence_to_json
from specaudit.equivalence.rulings.record import PromptOutputs
from specaudit.equivalence.run_context import Reruns, RunContext
from specaudit.equivalence.run_record import equivalent, run_record
from specaudit.engines.contract import capability, declares


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
    if trace is None:
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


@dataclass(frozen=True)
class RunSettings:
    """What one run of one engine is audited under: the audit's settings (equivalence/pipeline/settings.py) as
    they apply to this run, and the run's own engine name, batch size and dtype."""

    max_new_tokens: int
    eos_token_id: Any  # one id, several (any ends a row) or None
    dtype: str
    engine_name: str = "engine"
    batch_size: int | None = None
    device: str | None = None  # None: the target's device
    # a black-box engine's declared noise band (equivalence/rulings/band.py); neither: measured
    engine_dtype: str | None = None
    logit_tolerance: float | None = None
    pad_token_id: int | None = None  # the pad id declared to the engines (None: the pair's own)
    draft_tokens: int | None = None  # k (None: the trace's)
    diagnosis: str = "full"  # "full", "quick" or "off"
    diagnosis_budget: float | None = None  # seconds after which the diagnosis starts no more re-runs
    # acceptance (equivalence/acceptance/run.py): the stated proposer, an earlier audit.json, the gate's ratio
    speculation: str | None = None
    acceptance_baseline: str | None = None
    require_acceptance: float | None = None
    payoff_repeats: int = 0  # --payoff N: time the speculative and the plain engine N times each (0: not)
    # one RequestParams per prompt (bad words resolved), handed to the engine and applied by the reference; None:
    # the plain path of every engine (equivalence/blackbox/requests_run.py)
    requests: tuple[Any, ...] | None = None


def audit_engine(
    engine: Any,
    pair: ModelPair,
    prompts: list[list[int]],
    settings: RunSettings,
    *,
    reference: Reference | None = None,
    replay_target: PreTrainedModel | None = None,
    replay_draft: PreTrainedModel | None = None,
    context: RunContext | None = None,
    rerun: Reruns | None = None,
    bundle_dir: Any = None,
) -> dict[str, Any]:
    """Run `engine` on `prompts` and return its run record, in numbered stages: 1. run the engine,
    2. compare and rule, 3. the plain run's three-way rulings, 4. the draft's proposals, 5. the diagnosis,
    6. acceptance per draft position, observed against expected (`equivalence/acceptance/`), 7. the record
    (`equivalence/run_record.py`).

    Every divergence is ruled by `equivalence/rulings/` (one `Ruler` for every dtype; a black-box engine,
    `engine.black_box`: recordings, live servers, with a noise band declared by `settings.engine_dtype` /
    `settings.logit_tolerance` or measured from its log-probabilities). With `bundle_dir`, every divergence is
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
    max_new_tokens, eos_token_id, dtype = settings.max_new_tokens, settings.eos_token_id, settings.dtype
    batch_size, pad_token_id, diagnosis = settings.batch_size, settings.pad_token_id, settings.diagnosis
    requests = list(settings.requests) if settings.requests is not None else None
    if context is None:
        context = RunContext(pair, [list(p) for p in prompts], max_new_tokens, eos_token_id, dtype, batch_size,
                             engine=engine, reruns=rerun,
                             options={} if pad_token_id is None else {"pad_token_id": pad_token_id})
    if requests is not None:  # the reference under each prompt's parameters, the engine handed the same
        requests_run.hand_requests(engine, requests, pair.tokenizer)
        if reference is None:
            reference = requests_run.request_reference(pair, prompts, requests, max_new_tokens, eos_token_id,
                                                       requests_run.penalty_scope(engine))
    if reference is None:
        reference = Reference(pair, prompts, max_new_tokens, eos_token_id)
    if replay_target is None:
        replay_target = pair.target if dtype == "float64" else float64_copy(pair.target)

    # 1. run the engine (the prompts that make it fail found by bisection, without request parameters: a fresh
    #    engine would run without them); an in-process engine's own call is watched: what it fed the target, kept
    #    compactly for the diagnosis (diagnosis/observe.py)
    watch = None
    if diagnosis != "off" and not capability(engine, "black_box"):
        watch = watch_for(pair.target, pad_token_id if pad_token_id is not None else pair.pad_token_id,
                          getattr(pair, "draft", None))
    run = run_engine(engine, prompts, max_new_tokens, eos_token_id, context, watch, isolate=requests is None)
    # 2. compare with the reference and rule each divergence: in float64 every mismatch is a bug; below it,
    #    and for black-box engines in any dtype, precision is measured on the run (rulings/ruler.py); under
    #    request parameters, against the processed logits, a parameter's own class first (blackbox/requests_run.py)
    band, refused = None, {}
    if requests is not None:  # prompts whose parameters the engine refused are not judged
        refused = {int(i): exc for i, exc in capability(engine, "last_refused") or []}
    if capability(engine, "black_box") or requests is not None:
        skipped = run.failed | set(refused)
        logprobs = [lp if i not in skipped else None for i, lp in enumerate(run.logprobs)] if run.logprobs else None
        band = rulings.noise_band(dtype, settings.engine_dtype, settings.logit_tolerance, logprobs, run.outputs,
                                  reference.outputs, reference.logits)
    ruler = Ruler(dtype, pair.target, replay_target, band)
    if requests is None:
        judged = compare_and_rule(run, pair, prompts, reference, ruler, band, dtype, max_new_tokens, eos_token_id)
    else:
        ruled = requests_run.rule_requests(engine, pair, prompts, requests, reference, run.outputs, band,
                                           eos_token_id, run.failed, max_new_tokens)
        judged = Ruled(ruled.prompt_records, ruled.divergences, None)
    # 3. the plain run: a configured plain engine, or the plain control made only when a flip needs it
    plain = context.plain(any(d.structural for d in judged.divergences), band is not None, requests=requests)
    plain_outputs = plain.get("outputs") if plain is not None else None
    if plain_outputs is not None and requests is not None:
        judged.divergences = requests_run.rule_against_plain(judged.divergences, plain_outputs, run.outputs, reference,
                                                             requests, eos_token_id, run.failed | set(refused))
    elif plain_outputs is not None:  # three-way rulings: reference, plain run (the plain control), speculative run
        judged.divergences = [rulings.plain_rule(d, list(judged_against(d, reference.outputs)),
                                                 plain_outputs[d.prompt_index]) for d in judged.divergences]
    # 4. the draft's own proposals against the draft model's choices
    if requests is None:  # under request parameters a constraint masks the proposals
        judged.divergences += draft_findings(run, pair, prompts, judged.divergences, dtype, replay_draft)
    # 5. name the cause of every structural divergence
    diagnosed_at = time.perf_counter()
    diagnoser = None
    if diagnosis != "off" and any(d.structural for d in judged.divergences):
        below = dtype != "float64"
        facts = RunFacts(
            prompts=[list(p) for p in prompts], references=[list(r) for r in reference.outputs], outputs=run.outputs,
            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
            pad_token_id=pad_token_id if pad_token_id is not None else pair.pad_token_id,
            trace=run.trace, engine_logits=list(run.logits), target=pair.target, draft=pair.draft,
            # a fresh engine would run without the request parameters: no re-run under them
            run=context if context.can_rerun and requests is None else None, batch_size=batch_size,
            draft_tokens=settings.draft_tokens or (run.trace.draft_tokens if run.trace is not None else 0),
            ruler=ruler if below else None, replay_target=replay_target if below else None,
            replay_draft=replay_draft if below else None, reference_logits=list(reference.logits),
            logit_paths=[list(r) for r in reference.outputs], mode=diagnosis,
            observe_inputs=not capability(engine, "black_box"), watch=watch if run.isolation is None else None,
            deadline=None if settings.diagnosis_budget is None else time.monotonic() + settings.diagnosis_budget,
            processed=None if requests is None else requests_run.processed_logits(
                prompts, run.outputs, requests, eos_token_id, requests_run.penalty_scope(engine)))
        diagnoser = diagnose(judged, facts)
    diagnosis_seconds = time.perf_counter() - diagnosed_at
    timing = {
        "engine": run.seconds,
        "reference": reference.seconds,  # shared by the runs of one pair and dtype
        "controls": ruler.seconds,  # the rulings' float64 and same-dtype replays
        "plain_control": (plain or {}).get("seconds"),  # shared by the runs of one batch composition
        # the diagnosis's checks and replays: everything it did but re-run the engine
        "replays": (diagnosis_seconds - diagnoser.rerun_seconds - diagnoser.observe_seconds
                    if diagnoser is not None else 0.0),
        "reruns": diagnoser.rerun_seconds if diagnoser is not None else 0.0,
        # the hooks inside the engine's own call (part of "engine"), and reading what they kept or a hooked re-run
        "observation_hooks": watch.hook_seconds if watch is not None else 0.0,
        "observation": diagnoser.observe_seconds if diagnoser is not None else 0.0,
        "diagnosis": diagnosis_seconds,  # replays, re-runs and observation included
        "diagnosis_mode": diagnosis,
    }
    # 6. acceptance: observed per draft position against what the proposer reaches along the outputs
    evidence = speculation.of_run(engine, run.trace)
    acceptance = acceptance_of_run(
        engine, run.trace, evidence, target=replay_target,
        draft=(pair.draft if dtype == "float64" or pair.draft is None
               else replay_draft if replay_draft is not None else float64_copy(pair.draft)),
        prompts=prompts, outputs=run.outputs, failed=run.failed | set(refused), dtype=dtype,
        k=settings.draft_tokens or (run.trace.draft_tokens if run.trace is not None else None),
        spec=settings.speculation, baseline_path=settings.acceptance_baseline,
        baseline=load_baseline(settings.acceptance_baseline) if settings.acceptance_baseline else None,
        required=settings.require_acceptance, engine_name=settings.engine_name, pair_name=pair.name,
        batch_size=batch_size, tokenizer=pair.tokenizer,
        # under request parameters the replay continues with the target's processed choices (acceptance/run.py)
        **({} if requests is None else {
            "requests": requests, "penalty_scope": requests_run.penalty_scope(engine),
            "stop_ids": [sorted(set(eos_ids(eos_token_id)) | set(p.stop_token_ids)) for p in requests]}))
    timing["acceptance"] = acceptance.pop("seconds")
    if settings.payoff_repeats:  # tokens per second against the plain engine, the ratio and its spread
        payoff_started = time.perf_counter()
        acceptance["payoff"] = (
            context.payoff(settings.payoff_repeats)
            if not capability(engine, "black_box") or context.plain_engine else
            {"plain_engine": None, "error": "a server or recording needs --plain-engine beside it"})
        timing["payoff"] = time.perf_counter() - payoff_started
    # 7. the run record, its divergences serialized once (records/serialize.py), each naming its repro bundle
    divergences = judged.divergences
    structural = sum(d.structural for d in divergences)
    describe = capability(engine, "describe")
    description = describe() if callable(describe) else None
    noise_band = band.to_dict() if band is not None else None
    if bundle_dir is not None and divergences:
        from specaudit.equivalence.blackbox.bundles import BundleRun, write_bundles

        divergences = write_bundles(
            bundle_dir, BundleRun(engine=settings.engine_name, pair=pair.name, dtype=dtype,
                                  device=settings.device or str(pair.target.device), batch_size=batch_size,
                                  engine_description=description, noise_band=noise_band),
            divergences, prompts, reference.outputs, run.outputs, run.logprobs, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id)
    written = [divergence_to_json(d) for d in divergences]
    return run_record(
        engine=settings.engine_name, pair=pair.name, batch_size=batch_size, dtype=dtype,
        device=settings.device or str(pair.target.device), num_prompts=len(prompts),
        exact_matches=judged.exact_matches, equivalent=equivalent(written, sorted(run.failed)),
        structural_divergences=structural, numerical_divergences=len(divergences) - structural,
        max_logit_error=judged.worst_error, logit_tolerance=LOGIT_TOLERANCE.get(dtype), seconds=run.seconds,
        tokens_generated=sum(len(o) for o in run.outputs), trace=trace_summary(run.trace),
        prompts=judged.prompts, divergences=written, noise_band=noise_band, speculation=evidence,
        speculation_observed=speculation.observed(evidence), acceptance=acceptance,
        plain_engine=None if plain is None else rulings.plain_summary(
            plain["engine"], reference.outputs, plain_outputs, run.outputs, divergences,
            plain.get("description"), plain.get("speculation"), plain.get("error")),
        engine_description=description,
        failures=run.isolation.failures if run.isolation is not None else [],
        isolation=None if run.isolation is None else {"reruns": run.isolation.reruns, "notes": run.isolation.notes},
        timing=timing,
        **({} if requests is None else requests_run.request_fields(engine, requests, refused, divergences)))


@dataclass
class EngineRun:
    """What one call of the engine gave: its outputs, trace and time, and the prompts that made it fail."""

    outputs: list[list[int]]  # per prompt (a failing prompt's: empty)
    trace: Trace | None
    seconds: float
    isolation: Isolation | None  # the failure findings, when a prompt made the engine fail
    logits: list[torch.Tensor | None]  # per prompt, the engine's logits of its tokens [n, V] (None: not recorded)
    logprobs: list[Any] | None  # a black-box engine's reported log-probabilities, per prompt and position

    @property
    def failed(self) -> set[int]:
        return {f["prompt_index"] for f in self.isolation.failures} if self.isolation is not None else set()


def run_engine(engine: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Any,
               context: RunContext, watch: Any = None, isolate: bool = True) -> EngineRun:
    """Stage 1: the engine's one call on every prompt, inside `watch` when given (the hooks that record what it
    fed the target). When `generate` raises, the prompts that make it fail are found by bisection
    (`equivalence/isolate.py`, `context.run_subset`); a server's requests that errored (`last_failures`) are
    failure findings too."""
    if declares(engine, "record_logits"):
        engine.record_logits = True
    started = time.perf_counter()
    isolation = None
    try:
        with watch if watch is not None else contextlib.nullcontext():
            outputs = engine.generate([list(p) for p in prompts], max_new_tokens, eos_token_id)
        trace = capability(engine, "last_trace")
        if not isinstance(trace, Trace):  # the contract's trace or none: anything else an engine keeps is not read
            trace = None
    except Exception as exc:
        if not isolate or not isolatable(exc) or len(prompts) < 1:
            raise
        isolation = isolate_failures(context.run_subset, len(prompts), exc)
        if not any(out is not None for out in isolation.outputs):
            raise  # every prompt fails: the run failed
        outputs, trace = [out if out is not None else [] for out in isolation.outputs], None
    seconds = time.perf_counter() - started
    if len(outputs) != len(prompts):
        raise ValueError(f"engine returned {len(outputs)} outputs for {len(prompts)} prompts")
    refused = capability(engine, "last_failures") or []  # a server's requests that errored, per prompt
    if refused and isolation is None:
        isolation = Isolation(list(outputs), [failure_finding(int(i), exc) for i, exc in refused], 0)
    logprobs = (capability(engine, "last_logprobs") or None) if capability(engine, "black_box") else None
    return EngineRun([[int(t) for t in o] for o in outputs], trace, seconds, isolation,
                     (trace.logits if trace is not None else None) or [None] * len(prompts), logprobs)


@dataclass
class Ruled:
    """Stage 2's result: each prompt's record (`audit.json` `prompts`) and every divergence, ruled."""

    prompts: list[dict[str, Any]]
    divergences: list[Divergence]
    worst_error: float | None  # the largest logit error over every prompt

    @property
    def exact_matches(self) -> int:
        return sum(1 for p in self.prompts if p.get("exact"))


def compare_and_rule(run: EngineRun, pair: ModelPair, prompts: list[list[int]], reference: Reference, ruler: Ruler,
                     band: Any, dtype: str, max_new_tokens: int, eos_token_id: Any) -> Ruled:
    """Stage 2: each prompt's tokens against the reference, each first difference ruled (`rulings.divergence`);
    past a numerical flip the engine is judged on against a correct decoder continued on its own prefix;
    an exact prompt whose logits stray past the dtype's tolerance is a logit divergence."""
    tolerance = LOGIT_TOLERANCE.get(dtype)
    logprobs = run.logprobs

    def reported(index: int, position: int) -> Any:
        return (logprobs[index][position] if logprobs and logprobs[index] and position < len(logprobs[index])
                else None)

    judged, comparisons = Ruled([], [], None), []
    for index, (prompt, ref_out, eng_out) in enumerate(zip(prompts, reference.outputs, run.outputs)):
        comparison = compare_tokens(index, ref_out, eng_out)
        if index in run.failed:  # a failure finding, not a comparison
            comparison.exact, comparison.first_divergence, comparison.failed = False, None, True
            comparisons.append(comparison)
            continue
        error_so_far, same_dtype = None, None
        if run.logits[index] is not None:
            # replay along the engine's own output, in the audit dtype: what its step should have seen
            replay = replay_logits(pair.target, prompt, eng_out)
            error, where = logit_error(run.logits[index], replay)
            if not comparison.exact:
                upto = comparison.first_divergence + 1
                error_so_far, _ = logit_error(run.logits[index][:upto], replay[:upto])
                if comparison.first_divergence < replay.shape[0]:  # the audit dtype on the common prefix
                    same_dtype = replay[comparison.first_divergence]
            comparison.max_logit_error, comparison.worst_logit_position = error, where
            if error is not None:
                judged.worst_error = error if judged.worst_error is None else max(judged.worst_error, error)
        comparisons.append(comparison)
        if not comparison.exact:
            outputs = PromptOutputs(index, prompt, ref_out, eng_out, reference.logits[index], run.trace, pair.tokenizer)
            record = rulings.divergence(
                outputs, comparison.first_divergence, ruler, logit_error_value=comparison.max_logit_error,
                logit_error_so_far=error_so_far, band=band, engine_entry=reported(index, comparison.first_divergence),
                same_dtype=same_dtype)
            judged.divergences.append(record)
            # past a numerical flip, judge on: a correct decoder continued on the engine's own prefix says
            # what it chooses from there, so a bug that shows after a rounding flip is still seen
            along = None  # [n + 1, V] audit-dtype logits after each prefix of the engine's output
            for _ in range(MAX_CONTINUATIONS):
                if record.kind != "numerical" or record.engine_token is None:
                    break
                if along is None:
                    along = replay_logits(pair.target, prompt, eng_out + [0])
                continued = next_difference(along.argmax(-1).tolist(), eng_out, int(record.position),  # type: ignore[arg-type]
                                            max_new_tokens, eos_token_id)
                if continued is None:
                    break
                position = continued.position
                record = rulings.divergence(
                    PromptOutputs(index, prompt, continued.tokens, eng_out, along, run.trace, pair.tokenizer),
                    position, ruler, logit_error_value=comparison.max_logit_error, band=band,
                    engine_entry=reported(index, position), same_dtype=along[position] if position < along.shape[0] else None)
                # judged against a correct decoder from the engine's prefix after the flip at `continued_after`
                record = replace(record, continued_after=continued.after, continued_reference=tuple(continued.tokens))
                judged.divergences.append(record)
        elif tolerance is not None and comparison.max_logit_error is not None and comparison.max_logit_error > tolerance:
            judged.divergences.append(rulings.divergence(
                PromptOutputs(index, prompt, ref_out, eng_out, reference.logits[index], run.trace, pair.tokenizer),
                comparison.worst_logit_position, ruler, detected_by="logits",
                logit_error_value=comparison.max_logit_error))
    judged.prompts = [c.to_dict() for c in comparisons]
    return judged


def draft_findings(run: EngineRun, pair: ModelPair, prompts: list[list[int]], divergences: list[Divergence],
                   dtype: str, replay_draft: PreTrainedModel | None) -> list[Divergence]:
    """Stage 4: for an engine whose proposals come from the draft model, each row's first proposal the draft
    would not have made (rows that diverged left out); below float64 a proposal within the draft's precision
    of its float64 choice passes."""
    trace = run.trace
    if trace is None or not trace.proposals_from_draft_model or pair.draft is None:
        return []
    diverged = {d.prompt_index for d in divergences}
    draft, accept = pair.draft, None
    if dtype != "float64":  # the float64 draft chooses; a proposal within the precision's reach passes
        draft = replay_draft if replay_draft is not None else float64_copy(pair.draft)
        draft_precision, floors = DraftPrecision(dtype, pair.draft, draft), {}

        def accept(row: int, start: int, choice: int, proposal: int) -> bool:
            sequence = list(prompts[row]) + run.outputs[row]
            if row not in floors:  # how far the draft in this dtype strays from float64 on this row
                floors[row] = departure_floor(pair.draft, draft, sequence)
            return draft_precision.admits(sequence[:start], choice, proposal, floors[row])

    mismatches = first_draft_mismatches(trace, draft, prompts, run.outputs, diverged, accept)
    return [draft_divergence(index, mismatch, trace) for index, mismatch in sorted(mismatches.items())]


def judged_against(divergence: Divergence, references: list[list[int]]) -> tuple[int, ...] | list[int]:
    """The output `divergence` was judged against: a correct decoder's past a numerical flip, else the
    reference's."""
    if divergence.continued_reference is not ABSENT:
        return divergence.continued_reference
    return references[divergence.prompt_index]


def unnamed(divergence: Divergence) -> bool:
    """A structural divergence whose cause no ruling named yet (a request parameter's check names its own)."""
    return divergence.structural and divergence.diagnosis_class in (None, "unknown")


def seen_input(diagnosis: Diagnosis) -> bool:
    """A wrong input the watched run was seen feeding (its provenance named it): the cause, before a class named
    from outputs alone (a processor replay whose token the wrong input chose by chance)."""
    return diagnosis.cls in INPUT_CLASSES and str(diagnosis.named_by or "") == PROVENANCE


def diagnose(judged: Ruled, facts: RunFacts) -> Diagnoser:
    """Stage 5: name the bug of every structural divergence (equivalence/diagnosis/core.py) from the run's `facts`;
    the run context runs a fresh engine for its experiments, and one hooked re-run of it observes what an
    in-process engine fed the target (`facts.observe_inputs`; equivalence/diagnosis/observe.py). Each divergence
    judged past a numerical flip is diagnosed against the reference it was judged by, decoded on to the end of the
    budget. A class a request parameter's check named from outputs stands unless the watched run shows a wrong
    input behind the token (`seen_input`). `judged.divergences` become the diagnosed ones."""
    diagnoser = Diagnoser(facts)
    originals = diagnoser.references
    diagnosed: list[Divergence] = []
    for divergence in judged.divergences:
        named = divergence.structural and not unnamed(divergence)
        if not unnamed(divergence) and not (named and facts.watch is not None):
            diagnosed.append(divergence)
            continue
        index = divergence.prompt_index
        if divergence.continued_reference is not ABSENT:
            head = list(divergence.continued_reference)
            left = facts.max_new_tokens - len(head)
            whole = head if left <= 0 or not head or head[-1] in eos_ids(facts.eos_token_id) else head + greedy_decode(
                facts.target, list(facts.prompts[index]) + head, left, facts.eos_token_id)[0]
            diagnoser.references = [whole if i == index else r for i, r in enumerate(originals)]
        found = diagnoser.diagnose(divergence)
        if not named:
            divergence = replace(divergence, diagnosis=found)
        elif seen_input(found):  # the output check's class was a symptom of the input seen
            earlier = divergence.diagnosis
            assert earlier  # named
            found = replace(found, tried=(f"{earlier.named_by or None}: {earlier.evidence}", *found.tried))
            divergence = replace(divergence, diagnosis=found)
        diagnosed.append(divergence)
        diagnoser.references = originals
    judged.divergences = note_shared_mechanisms(diagnosed)
    return diagnoser
