"""A run's acceptance record: which expectation applies, computed where the audit has what it needs.

The expectation, in this order:

1. `--acceptance-baseline FILE`: an earlier audit.json's observed per-position counts, from the run with
   the same engine, pair, batch size and dtype (else the same engine and pair, else the first run that has
   them);
2. `--speculation draft:k=..` or `ngram:k=..,min=..,max=..`: the proposer the user states (a server's);
   for a live server (llamacpp:, vllm:, sglang:, trtllm:) audited with a draft model folder (`--draft`) and
   no `--speculation`, `draft:k=<--draft-tokens>`: the draft given is the one the server is meant to serve
   (`implied_spec`; the record's `implied` says so);
3. an in-process engine's own drafter (the engine contract's `drafter`): the draft model's greedy
   proposals (`ModelDrafter` without a chooser) or prompt lookup (`PromptLookupDrafter`, its latest
   occurrence and n-gram sizes);
4. else none: the record says why, and only the observed counters are kept.

The replay walks the run's own outputs (prompts the engine failed on left out): where they equal the
reference, as in every passing run, that is the reference's output; where a run diverged, the target's
tokens the engine really verified. The expectation is exact where the engine runs in float64 in process;
otherwise it is an estimate (the note says what bounds it) and excess over it is no "impossible" finding.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from specaudit.engines.contract import capability
from specaudit.engines.drafters import ModelDrafter, PromptLookupDrafter
from specaudit.engines.trace import Trace
from specaudit.equivalence.acceptance import counters, expected as expected_
from specaudit.equivalence.acceptance.findings import compare
from specaudit.equivalence.acceptance.observed import ObservedAcceptance, of_run
from specaudit.equivalence.errors import one_line

BELOW_FLOAT64 = ("the engine runs in {dtype}: its draft may propose another token than the float64 draft where the "
                 "draft precision ruling (equivalence/rulings/draft.py) admits one, so the float64 replay is an "
                 "estimate, off by at most the steps whose proposals the ruling admits")
BLACK_BOX = ("the engine runs outside this process: the replay in float64 is an estimate of its proposer "
             "(its own precision may choose other drafts at near-ties, and past a row's end the float64 target's "
             "tokens stand in for its own)")


def load_baseline(path: str | Path) -> list[dict[str, Any]]:
    """The runs of an earlier audit.json; ValueError with one line when it is none."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--acceptance-baseline {path}: cannot read an audit.json ({type(exc).__name__})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise ValueError(f"--acceptance-baseline {path}: no runs in it (not an audit.json)")
    if not any(_observed_in(run) is not None for run in runs):
        raise ValueError(f"--acceptance-baseline {path}: no run in it has per-position acceptance counters")
    return runs


def _observed_in(run: dict[str, Any]) -> ObservedAcceptance | None:
    record = (run.get("acceptance") or {}).get("observed") if isinstance(run, dict) else None
    if not record:
        return None
    observed = ObservedAcceptance.from_json(record)
    return observed if observed.accepted_per_position is not None and observed.drafts_per_position is not None else None


def baseline_for(runs: list[dict[str, Any]], engine: str, pair: str, batch_size: int | None,
                 dtype: str) -> tuple[ObservedAcceptance, str] | None:
    """The earlier run that matches this one best, with how it matched."""
    keys = (("engine", "pair", "batch_size", "dtype"), ("engine", "pair"), ())
    wanted = {"engine": engine, "pair": pair, "batch_size": batch_size, "dtype": dtype}
    for key in keys:
        for run in runs:
            observed = _observed_in(run)
            if observed is not None and all(run.get(name) == wanted[name] for name in key):
                return observed, (f"{run.get('engine')}, {run.get('pair')}, batch {run.get('batch_size')}, "
                                  f"{run.get('dtype')}")
    return None


SERVER_PREFIXES = ("llamacpp", "vllm", "sglang", "trtllm")


def implied_spec(engine_name: str, draft: Any, k: int | None) -> tuple[str, str] | None:
    """(`draft:k=K`, why) where a live server is audited with a draft model loaded from a folder (`--draft`)
    and nothing states its proposer; else None. A built-in pair's draft (built in memory, no folder) implies
    nothing: the server was given no weights of it."""
    prefix, sep, _ = engine_name.partition(":")
    folder = getattr(getattr(draft, "config", None), "name_or_path", "") if draft is not None else ""
    if not sep or prefix not in SERVER_PREFIXES or not folder or k is None:
        return None
    return f"draft:k={k}", (f"implied by --draft {folder} for the server {engine_name} (no --speculation given): "
                            f"the server's proposer is taken to be that draft model, k={k}")


def proposer_of(engine: Any, spec: str | None, draft: Any, k: int | None,
                trace: Trace | None = None) -> tuple[Any, int] | str:
    """The proposer to replay and its k, or why there is none. An engine's drafter is recognised by its
    class, or by what it declares (a planted fault rebuilds the drafter's module, so its class is another
    object): a trace whose proposals are the draft model's, a drafter with a draft model and no chooser, or
    one with n-gram sizes."""
    if spec is not None:
        stated = expected_.parse_spec(spec)
        if stated.kind == "draft":
            if draft is None:
                return "--speculation draft: the pair has no draft model"
            return expected_.DraftModelProposer(draft), stated.k
        return expected_.NgramProposer(stated.min_ngram, stated.max_ngram, stated.occurrence), stated.k
    drafter = capability(engine, "drafter")
    if k is None:
        return "the engine's k is unknown"
    from_draft = isinstance(drafter, ModelDrafter) or (trace is not None and trace.proposals_from_draft_model) or (
        drafter is not None and getattr(drafter, "draft", None) is not None and hasattr(drafter, "chooser"))
    if from_draft and getattr(drafter, "chooser", None) is None and (draft is not None or drafter is not None):
        return expected_.DraftModelProposer(draft if draft is not None else drafter.draft), k
    if isinstance(drafter, PromptLookupDrafter) or (hasattr(drafter, "min_ngram") and hasattr(drafter, "max_ngram")):
        return expected_.NgramProposer(drafter.min_ngram, drafter.max_ngram, "latest"), k
    if drafter is None:
        return "the engine's proposer is not known: state it with --speculation, or give --acceptance-baseline"
    return f"the engine's proposer ({type(drafter).__name__}) has no replay: give --acceptance-baseline"


def request_choosers(requests: Sequence[Any], prompts: Sequence[Sequence[int]], stop_ids: Sequence[Sequence[int]],
                     penalty_scope: str, grammars: Sequence[Any] | None = None) -> list[expected_.Chooser]:
    """Per prompt, the target's greedy choice under its request parameters: the raw logits processed on the
    tokens so far (engines/requests `process`, what the engines' acceptance rule compares the drafts with),
    masked first by its grammar where it has one (`grammars`: per prompt a maker of its matcher, or None)."""
    from specaudit.engines.requests import process

    def chooser(prompt: Sequence[int], params: Any, stops: Sequence[int], make: Any) -> expected_.Chooser:
        grammar = _GrammarAlong(make()) if make is not None else None

        def choose(logits: Any, history: list[int]) -> int:
            allowed = grammar.allowed_after(history) if grammar is not None else None
            return int(process(logits, prompt, history, params, stops, penalty_scope, allowed=allowed).greedy.argmax())
        return choose

    makers = list(grammars) if grammars is not None else [None] * len(prompts)
    return [chooser(prompt, params, stops, make)
            for prompt, params, stops, make in zip(prompts, requests, stop_ids, makers)]


class _GrammarAlong:
    """A matcher kept at the end of a growing history: `allowed_after(history)` [V] (None once the history
    leaves the grammar: the target's choice there is unmasked, as nothing constrains it)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher, self.advanced, self.broken = matcher, [], False

    def allowed_after(self, history: Sequence[int]) -> Any:
        kept = 0
        while kept < min(len(self.advanced), len(history)) and self.advanced[kept] == history[kept]:
            kept += 1
        if kept < len(self.advanced):
            self.matcher.rollback(len(self.advanced) - kept)
            self.advanced, self.broken = self.advanced[:kept], False
        for token in history[kept:]:
            if self.broken or not self.matcher.advance(token):
                self.broken = True
                break
            self.advanced.append(int(token))
        return None if self.broken else self.matcher.allowed()


def grammar_makers(requests: Sequence[Any], tokenizer: Any, vocab_size: int, stop_ids: Sequence[Sequence[int]],
                   prompts: Sequence[Sequence[int]]) -> list[Any]:
    """Per request, a maker of a fresh matcher of its constraint (None: unconstrained)."""
    from specaudit.engines.constraints.matcher import row_matcher

    def maker(constraint: Any, stops: Sequence[int], prompt: Sequence[int]) -> Any:
        return lambda: row_matcher(constraint, tokenizer, vocab_size, list(stops), prompt)

    return [maker(r.constraint, stops, prompt) if r.constraint is not None else None
            for r, stops, prompt in zip(requests, stop_ids, prompts)]


def unreplayable(requests: Sequence[Any], proposer: Any, black_box: bool, tokenizer: Any = None) -> str | None:
    """Why a replay along request parameters would give a wrong number, or None: a sampled request; a
    structured-output grammar on a server (whether its drafter is masked is the server's: vLLM 0.32.0 does not
    mask it, reports/wild) or without the tokenizer its matcher needs; a server's draft model, which may or
    may not process its own logits. In process, a grammar masks the draft model's proposals (`ModelDrafter`
    with `DraftMask`) and the target's choices, and the replay does both."""
    if any(r.sampled for r in requests):
        return "a request samples (temperature > 0): the greedy replay does not apply; audit it with --temperature"
    if any(r.constraint is not None for r in requests) and (black_box or tokenizer is None):
        return ("a structured-output grammar: whether the server masks its drafter's proposals is its own "
                "(engines/constraints/): give --acceptance-baseline")
    if isinstance(proposer, expected_.DraftModelProposer) and black_box:
        return ("whether the server's draft model applies the request's processors to its own logits is not "
                "known: give --acceptance-baseline")
    return None


def _vocab_width(model: Any) -> int:
    """The width of the model's logits (the matcher's vocabulary size, as the engines make theirs)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def acceptance_of_run(engine: Any, trace: Trace | None, evidence: dict[str, Any] | None, *, target: Any,
                      draft: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                      failed: set[int], dtype: str, k: int | None, spec: str | None = None,
                      baseline: list[dict[str, Any]] | None = None, baseline_path: str | None = None,
                      required: float | None = None, engine_name: str = "", pair_name: str = "",
                      batch_size: int | None = None, requests: Sequence[Any] | None = None,
                      stop_ids: Sequence[Sequence[int]] | None = None,
                      penalty_scope: str = "output", tokenizer: Any = None) -> dict[str, Any]:
    """The run's `acceptance` record (equivalence/acceptance/findings.py `AcceptanceRecord`, as JSON), with
    the seconds its replay took. `draft` is the draft model in float64 (the replay's). `requests`: one
    `RequestParams` per prompt (with each prompt's `stop_ids` and the `penalty_scope` of its processors) where
    the run sent request parameters: the drafter proposes from its raw logits, as the engines' drafters do, and
    the target's continuation past an output's end is its processed greedy choice (`request_choosers`)."""
    started = time.perf_counter()
    observed = counters.of_run(engine, trace, evidence)  # a server's or recording's counters, or of_run's
    black_box = bool(capability(engine, "black_box"))
    expected, unavailable, implied = None, None, None
    if baseline is not None:
        found = baseline_for(baseline, engine_name, pair_name, batch_size, dtype)
        if found is None:
            unavailable = f"no run of {baseline_path} has per-position counters"
        else:
            expected = expected_.from_baseline(found[0], f"{baseline_path}: {found[1]}")
    else:
        implied = implied_spec(engine_name, draft, k) if spec is None else None
        if implied is not None:
            spec = implied[0]
        chosen = proposer_of(engine, spec, draft, k if k is not None else (trace.draft_tokens if trace else None),
                             trace)
        if isinstance(chosen, str):
            unavailable = chosen
        else:
            proposer, width = chosen
            exact = not black_box and (dtype == "float64" or isinstance(proposer, expected_.NgramProposer))
            note = "" if exact else (BLACK_BOX if black_box else BELOW_FLOAT64.format(dtype=dtype))
            rows = [i for i in range(len(prompts)) if i not in failed and outputs[i]]
            unavailable = unreplayable(requests, proposer, black_box, tokenizer) if requests is not None else None
            stops = stop_ids or [[] for _ in prompts]
            grammars = (grammar_makers(requests, tokenizer, _vocab_width(target), stops, prompts)
                        if requests is not None and not unavailable else None)
            choosers = (request_choosers(requests, prompts, stops, penalty_scope, grammars)
                        if requests is not None else None)
            # the draft model is masked by the grammar (`ModelDrafter`); n-gram proposals are not (no logits)
            draft_grammars = grammars if isinstance(proposer, expected_.DraftModelProposer) else None
            try:
                expected = None if unavailable else expected_.replay(
                    proposer, target, prompts, outputs, width, exact=exact, note=note, rows=rows, choosers=choosers,
                    grammars=draft_grammars)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # the run keeps its verdict; only the expectation is missing
                unavailable = one_line(f"the {proposer.name} failed ({type(exc).__name__}: {exc})")
    compared = compare(observed, expected, required=required, unavailable=unavailable)
    if implied is not None:
        compared = replace(compared, implied=implied[1])
    record = counters.with_server_problems(compared.to_json(), engine, evidence)
    record["seconds"] = time.perf_counter() - started
    return record
