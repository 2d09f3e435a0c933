"""The greedy judge's rulings under request parameters (equivalence/audit.py `audit_engine`, stages 2 and 3): the
reference decodes each prompt under its parameters (engines/requests/reference.py), the engine is handed the same
parameters (a live server sends them in its own names, engines/adapters/request_fields.py; an in-process engine
declares `request_params`), and its tokens and everything it says beside them are checked
(equivalence/blackbox/outputs.py).

A token divergence that a parameter explains gets its class there (`stop_string`, `logits_processor`);
any other token divergence is ruled against the run's noise band on the PROCESSED logits (a near-tie
there is `numerical`) and, when structural, named by how the row ended (`stop_eos`, `stop_length`) or
left to the diagnosis. A parameter the server refuses (HTTP 400 naming it) or its dialect cannot carry is
listed under `refused_parameters` and that prompt is not judged: it is not a divergence.

Per-prompt parameters come from the prompts file: a `params` object on a JSONL line
(`RequestParams.from_dict`), merged over the one set given on the command line (`prompt_params`).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specaudit.engines.adapters.request_fields import LOGPROB_DEFINITION, PENALTY_SCOPE
from specaudit.engines.constraints.fields import CONSTRAINED_LOGPROB_DEFINITION
from specaudit.engines.limits import eos_ids
from specaudit.engines.requests.reference import RequestResult, decode_with_params
from specaudit.engines.requests import RequestParams, process
from specaudit.equivalence import speculation
from specaudit.equivalence import rulings
from specaudit.equivalence.records import ABSENT, Divergence
from specaudit.equivalence.rulings.record import make_divergence, named
from specaudit.equivalence.blackbox.constraints import constraint_cause, constraint_refusal, violation_finding
from specaudit.equivalence.blackbox.outputs import check_report, token_cause
from specaudit.engines.contract import capability, declares
from specaudit.equivalence.guard import unguarded


def file_params(source: str) -> list[dict[str, Any] | None]:
    """Each non-blank line's `params` object of a prompts file (None: none on that line, or the built-in set), read
    once per file and version (equivalence/prompts.py reads the same lines, in the same order)."""
    if source == "builtin" or not Path(source).is_file():
        return []
    stat = Path(source).stat()
    return list(_file_params(str(Path(source).resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _file_params(path: str, _mtime_ns: int, _size: int) -> tuple[dict[str, Any] | None, ...]:
    from specaudit.equivalence.prompts import is_recorded

    params: list[dict[str, Any] | None] = []
    recorded: set[tuple[int, ...]] = set()  # a recording's prompts are taken once each, as equivalence/prompts.py does
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if is_recorded(record):
            key = tuple(record["prompt_ids"]) if isinstance(record["prompt_ids"], list) else ()
            if key in recorded:
                continue
            recorded.add(key)
        params.append((record.get("params") or None) if isinstance(record, dict) else None)
    return tuple(params)


def prompt_params(source: str, num_prompts: int, common: RequestParams | None,
                  from_file: int | None = None) -> list[RequestParams]:
    """Each prompt's parameters: the prompts file's `params` object on its line (non-blank lines, in order,
    as `equivalence/prompts.py` reads them) merged over `common`; `common` alone for the built-in set and
    for prompts past the file's (the adversarial ones). `from_file`: how many of the file's prompts the
    audit uses (`--num-prompts`), None for all."""
    base = common or RequestParams()
    per_line: list[RequestParams] = []
    for number, given in enumerate(file_params(source), 1):
        try:
            per_line.append(base.merged(RequestParams.from_dict(given)) if given else base)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}:{number}: params: {exc}") from None
    if from_file is not None:
        per_line = per_line[:from_file]
    return [per_line[i] if i < len(per_line) else base for i in range(num_prompts)]


def has_request_params(source: str, common: RequestParams | None) -> bool:
    """Whether the audit sends any request parameter: a common set, or a `params` object in the prompts file."""
    if common is not None and not (common.is_plain() and common.logprobs is None):
        return True
    return any(file_params(source))


def _ending_class(reference: RequestResult, tokens: list[int], position: int, limit: int, stop_ids: list[int]) -> str:
    """The class of a structural divergence no parameter explains, from how the rows ended."""
    if position >= len(reference.tokens):  # the engine went on past the reference's end
        return "stop_length" if reference.finish_reason == "length" else "stop_eos"
    if position >= len(tokens):  # the engine ended early: at a stop id, or short of its budget without one
        return "stop_eos" if tokens and tokens[-1] in stop_ids else "stop_length"
    return "unknown"


@dataclass
class RequestReference:
    """The reference under each prompt's request parameters (engines/requests/reference.py `decode_with_params`):
    the tokens the greedy judge compares, the raw float64 logits each was chosen from, and how each ended."""

    results: list[RequestResult]
    seconds: float
    kept: bool = False  # never read back from the reference memo

    @property
    def outputs(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    @property
    def logits(self) -> list[torch.Tensor | None]:
        return [r.logits for r in self.results]


def penalty_scope(engine: Any) -> str:
    """What the engine's penalties count (its dialect's documented scope, or what an own engine declares)."""
    inner = unguarded(engine)
    return capability(inner, "penalty_scope") or PENALTY_SCOPE.get(capability(inner, "dialect") or "vllm", "output")


def logprob_definition(engine: Any) -> str:
    return LOGPROB_DEFINITION.get(capability(unguarded(engine), "dialect") or "vllm", "raw")


def request_reference(pair: Any, prompts: list[list[int]], params: list[RequestParams], max_new_tokens: int,
                      eos_token_id: Any, scope: str) -> RequestReference:
    started = time.perf_counter()
    results = [decode_with_params(pair.target, prompt, p, max_new_tokens, eos_token_id, pair.tokenizer,
                                  penalty_scope=scope) for prompt, p in zip(prompts, params)]
    return RequestReference(results, time.perf_counter() - started)


def hand_requests(engine: Any, params: list[RequestParams], tokenizer: Any) -> None:
    """Set each prompt's parameters on the engine before its call (and the tokenizer an in-process engine needs
    for stop strings, engines/requests/rows.py)."""
    inner = unguarded(engine)
    if not declares(inner, "request_params"):
        raise ValueError("the engine takes no request parameters (its class declares no `request_params`): they are "
                         "sent to live servers (llamacpp:, vllm:, sglang:, trtllm:) and to engines that take them")
    inner.request_params = list(params)
    if declares(inner, "request_tokenizer"):
        inner.request_tokenizer = tokenizer


@dataclass
class RequestRulings:
    """Stage 2 of the greedy judge under request parameters: per prompt its record (`audit.json` `prompts`), every
    divergence ruled and named where a parameter explains it, and the prompts whose parameters were refused."""

    prompt_records: list[dict[str, Any]]
    divergences: list[Divergence]
    refused: dict[int, Any]


def rule_requests(engine: Any, pair: Any, prompts: list[list[int]], params: list[RequestParams],
                  reference: RequestReference, outputs: list[list[int]], band: Any, eos_token_id: Any,
                  failed: set[int], max_new_tokens: int) -> RequestRulings:
    """Each prompt's tokens, and everything the engine reported beside them, against the reference under the
    prompt's own parameters (module docstring)."""
    inner = unguarded(engine)
    dialect = capability(inner, "dialect") or "vllm"
    scope, definition = penalty_scope(engine), logprob_definition(engine)
    refused = {index: exc for index, exc in capability(inner, "last_refused") or []}
    completions = capability(inner, "last_completions") or [None] * len(prompts)  # an own engine reports nothing
    divergences: list[Divergence] = []
    prompt_records: list[dict[str, Any]] = []
    for index in range(len(prompts)):
        result, tokens, p = reference.results[index], outputs[index], params[index]
        record = {"index": index, "params": p.to_dict(), "reference_finish": [result.finish_reason, result.stop_reason]}
        if index in failed:
            record.update({"exact": False, "failed": True})
            prompt_records.append(record)
            continue
        if index in refused:
            record.update({"exact": None, "refused": str(refused[index])})
            prompt_records.append(record)
            continue
        completion = completions[index] if index < len(completions) else None
        returned = list(completion.token_ids) if completion is not None else tokens
        report = completion.report if completion is not None else {}
        stop_ids = sorted(set(eos_ids(eos_token_id)) | set(p.stop_token_ids))
        limit = p.max_tokens if p.max_tokens is not None else max_new_tokens
        exact = tokens == result.tokens
        record.update({"exact": exact, "reported_finish": [report.get("finish_reason"), report.get("stop_reason")]})
        prompt_records.append(record)
        row_findings: list[Divergence] = []
        if not exact:  # a grammar mistake first (a forbidden token), then the processors' replays
            cause = constraint_cause(index, p, result, tokens, stop_ids, pair.tokenizer, prompts[index], scope)
            cause = cause or token_cause(index, prompts[index], p, result, tokens, eos_token_id, pair.tokenizer, scope,
                                         band.at, reported_stop=report.get("stop_reason"))
            if cause is None:
                cause = _ruled(index, prompts[index], p, result, tokens, band, stop_ids, scope, limit)
                if cause.kind == "structural" and cause.diagnosis_class == "unknown":  # a mask one position off?
                    cause = constraint_cause(index, p, result, tokens, stop_ids, pair.tokenizer, prompts[index],
                                             scope, admitted_too=True) or cause
            row_findings.append(cause)
        named = {d.diagnosis_class for d in row_findings}
        reported = (CONSTRAINED_LOGPROB_DEFINITION.get(dialect, definition) if p.constraint is not None
                    and capability(inner, "black_box") else definition)  # under a grammar, the dialect's own
        row_findings += [d for d in check_report(index, prompts[index], p, result, returned, report, eos_token_id,
                                                 pair.tokenizer, reported, band.at)
                         if d.diagnosis_class not in named]  # one finding per cause and prompt
        broken = violation_finding(index, p, tokens, stop_ids, pair.tokenizer, prompts[index])
        if broken is not None:  # the output itself breaks its constraint: a finding of its own
            row_findings.append(broken)
            record["constraint_violation"] = broken.evidence["reason"]
        divergences += row_findings
    return RequestRulings(prompt_records, divergences, refused)


def processed_logits(prompts: list[list[int]], outputs: list[list[int]], params: list[RequestParams],
                     eos_token_id: Any, scope: str) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """(prompt index, new token position, raw logits [V]) -> the logits a correct decoder chooses from there:
    the prompt's processors on the engine's own output before that position (the diagnosis's choices under
    request parameters, diagnosis/facts.py `RunFacts.processed`)."""
    def processed(index: int, position: int, logits: torch.Tensor) -> torch.Tensor:
        p = params[index]
        stop_ids = sorted(set(eos_ids(eos_token_id)) | set(p.stop_token_ids))
        return process(logits.to(torch.float64), prompts[index], outputs[index][:position], p, stop_ids,
                       scope).greedy
    return processed


def rule_against_plain(divergences: list[Divergence], plain_outputs: list[list[int]], outputs: list[list[int]],
                       reference: RequestReference, params: list[RequestParams], eos_token_id: Any,
                       skipped: set[int]) -> list[Divergence]:
    """Stage 3 under request parameters: `divergences` with the three-way rulings (reference, plain engine,
    speculative engine) of every divergence of a judged prompt (rulings/plain.py)."""
    return [_against_plain(d, plain_outputs, outputs, reference, params, eos_token_id)
            if d.prompt_index not in skipped else d for d in divergences]


def _against_plain(divergence: Divergence, plain_outputs: list[list[int]], outputs: list[list[int]],
                   reference: RequestReference, params: list[RequestParams], eos_token_id: Any) -> Divergence:
    index = divergence.prompt_index
    if divergence.detected_by == "constraint":
        return rulings.plain_rule_violation(divergence, outputs[index], plain_outputs[index])
    return rulings.plain_rule_processed(divergence, reference.results[index].tokens, plain_outputs[index],
                                        _forbidden(reference.results[index], divergence, eos_token_id, params[index]))


def request_fields(engine: Any, params: list[RequestParams], refused: dict[int, Any],
                   divergences: list[Divergence]) -> dict[str, Any]:
    """What a run under request parameters adds to its record."""
    return {"request_params": [p.to_dict() for p in params], "penalty_scope": penalty_scope(engine),
            "logprob_definition": logprob_definition(engine),
            "reference_mismatches": sum(d.kind == rulings.REFERENCE_MISMATCH for d in divergences),
            "refused_parameters": [{"prompt_index": i, "parameter": exc.parameter, "why": exc.why}
                                   for i, exc in sorted(refused.items())]}


def _forbidden(reference: RequestResult, divergence: Divergence, eos_token_id: Any, params: RequestParams) -> bool:
    """Whether the reference's grammar forbids the engine's token at the divergence (None: the engine's row
    ended there, so its stop ids)."""
    position = divergence.position
    if reference.allowed is None or position is None or position >= len(reference.allowed):
        return False
    allowed = reference.allowed[position]  # [V]
    token = divergence.engine_token
    candidates = [token] if token is not None else sorted(set(eos_ids(eos_token_id)) | set(params.stop_token_ids))
    return bool(candidates) and not any(0 <= t < allowed.shape[0] and bool(allowed[t]) for t in candidates)


def plain_under_requests(engine: Any, name: str | None, prompts: list[list[int]], params: list[RequestParams],
               max_new_tokens: int, eos_token_id: Any, tokenizer: Any) -> dict[str, Any]:
    """The plain engine's outputs under the same requests, or the error that stopped it (the run is then
    ruled without it); `{"outputs": None}` when there is no plain engine."""
    from specaudit.equivalence.errors import one_line

    if engine is None:
        return {"engine": None, "outputs": None, "error": None}
    inner = unguarded(engine)
    started = time.perf_counter()
    try:
        inner.request_params = list(params)
        if declares(inner, "request_tokenizer"):
            inner.request_tokenizer = tokenizer
        outputs = engine.generate([list(p) for p in prompts], max_new_tokens, eos_token_id)
        failures = [int(index) for index, _ in capability(inner, "last_failures") or []]
        refused = [int(index) for index, _ in capability(inner, "last_refused") or []]
        if failures or refused:
            raise RuntimeError(f"prompt(s) {sorted(set(failures + refused))} failed or were refused")
        describe = capability(inner, "describe")
        return {"engine": name, "outputs": outputs, "error": None, "seconds": time.perf_counter() - started,
                "description": describe() if callable(describe) else None,
                "speculation": speculation.of_run(inner, capability(inner, "last_trace"))}
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # the audited run goes on, ruled without the plain run
        return {"engine": name, "outputs": None, "seconds": time.perf_counter() - started,
                "error": one_line(f"the plain engine {name} failed ({type(exc).__name__}: {exc}); the divergences "
                                  "are ruled without it")}


def _ruled(index: int, prompt: list[int], params: RequestParams, reference: RequestResult, tokens: list[int],
           band: rulings.NoiseBand, stop_ids: list[int], scope: str, limit: int) -> Divergence:
    """A token divergence no parameter explains: the noise band on the processed logits at the split."""
    position = next((i for i, (a, b) in enumerate(zip(reference.tokens, tokens)) if a != b),
                    min(len(reference.tokens), len(tokens)))
    reference_token = reference.tokens[position] if position < len(reference.tokens) else None
    engine_token = tokens[position] if position < len(tokens) else None
    row = None
    if reference.logits is not None and position < reference.logits.shape[0]:
        row = process(reference.logits[position].to(torch.float64), prompt, reference.tokens[:position], params,
                      stop_ids, scope, allowed=reference.allowed_at(position)).greedy  # [V] as the reference chose
    kind, evidence = rulings.rule_on_band(band, row, reference_token, engine_token)
    return make_divergence(
        prompt_index=index, position=position, reference_token=reference_token, engine_token=engine_token, kind=kind,
        decided_by=evidence["decided_by"], detected_by="tokens", evidence=evidence,
        diagnosis=named(_ending_class(reference, tokens, position, limit, stop_ids), evidence.get("reason"), "ending")
        if kind == "structural" else ABSENT)


SERVER_PREFIXES = ("llamacpp", "vllm", "sglang", "trtllm")


def preflight(config: Any) -> None:
    """`UsageError` for request parameters the audit cannot send: an engine that is not a live server, a
    plain engine beside them, or a prompts file whose `params` do not parse."""
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.validate import UsageError

    try:
        if not has_request_params(config.prompts, config.request_params):
            return
        _check_usage(config, black_box_prefix)
    except (ValueError, json.JSONDecodeError) as exc:
        raise UsageError(str(exc)) from None


def _check_usage(config: Any, black_box_prefix: Any) -> None:
    from specaudit.engines.registry import takes_request_params

    others = [name for name in config.engines
              if black_box_prefix(name) not in SERVER_PREFIXES and not takes_request_params(name)]
    if others:
        raise ValueError(f"request parameters are sent to live servers ({', '.join(p + ':URL' for p in SERVER_PREFIXES)}) "
                         f"and to engines whose class declares `request_params`; {', '.join(others)} takes token ids "
                         "and limits alone")
    if config.plain_engine and (black_box_prefix(config.plain_engine) not in SERVER_PREFIXES
                                and not takes_request_params(config.plain_engine)):
        raise ValueError(f"the plain engine {config.plain_engine} takes no request parameters: it would decode "
                         "other requests than the audited engine")
    lines = len(file_params(config.prompts))
    params = prompt_params(config.prompts, lines, config.request_params)  # parses every line's params
    constraints = [p.constraint for p in params + [config.request_params or RequestParams()] if p.constraint is not None]
    if constraints:
        _check_constraints(config, constraints, black_box_prefix)


def _check_constraints(config: Any, constraints: list[Any], black_box_prefix: Any) -> None:
    """A constraint no engine of the audit may drop: each must take it (in-process: its class declares
    `takes_constraints`; a server: its dialect carries it, engines/constraints/fields.py)."""
    from specaudit.engines.constraints.matcher import _xgrammar
    from specaudit.engines.registry import resolve

    _xgrammar()  # the reference's grammar engine installed
    for constraint in constraints:
        if constraint.backend == "llguidance":  # installed, and the constraint one it takes
            from specaudit.engines.constraints.llguidance_matcher import llguidance_grammar

            llguidance_grammar(constraint)
    for name in list(config.engines) + ([config.plain_engine] if config.plain_engine else []):
        prefix = black_box_prefix(name)
        server = prefix in SERVER_PREFIXES
        why = constraint_refusal(name, constraints, dialect=prefix if server else None, recording=False,
                                 takes_constraints=server or bool(getattr(resolve(name), "takes_constraints", False)))
        if why is not None:
            raise ValueError(why)
