"""The served oracle (`specaudit audit --engine E --reference R [--tokenizer DIR]`): no weights in the process.

The reference is an engine of the same model with speculation off (a plain vLLM, SGLang, llama.cpp or TensorRT-LLM
server, or a recording of one). `ServedOracle` is the pipeline's oracle for it (equivalence/pipeline/runner.py):

1. `open`: the prompts, in the served model's tokens (`--tokenizer DIR`: its tokenizer and config files, never
   its weights; or a prompts file of ids; a recording's own prompts), with the adversarial prompts sized from
   DIR's config; then the reference, behind the guard (`--timeout`, the output contract):
   - greedy: asked twice: one prompt at a time (unless `--reference-batch-invariant` says it answers alike at
     any batch, then `--batch-size` at once), then every prompt in flight at once in reverse order; the first
     run is the reference, the two runs' disagreement its determinism (`audit.json` `reference.determinism`);
   - sampled: asked once for the log-probabilities of the first prompt (`prompt_logprobs`, vLLM), the call
     every sampled token's teacher forcing makes.
   A reference that fails or hangs raises `ReferenceFailed`: the audit ends, exit 1, one line.
2. `run`: each audited engine at each batch size, guarded; greedy: its outputs ruled by `rulings/served.py`
   (exact, numerical where the reference's margin lies within the band measured for this deployment,
   structural otherwise), each a `records.Divergence` of the one divergence schema (rulings/record.py), and its
   reports (usage, finish_reason, log-probabilities) checked against the reference server's; sampled: its
   samples teacher-forced through the reference (equivalence/sampling/served.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.engines.contract import capability
from specaudit.engines.limits import eos_ids
from specaudit.engines.registry import black_box_prefix, make_engine
from specaudit.equivalence.errors import ReferenceFailed, UsageError, one_line
from specaudit.equivalence.guard import GuardedEngine, call_with_timeout, check_recorded_samples, failure_message
from specaudit.equivalence.pipeline import sampled
from specaudit.equivalence.pipeline.settings import AuditSettings, source_of
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.records.serialize import divergence_to_json
from specaudit.equivalence.rulings import served as served_rulings
from specaudit.equivalence.run_record import equivalent, failed_run, run_record

RERUN_IN_FLIGHT = 16  # the reference's second run: every prompt in flight at once, at most this many
TEACHER_FORCE_TOP = 20  # vLLM's default max_logprobs


@dataclass
class Served:
    """What the tokenizer folder says about the served model (config files only)."""

    tokenizer: Any
    eos_token_id: Any
    pad_token_id: int | None
    bos_token_id: int | None
    vocab_size: int | None
    max_positions: int | None


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_served(folder: str | None) -> Served:
    """The tokenizer and config of `folder` (no weights are read); all None without a folder."""
    if folder is None:
        return Served(None, None, None, None, None, None)
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"--tokenizer {folder}: no such folder; give the served model's folder (its tokenizer "
                         "and config files are enough)")
    from specaudit.engines.models.model_files import has_tokenizer_files

    if not has_tokenizer_files(path):
        raise UsageError(f"--tokenizer {folder}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...) "
                         "in it; give the served model's folder")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise UsageError(f"--tokenizer {folder}: transformers cannot load its tokenizer ({one_line(str(exc))})") from None
    config, generation = _json(path / "config.json"), _json(path / "generation_config.json")
    config = config.get("text_config", config) if "vocab_size" not in config else config
    eos = generation.get("eos_token_id", config.get("eos_token_id", tokenizer.eos_token_id))
    ids = eos_ids(eos)
    pad = config.get("pad_token_id", generation.get("pad_token_id"))
    if pad is None:
        pad = ids[0] if ids else None
    bos = config.get("bos_token_id", tokenizer.bos_token_id)
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    return Served(tokenizer, (ids[0] if len(ids) == 1 else ids) if ids else None, pad, bos,
                  config.get("vocab_size"), config.get("max_position_embeddings"))


# ---- asking an engine ------------------------------------------------------------------------------

def build(spec: str, batch_size: int, settings: AuditSettings, top_logprobs: int | None = None) -> Any:
    options = dict(settings.engine_options)
    if top_logprobs is not None:
        options["top_logprobs"] = top_logprobs
    engine = make_engine(spec, None, None, batch_size=batch_size, draft_tokens=settings.draft_tokens, **options)
    if settings.request_params is not None:
        from specaudit.engines.contract import declares

        if not declares(engine, "request_params"):
            raise UsageError(f"{spec} takes no request parameters (a recording answers as it was recorded): drop "
                             "the request parameters, or audit the live server")
        engine.request_params = settings.request_params
    return engine


def ask(engine: Any, prompts: list[list[int]], max_new_tokens: int, eos: Any, *, timeout: float | None,
        vocab_size: int | None, order: list[int] | None = None) -> dict[str, Any]:
    """`engine.generate` on `prompts` behind the guard (`timeout` seconds, the output contract), sent in
    `order`, answers put back in prompt order: outputs, per-token top log-probabilities, what it reported
    beside them, its speculation counters, seconds."""
    order = list(range(len(prompts))) if order is None else order
    guarded = GuardedEngine(engine, timeout=timeout, vocab_size=vocab_size)
    started = time.perf_counter()
    outputs = guarded.generate([list(prompts[i]) for i in order], max_new_tokens, eos)
    seconds = time.perf_counter() - started
    back = {position: i for i, position in enumerate(order)}

    def put_back(values: list[Any] | None) -> list[Any]:
        values = list(values or [])
        return [values[back[i]] if back[i] < len(values) else None for i in range(len(prompts))]

    completions = put_back(capability(engine, "last_completions"))  # a server engine's own
    details = put_back(capability(engine, "last_details"))
    reports = []
    for completion, detail in zip(completions, details):
        report = dict(completion.report if completion is not None else {})
        if detail:
            report["returned_tokens"] = detail.get("returned_tokens")
            report["client_notes"] = detail.get("notes")
        reports.append(report)
    failures = {order[i]: str(exc) for i, exc in capability(engine, "last_failures")}
    describe = capability(engine, "describe")
    return {"outputs": put_back(outputs), "logprobs": put_back(capability(engine, "last_logprobs")),
            "reports": reports, "failures": failures, "seconds": seconds,
            "speculation": capability(engine, "last_speculation"),
            "description": describe() if callable(describe) else None}


def teacher_forcer(engine: Any, eos: Any, timeout: float | None, top: int = TEACHER_FORCE_TOP):
    """(prompt + prefix, token) -> {token id: log-probability} at the prefix, through the engine's own
    teacher forcing (`logprobs_at`: vLLM's `prompt_logprobs`, exact for any token; other servers' top `top`
    at the prefix), each call behind `timeout`; None for an engine without it (a recording)."""
    at = capability(engine, "logprobs_at")
    if not callable(at):
        return None
    return lambda prefix, token: call_with_timeout(at, (list(prefix), int(token), eos, top), timeout)


# ---- the prompts ------------------------------------------------------------------------------------

def served_eos(settings: AuditSettings, served_model: Served) -> Any:
    return served_model.eos_token_id if settings.eos_token_id == "pair" else settings.eos_token_id


def served_prompts(settings: AuditSettings, served_model: Served, *, adversarial: bool, unique: bool) -> Any:
    """The group's prompt set (equivalence/pipeline/prompt_set.py): a recording (an audited engine's or the
    reference's) brings its own prompts, unless a prompts file is given; the adversarial cases are sized from the
    served model's config where `adversarial`."""
    from specaudit.equivalence.adversarial import adversarial_prompts
    from specaudit.equivalence.pipeline.prompt_set import recording_specs, resolve_prompts

    def additions(prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
        cases, skipped = adversarial_prompts(
            [t for p in prompts for t in p], pad_token_id=served_model.pad_token_id,
            eos_token_id=served_eos(settings, served_model), bos_token_id=served_model.bos_token_id,
            max_positions=served_model.max_positions, max_new_tokens=settings.max_new_tokens,
            draft_tokens=settings.draft_tokens)
        first = len(prompts)
        return prompts + [list(c.tokens) for c in cases], {
            "first_index": first, "skipped": skipped,
            "cases": [{"prompt_index": first + i, **c.describe()} for i, c in enumerate(cases)]}

    recordings = recording_specs([*settings.engines, settings.reference])
    if settings.prompts == "builtin" and not recordings and served_model.tokenizer is None:
        raise UsageError("--reference with the built-in prompts needs the served model's tokenizer: give "
                         "--tokenizer DIR, or --prompts FILE with input_ids")
    # the reference is asked once for the group's prompts: every recording defines them
    return resolve_prompts(settings, tokenizer=served_model.tokenizer, vocab_size=served_model.vocab_size,
                           max_positions=served_model.max_positions, unique=unique, with_requests=False,
                           from_recordings=recordings,
                           adversarial=additions if adversarial else None)


def preflight(settings: AuditSettings) -> None:
    if not black_box_prefix(settings.reference):
        raise UsageError(f"--reference {settings.reference}: give a served or recorded engine (vllm:URL, sglang:URL, "
                         "llamacpp:URL, trtllm:URL or recorded:FILE); an in-process reference is --target")
    inprocess = [spec for spec in settings.engines if not black_box_prefix(spec)]
    if inprocess:
        raise UsageError(f"--reference audits served or recorded engines only: engine {inprocess[0]} runs in this "
                         "process and needs the weights (give --target instead of --reference)")


def sampled_refusal(settings: AuditSettings) -> str | None:
    """Why a served reference cannot teacher-force these sampled settings, or None."""
    sampling = settings.sampling
    if sampling.temperature != 1.0 or sampling.top_p != 1.0 or sampling.top_k != 0:
        return (f"--reference with --temperature {sampling.temperature:g} (top-p {sampling.top_p:g}, "
                f"top-k {sampling.top_k}): the reference's prompt log-probabilities describe "
                "temperature 1 without cuts; give --temperature 1 (no --top-p, --top-k), or --target "
                "for other settings")
    if black_box_prefix(settings.reference) != "vllm":
        return (f"--reference {settings.reference}: the sampled audit teacher-forces through "
                "prompt_logprobs, which only vllm:URL gives here")
    return None


def reference_failure(spec: str, exc: BaseException) -> str:
    """Why the served reference failed, in one line."""
    from specaudit.equivalence.errors import EngineFailure, RunTimeout

    if isinstance(exc, RunTimeout):
        return f"the reference {spec} did not answer: {exc}"
    if isinstance(exc, EngineFailure):
        return f"the reference {spec} broke the output contract: {exc}"
    return f"the reference {spec} failed: {type(exc).__name__}: {exc}"


# ---- the group ---------------------------------------------------------------------------------------

class ServedOracle:
    """The runs judged against a served reference (module docstring)."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self.title = "served"
        # the served model, by its tokenizer folder's name (or the reference's spec)
        self.name = Path(settings.tokenizer).name if settings.tokenizer else settings.reference
        self.prompts: list[list[int]] = []
        self.record: dict[str, Any] = {"engine": settings.reference, "error": None}
        self.sampled_engines: dict[str, Any] = {}

    def _open(self, *, adversarial: bool, unique: bool) -> None:
        settings = self.settings
        self.served_model = load_served(settings.tokenizer)
        self.eos = served_eos(settings, self.served_model)
        prompt_set = served_prompts(settings, self.served_model, adversarial=adversarial, unique=unique)
        self.prompts, self.adversarial = prompt_set.prompts, prompt_set.adversarial

    def open_greedy(self) -> None:
        settings = self.settings
        self._open(adversarial=True, unique=False)
        first_batch = max(settings.batch_sizes) if settings.reference_batch_invariant else 1
        second_batch = max(first_batch, min(RERUN_IN_FLIGHT, len(self.prompts)))
        self.record["asked"] = (f"{first_batch} prompts in flight (declared batch-invariant)"
                                if settings.reference_batch_invariant else "one prompt at a time")
        engine = build(settings.reference, first_batch, settings, settings.reference_top_logprobs)
        rerun_engine = build(settings.reference, second_batch, settings, settings.reference_top_logprobs)
        vocab = self.served_model.vocab_size
        try:
            first = ask(engine, self.prompts, settings.max_new_tokens, self.eos, timeout=settings.timeout,
                        vocab_size=vocab)
            second = ask(rerun_engine, self.prompts, settings.max_new_tokens, self.eos, timeout=settings.timeout,
                         vocab_size=vocab, order=list(reversed(range(len(self.prompts)))))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a reference that fails or hangs: nothing can be judged
            raise ReferenceFailed(reference_failure(settings.reference, exc)) from exc
        if first["failures"]:
            raise ReferenceFailed(f"the reference {settings.reference} failed on {len(first['failures'])} prompt(s): "
                                  + next(iter(first["failures"].values())))
        self.first, self.second = first, second
        self.determinism = served_rulings.rerun_disagreement(first["outputs"], second["outputs"], first["logprobs"],
                                                             second["logprobs"])
        requests = len(self.prompts)
        self.record.update({
            "description": first["description"], "outputs": first["outputs"],
            "runs": [{"in_flight": first_batch, "order": "prompt order", "seconds": first["seconds"],
                      "seconds_per_request": first["seconds"] / requests, "failures": first["failures"]},
                     {"in_flight": second_batch, "order": "reversed", "seconds": second["seconds"],
                      "seconds_per_request": second["seconds"] / requests, "failures": second["failures"]}],
            "determinism": self.determinism,
            "speculation": first["speculation"],
            "prompts_with_logprobs": sum(lp is not None for lp in first["logprobs"]),
        })
        self.force = teacher_forcer(engine, self.eos, settings.timeout)

    def open_sampled(self) -> None:
        self._open(adversarial=False, unique=True)  # one recorded line per sample: each prompt once
        from specaudit.engines.adapters.sampled_servers import make_sampled_server
        from specaudit.engines.sampling.process import SamplingParams
        from specaudit.equivalence.sampling.served import TOP

        settings = self.settings
        self.record["asked"] = f"prompt log-probabilities (its top {TOP} and the sampled token)"
        try:
            self.reference = make_engine(settings.reference, None, None, batch_size=1, draft_tokens=1,
                                         **settings.engine_options)
            self.sampled_engines = {spec: (sampled.recorded_samples(spec) if source_of(spec) == "recording" else
                                           make_sampled_server(spec, SamplingParams(temperature=1.0),
                                                               seed=settings.sampling.seed,
                                                               batch_size=settings.batch_sizes[0],
                                                               **settings.engine_options))
                                    for spec in settings.engines}
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        try:  # the call every teacher forcing makes, once, behind the guard
            call_with_timeout(self.reference.prompt_logprobs, (list(self.prompts[0]), self.eos, TOP), settings.timeout)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ReferenceFailed(reference_failure(settings.reference, exc)) from exc

    def describe(self, audit: dict[str, Any]) -> None:
        audit["reference"] = self.record
        audit["num_prompts"] = len(self.prompts)
        audit["adversarial"] = self.adversarial
        audit["config"].update(num_prompts=len(self.prompts), eos_token_id=self.eos, pairs=[self.name])

    def failed_runs(self, exc: BaseException) -> list[dict[str, Any]]:
        return [failed_run(self._base(spec, batch_size), failure_message(spec, exc, batch_size=batch_size,
                                                                         device="server"), exc)
                for spec in self.settings.engines for batch_size in self.settings.batch_sizes]

    def _base(self, spec: str, batch_size: int) -> dict[str, Any]:
        return {"engine": spec, "pair": self.name, "batch_size": batch_size, "dtype": "served", "device": "server",
                "num_prompts": len(self.prompts)}

    def greedy_run(self, spec: str, batch_size: int) -> dict[str, Any]:
        try:
            return self._greedy_run(spec, batch_size)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine that fails or hangs: a failed run, the others judged
            return failed_run({**self._base(spec, batch_size), "mode": "greedy"},
                              failure_message(spec, exc, batch_size=batch_size, device="server"), exc)

    def _greedy_run(self, spec: str, batch_size: int) -> dict[str, Any]:
        settings, prompts, eos, first, second = self.settings, self.prompts, self.eos, self.first, self.second
        engine = build(spec, batch_size, settings)
        answered = ask(engine, prompts, settings.max_new_tokens, eos,
                       timeout=settings.timeout, vocab_size=self.served_model.vocab_size)
        outputs, reference = answered["outputs"], first["outputs"]
        gap = served_rulings.engine_logprob_gap(reference, outputs, first["logprobs"], answered["logprobs"])
        band = served_rulings.measure_band(self.determinism, gap, logit_tolerance=settings.logit_tolerance,
                                           engine_dtype=settings.engine_dtype)
        divergences: list[Divergence] = []
        for index, (prompt, ref, out) in enumerate(zip(prompts, reference, outputs)):
            if index in answered["failures"]:
                divergences.append(served_rulings.request_failed(index, answered["failures"][index], prompt, ref, out))
                continue
            ref_report = first["reports"][index] if index < len(first["reports"]) else {}
            record = served_rulings.rule(index, prompt, ref, out, eos_token_id=eos, reference_lps=first["logprobs"][index],
                                         band=band, all_references=reference, second_reference=second["outputs"][index],
                                         teacher_force=self.force, params=settings.request_params,
                                         reference_report=ref_report)
            if record is not None:
                divergences.append(record)
            divergences += served_rulings.report_findings(index, prompt, ref, out, answered["reports"][index] or {},
                                                          first["logprobs"][index], band, eos,
                                                          reference_finish=(ref_report or {}).get("finish_reason"))
            params = settings.request_params
            if params is not None and params.constraint is not None and index not in answered["failures"]:
                # the output against its own constraint: a finding of its own, whatever the served reference says
                from specaudit.equivalence.blackbox.constraints import violation_finding

                stops = sorted(set(eos_ids(eos)) | set(params.stop_token_ids))
                broken = violation_finding(index, params, out, stops, self.served_model.tokenizer, prompt)
                if broken is not None:
                    divergences.append(broken)
        structural = sum(d.structural for d in divergences)
        written = [divergence_to_json(d) for d in divergences]  # the run's divergences, serialized once
        from specaudit.equivalence.acceptance import counters

        acceptance = counters.served_record(engine, answered["speculation"], settings.require_acceptance)
        run = run_record(**self._base(spec, batch_size), seconds=answered["seconds"],
                         seconds_per_request=answered["seconds"] / max(1, len(prompts)),
                         description=answered["description"], speculation=answered["speculation"], outputs=outputs,
                         noise_band=band.to_dict(), divergences=written,
                         exact_matches=sum(ref == out for ref, out in zip(reference, outputs)),
                         structural_divergences=structural,
                         numerical_divergences=sum(d.kind == "numerical" for d in divergences),
                         equivalent=equivalent(written), eos_token_ids=list(eos_ids(eos)), acceptance=acceptance)
        return run

    def sampled_run(self, spec: str, batch_size: int, progress: Any = None) -> dict[str, Any]:
        from specaudit.equivalence.sampling.run import failed_report, sampled_run
        from specaudit.equivalence.sampling.served import served_sampled_audit

        settings, sampling = self.settings, self.settings.sampling
        started = time.perf_counter()
        engine, recorded = self.sampled_engines[spec], None
        if source_of(spec) == "recording":  # its samples are checked as an engine's outputs are
            recorded, engine = engine, None
        try:  # behind the guard: a time limit on the engine and on each reference call, the output contract
            if recorded is not None:
                recorded = check_recorded_samples(recorded, self.served_model.vocab_size)
            result = served_sampled_audit(
                None if engine is None else GuardedEngine(engine, timeout=settings.timeout,
                                                          vocab_size=self.served_model.vocab_size),
                TimedReference(self.reference, settings.timeout), self.prompts, samples=sampling.samples,
                max_new_tokens=settings.max_new_tokens, eos_token_id=self.eos, seed=sampling.seed,
                alpha=sampling.alpha, recorded=recorded)
            result["seconds"] = {"sampling and testing": time.perf_counter() - started}
            result["acceptance"] = served_acceptance(engine, result.get("speculation"), settings)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a server that fails: a failed run, the others judged
            result = failed_report(spec, exc, batch_size=batch_size, device="server",
                                   seconds=time.perf_counter() - started)
        base = self._base(spec, batch_size)
        return sampled_run(base, result)

    def close(self) -> None:
        self.sampled_engines = {}


def served_acceptance(engine: Any, speculation: dict[str, Any] | None, settings: AuditSettings) -> dict[str, Any]:
    """A served sampled run's acceptance record: the server's own counters (equivalence/acceptance/counters.py)
    against `--acceptance-baseline` where given; else no expectation (no draft weights to teacher-force)."""
    from specaudit.equivalence.acceptance import counters
    from specaudit.equivalence.acceptance.expected import from_baseline
    from specaudit.equivalence.acceptance.run import baseline_for, load_baseline
    from specaudit.equivalence.acceptance.sampled import sampled_record

    observed = counters.of_run(engine, None, speculation) if engine is not None else None
    baseline = None
    if settings.acceptance_baseline is not None:
        found = baseline_for(load_baseline(settings.acceptance_baseline), "", "", None, "")
        baseline = None if found is None else from_baseline(found[0], f"{settings.acceptance_baseline}: {found[1]}")
    return sampled_record(None, None, None, observed=observed, exact=False, required=settings.require_acceptance,
                          baseline=baseline, unavailable="a served reference gives no draft distribution to "
                          "teacher-force: give --acceptance-baseline to compare the counters")


class TimedReference:
    """A served reference whose teacher-forcing calls (`prompt_logprobs`) each run behind `timeout`."""

    def __init__(self, reference: Any, timeout: float | None) -> None:
        self.reference, self.timeout = reference, timeout

    def prompt_logprobs(self, *args: Any) -> Any:
        return call_with_timeout(self.reference.prompt_logprobs, args, self.timeout)
