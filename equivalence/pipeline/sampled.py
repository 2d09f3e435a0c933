"""The sampled judge against the in-process oracle: a pair's target (and draft) in float64 on the CPU, which
teacher-forces every sampled token (equivalence/sampling/). The pipeline's `WeightsOracle` (pipeline/weights.py) opens it once per pair
(`open_pair`) and asks it for one run per engine (`pair_run`); the run is guarded as every run is
(equivalence/sampling/run.py `guarded_sampled_audit`: `--timeout`, the output contract, a failed run).

A recording (`recorded:FILE`, one line per sample, its prompt repeated) brings its own prompts: where every
engine is a recording and no prompt file is given, the prompts are the recordings' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specaudit.equivalence.errors import UsageError
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair, source_of


def recorded_samples(spec: str) -> list[tuple[list[int], list[int]]]:
    """A recording's samples (one line per sample, its prompt repeated): (prompt, tokens)."""
    from specaudit.engines.adapters.recorded import read_recording

    return [(line.prompt_ids, line.output_ids) for line in read_recording(spec.partition(":")[2])]


def _float64_copy_fits(pair: Any) -> tuple[bool, float, float | None]:
    """Whether a float64 copy of the pair fits in the host's available memory: (fits, GiB needed, GiB free)."""
    models = [m for m in (pair.target, pair.draft) if m is not None]
    needed = sum(p.numel() for m in models for p in m.parameters()) * 8 / 2 ** 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) / 2 ** 20
                return needed < 0.8 * free, needed, free
    except OSError:
        pass
    return True, needed, None


def _load(pair_spec: str | UserPair, dtype: str, device: str) -> Any:
    from specaudit.engines.models.zoo import load_pair

    if isinstance(pair_spec, str):
        return load_pair(pair_spec, dtype=dtype, device=device)
    return load_pair(target_path=pair_spec.target, draft_path=pair_spec.draft or pair_spec.target, dtype=dtype,
                     device=device, trust_remote_code=pair_spec.trust_remote_code,
                     allow_pickle_weights=pair_spec.allow_pickle_weights)


def sampling_params(settings: AuditSettings) -> Any:
    from specaudit.engines.sampling.process import SamplingParams

    sampling, common = settings.sampling, settings.request_params
    return SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          min_p=common.min_p if common is not None else 0.0)


# request parameters the sampled judge cannot apply: what each would need
UNSAMPLED_FIELDS = {"stop": "stop strings end a sample on its text, which the sampled tests do not read",
                    "stop_token_ids": "a stop id ends a sample; the sampled tests end samples at EOS alone",
                    "max_tokens": "give --max-new-tokens, every sample's budget",
                    "logprobs": "the sampled audit tests tokens, not reported probabilities",
                    "seed": "the run seeds every request itself (--seed)"}


def prompt_requests(settings: AuditSettings, count: int, tokenizer: Any, *, served: bool = False) -> list[Any] | None:
    """One `RequestParams` per prompt: the sampler's temperature, top-k and top-p, the command line's request
    parameters (penalties, logit bias, bad words, min_tokens, min-p) and a prompts file line's `params` over
    them; bad words resolved to ids with the target's tokenizer. None when nothing but the sampler is asked
    (every engine then samples as before). `UsageError` for a parameter the sampled judge cannot apply."""
    from specaudit.engines.requests import RequestParams, with_bad_words_resolved
    from specaudit.equivalence.pipeline import prompt_set

    sampling = settings.sampling
    sampler = RequestParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    common = sampler.merged(settings.request_params) if settings.request_params is not None else sampler
    params = prompt_set.prompt_requests(settings, count, None, common=common)  # each line's params over the sampler's
    if params is None or all(p == sampler for p in params):  # --top-k alone: the sampler's own cut, as before
        return None
    if served:  # against a served reference
        raise UsageError("request parameters with --temperature need the weights (--pair, or --target): a served "
                         "reference's log-probabilities are the raw model's, before any penalty")
    for number, p in enumerate(params, 1):
        refused = next((name for name in p.sent() if name in UNSAMPLED_FIELDS), None)
        if refused is not None:
            raise UsageError(f"prompt {number}: {refused} is not applied by the sampled audit (--temperature): "
                             f"{UNSAMPLED_FIELDS[refused]}; drop it")
    return [with_bad_words_resolved(p, tokenizer) for p in params]


def preflight(settings: AuditSettings, *, served: bool = False) -> None:
    """`UsageError` for request parameters the sampled judge cannot apply, before a model is loaded (the
    prompts file's `params` of every line, the command line's); `served`: against a served reference."""
    from specaudit.equivalence.blackbox.requests_run import has_request_params

    if not has_request_params(settings.prompts, settings.request_params):
        return
    from specaudit.equivalence.blackbox.requests_run import file_params

    lines = max(1, len(file_params(settings.prompts)))
    prompt_requests(settings, lines, None, served=served)


def open_pair(settings: AuditSettings, pair: Any, pair_spec: str | UserPair, dtype: str
              ) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(the float64 oracle pair, the prompt set, the EOS ids, each engine built or its recorded samples);
    `UsageError` for what cannot run (a float64 copy that does not fit, EOS ids or prompts outside the
    vocabulary, an engine that cannot be built)."""
    from specaudit.equivalence import validate
    from specaudit.engines.registry import make_engine

    device, sampling = settings.device, settings.sampling
    on_cpu_in_float64 = dtype == "float64" and torch.device(device).type == "cpu"
    if not on_cpu_in_float64:
        fits, needed, free = _float64_copy_fits(pair)
        if not fits:
            raise UsageError(f"teacher forcing needs the pair in float64 on the CPU ({needed:.1f} GiB) and "
                             f"{free:.1f} GiB are free: audit a smaller model of the same architecture")
    oracle = pair if on_cpu_in_float64 else _load(pair_spec, "float64", "cpu")
    vocab_size = pair.target.config.vocab_size
    validate.check_eos_ids(settings.eos_token_id, validate.PairLimits(pair.name, vocab_size, None, None))
    eos = pair.eos_token_id if settings.eos_token_id == "pair" else settings.eos_token_id
    built: dict[str, Any] = {}
    for spec in settings.engines:
        try:
            built[spec] = (recorded_samples(spec) if source_of(spec) == "recording"
                           else make_engine(spec, pair.target, pair.draft, sampling=sampling_params(settings),
                                            seed=sampling.seed, draft_tokens=settings.draft_tokens,
                                            batch_size=settings.batch_sizes[0], **settings.engine_options))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad name, file or factory: one line, exit 2
            what = str(exc) if isinstance(exc, (ValueError, ImportError, OSError)) else f"{type(exc).__name__}: {exc}"
            raise UsageError(f"engine {spec}: {what}" if spec not in what else what) from None
    from specaudit.equivalence.pipeline.prompt_set import recording_specs, resolve_prompts

    recordings = recording_specs(settings.engines)
    prompt_set = resolve_prompts(  # a recording holds one line per sample: each prompt once
        settings, tokenizer=pair.tokenizer, vocab_size=vocab_size, unique=True, with_requests=False,
        from_recordings=recordings if len(recordings) == len(settings.engines) else ())
    prompts = prompt_set.prompts
    asked = prompt_requests(settings, len(prompts), pair.tokenizer)
    if asked is not None:
        from specaudit.engines.contract import declares

        for spec, engine in built.items():
            if source_of(spec) != "recording" and not declares(engine, "request_params"):
                raise UsageError(f"engine {spec} takes no request parameters (it declares no `request_params`): "
                                 "audit it with the temperature and cuts alone, or drop the request parameters")
        _check_constraints(built, [p.constraint for p in asked if p.constraint is not None])
    return oracle, prompt_set, eos, built


def _check_constraints(built: dict[str, Any], constraints: list[Any]) -> None:
    """`UsageError` for an engine that would drop a constraint: a server whose dialect cannot carry it, an
    in-process engine that declares no `takes_constraints`, a recording (what was asked of it is unknown)."""
    from specaudit.equivalence.blackbox.constraints import constraint_refusal

    for spec, engine in built.items():
        server = getattr(engine, "server", engine)  # a sampled server wraps the dialect's engine
        recording = source_of(spec) == "recording"
        why = constraint_refusal(spec, constraints, dialect=None if recording else getattr(server, "dialect", None),
                                 recording=recording, takes_constraints=bool(getattr(engine, "takes_constraints", False)),
                                 verb="sample")
        if why is not None:
            raise UsageError(why)


def pair_run(settings: AuditSettings, spec: str, engine: Any, pair: Any, oracle: Any, prompts: list[list[int]],
             eos: Any, batch_size: int, dtype: str, progress: Any = None) -> dict[str, Any]:
    """One sampled run of `engine` (built, or a recording's samples), guarded; its `audit.json` record."""
    import sys

    from specaudit.equivalence.sampling.run import guarded_sampled_audit, sampled_run

    sampling = settings.sampling
    recorded = engine if source_of(spec) == "recording" else None
    chunk = max(batch_size, -(-sampling.samples // 20))  # the draw's chunks: a bar over the samples moves after each
    bar = None
    if progress is not None and recorded is None:
        from tqdm import tqdm

        bar = tqdm(total=sampling.samples, unit="sample", desc=spec, file=sys.stderr, dynamic_ncols=True,
                   leave=False, mininterval=0, miniters=1)
    base = {"engine": spec, "pair": pair.name, "batch_size": batch_size, "dtype": dtype, "device": settings.device,
            "num_prompts": len(prompts)}
    try:
        report = guarded_sampled_audit(
            spec, lambda: engine, oracle.target, prompts, sampling_params(settings), timeout=settings.timeout,
            vocab_size=pair.target.config.vocab_size, batch_size=batch_size, device=settings.device,
            recorded=recorded, samples=sampling.samples, max_new_tokens=settings.max_new_tokens, eos_token_id=eos,
            seed=sampling.seed, alpha=sampling.alpha, draft=oracle.draft,
            run_target=None if oracle is pair else pair.target, chunk=chunk, progress=bar,
            request_params=prompt_requests(settings, len(prompts), pair.tokenizer), tokenizer=pair.tokenizer,
            draft_tokens=settings.draft_tokens, require_acceptance=settings.require_acceptance,
            acceptance_baseline=acceptance_baseline(settings, spec, pair.name, batch_size, dtype))
    finally:
        if bar is not None:
            bar.close()
    return sampled_run(base, report)


def acceptance_baseline(settings: AuditSettings, spec: str, pair_name: str, batch_size: int, dtype: str) -> Any:
    """`--acceptance-baseline`'s run that matches this one best (the same engine, pair, batch size and dtype,
    else the same engine and pair, else the first with counts), as an expectation (`ExpectedAcceptance`), or None
    when none is given."""
    if settings.acceptance_baseline is None:
        return None
    from specaudit.equivalence.acceptance.expected import from_baseline
    from specaudit.equivalence.acceptance.run import baseline_for, load_baseline

    found = baseline_for(load_baseline(settings.acceptance_baseline), spec, pair_name, batch_size, dtype)
    return None if found is None else from_baseline(found[0], f"{settings.acceptance_baseline}: {found[1]}")


def refusal(settings: AuditSettings) -> str | None:
    """Why the sampled judge cannot take these settings, or None."""
    sampling = settings.sampling
    if sampling.samples < 1:
        return "--samples must be at least 1"
    if not 0 < sampling.alpha < 1:
        return f"--alpha {sampling.alpha}: give a family-wise false-positive rate between 0 and 1, e.g. 0.01"
    if len(settings.pairs) > 1:  # a served reference has none
        return "the sampled audit takes one pair: one --pair, or --target (and --draft for a speculative engine)"
    for flag, values in (("--batch-size", settings.batch_sizes), ("--dtype", settings.dtypes)):
        if len(values) != 1:
            return (f"{flag} {' '.join(map(str, values))}: the sampled audit takes one value; run it once per "
                    f"{flag[2:].replace('-', ' ')}")
    return None

