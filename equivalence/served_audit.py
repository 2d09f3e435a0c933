"""The audit against a served reference (`specaudit audit --engine E --reference R --tokenizer DIR`).

No weights in the audit's process: the reference is an engine of the same model with speculation off (a
plain vLLM, SGLang, llama.cpp or TensorRT-LLM server, or a recording of one). The run:

1. the prompts, in the served model's tokens (`--tokenizer DIR`: its tokenizer and config files, never
   its weights; or a prompts file of ids), with the adversarial prompts sized from DIR's config;
2. the reference asked twice: one prompt at a time (unless `--reference-batch-invariant` says it answers
   alike at any batch, then `--batch-size` at once), then every prompt in flight at once in reverse
   order; the first run is the reference, the two runs' disagreement is its determinism (`audit.json`
   `reference.determinism`, and the report);
3. each audited engine at each batch size, its outputs ruled by `rulings/served.py`: exact, numerical
   where the reference's margin lies within the band measured for this deployment, structural
   otherwise, each with `decided_by`; its reports (usage, finish_reason, log-probabilities) checked
   against the reference server's.

`audit.json` and `report.md` are written to `--out`. Exit status: 0 every run exact or numerical, 1 a
structural divergence or a failed run (the reference's failure included).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specaudit.engines.limits import eos_ids
from specaudit.equivalence.errors import UsageError, one_line
from specaudit.equivalence.rulings import served
from specaudit.engines.contract import capability
from specaudit.equivalence.run_record import all_passed, run_record

RERUN_IN_FLIGHT = 16  # the reference's second run: every prompt in flight at once, at most this many
TEACHER_FORCE_TOP = 20  # vLLM's default max_logprobs


@dataclass
class ServedConfig:
    engines: list[str]
    reference: str
    tokenizer: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [8])
    prompts: str = "builtin"
    num_prompts: int | None = None
    max_new_tokens: int = 32
    draft_tokens: int = 4
    eos_token_id: Any = "pair"
    engine_options: dict[str, Any] = field(default_factory=dict)
    engine_dtype: str | None = None
    logit_tolerance: float | None = None
    adversarial: bool = True
    reference_batch_invariant: bool = False
    reference_top_logprobs: int = 5
    require_speculation: bool = False
    request_params: Any = None  # one RequestParams for every request, sent alike to the reference and the engines


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

def _build(spec: str, batch_size: int, config: ServedConfig, top_logprobs: int | None = None) -> Any:
    from specaudit.engines.registry import make_engine

    options = dict(config.engine_options)
    if top_logprobs is not None:
        options["top_logprobs"] = top_logprobs
    engine = make_engine(spec, None, None, batch_size=batch_size, draft_tokens=config.draft_tokens, **options)
    if config.request_params is not None:
        if not hasattr(engine, "request_params"):
            raise UsageError(f"{spec} takes no request parameters (a recording answers as it was recorded): drop "
                             "the request parameters, or audit the live server")
        engine.request_params = config.request_params
    return engine


def ask(engine: Any, prompts: list[list[int]], max_new_tokens: int, eos: Any,
        order: list[int] | None = None) -> dict[str, Any]:
    """`engine.generate` on `prompts` (sent in `order`, answers put back in prompt order): outputs,
    per-token top log-probabilities, what it reported beside them, its speculation counters, seconds."""
    order = list(range(len(prompts))) if order is None else order
    started = time.perf_counter()
    outputs = engine.generate([list(prompts[i]) for i in order], max_new_tokens, eos)
    seconds = time.perf_counter() - started
    back = {position: i for i, position in enumerate(order)}

    def put_back(values: list[Any] | None) -> list[Any]:
        values = list(values or [])
        return [values[back[i]] if back[i] < len(values) else None for i in range(len(prompts))]

    completions = put_back(getattr(engine, "last_completions", None))  # a server engine's own
    details = put_back(getattr(engine, "last_details", None))
    reports = []
    for completion, detail in zip(completions, details):
        report = dict(getattr(completion, "report", None) or {})
        if detail:
            report["returned_tokens"] = detail.get("returned_tokens")
            report["client_notes"] = detail.get("notes")
        reports.append(report)
    failures = {order[i]: str(exc) for i, exc in capability(engine, "last_failures")}
    return {"outputs": put_back(outputs), "logprobs": put_back(capability(engine, "last_logprobs")),
            "reports": reports, "failures": failures, "seconds": seconds,
            "speculation": capability(engine, "last_speculation"),
            "description": engine.describe() if callable(capability(engine, "describe")) else None}


def teacher_forcer(engine: Any, eos: Any, top: int = TEACHER_FORCE_TOP):
    """(prompt + prefix, token) -> {token id: log-probability} at the prefix, through the engine's own
    teacher forcing (`logprobs_at`: vLLM's `prompt_logprobs`, exact for any token; other servers' top `top`
    at the prefix); None for an engine without it (a recording)."""
    at = getattr(engine, "logprobs_at", None)
    if not callable(at):
        return None
    return lambda prefix, token: at(list(prefix), int(token), eos, top)


# ---- the audit -------------------------------------------------------------------------------------

def _prompts(config: ServedConfig, served_model: Served) -> tuple[list[list[int]], dict[str, Any] | None]:
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.adversarial import adversarial_prompts
    from specaudit.equivalence.prompts import PromptError, load_prompts

    recordings = [spec for spec in config.engines + [config.reference] if black_box_prefix(spec) == "recorded"]
    if recordings:  # a recording brings its own prompts
        from specaudit.engines.adapters.recorded import read_recording

        prompts = [line.prompt_ids for line in read_recording(recordings[0].partition(":")[2])]
        return (prompts[: config.num_prompts] if config.num_prompts else prompts), None
    if config.prompts == "builtin" and served_model.tokenizer is None:
        raise UsageError("--reference with the built-in prompts needs the served model's tokenizer: give "
                         "--tokenizer DIR, or --prompts FILE with input_ids")
    try:
        prompts = load_prompts(config.prompts, served_model.tokenizer, config.num_prompts,
                               vocab_size=served_model.vocab_size, max_positions=served_model.max_positions,
                               max_new_tokens=config.max_new_tokens)
    except PromptError as exc:
        raise UsageError(str(exc)) from None
    if not config.adversarial:
        return prompts, None
    cases, skipped = adversarial_prompts(
        [t for p in prompts for t in p], pad_token_id=served_model.pad_token_id,
        eos_token_id=_eos(config, served_model), bos_token_id=served_model.bos_token_id,
        max_positions=served_model.max_positions, max_new_tokens=config.max_new_tokens,
        draft_tokens=config.draft_tokens)
    first = len(prompts)
    return prompts + [list(c.tokens) for c in cases], {
        "first_index": first, "skipped": skipped,
        "cases": [{"prompt_index": first + i, **c.describe()} for i, c in enumerate(cases)]}


def _eos(config: ServedConfig, served_model: Served) -> Any:
    return served_model.eos_token_id if config.eos_token_id == "pair" else config.eos_token_id


def preflight(config: ServedConfig) -> None:
    from specaudit.engines.registry import black_box_prefix

    if not black_box_prefix(config.reference):
        raise UsageError(f"--reference {config.reference}: give a served or recorded engine (vllm:URL, sglang:URL, "
                         "llamacpp:URL, trtllm:URL or recorded:FILE); an in-process reference is --target")
    inprocess = [spec for spec in config.engines if not black_box_prefix(spec)]
    if inprocess:
        raise UsageError(f"--reference audits served or recorded engines only: engine {inprocess[0]} runs in this "
                         "process and needs the weights (give --target instead of --reference)")


def run_served_audit(config: ServedConfig, out_dir: Path) -> dict[str, Any]:
    """The audit (module docstring); raises `UsageError` before any request for bad input."""
    from specaudit import __version__
    from specaudit.equivalence.runner import machine_info, write_json

    preflight(config)
    served_model = load_served(config.tokenizer)
    eos = _eos(config, served_model)
    prompts, adversarial = _prompts(config, served_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    audit: dict[str, Any] = {
        "specaudit_version": __version__, "mode": "served-reference",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info("cpu"),
        "config": {**asdict(config), "eos_token_id": eos,
                   "request_params": config.request_params.to_dict() if config.request_params is not None else None},
        "num_prompts": len(prompts), "adversarial": adversarial, "complete": False, "reference": None, "runs": []}
    json_path = out_dir / "audit.json"
    write_json(json_path, audit)

    # the reference, twice
    first_batch = max(config.batch_sizes) if config.reference_batch_invariant else 1
    second_batch = max(first_batch, min(RERUN_IN_FLIGHT, len(prompts)))
    reference_record: dict[str, Any] = {"engine": config.reference, "error": None,
                                        "asked": (f"{first_batch} prompts in flight (declared batch-invariant)"
                                                  if config.reference_batch_invariant else "one prompt at a time")}
    audit["reference"] = reference_record
    try:
        engine = _build(config.reference, first_batch, config, config.reference_top_logprobs)
        first = ask(engine, prompts, config.max_new_tokens, eos)
        rerun_engine = _build(config.reference, second_batch, config, config.reference_top_logprobs)
        second = ask(rerun_engine, prompts, config.max_new_tokens, eos, order=list(reversed(range(len(prompts)))))
    except KeyboardInterrupt:
        raise
    except UsageError:
        raise
    except Exception as exc:
        reference_record["error"] = one_line(f"the reference {config.reference} failed ({type(exc).__name__}: {exc})")
        audit["complete"] = True
        write_json(json_path, audit)
        return audit
    determinism = served.rerun_disagreement(first["outputs"], second["outputs"], first["logprobs"], second["logprobs"])
    requests = len(prompts)
    reference_record.update({
        "description": first["description"], "outputs": first["outputs"],
        "runs": [{"in_flight": first_batch, "order": "prompt order", "seconds": first["seconds"],
                  "seconds_per_request": first["seconds"] / requests, "failures": first["failures"]},
                 {"in_flight": second_batch, "order": "reversed", "seconds": second["seconds"],
                  "seconds_per_request": second["seconds"] / requests, "failures": second["failures"]}],
        "determinism": determinism,
        "speculation": first["speculation"],
        "prompts_with_logprobs": sum(lp is not None for lp in first["logprobs"]),
    })
    if first["failures"]:
        reference_record["error"] = one_line(f"the reference failed on {len(first['failures'])} prompt(s): "
                                             + next(iter(first["failures"].values())))
    write_json(json_path, audit)
    force = teacher_forcer(engine, eos)

    for spec in config.engines:
        for batch_size in config.batch_sizes:
            audit["runs"].append(_one_run(spec, batch_size, config, prompts, eos, first, second, determinism, force))
            write_json(json_path, audit)
    audit["complete"] = True
    write_json(json_path, audit)
    return audit


def _one_run(spec: str, batch_size: int, config: ServedConfig, prompts: list[list[int]], eos: Any,
             first: dict[str, Any], second: dict[str, Any], determinism: dict[str, Any], force: Any) -> dict[str, Any]:
    run = run_record(engine=spec, pair=Path(config.tokenizer).name if config.tokenizer else config.reference,
                     batch_size=batch_size, dtype="served", device="server", num_prompts=len(prompts), findings=[])
    try:
        answered = ask(_build(spec, batch_size, config), prompts, config.max_new_tokens, eos)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        run["error"] = one_line(f"{spec} failed ({type(exc).__name__}: {exc})")
        return run
    outputs, reference = answered["outputs"], first["outputs"]
    run.update(seconds=answered["seconds"], seconds_per_request=answered["seconds"] / max(1, len(prompts)),
               description=answered["description"], speculation=answered["speculation"], outputs=outputs)
    gap = served.engine_logprob_gap(reference, outputs, first["logprobs"], answered["logprobs"])
    band = served.measure_band(determinism, gap, logit_tolerance=config.logit_tolerance,
                               engine_dtype=config.engine_dtype)
    findings = []
    for index, (prompt, ref, out) in enumerate(zip(prompts, reference, outputs)):
        if index in answered["failures"]:
            continue
        ref_report = first["reports"][index] if index < len(first["reports"]) else {}
        findings += served.report_findings(index, prompt, ref, out, answered["reports"][index] or {},
                                           first["logprobs"][index], band, eos,
                                           reference_finish=(ref_report or {}).get("finish_reason"))
    divergences = []
    for index, (prompt, ref, out) in enumerate(zip(prompts, reference, outputs)):
        if index in answered["failures"]:
            divergences.append({"prompt_index": index, "position": 0, "kind": "structural", "class": "unknown",
                                "needs_weights": False, "decided_by": "request-failed",
                                "reason": answered["failures"][index]})
            continue
        record = served.rule(index, prompt, ref, out, eos_token_id=eos, reference_lps=first["logprobs"][index],
                             band=band, all_references=reference, second_reference=second["outputs"][index],
                             teacher_force=force, params=config.request_params,
                             reference_report=first["reports"][index] if index < len(first["reports"]) else None)
        if record is not None:
            divergences.append(record)
    run.update(band=band.to_dict(), divergences=divergences, findings=findings,
               exact_matches=sum(ref == out for ref, out in zip(reference, outputs)),
               structural_divergences=sum(d["kind"] == "structural" for d in divergences) + len(findings),
               numerical_divergences=sum(d["kind"] == "numerical" for d in divergences))
    run["equivalent"] = run["structural_divergences"] == 0
    if config.require_speculation:
        drafted = (answered["speculation"] or {}).get("drafted_tokens")
        if not drafted:
            run["equivalent"] = False
            run["error"] = "--require-speculation: the engine showed no drafted tokens"
    return run


def exit_status(audit: dict[str, Any]) -> int:
    if (audit.get("reference") or {}).get("error"):
        return 1
    return 0 if audit["runs"] and all_passed(audit) else 1


def summary_lines(audit: dict[str, Any]) -> list[str]:
    reference = audit.get("reference") or {}
    lines = []
    if reference.get("error"):
        return [f"reference {reference['engine']}: FAILED: {reference['error']}"]
    det = reference.get("determinism") or {}
    runs = reference.get("runs") or []
    lines.append(f"reference {reference['engine']} ({reference['asked']}, {runs[0]['seconds_per_request']:.3f} s per "
                 f"request): its re-run at {runs[1]['in_flight']} in flight, reversed, identical on "
                 f"{det.get('identical')} of {det.get('prompts')} prompts"
                 + (f"; largest flip margin {det['largest_flip_margin']:.3g}" if det.get("largest_flip_margin") is not None else "")
                 + f"; largest log-probability difference {det.get('largest_logprob_difference', 0):.3g}")
    for run in audit["runs"]:
        if run.get("error") and not run.get("divergences"):
            lines.append(f"{run['engine']} B={run['batch_size']}: FAILED: {run['error']}")
            continue
        lines.append(f"{run['engine']} B={run['batch_size']}: {run['exact_matches']}/{run['num_prompts']} exact, "
                     f"{run['numerical_divergences']} numerical, {run['structural_divergences']} structural "
                     f"(band {run['band']['width']:.3g})" + (f"; {run['error']}" if run.get("error") else ""))
    return lines


def write_report(audit: dict[str, Any], out_dir: Path) -> Path:
    """`report.md`: the reference's determinism, each run's band and every divergence with what decided it."""
    reference = audit.get("reference") or {}
    text = ["# specaudit: audit against a served reference", "",
            f"specaudit {audit['specaudit_version']}, {audit['created']}; {audit['num_prompts']} prompts, "
            f"{audit['config']['max_new_tokens']} new tokens; no weights in the audit's process.", "",
            "## The reference", ""]
    if reference.get("error"):
        text += [f"**failed**: {reference['error']}", ""]
    else:
        det = reference["determinism"]
        text += [f"`{reference['engine']}`, asked {reference['asked']}.", "",
                 "| run | in flight | order | seconds | s per request |", "|---|---|---|---|---|"]
        for n, r in enumerate(reference["runs"], 1):
            text.append(f"| {n} | {r['in_flight']} | {r['order']} | {r['seconds']:.2f} | {r['seconds_per_request']:.3f} |")
        text += ["", f"Determinism: the two runs agree on {det['identical']} of {det['prompts']} prompts; largest "
                 f"log-probability difference on their common prefixes {det['largest_logprob_difference']:.3g}"
                 + (f"; flips: " + ", ".join(f"prompt {f['prompt_index']} at {f['position']} (margin "
                                             f"{'?' if f['margin'] is None else format(f['margin'], '.3g')})"
                                             for f in det["flips"]) if det["flips"] else "") + ".", ""]
    text += ["## Runs", ""]
    for run in audit["runs"]:
        text.append(f"### {run['engine']}, {run['batch_size']} in flight")
        text.append("")
        if run.get("error"):
            text += [f"**{run['error']}**", ""]
        if "band" not in run:
            continue
        band = run["band"]
        parts = ", ".join(f"{k} {v:.3g}" for k, v in band["parts"].items() if v is not None)
        text += [f"{run['exact_matches']}/{run['num_prompts']} exact, {run['numerical_divergences']} numerical, "
                 f"{run['structural_divergences']} structural. Band {band['width']:.3g} ({parts or 'nothing measured'})"
                 + "".join(f"; {n}" for n in band["notes"]) + ".", ""]
        rows = run["divergences"] + run["findings"]
        if rows:
            text += ["| prompt | position | reference | engine | kind | class | decided by | why |",
                     "|---|---|---|---|---|---|---|---|"]
            for d in rows:
                cls = d.get("class") or ""
                if d.get("needs_weights"):
                    cls = "unknown (needs the weights)"
                text.append(f"| {d['prompt_index']} | {d['position']} | {d.get('reference_token')} | "
                            f"{d.get('engine_token')} | {d['kind']} | {cls} | {d['decided_by']} | "
                            f"{d['reason'].replace('|', '/')} |")
            text.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(text) + "\n")
    return path
