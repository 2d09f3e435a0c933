"""The one audit pipeline: every run of `specaudit audit`, whatever its composition, through one loop.

A run composes three choices (equivalence/pipeline/settings.py): how outputs are obtained (an in-process
engine, a live server, a recording), the oracle (the weights of a pair in a dtype, or a served reference) and
the judge (greedy tokens, or sampled statistics; equivalence/pipeline/judges.py). `compose` is the one place
that reads those choices off the settings: it checks the inputs of the composition and builds the judge and
the oracles. The loop is the same for all:

1. `compose`: every input checked before a model is loaded or a request sent (`UsageError`, exit 2); the judge
   and the oracle groups;
2. the header: `audit.json`'s top level (`specaudit_version`, `created`, `machine`, `config`), written at once;
3. per oracle, `judge.open(oracle)`: the models, prompts (equivalence/pipeline/prompt_set.py) and the
   reference's outputs or teacher forcing. A pair that fails to load records a failed run for each of its
   (engine, batch size) and the audit goes on; a served reference that fails or hangs ends the audit
   (`reference.error`, exit 1);
4. per engine and batch size, `judge.run(engine, batch size, oracle)`: one run behind the guard
   (`guard.GuardedEngine`: `--timeout`, the output contract, crash isolation): its record (`run_record`), or a
   failed run; never an exception but Ctrl-C;
5. `audit.json` rewritten (atomically) after every run, so a crash or Ctrl-C keeps every finished run.

One verdict (`run_record.passed`), one exit status (`exit_status`), one terminal summary
(`reports.summary.summary_table`) and one report writer (`reports.markdown.write_reports`) read the result.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import transformers

from specaudit.equivalence.errors import ReferenceFailed, UsageError, one_line
from specaudit.equivalence.pipeline.judges import GreedyJudge, Judge, Oracle, SampledJudge
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair
from specaudit.equivalence.records import Audit, Run
from specaudit.equivalence.records.serialize import as_audit, run_from_json, run_to_json
from specaudit.equivalence.run_record import all_passed

from specaudit import __version__ as VERSION

EXIT_EQUIVALENT, EXIT_NOT_EQUIVALENT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
__all__ = ["AuditSettings", "UserPair", "compose", "exit_status", "run_audit"]


def __getattr__(name: str) -> Any:
    if name == "AuditConfig":  # the name earlier versions gave the settings: it works, and says so once
        warnings.warn("AuditConfig is AuditSettings now (specaudit.equivalence.pipeline.settings); AuditConfig "
                      "will be removed in a later version", DeprecationWarning, stacklevel=2)
        globals()["AuditConfig"] = AuditSettings  # warned once: later lookups find it here
        return AuditSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def machine_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "cuda": torch.cuda.is_available(),
        "device_name": None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    info["device_name"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            info["device_name"] = platform.processor() or None
    return info


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def header(settings: AuditSettings, device: str) -> dict[str, Any]:
    """`audit.json`'s top level before any run, the same for every composition."""
    return {
        "specaudit_version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "config": settings.to_dict(),
        "complete": False,
        "runs": [],
    }


def acceptance_preflight(settings: AuditSettings) -> None:
    """The acceptance settings (equivalence/acceptance/): the gate's ratio, the stated proposer, the baseline."""
    from specaudit.equivalence.acceptance.expected import parse_spec
    from specaudit.equivalence.acceptance.run import load_baseline

    if settings.require_acceptance is not None and not 0 < settings.require_acceptance <= 1:
        raise UsageError(f"--require-acceptance {settings.require_acceptance}: give a ratio 0 < R <= 1")
    if settings.payoff < 0:
        raise UsageError(f"--payoff {settings.payoff}: give a number of repeats, 1 or more (0: no payoff)")
    try:
        if settings.speculation is not None:
            parse_spec(settings.speculation)
        if settings.acceptance_baseline is not None:
            load_baseline(settings.acceptance_baseline)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Composition:
    """The judge and the oracles of one audit, built by `compose`."""

    judge: Judge
    oracles: Callable[[], Iterator[Oracle]]  # opened one after another, in order
    planned: int  # runs: engines x batch sizes x oracles
    device: str  # where the oracle computes ("cpu" for a served reference)


def compose(settings: AuditSettings, out_dir: Path) -> Composition:
    """The one place that reads the composition's choices off the settings: every input checked before a model
    is loaded or a request sent (`UsageError`, exit 2), then the judge and the oracles."""
    if settings.search is not None:  # the workload drawn instead of fixed (equivalence/search/pipeline.py)
        from specaudit.equivalence.search.pipeline import composition

        return Composition(*composition(settings, out_dir))
    served_reference, sampled_mode = settings.oracle == "served", settings.mode == "sampled"
    if served_reference:
        from specaudit.equivalence.pipeline import served

        served.preflight(settings)
        refused = served.sampled_refusal(settings) if sampled_mode else None
        if refused is not None:
            raise UsageError(refused)
    elif sampled_mode:  # engine names are the sampled ones; the pair's limits are checked on opening it
        from specaudit.equivalence import validate

        validate.check_numbers(settings)
        validate.check_dtypes(settings.dtypes)
        validate.check_device(settings.device, settings.dtypes)
    else:
        from specaudit.equivalence.pipeline import weights

        weights.preflight(settings)
    if sampled_mode:  # request parameters the sampled judge applies; which engines take them: on opening
        from specaudit.equivalence.pipeline import sampled

        sampled.preflight(settings, served=served_reference)
    else:
        from specaudit.equivalence.blackbox import requests_run

        requests_run.preflight(settings)  # request parameters go to engines that take them
    acceptance_preflight(settings)
    judge: Judge = SampledJudge() if sampled_mode else GreedyJudge()
    runs = len(settings.engines) * len(settings.batch_sizes)
    if served_reference:
        from specaudit.equivalence.pipeline.served import ServedOracle

        return Composition(judge, lambda: iter([ServedOracle(settings)]), runs, "cpu")

    def pair_oracles() -> Iterator[Oracle]:
        from specaudit.equivalence.pipeline.weights import WeightsOracle

        first = True  # the engines' factories are checked once, on the first pair loaded
        for dtype in settings.dtypes:
            for pair_spec in settings.pairs:
                oracle = WeightsOracle(settings, pair_spec, dtype, out_dir, check_factories=first)
                yield oracle
                first = first and not oracle.loaded  # a pair that failed to load leaves the check to the next

    return Composition(judge, pair_oracles, runs * len(settings.pairs) * len(settings.dtypes), settings.device)


def run_audit(
    settings: AuditSettings,
    out_dir: Path,
    progress: Callable[[int], Any] | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every run of the audit (module docstring); returns the audit dict (also in `out_dir/audit.json`).
    Raises `UsageError` (before any run) for bad input, and KeyboardInterrupt (the finished runs kept)."""
    composition = compose(settings, out_dir)
    judge = composition.judge
    out_dir.mkdir(parents=True, exist_ok=True)
    audit = header(settings, composition.device)
    json_path = out_dir / "audit.json"
    write_json(json_path, audit)
    bar = progress(composition.planned) if progress else None

    def record(run: Run | dict[str, Any]) -> None:  # kept at once: a crash or Ctrl-C loses no finished run
        audit["runs"].append(run_to_json(run if isinstance(run, Run) else run_from_json(run)))
        write_json(json_path, audit)
        if on_run is not None:
            on_run(audit["runs"][-1])
        if bar is not None:
            bar.update(1)

    try:
        for oracle in composition.oracles():
            try:
                judge.open(oracle)
            except UsageError:
                if bar is not None:  # no run was made: clear the bar, leave the error line alone
                    bar.leave = False
                raise
            except ReferenceFailed as exc:  # nothing can be judged: the audit ends here
                audit["reference"] = {**(audit.get("reference") or {}), "engine": settings.reference,
                                      "error": one_line(str(exc))}
                break
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # a pair that fails to load: each of its runs failed, the next pair goes on
                for run in oracle.failed_runs(exc):
                    record(run)
                oracle.close()
                continue
            oracle.describe(audit)
            write_json(json_path, audit)
            for engine_name in settings.engines:
                for batch_size in settings.batch_sizes:
                    if bar is not None:
                        bar.set_description(f"{engine_name} {oracle.title} B={batch_size}")
                    record(judge.run(engine_name, batch_size, oracle, progress=None if bar is None else progress))
            oracle.close()
    finally:
        if bar is not None:
            bar.close()
    audit["complete"] = True
    write_json(json_path, audit)
    return audit


def exit_status(audit: Audit | dict[str, Any]) -> int:
    """The audit's one exit status, for every composition: 0 when every run passed (`run_record.passed`);
    1 when a served reference failed, no run was made, any run has a structural divergence, a departure or
    failed, a reference mismatch (rulings/plain.py: the plain engine makes the reference's divergence), or
    a gate that failed or could not be applied (`require_speculation`, `require_acceptance`:
    equivalence/gates.py)."""
    from specaudit.equivalence.gates import gate_failures

    audit = as_audit(audit)
    if (audit.reference or {}).get("error") or not audit.runs:
        return EXIT_NOT_EQUIVALENT
    if not all_passed(audit):
        return EXIT_NOT_EQUIVALENT
    if any(r.reference_mismatches for r in audit.runs):  # prompts the reference could not judge
        return EXIT_NOT_EQUIVALENT
    if gate_failures(audit):  # a gate that failed a run, or could not be applied to one
        return EXIT_NOT_EQUIVALENT
    return EXIT_EQUIVALENT
