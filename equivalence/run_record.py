"""One run of `audit.json`, built here for every kind of run: a greedy audit's (equivalence/audit.py), one
with request parameters (equivalence/blackbox/requests_run.py), a sampled one (equivalence/sampling/run.py),
and a run that did not finish (`failed_run`). The verdict of a run and of an audit is read here too.

Every run has `engine`, `mode` ("greedy" or "sampled"), `pair`, `batch_size`, `dtype`, `device`,
`num_prompts`, `equivalent`, `error` (None, or one line) and `seconds`. A greedy run's other fields start
from `GREEDY_DEFAULTS`, what a run that compared nothing holds; a sampled run keeps its tests' report in
`sampled` (docs/reports.md, docs/sampling.md).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from specaudit.equivalence.errors import one_line

if TYPE_CHECKING:
    from specaudit.equivalence.records import Audit, Divergence, Run

GREEDY, SAMPLED = "greedy", "sampled"

# a greedy run's fields before anything was compared: what a failed run keeps
GREEDY_DEFAULTS: dict[str, Any] = {
    "exact_matches": 0, "equivalent": False, "structural_divergences": 0, "numerical_divergences": 0,
    "max_logit_error": None, "logit_tolerance": None, "seconds": None, "tokens_generated": 0, "trace": None,
    "prompts": [], "divergences": [], "failures": [],
}


def run_record(*, engine: str, pair: str, batch_size: int | None, dtype: str, device: str, num_prompts: int,
               mode: str = GREEDY, **fields: Any) -> dict[str, Any]:
    """A run: the fields every run has, the mode's defaults, then `fields` (which override them)."""
    if mode not in (GREEDY, SAMPLED):
        raise ValueError(f"unknown run mode {mode!r}")
    return {"engine": engine, "mode": mode, "pair": pair, "batch_size": batch_size, "dtype": dtype,
            "device": device, "num_prompts": num_prompts, **(GREEDY_DEFAULTS if mode == GREEDY else {}),
            "error": None, **fields}


def failed_run(base: dict[str, Any], message: str, exc: BaseException) -> dict[str, Any]:
    """A run that did not finish: `base` (engine, pair, batch size, dtype, device, prompts and whatever else
    the caller knows), `failed`, `error` in one line and `traceback` the whole story."""
    return run_record(**{"mode": GREEDY, **base}, failed=True, equivalent=False, error=one_line(message),
                      traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def equivalent(divergences: Sequence[Divergence | Mapping[str, Any]], failures: Sequence[Any] = ()) -> bool:
    """A greedy run's verdict from what it found, every kind of run alike (in process, a server with request
    parameters, a served reference): no structural divergence, and no prompt that made the engine fail."""
    from specaudit.equivalence.records.serialize import as_divergence

    return not failures and not any(as_divergence(d).structural for d in divergences)


def passed(run: Run | Mapping[str, Any]) -> bool:
    """The run finished and is equivalent: no structural divergence (greedy), no departure found (sampled)."""
    from specaudit.equivalence.records.serialize import as_run

    return as_run(run).passed


def all_passed(audit: Audit | Mapping[str, Any]) -> bool:
    from specaudit.equivalence.records.serialize import as_audit

    return all(run.passed for run in as_audit(audit).runs)


def upgrade(audit: dict[str, Any]) -> dict[str, Any]:
    """An `audit.json` of an earlier version in this version's names, so its readers keep working: a copy, read
    by the one serializer (`equivalence/records/serialize.py` `upgrade`: a served run's `band`, its divergences'
    top-level `class`, its `findings`; a run without `mode` or `failures`)."""
    from specaudit.equivalence.records.serialize import upgrade as upgraded

    return upgraded(audit)
