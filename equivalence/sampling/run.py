"""One sampled audit: draw `samples` outputs from an engine (or read them from a recording), test them
against the target by teacher forcing (`audit`), and, for an in-process engine, check the seed's
promises: the same seed gives the same tokens, and a seeded request gives the same tokens alone as
inside a batch (randomness leaking across rows breaks it).

`guarded_sampled_audit` runs the engine behind the greedy audit's guard (`equivalence/guard.py`): a
time limit on each `generate` call, and one output per request, each a list of integer ids in the
vocabulary; then no output past the budget or past an EOS id (`check_budget`, which the greedy audit's
comparison does there). An engine that breaks any of these, or raises, gives a failed run
(`failed_report`: a one-line `error` and the traceback), never an exception out of the audit."""

from __future__ import annotations

import inspect
import time
import traceback
from typing import Any, Callable

import torch

from specaudit.engines.sampling.engine import request_seeds
from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.acceptance import counters
from specaudit.equivalence.acceptance.sampled import (BELOW_FLOAT64, VerifyStep, observed_of, overlaps,
                                                      sampled_record, verify_steps)
from specaudit.equivalence.errors import one_line
from specaudit.equivalence.guard import GuardedEngine, failure_message, out_of_memory, unguarded
from specaudit.equivalence.reports.sampled import PASS
from specaudit.equivalence.rulings.thresholds import ALPHA
from specaudit.equivalence.run_record import SAMPLED, run_record
from specaudit.equivalence.sampling.audit import audit_samples
from specaudit.equivalence.sampling.teacher import Sample
from specaudit.engines.contract import capability, declares

def spread(prompts: list[list[int]], samples: int) -> list[list[int]]:
    """`samples` requests over the prompts, as evenly as possible, in prompt order."""
    return [prompts[i % len(prompts)] for i in range(samples)]


def check_budget(outputs: list[list[int]], max_new_tokens: int, eos_token_id: Any, *, recording: bool = False) -> None:
    """`EngineFailure` for an output past `max_new_tokens` or with tokens after an EOS id: the greedy audit
    judges these as divergences, but the sampled tests would take them for samples of the target."""
    from specaudit.engines.limits import eos_ids
    from specaudit.equivalence.errors import EngineFailure

    stops = set(eos_ids(eos_token_id))
    for index, tokens in enumerate(outputs):
        if len(tokens) > max_new_tokens:
            fix = f": pass --max-new-tokens {max(len(t) for t in outputs)}" if recording else ""
            raise EngineFailure(f"output {index} has {len(tokens)} tokens, more than max_new_tokens "
                                f"{max_new_tokens}{fix}")
        ended = next((position for position, token in enumerate(tokens[:-1]) if token in stops), None)
        if ended is not None:
            raise EngineFailure(f"output {index} goes on after EOS {tokens[ended]} at position {ended}; the contract "
                                "is to stop at the first EOS")


def _ask(engine: Any, params: list[Any] | None) -> None:
    """Set the request parameters of the engine's next `generate` (one per prompt), where the run has any."""
    if params is not None:
        unguarded(engine).request_params = list(params)


def draw(engine: Any, requests: list[list[int]], max_new_tokens: int, eos_token_id: Any, *, seed: int,
         chunk: int | None = None, progress: Any = None, params: list[Any] | None = None,
         verify_log: list[VerifyStep] | None = None) -> tuple[list[list[int]], list[list[int]] | None, Any]:
    """The engine's outputs for `requests`, each token's step offset (or None) and its speculation counters
    (or None). With `chunk`, an engine that takes per-request seeds and keeps no counters of its own
    (`last_speculation`, which a later call would replace) is called `chunk` requests at a time with the
    seeds it would give them itself in one call (`request_seeds(seed, n)`), so its tokens are the same
    (the seed check tests that promise) and `progress` (anything with `update(n)`, e.g. a tqdm bar) moves
    after each chunk; any other engine is called once. `params`: one `RequestParams` per request, set as the
    engine's `request_params` before each call (its slice for a chunk). `verify_log`: where given, each call's
    verify steps from the engine's trace are appended to it (equivalence/acceptance/sampled.py), numbered by
    request in the draw."""
    base = unguarded(engine)
    whole = (chunk is None or chunk >= len(requests) or declares(base, "last_speculation")
             or "seeds" not in inspect.signature(base.generate).parameters)
    if whole:
        _ask(engine, params)
        outputs = engine.generate(requests, max_new_tokens, eos_token_id)
        if verify_log is not None:
            verify_log += verify_steps(capability(base, "last_trace"))
        if progress is not None:
            progress.update(len(requests))
        # the draw's own counters, read before the seed checks call the engine again
        return outputs, capability(engine, "last_step_offsets"), capability(engine, "last_speculation")
    seeds = request_seeds(seed, len(requests))
    outputs: list[list[int]] = []
    offsets: list[list[int]] | None = []
    for start in range(0, len(requests), chunk):
        part = slice(start, start + chunk)
        _ask(engine, params[part] if params is not None else None)
        outputs += engine.generate(requests[part], max_new_tokens, eos_token_id, seeds=seeds[part])
        if verify_log is not None:
            verify_log += verify_steps(capability(base, "last_trace"), first=start)
        got = capability(engine, "last_step_offsets")
        offsets = None if offsets is None or got is None else offsets + [list(o) for o in got]
        if progress is not None:
            progress.update(len(requests[part]))
    return outputs, offsets, None


def check_seeds(engine: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Any, seed: int,
                params: list[Any] | None = None) -> dict[str, Any]:
    """Same seed twice, and the first request alone against it inside the batch. `params`: one
    `RequestParams` per prompt, or None."""
    if "seeds" not in inspect.signature(unguarded(engine).generate).parameters:
        return {"checked": False, "why": "the engine takes no per-request seeds"}
    batch = prompts[:4] if len(prompts) >= 4 else (prompts * 4)[:4]
    asked = None if params is None else (params[:4] if len(params) >= 4 else (params * 4)[:4])
    seeds = request_seeds(seed + 7919, len(batch))
    _ask(engine, asked)
    first = engine.generate(batch, max_new_tokens, eos_token_id, seeds=seeds)
    _ask(engine, asked)
    second = engine.generate(batch, max_new_tokens, eos_token_id, seeds=seeds)
    alone = []
    for index, (prompt, s) in enumerate(zip(batch, seeds)):
        _ask(engine, None if asked is None else [asked[index]])
        alone.append(engine.generate([prompt], max_new_tokens, eos_token_id, seeds=[s])[0])
    return {"checked": True, "same_seed_same_output": first == second, "alone_equals_batch": alone == first,
            "rows_differing_alone": [i for i, (a, b) in enumerate(zip(alone, first)) if a != b]}


def sampled_audit(engine: Any, target: Any, prompts: list[list[int]], params: SamplingParams, *, samples: int,
                  max_new_tokens: int, eos_token_id: Any, seed: int, alpha: float = ALPHA,
                  recorded: list[Sample] | None = None, seed_checks: bool = True, draft: Any = None,
                  run_target: Any = None, chunk: int | None = None, progress: Any = None,
                  request_params: list[Any] | None = None, require_acceptance: float | None = None,
                  acceptance_baseline: Any = None, tokenizer: Any = None,
                  draft_tokens: int | None = None) -> dict[str, Any]:
    """Draw (or take `recorded`) samples, audit them, check the seeds; the report's dict. `target` (and
    `draft`) teacher-force in float64: the oracle; `draft`: for the tests ordered toward the draft's
    distribution (equivalence/sampling/audit.py); `run_target`: the target as the engine runs it (its
    device and dtype), for the rounding allowance; an engine's `last_step_offsets` (each token's offset in
    its step) stratifies the tests; `chunk`, `progress`: see `draw`; `request_params`: one `RequestParams` per
    prompt (penalties, logit bias, bad words as ids, min_tokens, min-p beside the sampler's cuts), sent as the
    engine's `request_params` and applied by the reference, or None; `require_acceptance` (the gate's R) and
    `acceptance_baseline` (an `ExpectedAcceptance` from an earlier audit) go into the `acceptance` record
    (`sampled_acceptance`); `tokenizer`: the target's (a constraint's grammar vocabulary; set as the engine's
    `request_tokenizer`); `draft_tokens`: the engine's k (which step offset is the bonus token's, for naming a
    structured-output fault). Raises whatever the engine raises: `guarded_sampled_audit` guards it."""
    from specaudit.engines.limits import eos_ids

    started = time.perf_counter()
    offsets = None
    verify_log: list[VerifyStep] = []  # every verify step of the draw, from the engine's trace
    if engine is not None and tokenizer is not None and declares(unguarded(engine), "request_tokenizer"):
        unguarded(engine).request_tokenizer = tokenizer
    if recorded is None:
        requests = spread(prompts, samples)
        per_sample = None if request_params is None else spread(request_params, samples)
        outputs, offsets, speculation = draw(engine, requests, max_new_tokens, eos_token_id, seed=seed,
                                             chunk=chunk, progress=progress, params=per_sample,
                                             verify_log=verify_log)
        check_budget(outputs, max_new_tokens, eos_token_id)
        drawn: list[Sample] = list(zip(requests, outputs))
    else:
        check_budget([tokens for _, tokens in recorded], max_new_tokens, eos_token_id, recording=True)
        drawn, speculation = recorded, None
        by_prompt = {tuple(p): r for p, r in zip(prompts, request_params or [])}
        per_sample = None if request_params is None else [by_prompt.get(tuple(p), request_params[0]) for p, _ in drawn]
    sampling_seconds = time.perf_counter() - started
    scope = (capability(unguarded(engine), "penalty_scope") if engine is not None else None) or "output"
    alphas: list[torch.Tensor] = []  # per sample [n]: sum_x min(p, q) before each token

    def keep_overlaps(target_probs: list[torch.Tensor], draft_probs: list[torch.Tensor] | None) -> None:
        if draft_probs is not None:
            alphas.extend(overlaps(target_probs, draft_probs))

    report = audit_samples(target, drawn, params, alpha=alpha, seed=seed, offsets=offsets, draft=draft,
                           run_model=run_target, requests=per_sample, stop_ids=tuple(sorted(eos_ids(eos_token_id))),
                           penalty_scope=scope, tokenizer=tokenizer, on_tables=keep_overlaps)
    if per_sample is not None:
        _judge_constraints(report, drawn, per_sample, offsets, draft_tokens, tuple(sorted(eos_ids(eos_token_id))),
                           tokenizer, int(target.config.vocab_size))
    testing_done = time.perf_counter()
    report["acceptance"] = sampled_acceptance(
        verify_log, [tokens for _, tokens in drawn], alphas or None, speculation=speculation, engine=engine,
        recorded=recorded is not None, run_target=run_target, required=require_acceptance,
        baseline=acceptance_baseline)
    report["seconds"] = {"sampling": sampling_seconds, "testing": testing_done - started - sampling_seconds,
                         "acceptance": time.perf_counter() - testing_done}
    report["speculation"] = speculation
    report["seeds"] = (check_seeds(engine, prompts, max_new_tokens, eos_token_id, seed, request_params)
                       if recorded is None and seed_checks
                       else {"checked": False, "why": "a recording cannot be re-run" if recorded is not None
                             else "not asked"})
    seeds = report["seeds"]
    report["verdict"] = ("departure" if report["departs"]
                         else "seed broken" if seeds.get("checked") and not (seeds["same_seed_same_output"]
                                                                             and seeds["alone_equals_batch"])
                         else PASS)
    return report


def sampled_acceptance(verify_log: list[VerifyStep], outputs: list[list[int]], alphas: list[torch.Tensor] | None, *,
                       speculation: dict[str, Any] | None, engine: Any, recorded: bool, run_target: Any,
                       required: float | None, baseline: Any) -> dict[str, Any]:
    """The sampled run's `acceptance` record (equivalence/acceptance/sampled.py): observed from the verify steps
    of the engine's trace (else a server's counters), expected sum_x min(p, q) along the samples (exact in
    law where the engine runs the float64 pair in process; else an estimate), or why there is none."""
    base = unguarded(engine) if engine is not None else None
    observed = (observed_of(verify_log, "the engine's trace: every verify step of the draw") if verify_log
                else counters.of_run(base, None, speculation) if base is not None else None)
    why = None
    if recorded:
        why = "a recording keeps no verify steps: give --acceptance-baseline to compare its counters"
    elif not verify_log:
        why = ("the engine shows no verify steps (no trace of its steps): the sampled expectation needs where each "
               "step began; give --acceptance-baseline to compare its counters")
    elif not any(step.drafted for step in verify_log):
        why = "the engine proposed no draft token (it does not speculate): nothing to expect"
    elif alphas is None:
        why = "the pair has no draft model to teacher-force"
    exact = run_target is None
    note = "" if exact else BELOW_FLOAT64.format(dtype=str(next(run_target.parameters()).dtype).removeprefix("torch."))
    return sampled_record(verify_log, outputs, alphas if why is None else None, observed=observed, exact=exact,
                          note=note, required=required, baseline=baseline, unavailable=why)


def _judge_constraints(report: dict[str, Any], samples: list[Sample], requests: list[Any], offsets: Any,
                       draft_tokens: int | None, stop_ids: tuple[int, ...], tokenizer: Any, vocab_size: int) -> None:
    """The structured-output findings in `report["constraints"]` (equivalence/blackbox/constraints.py): an output
    that violates its constraint is a departure of its own, and the class that explains the forbidden tokens
    names the finding."""
    from specaudit.equivalence.blackbox.constraints import sampled_constraint_findings

    found = sampled_constraint_findings(samples, requests, offsets, draft_tokens, stop_ids, tokenizer, vocab_size)
    report["constraints"] = found
    if found is None or not (found["violations"] or found["class"]):
        return
    report["departs"] = True
    words = [f"{found['violations']} of {found['constrained_samples']} outputs violate their constraint "
             "(constraint_violation)"] if found["violations"] else []
    if found["class"]:
        words.append(f"{found['class']}: {found['reason']}")
    report["finding"] = "; ".join(words + ([report["finding"]] if report.get("finding") else []))


def failed_report(engine_name: str, exc: BaseException, *, batch_size: int | None, device: str,
                  seconds: float | None = None) -> dict[str, Any]:
    """The record of a sampled run that did not finish: `error` in one line (the greedy audit's wording,
    `guard.failure_message`), `traceback` the whole story, `seconds` until it was given up."""
    return {"verdict": "run failed", "failed": True, "seconds": seconds,
            "error": one_line(failure_message(engine_name, exc, batch_size=batch_size, device=device)),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def sampled_run(base: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """A sampled run as `audit.json` keeps it beside greedy runs (equivalence/run_record.py): `base` (engine,
    pair, batch size, dtype, device, prompts), `mode` "sampled", `equivalent` (no departure found), `verdict`, `seconds`; a finished
    run's tests in `sampled` (equivalence/sampling/audit.py), a failed run's `failed`, `error`, `traceback`."""
    verdict = {"verdict": report["verdict"], "equivalent": report["verdict"] == PASS}
    if report.get("failed"):
        return run_record(**base, mode=SAMPLED, **verdict, failed=True, error=report["error"],
                          traceback=report["traceback"], seconds=report.get("seconds"))
    acceptance = report.pop("acceptance", None)  # the run's, beside a greedy run's (equivalence/acceptance/)
    return run_record(**base, mode=SAMPLED, **verdict, seconds=sum((report.get("seconds") or {}).values()),
                      sampled=report, acceptance=acceptance)


def guarded_sampled_audit(engine_name: str, build: Callable[[], Any], target: Any, prompts: list[list[int]],
                          params: SamplingParams, *, timeout: float | None, vocab_size: int | None,
                          batch_size: int | None, device: str, recorded: list[Sample] | None = None,
                          **audit_options: Any) -> dict[str, Any]:
    """`sampled_audit` of the engine `build()` returns, behind the guard (module docstring): the report,
    or `failed_report` when building it, one of its `generate` calls or the audit of its output fails.
    `audit_options`: `sampled_audit`'s keywords. A recording is checked like an engine's outputs."""
    started = time.perf_counter()
    try:
        if recorded is not None:
            from specaudit.equivalence.guard import check_recorded_samples

            recorded, engine = check_recorded_samples(recorded, vocab_size), None
        else:
            engine = GuardedEngine(build(), timeout=timeout, vocab_size=vocab_size)
        report = sampled_audit(engine, target, prompts, params, recorded=recorded, **audit_options)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one engine failing must not lose the others' runs
        if out_of_memory(exc) and device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()  # before the next engine
        return failed_report(engine_name, exc, batch_size=batch_size, device=device,
                             seconds=time.perf_counter() - started)
    describe = capability(unguarded(engine), "describe") if engine is not None else None
    if callable(describe):
        report["engine"] = describe()
    return report
