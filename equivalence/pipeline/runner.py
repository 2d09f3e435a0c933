"""The one audit pipeline: every run of `specaudit audit`, whatever its composition, through one loop.

A run composes three choices (equivalence/pipeline/settings.py): how outputs are obtained (an in-process
engine, a live server, a recording), the oracle (the in-process reference with the weights, or a served
reference) and the judge (greedy tokens, or sampled statistics). The loop is the same for all:

1. `preflight`: every input checked before a model is loaded or a request sent (`UsageError`, exit 2);
2. the header: `audit.json`'s top level (`specaudit_version`, `created`, `machine`, `config`), written at once;
3. per oracle group (a pair in a dtype, or the served reference), `open`: the models, prompts and the
   reference's outputs. A pair that fails to load records a failed run for each of its (engine, batch size)
   and the audit goes on; a served reference that fails or hangs ends the audit (`reference.error`, exit 1);
4. per engine and batch size, one run behind the guard (`guard.GuardedEngine`: `--timeout`, the output
   contract, crash isolation): its record (`run_record`), or a failed run; never an exception but Ctrl-C;
5. `audit.json` rewritten (atomically) after every run, so a crash or Ctrl-C keeps every finished run.

One verdict (`run_record.passed`), one exit status (`exit_status`), one terminal summary
(`reports.summary.summary_table`) and one report writer (`reports.markdown.write_reports`) read the result.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import transformers

from specaudit.engines.limits import eos_ids
from specaudit.engines.models import zoo
from specaudit.engines.adapters._http import ServerDied
from specaudit.engines.ops.layout import UnsupportedModel
from specaudit.engines.registry import black_box_prefix, make_engine
from specaudit.equivalence import speculation, validate
from specaudit.equivalence.acceptance import findings as acceptance_findings
from specaudit.equivalence.adversarial import declare_pad_token_id, with_adversarial_prompts
from specaudit.equivalence.audit import Reference, RunSettings, audit_engine
from specaudit.equivalence.blackbox import requests_run
from specaudit.equivalence.errors import ReferenceFailed, UsageError, one_line
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair
from specaudit.equivalence.run_record import all_passed, failed_run
from specaudit.equivalence.guard import GuardedEngine, failure_message, out_of_memory
from specaudit.equivalence.prompts import load_prompts
from specaudit.equivalence.run_context import RunContext

from specaudit import __version__ as VERSION
from specaudit.engines.contract import capability

EXIT_EQUIVALENT, EXIT_NOT_EQUIVALENT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
AuditConfig = AuditSettings  # the name earlier versions gave the settings


class Group(Protocol):
    """The runs judged against one oracle: a pair in a dtype, or the served reference."""

    title: str

    def open(self) -> None: ...
    def describe(self, audit: dict[str, Any]) -> None: ...
    def failed_runs(self, exc: BaseException) -> list[dict[str, Any]]: ...
    def run(self, engine: str, batch_size: int, progress: Any = None) -> dict[str, Any]: ...
    def close(self) -> None: ...


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


def load(pair: str | UserPair, dtype: str, device: str) -> zoo.ModelPair:
    if isinstance(pair, UserPair):
        return zoo.load_pair(target_path=pair.target, draft_path=pair.draft, dtype=dtype, device=device,
                             trust_remote_code=pair.trust_remote_code,
                             allow_pickle_weights=pair.allow_pickle_weights)
    return zoo.load_pair(pair, dtype=dtype, device=device)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def header(settings: AuditSettings) -> dict[str, Any]:
    """`audit.json`'s top level before any run, the same for every composition."""
    return {
        "specaudit_version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(settings.device if settings.oracle == "weights" else "cpu"),
        "config": settings.to_dict(),
        "complete": False,
        "runs": [],
    }


def preflight(settings: AuditSettings) -> None:
    """Every input checked before a model is loaded or a request is sent: `UsageError` (exit 2)."""
    if settings.oracle == "served":
        from specaudit.equivalence.pipeline import served

        served.preflight(settings)
    elif settings.judge == "sampled":  # engine names are the sampled ones; the pair's limits are checked on opening it
        validate.check_numbers(settings)
        validate.check_dtypes(settings.dtypes)
        validate.check_device(settings.device, settings.dtypes)
    else:
        validate.preflight(settings)
    if settings.judge == "sampled":  # request parameters the sampled judge applies; which engines take them: on opening
        from specaudit.equivalence.pipeline import sampled

        sampled.preflight(settings)
    else:
        requests_run.preflight(settings)  # request parameters go to engines that take them
    acceptance_preflight(settings)


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


def groups(settings: AuditSettings, out_dir: Path) -> Iterator[Group]:
    """The oracle groups in order: the served reference, or each pair in each dtype."""
    if settings.oracle == "served":
        from specaudit.equivalence.pipeline.served import ServedGroup

        yield ServedGroup(settings)
        return
    first = True  # the engines' factories are checked once, on the first pair loaded
    for dtype in settings.dtypes:
        for pair_spec in settings.pairs:
            group = PairGroup(settings, pair_spec, dtype, out_dir, check_factories=first)
            yield group
            first = first and not group.loaded  # a pair that failed to load leaves the check to the next


def run_audit(
    settings: AuditSettings,
    out_dir: Path,
    progress: Callable[[int], Any] | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every run of the audit (module docstring); returns the audit dict (also in `out_dir/audit.json`).
    Raises `UsageError` (before any run) for bad input, and KeyboardInterrupt (the finished runs kept)."""
    preflight(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    audit = header(settings)
    json_path = out_dir / "audit.json"
    write_json(json_path, audit)
    planned = len(settings.engines) * len(settings.batch_sizes) * (
        1 if settings.oracle == "served" else len(settings.pairs) * len(settings.dtypes))
    bar = progress(planned) if progress else None

    def record(run: dict[str, Any]) -> None:  # kept at once: a crash or Ctrl-C loses no finished run
        audit["runs"].append(run)
        write_json(json_path, audit)
        if on_run is not None:
            on_run(run)
        if bar is not None:
            bar.update(1)

    try:
        for group in groups(settings, out_dir):
            try:
                group.open()
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
                for run in group.failed_runs(exc):
                    record(run)
                group.close()
                continue
            group.describe(audit)
            write_json(json_path, audit)
            for engine_name in settings.engines:
                for batch_size in settings.batch_sizes:
                    if bar is not None:
                        bar.set_description(f"{engine_name} {group.title} B={batch_size}")
                    record(group.run(engine_name, batch_size, progress=None if bar is None else progress))
            group.close()
    finally:
        if bar is not None:
            bar.close()
    audit["complete"] = True
    write_json(json_path, audit)
    return audit


class PairGroup:
    """The runs judged against the in-process reference: one pair, loaded in one dtype."""

    def __init__(self, settings: AuditSettings, pair_spec: str | UserPair, dtype: str, out_dir: Path, *,
                 check_factories: bool = True) -> None:
        self.settings, self.pair_spec, self.dtype, self.out_dir = settings, pair_spec, dtype, out_dir
        self.check_factories = check_factories
        self.loaded = False  # the pair loaded and its engines' factories checked
        self.title = f"{pair_spec if isinstance(pair_spec, str) else pair_spec.name} {dtype}"
        self.stage = "loading the pair"
        self.pair = self.replay = self.reference = self.prompts = self.adversarial = self.eos = None
        self.plain_runs: dict[Any, dict[str, Any]] = {}  # one plain run per batch size and prompt set
        self.sampled: dict[str, Any] = {}  # the sampled judge's engines, built before any draw

    def open(self) -> None:
        settings, dtype = self.settings, self.dtype
        try:
            self.pair = load(self.pair_spec, dtype, settings.device)
        except UnsupportedModel as exc:  # an architecture the engines cannot batch: bad usage
            raise UsageError(f"{exc}; audit it with the reference or a black-box engine") from exc
        pair = self.pair
        if settings.judge == "sampled":
            return self._open_sampled()
        if self.check_factories:
            validate.check_factories(settings, pair)  # a UsageError here ends the audit before any run
        self.loaded = True
        # the float64 target (and draft) that rule flips below float64
        self.replay = pair if dtype == "float64" else load(self.pair_spec, "float64", settings.device)
        prompts = load_prompts(settings.prompts, pair.tokenizer, settings.num_prompts)
        eos = pair.eos_token_id if settings.eos_token_id == "pair" else settings.eos_token_id
        declared_pad = settings.pad_token_id
        if declared_pad is None and isinstance(settings.engine_options.get("pad_token_id"), int):
            declared_pad = settings.engine_options["pad_token_id"]  # the engines' pad id: the pair's too
        if declared_pad is not None:
            vocab = pair.target.config.vocab_size
            if declared_pad >= vocab:
                raise UsageError(f"--pad-token-id {declared_pad}: pair {pair.name} has {vocab} token ids "
                                 f"(0 to {vocab - 1})")
            declare_pad_token_id(pair, declared_pad)
        if settings.adversarial:
            prompts, self.adversarial = with_adversarial_prompts(
                pair, prompts, eos_token_id=eos, max_new_tokens=settings.max_new_tokens,
                draft_tokens=settings.draft_tokens)
        self.stage = "the reference (greedy decoding, one prompt at a time)"
        # recordings bring their own prompts (decoded in _one_run): skip the unused reference
        only_recordings = all(black_box_prefix(name) == "recorded" for name in settings.engines)
        self.reference = None if only_recordings else Reference(pair, prompts, settings.max_new_tokens, eos)
        self.prompts, self.eos = prompts, eos

    def _open_sampled(self) -> None:
        """The sampled judge: the oracle is the target (and draft) in float64 on the CPU, teacher forcing;
        every engine is built before any draw (a name, file or factory that fails is bad usage)."""
        from specaudit.equivalence.pipeline import sampled

        self.oracle_pair, self.prompts, self.eos, self.sampled = sampled.open_pair(self.settings, self.pair,
                                                                                   self.pair_spec, self.dtype)

    def describe(self, audit: dict[str, Any]) -> None:
        audit["config"]["num_prompts"] = len(self.prompts) if self.prompts is not None else None
        if self.settings.judge == "greedy" and self.reference is None:  # only recordings: each run says how many
            audit["config"]["prompts"], audit["config"]["num_prompts"] = "the recordings' own", None

    def failed_runs(self, exc: BaseException) -> list[dict[str, Any]]:
        return _pair_failure(self.pair_spec, self.dtype, self.settings, self.stage, exc)

    def run(self, engine: str, batch_size: int, progress: Any = None) -> dict[str, Any]:
        settings = self.settings
        if settings.judge == "sampled":
            from specaudit.equivalence.pipeline import sampled

            return sampled.pair_run(settings, engine, self.sampled[engine], self.pair, self.oracle_pair,
                                    self.prompts, self.eos, batch_size, self.dtype, progress)
        return _one_run(engine, self.pair, self.prompts, batch_size, self.dtype, settings, self.eos,
                        self.reference, self.replay, self.out_dir / "bundles" if settings.bundles else None,
                        self.adversarial, self.plain_runs)

    def close(self) -> None:
        self.pair = self.replay = self.reference = None
        self.sampled = {}
        _free_device_memory(self.settings.device)


def _free_device_memory(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pair_failure(pair_spec, dtype: str, config: AuditConfig, stage: str, exc: Exception) -> list[dict[str, Any]]:
    name = pair_spec if isinstance(pair_spec, str) else "+".join(
        Path(p).name for p in (pair_spec.target, pair_spec.draft) if p is not None)
    if out_of_memory(exc):
        _free_device_memory(config.device)
        why = f"out of memory on {config.device} during {stage} (batch size 1)"
    else:
        why = f"{stage} failed: {type(exc).__name__}: {exc}"
    message = f"pair {name} in {dtype}: {why}; no engine was run on it"
    return [failed_run({"engine": engine_name, "pair": name, "batch_size": batch_size, "dtype": dtype,
                         "device": config.device, "num_prompts": config.num_prompts or 0}, message, exc)
            for engine_name in config.engines for batch_size in config.batch_sizes]


def _one_run(engine_name, pair, prompts, batch_size, dtype, config, eos, reference, replay,
             bundle_dir: Path | None = None, adversarial: dict[str, Any] | None = None,
             plain_runs: dict[Any, dict[str, Any]] | None = None) -> dict[str, Any]:
    base = {"engine": engine_name, "mode": "greedy", "pair": pair.name, "batch_size": batch_size, "dtype": dtype,
            "device": config.device, "num_prompts": len(prompts),
            "eos_token_ids": list(eos_ids(eos)),  # the set the run stopped at (config "pair": the pair's own)
            "pair_info": dict(pair.info)}  # layouts and float64 switches (eager experts, float64 softmax)
    try:
        options = {"pad_token_id": pair.pad_token_id, "record_logits": True, **config.engine_options}
        engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size,
                             draft_tokens=config.draft_tokens, **options)
        recorded_prompts = capability(engine, "recorded_prompts")
        if recorded_prompts is not None:  # a recording brings its own prompts: the reference decodes those
            prompts = recorded_prompts[: config.num_prompts] if config.num_prompts else recorded_prompts
            base["num_prompts"] = len(prompts)
            reference = Reference(pair, prompts, config.max_new_tokens, eos)
            adversarial = None  # a recording's prompts are its own

        black_box = bool(capability(engine, "black_box"))
        # what the audit may run besides the engine's one call: fresh engines for the crash isolation and
        # the diagnosis (their re-runs share --diagnosis-budget, else --timeout), and the plain run
        budget = config.diagnosis_budget if config.diagnosis_budget is not None else config.timeout
        context = RunContext(pair, [list(p) for p in prompts], config.max_new_tokens, eos, dtype, batch_size,
                             engine_name=engine_name, engine=engine, draft_tokens=config.draft_tokens, options=options,
                             timeout=config.timeout, rerun_budget=budget, plain_engine=config.plain_engine,
                             plain_runs={} if plain_runs is None else plain_runs,
                             rerunnable=recorded_prompts is None)
        engine = GuardedEngine(engine, timeout=config.timeout, vocab_size=getattr(pair.target.config, "vocab_size", None))
        if requests_run.has_request_params(config.prompts, config.request_params):
            return {**base, **requests_run.run_with_params(engine, pair, prompts, config, dtype, engine_name, batch_size,
                                                           black_box, plain_engine=context.plain_engine_built())}
        run_settings = RunSettings(
            max_new_tokens=config.max_new_tokens, eos_token_id=eos, dtype=dtype, engine_name=engine_name,
            batch_size=batch_size, device=config.device, engine_dtype=config.engine_dtype,
            logit_tolerance=config.logit_tolerance, pad_token_id=options.get("pad_token_id", pair.pad_token_id),
            draft_tokens=config.draft_tokens, diagnosis=config.diagnosis, diagnosis_budget=config.diagnosis_budget,
            speculation=config.speculation, acceptance_baseline=config.acceptance_baseline,
            require_acceptance=config.require_acceptance, payoff_repeats=config.payoff)
        run = audit_engine(engine, pair, prompts, run_settings, reference=reference, replay_target=replay.target,
                           replay_draft=replay.draft if dtype != "float64" else None, bundle_dir=bundle_dir,
                           context=context)
        run.update({k: v for k, v in base.items() if k not in run or run[k] is None})
        run["adversarial"] = adversarial
        return run
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one engine failing must not lose the others' runs
        if out_of_memory(exc):
            _free_device_memory(config.device)
        failed = failed_run(base, failure_message(engine_name, exc, batch_size=batch_size, device=config.device), exc)
        if isinstance(exc, ServerDied):  # not "cannot reach": it answered, then went away
            failed["server_died"] = exc.details
        return failed


def exit_status(audit: dict[str, Any]) -> int:
    """The audit's one exit status, for every composition: 0 when every run passed (`run_record.passed`);
    1 when a served reference failed, no run was made, any run has a structural divergence, a departure or
    failed, a reference mismatch (rulings/plain.py: the plain engine makes the reference's divergence), or
    a gate that failed or could not be applied (`require_speculation`, `require_acceptance`:
    equivalence/gates.py)."""
    from specaudit.equivalence.gates import gate_failures

    if (audit.get("reference") or {}).get("error") or not audit.get("runs"):
        return EXIT_NOT_EQUIVALENT
    if not all_passed(audit):
        return EXIT_NOT_EQUIVALENT
    if any(r.get("reference_mismatches") for r in audit["runs"]):  # prompts the reference could not judge
        return EXIT_NOT_EQUIVALENT
    if gate_failures(audit):  # a gate that failed a run, or could not be applied to one
        return EXIT_NOT_EQUIVALENT
    return EXIT_EQUIVALENT
