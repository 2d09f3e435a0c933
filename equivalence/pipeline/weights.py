"""The oracle with the weights: one pair, loaded in one dtype, in this process (equivalence/pipeline/runner.py).

For the greedy judge it is the reference (plain greedy decoding of one prompt at a time, equivalence/audit.py
`Reference`; under request parameters each prompt's own processed decoding), the float64 copy that rules flips
below float64, and the pair every in-process engine is built on; each run is `audit.audit_engine`. For the
sampled judge it is the target (and draft) in float64 on the CPU, which teacher-forces every sampled token
(equivalence/pipeline/sampled.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specaudit.engines.adapters._http import ServerDied
from specaudit.engines.contract import capability
from specaudit.engines.limits import eos_ids
from specaudit.engines.models import zoo
from specaudit.engines.ops.layout import UnsupportedModel
from specaudit.engines.registry import make_engine
from specaudit.equivalence import validate
from specaudit.equivalence.adversarial import declare_pad_token_id, with_adversarial_prompts
from specaudit.equivalence.audit import Reference, RunSettings, audit_engine
from specaudit.equivalence.errors import UsageError
from specaudit.equivalence.guard import GuardedEngine, failure_message, out_of_memory
from specaudit.equivalence.pipeline.prompt_set import PromptSet, recording_specs, resolve_prompts
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair
from specaudit.equivalence.run_context import RunContext
from specaudit.equivalence.run_record import failed_run


def load(pair: str | UserPair, dtype: str, device: str) -> zoo.ModelPair:
    if isinstance(pair, UserPair):
        return zoo.load_pair(target_path=pair.target, draft_path=pair.draft, dtype=dtype, device=device,
                             trust_remote_code=pair.trust_remote_code,
                             allow_pickle_weights=pair.allow_pickle_weights)
    return zoo.load_pair(pair, dtype=dtype, device=device)


def free_device_memory(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def failed_engine_run(base: dict[str, Any], engine_name: str, batch_size: int, device: str,
                      exc: BaseException) -> dict[str, Any]:
    """The failed run of an engine that raised in its run: the device's memory freed after an out-of-memory, and a
    server that answered, then went away, said so (`server_died`, not "cannot reach")."""
    if out_of_memory(exc):
        free_device_memory(device)
    failed = failed_run(base, failure_message(engine_name, exc, batch_size=batch_size, device=device), exc)
    if isinstance(exc, ServerDied):
        failed["server_died"] = exc.details
    return failed


def preflight(settings: AuditSettings) -> None:
    """The weights' inputs before a model is loaded: numbers, dtypes, the device, each pair's EOS ids and the
    prompts against each pair's vocabulary and positions (`UsageError`, exit 2)."""
    validate.preflight(settings)


class WeightsOracle:
    """The runs judged against the in-process reference: one pair, loaded in one dtype."""

    def __init__(self, settings: AuditSettings, pair_spec: str | UserPair, dtype: str, out_dir: Path, *,
                 check_factories: bool = True) -> None:
        self.settings, self.pair_spec, self.dtype, self.out_dir = settings, pair_spec, dtype, out_dir
        self.check_factories = check_factories
        self.loaded = False  # the pair loaded and its engines' factories checked
        self.title = f"{pair_spec if isinstance(pair_spec, str) else pair_spec.name} {dtype}"
        self.stage = "loading the pair"
        self.pair = self.replay = self.reference = self.eos = None
        self.prompt_set: PromptSet | None = None
        self.plain_runs: dict[Any, dict[str, Any]] = {}  # one plain run per batch size and prompt set
        self.sampled: dict[str, Any] = {}  # the sampled judge's engines, built before any draw
        self.oracle_pair = None  # the sampled judge's float64 pair on the CPU
        self.per_run_prompts = False  # every engine a recording: each run is audited on its own recording's prompts

    @property
    def prompts(self) -> list[list[int]] | None:
        return None if self.prompt_set is None else self.prompt_set.prompts

    def _load(self) -> zoo.ModelPair:
        try:
            self.pair = load(self.pair_spec, self.dtype, self.settings.device)
        except UnsupportedModel as exc:  # an architecture the engines cannot batch: bad usage
            raise UsageError(f"{exc}; audit it with the reference or a black-box engine") from exc
        return self.pair

    # ---- the greedy judge ----------------------------------------------------------------------------
    def open_greedy(self) -> None:
        settings, dtype = self.settings, self.dtype
        pair = self._load()
        if self.check_factories:
            validate.check_factories(settings, pair)  # a UsageError here ends the audit before any run
        self.loaded = True
        # the float64 target (and draft) that rule flips below float64
        self.replay = pair if dtype == "float64" else load(self.pair_spec, "float64", settings.device)
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
        recordings = recording_specs(settings.engines)
        self.prompt_set = resolve_prompts(
            settings, tokenizer=pair.tokenizer,
            # the weights decode any prompt: recordings define the set only where every engine is one
            from_recordings=recordings if len(recordings) == len(settings.engines) else (),
            adversarial=lambda prompts: with_adversarial_prompts(
                pair, prompts, eos_token_id=eos, max_new_tokens=settings.max_new_tokens,
                draft_tokens=settings.draft_tokens))
        self.stage = "the reference (greedy decoding, one prompt at a time)"
        # a recording is audited on its own prompts (its run decodes those): no reference for the group's
        self.per_run_prompts = bool(recordings) and len(recordings) == len(settings.engines)
        # under request parameters each run decodes the reference under them (its engine's penalty scope)
        self.reference = (None if self.per_run_prompts or self.prompt_set.requests is not None
                          else Reference(pair, self.prompt_set.prompts, settings.max_new_tokens, eos))
        self.eos = eos

    def greedy_run(self, engine_name: str, batch_size: int) -> dict[str, Any]:
        """One guarded greedy run of `engine_name` at `batch_size` (equivalence/audit.py `audit_engine`)."""
        settings, pair, dtype, eos = self.settings, self.pair, self.dtype, self.eos
        prompt_set = self.prompt_set
        base = {"engine": engine_name, "mode": "greedy", "pair": pair.name, "batch_size": batch_size, "dtype": dtype,
                "device": settings.device, "num_prompts": len(prompt_set.prompts),
                "eos_token_ids": list(eos_ids(eos)),  # the set the run stopped at (config "pair": the pair's own)
                "pair_info": dict(pair.info)}  # layouts and float64 switches (eager experts, float64 softmax)
        try:
            options = {"pad_token_id": pair.pad_token_id, "record_logits": True, **settings.engine_options}
            engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size,
                                 draft_tokens=settings.draft_tokens, **options)
            reference = self.reference
            recorded = capability(engine, "recorded_prompts")
            if recorded is not None:  # a recording brings its own prompts: the reference decodes those
                prompt_set = prompt_set.for_recording(recorded, settings.num_prompts)
                base["num_prompts"] = len(prompt_set.prompts)
                reference = Reference(pair, prompt_set.prompts, settings.max_new_tokens, eos)
            prompts = prompt_set.prompts
            # what the audit may run besides the engine's one call: fresh engines for the crash isolation and
            # the diagnosis (their re-runs share --diagnosis-budget, else --timeout), and the plain run
            budget = settings.diagnosis_budget if settings.diagnosis_budget is not None else settings.timeout
            context = RunContext(pair, [list(p) for p in prompts], settings.max_new_tokens, eos, dtype, batch_size,
                                 engine_name=engine_name, engine=engine, draft_tokens=settings.draft_tokens,
                                 options=options, timeout=settings.timeout, rerun_budget=budget,
                                 plain_engine=settings.plain_engine, plain_runs=self.plain_runs,
                                 rerunnable=recorded is None)
            engine = GuardedEngine(engine, timeout=settings.timeout,
                                   vocab_size=getattr(pair.target.config, "vocab_size", None))
            run_settings = RunSettings(
                max_new_tokens=settings.max_new_tokens, eos_token_id=eos, dtype=dtype, engine_name=engine_name,
                batch_size=batch_size, device=settings.device, engine_dtype=settings.engine_dtype,
                logit_tolerance=settings.logit_tolerance,
                pad_token_id=options.get("pad_token_id", pair.pad_token_id), draft_tokens=settings.draft_tokens,
                diagnosis=settings.diagnosis, diagnosis_budget=settings.diagnosis_budget,
                speculation=settings.speculation, acceptance_baseline=settings.acceptance_baseline,
                require_acceptance=settings.require_acceptance, payoff_repeats=settings.payoff,
                requests=None if prompt_set.requests is None else tuple(prompt_set.requests))
            run = audit_engine(engine, pair, prompts, run_settings, reference=reference,
                               replay_target=self.replay.target,
                               replay_draft=self.replay.draft if dtype != "float64" else None,
                               bundle_dir=self.out_dir / "bundles" if settings.bundles else None, context=context)
            run.update({k: v for k, v in base.items() if k not in run or run[k] is None})
            run["adversarial"] = prompt_set.adversarial
            return run
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one engine failing must not lose the others' runs
            return failed_engine_run(base, engine_name, batch_size, settings.device, exc)

    # ---- the sampled judge ---------------------------------------------------------------------------
    def open_sampled(self) -> None:
        """The oracle is the target (and draft) in float64 on the CPU, teacher forcing; every engine is built
        before any draw (a name, file or factory that fails is bad usage)."""
        from specaudit.equivalence.pipeline import sampled

        pair = self._load()
        self.oracle_pair, self.prompt_set, self.eos, self.sampled = sampled.open_pair(
            self.settings, pair, self.pair_spec, self.dtype)

    def sampled_run(self, engine_name: str, batch_size: int, progress: Any = None) -> dict[str, Any]:
        from specaudit.equivalence.pipeline import sampled

        return sampled.pair_run(self.settings, engine_name, self.sampled[engine_name], self.pair, self.oracle_pair,
                                self.prompt_set.prompts, self.eos, batch_size, self.dtype, progress)

    # ---- both ----------------------------------------------------------------------------------------
    def describe(self, audit: dict[str, Any]) -> None:
        audit["config"]["num_prompts"] = len(self.prompts) if self.prompts is not None else None
        if self.per_run_prompts:  # each run says how many
            audit["config"]["prompts"], audit["config"]["num_prompts"] = "the recordings' own", None

    def failed_runs(self, exc: BaseException) -> list[dict[str, Any]]:
        settings = self.settings
        name = self.pair_spec if isinstance(self.pair_spec, str) else self.pair_spec.name
        if out_of_memory(exc):
            free_device_memory(settings.device)
            why = f"out of memory on {settings.device} during {self.stage} (batch size 1)"
        else:
            why = f"{self.stage} failed: {type(exc).__name__}: {exc}"
        message = f"pair {name} in {self.dtype}: {why}; no engine was run on it"
        return [failed_run({"engine": engine_name, "pair": name, "batch_size": batch_size, "dtype": self.dtype,
                            "device": settings.device, "num_prompts": settings.num_prompts or 0}, message, exc)
                for engine_name in settings.engines for batch_size in settings.batch_sizes]

    def close(self) -> None:
        self.pair = self.replay = self.reference = self.oracle_pair = None
        self.sampled = {}
        free_device_memory(self.settings.device)
