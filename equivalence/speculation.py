"""Did the engine really speculate? The run's speculation evidence and the verdict line it gives.

Each run record carries `speculation = {"drafted_tokens", "accepted_tokens", "acceptance_rate",
"preemptions", "source"}`, or None where nothing says:

- a live server: its own counters, read from its metrics endpoint before and after the run
  (engines/adapters/server_metrics.py);
- a built-in engine with a trace: k draft tokens per row per decode step, and the accepted counts;
- anything else (a recording, the reference, a user factory without a trace): None.

`speculation_observed` is True when the run drafted at least one token, False when the counters
were read and show none ("speculation not observed": the audit then proves nothing about
speculation), None when nothing was exposed. With `--require-speculation` a run whose
`speculation_observed` is not True fails the audit (exit 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from specaudit.engines.contract import capability
from specaudit.engines.trace import Trace
from specaudit.equivalence.records import ABSENT, Run
from specaudit.equivalence.records.serialize import as_run


def from_trace(trace: Trace | None) -> dict[str, Any] | None:
    """A built-in engine's speculation from its trace: None when it keeps none or never drafts."""
    if trace is None or not trace.draft_tokens:
        return None
    draft_tokens, steps = trace.draft_tokens, trace.steps
    decode = [step for step in steps if step.kind != "prefill"]
    drafted = sum(step.drafted(draft_tokens) for step in decode)
    accepted = sum(sum(step.accepted_counts) for step in decode)
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": (accepted / drafted) if drafted else None, "preemptions": None,
            "source": f"the engine's trace: up to k={draft_tokens} draft tokens per row per step, over {len(decode)} steps"}


def of_run(engine: Any, trace: Any) -> dict[str, Any] | None:
    """The speculation record of one run of `engine`."""
    if capability(engine, "black_box"):
        return capability(engine, "last_speculation")
    return from_trace(trace)


def observed(speculation: Mapping[str, Any] | None) -> bool | None:
    """True when at least one token was drafted, False when counted as none, None when not counted."""
    if not speculation or speculation.get("drafted_tokens") is None:
        return None
    return speculation["drafted_tokens"] > 0


def verdict(run: Run | Mapping[str, Any]) -> str:
    """One phrase for reports and the terminal: what the run's counters showed (`phrase`)."""
    return phrase(as_run(run).speculation)


def phrase(speculation: Mapping[str, Any] | None) -> str:
    """What the counters `speculation` (a run's `speculation` record, or None) showed, in one phrase."""
    seen = observed(speculation)
    if seen is None:
        if speculation and speculation.get("acceptance_rate") is not None:
            return (f"speculation not counted (the engine exposes only an acceptance rate, "
                    f"{speculation['acceptance_rate']:.2f})")
        return "speculation not measured (the engine exposes no draft counters)"
    if not seen:
        return "speculation not observed: the engine drafted no token, so this audit proves nothing about speculation"
    rate = speculation.get("acceptance_rate")
    text = f"speculation observed: {speculation['drafted_tokens']} drafted, {speculation['accepted_tokens']} accepted"
    if rate is not None:
        text += f" ({rate:.1%})"
    if speculation.get("preemptions") is not None:
        text += f", {speculation['preemptions']} preemption(s)"
    return text


def cell(speculation: Mapping[str, Any] | None) -> str:
    """A short table cell: `drafted/accepted (rate)`, `0 drafted`, or `-`."""
    seen = observed(speculation)
    if seen is None:
        return "-"
    if not seen:
        return "0 drafted"
    rate = speculation.get("acceptance_rate")
    return f"{speculation['drafted_tokens']}/{speculation['accepted_tokens']}" + (f" ({rate:.0%})" if rate is not None else "")


def adds_to_cell(speculation: Mapping[str, Any] | None) -> bool:
    """Whether `verdict` says more than `cell`: always, but where the counters were read and show drafted
    tokens and nothing else (no preemption count), the cell's drafted/accepted (rate) already says it all."""
    return observed(speculation) is not True or speculation.get("preemptions") is not None


def unmet(run: Run | Mapping[str, Any]) -> bool:
    """Whether this run fails `--require-speculation` (a failed run fails on its own)."""
    run = as_run(run)
    return not run.error and observed(run.speculation) is not True


def audit_note(runs: Iterable[Run | Mapping[str, Any]], required: bool) -> str:
    """What the verdict adds about speculation: the runs whose engine drafted nothing, and the runs
    of a black-box engine (its noise band written: a server, a recording; or any run, with `required`) that
    exposed no counters; "" when none."""
    finished = [run for run in map(as_run, runs) if not run.error and run.speculation is not ABSENT]
    zero = [run for run in finished if observed(run.speculation) is False]
    unknown = [run for run in finished if observed(run.speculation) is None
               and (required or run.noise_band not in (None, ABSENT))]
    parts = []
    for found, what in ((zero, "speculation not observed"), (unknown, "speculation not measured")):
        if found:
            engines = ", ".join(dict.fromkeys(str(run.engine) for run in found))
            parts.append(f"{what} in {len(found)} run{'s' if len(found) != 1 else ''} ({engines})")
    return "; ".join(parts)
