"""The gates an audit was asked for, and what each did: one decision for the exit status, the terminal and
the report.

Two gates turn a finding into a failure (exit 1):

- `--require-acceptance R`: a run fails when its observed acceptance is below R x expected at some draft
  position beyond chance (equivalence/acceptance/findings.py `unmet`). A run whose acceptance cannot be
  compared (no expectation: no proposer stated or known, a served reference without weights; or no
  per-position counters observed) fails as well: the gate was asked for and never applied;
- `--require-speculation`: a run fails when its engine did not show that it drafted: it drafted nothing,
  or it exposes no draft counters (equivalence/speculation.py `unmet`).

One check needs no option: a run whose every prompt's request parameters the engine refused judged nothing, and
its "equivalent" proves nothing (`JUDGED`): it fails the audit with one line naming what was refused.

A failed run (its engine crashed, timed out) fails on its own and is no gate's. `gate_failures` gives one
`GateFailure` per run that is short of R x expected (each with its own numbers) and one per distinct reason
a gate was not applied or not met, naming every run it covers, what is missing and how to give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specaudit.equivalence import speculation
from specaudit.equivalence.acceptance import findings as acceptance_findings
from specaudit.equivalence.records import Audit, Run
from specaudit.equivalence.records.serialize import as_audit, as_run

ACCEPTANCE = "--require-acceptance"
SPECULATION = "--require-speculation"
JUDGED = "a judged prompt"  # every run: at least one prompt judged (not refused, not failed)
# what makes a server count its drafts, by engine prefix (engines/adapters/server_metrics.py)
COUNTER_ADVICE = {
    "vllm": "serve it with --speculative-config, whose counters vLLM exposes on GET /metrics",
    "llamacpp": "start llama-server with --metrics (b11549 or later counts drafts there)",
    "sglang": "SGLang's /metrics has no draft counts, only an acceptance rate: audit its drafting elsewhere, or "
              "drop --require-speculation",
    "trtllm": "start trtllm-serve with its iteration statistics on GET /metrics",
    "recorded": "record it from a server that exposes its counters (specaudit record)",
}
IN_PROCESS_COUNTER_ADVICE = ("give the engine a trace (engines/trace.py) or `last_speculation` "
                             "(engines/contract.py)")
PER_POSITION_ADVICE = ("audit an engine that counts acceptance per draft position: an in-process engine's trace, "
                       "vLLM's /metrics (or --per-request-spec-decode-metrics detailed), llama.cpp's --metrics")


@dataclass(frozen=True)
class GateFailure:
    """One line on the terminal and in the report: a gate that failed runs, or could not be applied to them."""

    gate: str  # ACCEPTANCE, SPECULATION or JUDGED
    applied: bool  # False: the gate could not be evaluated on these runs (and fails them)
    runs: tuple[str, ...]  # the runs it names, each "engine pair B=N dtype"
    message: str  # one line: the gate, the runs, what is missing or short, and how to give it


def run_label(run: Run | Mapping[str, Any]) -> str:
    run = as_run(run)
    return f"{run.engine} {run.pair} B={run.batch_size} {run.dtype}"


def runs_text(runs: list[Run]) -> str:
    """The runs in a few words: per engine, pair and dtype, its batch sizes ("vllm:URL p B=4, 16 float32")."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for run in runs:
        key = (str(run.engine), str(run.pair), str(run.dtype))
        grouped.setdefault(key, []).append(str(run.batch_size))
    return "; ".join(f"{engine} {pair} B={', '.join(sizes)} {dtype}" for (engine, pair, dtype), sizes in grouped.items())


def _acceptance_gap(run: Run, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(what is missing, how to give it) when the run's acceptance could not be compared, else None."""
    record = run.acceptance  # an open-ended bag (equivalence/acceptance/findings.py `Comparison.to_json`)
    if not record:
        return "no acceptance record", "audit it with this version of specaudit"
    if record.get("positions"):
        return None
    reason = record.get("unavailable") or "not compared"
    k = config.get("draft_tokens") or "K"
    if record.get("expected") is None:
        if config.get("reference") is not None:  # a served reference: no weights to replay a proposer
            how = "give --acceptance-baseline FILE (an earlier audit.json of this engine)"
        elif config.get("acceptance_baseline"):
            how = "give an --acceptance-baseline FILE with a run of this engine and pair"
        else:
            how = (f"give --speculation draft:k={k} (with --draft) or ngram:k={k},min=N,max=M, "
                   "or --acceptance-baseline FILE")
        return f"no expectation ({reason})", how
    return f"no per-position counters observed ({reason})", PER_POSITION_ADVICE


def _counter_gap(run: Run) -> tuple[str, str]:
    """(what is missing, how to give it) for a run that fails --require-speculation."""
    evidence = run.speculation
    if speculation.observed(evidence) is False:
        return ("speculation not observed: the engine drafted no token",
                "start the engine with speculation on (a server's speculative config, an engine's draft)")
    note = (run.engine_description or {}).get("metrics_note")
    missing = "no draft counters" + (f" ({note})" if note else "")
    if evidence and evidence.get("acceptance_rate") is not None:
        missing += f" (only an acceptance rate, {evidence['acceptance_rate']:.2f})"
    prefix, sep, _ = str(run.engine).partition(":")
    return missing, COUNTER_ADVICE.get(prefix, IN_PROCESS_COUNTER_ADVICE) if sep else IN_PROCESS_COUNTER_ADVICE


def gate_failures(audit: Audit | Mapping[str, Any]) -> list[GateFailure]:
    """Every gate's failures (module docstring), in run order; [] when no gate was asked for or all passed.
    `audit`: an `Audit`, or the JSON object of `audit.json` (read once, `serialize.as_audit`)."""
    audit = as_audit(audit)
    config = audit.config
    runs = [run for run in audit.runs if not run.error]
    found: list[GateFailure] = []
    ratio = config.get("require_acceptance")
    if ratio is not None:
        gaps: dict[tuple[str, str], list[Run]] = {}
        for run in runs:
            gap = _acceptance_gap(run, config)
            if gap is not None:
                gaps.setdefault(gap, []).append(run)
            elif acceptance_findings.unmet(run):
                found.append(GateFailure(ACCEPTANCE, True, (run_label(run),), (
                    f"acceptance short: {run_label(run)}: below {ACCEPTANCE} {ratio:g} x expected; "
                    f"{acceptance_findings.headline(run.acceptance)}")))
        for (missing, how), covered in gaps.items():
            found.append(GateFailure(ACCEPTANCE, False, tuple(run_label(r) for r in covered), (
                f"{ACCEPTANCE} {ratio:g} was not applied to {runs_text(covered)}: {missing}; {how}")))
    if config.get("require_speculation"):
        unmet: dict[tuple[str, str], list[Run]] = {}
        for run in runs:
            if speculation.unmet(run):
                unmet.setdefault(_counter_gap(run), []).append(run)
        for (missing, how), covered in unmet.items():
            applied = speculation.observed(covered[0].speculation) is False
            verb = "failed on" if applied else "could not be checked on"
            found.append(GateFailure(SPECULATION, applied, tuple(run_label(r) for r in covered),
                                     f"{SPECULATION} {verb} {runs_text(covered)}: {missing}; {how}"))
    for run in runs:
        refused = nothing_judged(run)
        if refused is not None:
            found.append(GateFailure(JUDGED, False, (run_label(run),), (
                f"nothing was judged on {run_label(run)}: the engine refused every prompt's request parameters "
                f"({refused}); drop them, or audit an engine that takes them")))
    return found


def nothing_judged(run: Run) -> str | None:
    """What the engine refused, where a greedy run with request parameters judged no prompt (every one refused or
    failed, at least one refused); None where some prompt was judged."""
    refused = run.refused_parameters if isinstance(run.refused_parameters, tuple) else ()
    if not run.greedy or not refused or any(p.get("exact") is not None for p in run.prompts):
        return None
    kinds = dict.fromkeys(f"{r.get('parameter')}: {r.get('why')}" for r in refused)
    return "; ".join(kinds)
