"""The audit runner: engines x pairs x batch sizes x dtypes, one run record each.

`audit.json` is rewritten (atomically) after every run, so a crash or Ctrl-C keeps every
finished run. Before any run, `validate.preflight` (and, once the first pair is loaded,
`validate.check_factories`) raise `UsageError` for bad input. After that nothing ends the audit
but Ctrl-C: an engine that raises, breaks the output contract, runs out of memory or runs past
`timeout` seconds (`guard.GuardedEngine`) is recorded as a failed run, with a one-line `error` and
its `traceback`; a pair that fails to load or whose reference fails records a failed run for each
of its (engine, batch size) and the audit goes on.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

from specaudit.engines.limits import eos_ids
from specaudit.engines.models import zoo
from specaudit.engines.adapters._http import ServerDied
from specaudit.engines.ops.layout import UnsupportedModel
from specaudit.engines.registry import black_box_prefix, make_engine
from specaudit.equivalence import speculation, validate
from specaudit.equivalence.adversarial import declare_pad_token_id, with_adversarial_prompts
from specaudit.equivalence.audit import Reference, audit_engine
from specaudit.equivalence.blackbox import requests_run
from specaudit.equivalence.run_record import all_passed, failed_run
from specaudit.equivalence.guard import GuardedEngine, failure_message, out_of_memory
from specaudit.equivalence.prompts import load_prompts
from specaudit.equivalence.run_context import RunContext
from specaudit.equivalence.reports.summary import summary_table  # noqa: F401 (the runner's table, re-exported)

from specaudit import __version__ as VERSION
from specaudit.engines.contract import capability


@dataclass
class UserPair:
    target: str
    draft: str | None  # None: a target alone, enough for black-box engines (recordings, live servers)
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False


@dataclass
class AuditConfig:
    engines: list[str]
    pairs: list[str | UserPair]
    batch_sizes: list[int]
    dtypes: list[str] = field(default_factory=lambda: ["float64"])
    device: str = "cpu"
    prompts: str = "builtin"
    num_prompts: int | None = None
    max_new_tokens: int = 32
    draft_tokens: int = 4
    # "pair": the pair's own EOS ids; an id or a list of ids (any of them ends a row); None: never stop early
    eos_token_id: int | list[int] | None | str = "pair"
    engine_options: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = 3600.0  # seconds per run; a run past it is recorded as failed
    # black-box engines (recordings, servers): a declared noise band (equivalence/rulings/band.py)
    engine_dtype: str | None = None
    logit_tolerance: float | None = None
    bundles: bool = True  # write OUT/bundles/*.json, one repro bundle per divergence
    adversarial: bool = True  # add the adversarial prompts (equivalence/adversarial.py) to every pair's prompts
    pad_token_id: int | None = None  # the pad id the pair declares to the engines (None: the pair's own)
    require_speculation: bool = False  # a run whose engine drafted nothing (or exposes no counters) fails
    plain_engine: str | None = None  # the same engine without speculation: three-way rulings (rulings/plain.py)
    diagnosis: str = "full"  # "quick": checks and replays only; "full": re-runs of the engine too
    diagnosis_budget: float | None = None  # seconds per run for the diagnosis's re-runs (None: --timeout's)
    request_params: Any = None  # RequestParams for every prompt (live servers; blackbox/requests_run.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engines": self.engines,
            "pairs": [p if isinstance(p, str) else {"target": p.target, "draft": p.draft} for p in self.pairs],
            "batch_sizes": self.batch_sizes, "dtypes": self.dtypes, "device": self.device,
            "prompts": self.prompts, "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
            "draft_tokens": self.draft_tokens, "eos_token_id": self.eos_token_id,
            "engine_options": self.engine_options, "timeout": self.timeout,
            "engine_dtype": self.engine_dtype, "logit_tolerance": self.logit_tolerance,
            "adversarial": self.adversarial, "pad_token_id": self.pad_token_id,
            "require_speculation": self.require_speculation, "plain_engine": self.plain_engine,
            "diagnosis": self.diagnosis, "diagnosis_budget": self.diagnosis_budget,
            "request_params": self.request_params.to_dict() if self.request_params is not None else None,
        }


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


def run_audit(
    config: AuditConfig,
    out_dir: Path,
    progress: Callable[[int], Any] | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every (engine, pair, batch size, dtype) and return the audit dict (also in `out_dir/audit.json`).
    Raises `UsageError` (before any run) for bad input; see the module docstring for failures."""
    validate.preflight(config)
    requests_run.preflight(config)  # request parameters go to live servers only
    out_dir.mkdir(parents=True, exist_ok=True)
    audit: dict[str, Any] = {
        "specaudit_version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(config.device),
        "config": config.to_dict(),
        "complete": False,
        "runs": [],
    }
    json_path = out_dir / "audit.json"
    write_json(json_path, audit)
    bar = progress(len(config.engines) * len(config.pairs) * len(config.batch_sizes) * len(config.dtypes)) if progress else None
    factories_checked = False

    def record(run: dict[str, Any]) -> None:  # kept at once: a crash or Ctrl-C loses no finished run
        audit["runs"].append(run)
        write_json(json_path, audit)
        if on_run is not None:
            on_run(run)
        if bar is not None:
            bar.update(1)

    for dtype in config.dtypes:
        for pair_spec in config.pairs:
            stage = "loading the pair"
            try:
                try:
                    pair = load(pair_spec, dtype, config.device)
                except UnsupportedModel as exc:  # an architecture the engines cannot batch: bad usage
                    raise validate.UsageError(f"{exc}; audit it with the reference or a black-box engine") from exc
                if not factories_checked:
                    validate.check_factories(config, pair)  # a UsageError here ends the audit before any run
                    factories_checked = True
                # the float64 target (and draft) that rule flips below float64
                replay = pair if dtype == "float64" else load(pair_spec, "float64", config.device)
                prompts = load_prompts(config.prompts, pair.tokenizer, config.num_prompts)
                eos = pair.eos_token_id if config.eos_token_id == "pair" else config.eos_token_id
                declared_pad = config.pad_token_id
                if declared_pad is None and isinstance(config.engine_options.get("pad_token_id"), int):
                    declared_pad = config.engine_options["pad_token_id"]  # the engines' pad id: the pair's too
                if declared_pad is not None:
                    vocab = getattr(pair.target.config, "vocab_size", None)
                    if vocab is not None and declared_pad >= vocab:
                        raise validate.UsageError(f"--pad-token-id {declared_pad}: pair {pair.name} has "
                                                  f"{vocab} token ids (0 to {vocab - 1})")
                    declare_pad_token_id(pair, declared_pad)
                adversarial = None
                if config.adversarial:
                    prompts, adversarial = with_adversarial_prompts(
                        pair, prompts, eos_token_id=eos, max_new_tokens=config.max_new_tokens,
                        draft_tokens=config.draft_tokens)
                stage = "the reference (greedy decoding, one prompt at a time)"
                # recordings bring their own prompts (decoded in _one_run): skip the unused reference
                only_recordings = all(black_box_prefix(name) == "recorded" for name in config.engines)
                reference = None if only_recordings else Reference(pair, prompts, config.max_new_tokens, eos)
            except validate.UsageError:
                if bar is not None:  # no run was made: clear the bar, leave the error line alone
                    bar.leave = False
                    bar.close()
                raise
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # record every run of this pair as failed, go on with the next pair
                for run in _pair_failure(pair_spec, dtype, config, stage, exc):
                    record(run)
                pair = replay = reference = None
                continue
            audit["config"]["num_prompts"] = len(prompts)
            if reference is None:  # only recordings: each run says how many prompts its file holds
                audit["config"]["prompts"], audit["config"]["num_prompts"] = "the recordings' own", None
            plain_runs: dict[Any, dict[str, Any]] = {}  # one plain run per batch size and prompt set
            for engine_name in config.engines:
                for batch_size in config.batch_sizes:
                    if bar is not None:
                        bar.set_description(f"{engine_name} {pair.name} B={batch_size} {dtype}")
                    record(_one_run(engine_name, pair, prompts, batch_size, dtype, config, eos, reference, replay,
                                    out_dir / "bundles" if config.bundles else None, adversarial, plain_runs))
            del pair, replay, reference
    if bar is not None:
        bar.close()
    audit["complete"] = True
    write_json(json_path, audit)
    return audit


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
            return {**base, **requests_run.run_with_params(engine, pair, prompts, config, dtype, engine_name, batch_size, black_box)}
        run = audit_engine(engine, pair, prompts, max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                           dtype=dtype, reference=reference, replay_target=replay.target, engine_name=engine_name,
                           batch_size=batch_size, device=config.device, engine_dtype=config.engine_dtype,
                           logit_tolerance=config.logit_tolerance, bundle_dir=bundle_dir, context=context,
                           pad_token_id=options.get("pad_token_id", pair.pad_token_id),
                           draft_tokens=config.draft_tokens, diagnosis=config.diagnosis,
                           diagnosis_budget=config.diagnosis_budget,
                           replay_draft=replay.draft if dtype != "float64" else None)
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
    """0 when every run is equivalent, 1 when any has a structural divergence or failed, or, with
    `require_speculation`, when any run's engine did not show that it drafted."""
    if not all_passed(audit):
        return 1
    if (audit.get("config") or {}).get("require_speculation") and any(speculation.unmet(r) for r in audit["runs"]):
        return 1
    return 0

