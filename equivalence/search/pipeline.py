"""The search as a choice of the one pipeline (equivalence/pipeline/runner.py `compose`): which workload, the
fixed prompt set or one drawn by the search (`--search`).

`composition` checks the search's inputs (exit 2, one line) and gives the runner its judge and oracles: one
`SearchOracle` per pair and dtype (the weights in this process, loaded as `WeightsOracle` loads them; the prompts
of `--prompts` or the built-in set are the pool fresh prompts are cut from), and `SearchJudge`, whose run of one
engine at one batch size is a search (equivalence/search/run.py). The runner's loop, guard, `audit.json`, reports
and exit status are the audit's own; each finding's shrunk case is a bundle under `OUT/bundles/`, and what the
search covered is in the run's `search` and in `OUT/search.md`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

from specaudit.engines.registry import black_box_prefix, make_engine, takes_request_params
from specaudit.equivalence import validate
from specaudit.equivalence.errors import UsageError
from specaudit.equivalence.pipeline.judges import Mode
from specaudit.equivalence.pipeline.prompt_set import resolve_prompts
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair
from specaudit.equivalence.pipeline.weights import WeightsOracle, failed_engine_run, load
from specaudit.equivalence.records import Run
from specaudit.equivalence.records.serialize import run_from_json
from specaudit.equivalence.search.judging import Judging, JudgingSettings
from specaudit.equivalence.search.strategies import ALL_CONSTRAINTS, FAMILIES, PROBES, ConstraintScope

SERVERS = ("llamacpp", "vllm", "sglang", "trtllm")


def refusal(settings: AuditSettings) -> str | None:
    """Why the audit's settings cannot be searched, in one line, or None."""
    search = settings.search
    if search is None:
        return None
    if settings.reference is not None:
        return "--search draws requests that the in-process reference answers: drop --reference, give --target or --pair"
    if settings.sampling is not None:
        return "--search judges greedy tokens: drop --temperature"
    for name in settings.engines:
        prefix = black_box_prefix(name)
        if prefix == "recorded":
            return (f"--search draws new requests, and {name} holds answers to fixed prompts only: a recording "
                    "cannot be searched; give a live server or an in-process engine")
        if prefix not in SERVERS and not takes_request_params(name):
            return (f"--search sends request parameters, and {name} takes none (its class declares no "
                    "`request_params`): give a live server or an engine that takes them")
    if settings.plain_engine is not None:
        return "--search with --plain-engine is not supported: drop --plain-engine"
    if settings.request_params is not None:
        return "--search draws each request's parameters: drop the request-parameter flags (--stop, ...)"
    if (search.examples is None) == (search.minutes is None):
        return "--budget: give a number of examples (50) or of minutes (10m)"
    if search.examples is not None and search.examples < 1 or search.minutes is not None and search.minutes <= 0:
        return "--budget: give at least one example, or more than 0 minutes"
    if search.max_requests < 1:
        return "the search needs at least one request an example"
    if search.max_findings < 1:
        return "--max-findings: give at least 1"
    unknown = sorted(set(search.families or ()) - set(FAMILIES) - set(PROBES))
    if unknown:
        return f"unknown parameter families {', '.join(unknown)}: known are {', '.join(FAMILIES + PROBES)}"
    if search.reasoning_end and not search.reasoning_end.strip():
        return "--reasoning-end: give the marker's text (for example </think>), not blank"
    if search.diagnosis not in ("off", "quick"):
        return f"the search's diagnosis is off or quick (the shrunk case gets full), not {search.diagnosis!r}"
    return None


def composition(settings: AuditSettings, out_dir: Path) -> tuple[Any, Callable[[], Iterator[Any]], int, str]:
    """(judge, oracles, planned runs, device) for the runner's `Composition`; `UsageError` for bad input."""
    refused = refusal(settings)
    if refused is not None:
        raise UsageError(refused)
    validate.preflight(settings)
    from specaudit.equivalence.search.coverage import start_search_report

    start_search_report(out_dir)

    def oracles() -> Iterator[SearchOracle]:
        first = True
        for dtype in settings.dtypes:
            for pair_spec in settings.pairs:
                oracle = SearchOracle(settings, pair_spec, dtype, out_dir, check_factories=first)
                yield oracle
                first = first and not oracle.loaded

    planned = len(settings.engines) * len(settings.batch_sizes) * len(settings.pairs) * len(settings.dtypes)
    return SearchJudge(), oracles, planned, settings.device


class SearchOracle(WeightsOracle):
    """The weights of one pair in one dtype, as the search's reference (decoded per drawn prompt and parameters)."""

    def open_greedy(self) -> None:
        settings = self.settings
        pair = self._load()
        if self.check_factories:
            validate.check_factories(settings, pair)
        self.loaded = True
        self.replay = pair if self.dtype == "float64" else load(self.pair_spec, "float64", settings.device)
        self.eos = pair.eos_token_id if settings.eos_token_id == "pair" else settings.eos_token_id
        self.pool = resolve_prompts(settings, tokenizer=pair.tokenizer, with_requests=False).prompts
        self.stage = "the search"

    def describe(self, audit: dict[str, Any]) -> None:
        audit["config"]["prompts"] = f"drawn by the search (pool: {self.settings.prompts})"
        audit["config"]["num_prompts"] = None

    def greedy_run(self, engine_name: str, batch_size: int, show_progress: bool = True) -> dict[str, Any]:
        from specaudit.equivalence.search.coverage import write_search_report
        from specaudit.equivalence.search.run import search

        settings, pair = self.settings, self.pair
        base = {"engine": engine_name, "mode": "greedy", "pair": pair.name, "batch_size": batch_size,
                "dtype": self.dtype, "device": settings.device, "num_prompts": 0}
        try:
            options = {"pad_token_id": pair.pad_token_id, **settings.engine_options}
            engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size,
                                 draft_tokens=settings.draft_tokens, **options)
            judging = Judging(pair, engine, JudgingSettings(
                engine_name=engine_name, batch_size=batch_size, dtype=self.dtype,
                max_new_tokens=settings.max_new_tokens, eos_token_id=self.eos, device=settings.device,
                timeout=settings.timeout, engine_dtype=settings.engine_dtype, logit_tolerance=settings.logit_tolerance,
                draft_tokens=settings.draft_tokens, speculation=settings.speculation), self.replay)
            target = self.pair_spec.target if isinstance(self.pair_spec, UserPair) else None
            result = search(judging, search_settings=settings.search, pool=[list(p) for p in self.pool],
                            vocab_size=int(pair.target.config.vocab_size), out_dir=self.out_dir,
                            bad_words_as_text=black_box_prefix(engine_name) == "vllm", bundles=settings.bundles,
                            target=target, progress=show_progress,
                            constraint_scope=constraint_scope(engine_name, engine, pair.tokenizer,
                                                              settings.search.reasoning_end))
            write_search_report(self.out_dir, result.run)
            return result.run
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one engine failing must not lose the others' runs
            return failed_engine_run(base, engine_name, batch_size, settings.device, exc)


def constraint_scope(engine_name: str, engine: Any, tokenizer: Any, reasoning_end: str = "") -> ConstraintScope:
    """The structured outputs the search may send `engine` (strategies.ConstraintScope): a server what its
    dialect carries, as it is started by default (EBNF grammars, JSON with any whitespace; llama.cpp's JSON
    with llguidance, as it applies it), behind `reasoning_end` (its reasoning parser's marker, "" none); an
    in-process engine that declares `takes_constraints`, every kind, behind `reasoning_end` or markers drawn.
    None without a tokenizer (a grammar's mask is over text) or the reference's grammar engine."""
    from specaudit.engines.constraints import KINDS, Constraint
    from specaudit.engines.constraints.fields import dialect_refusal

    if tokenizer is None:
        return ConstraintScope()
    try:
        from specaudit.engines.constraints.matcher import _xgrammar

        _xgrammar()
    except Exception:
        return ConstraintScope()
    dialect = black_box_prefix(engine_name)
    if dialect not in SERVERS:
        if not getattr(engine, "takes_constraints", False):
            return ConstraintScope()
        return replace(ALL_CONSTRAINTS, reasoning_end=reasoning_end or None)
    backend = "llguidance" if dialect == "llamacpp" else "xgrammar"
    samples = {"json_schema": Constraint("json_schema", '{"type": "object"}', backend=backend),
               "json_object": Constraint("json_object", backend=backend), "regex": Constraint("regex", "a"),
               "choice": Constraint("choice", choices=("a",)), "grammar": Constraint("grammar", 'root ::= "a"')}
    kinds = tuple(k for k in KINDS if dialect_refusal(dialect, samples[k]) is None)
    if backend == "llguidance" and any(k.startswith("json") for k in kinds):
        try:
            from specaudit.engines.constraints.llguidance_matcher import llguidance_grammar

            llguidance_grammar(samples["json_object"])
        except Exception:  # llguidance not installed: no JSON kind
            kinds = tuple(k for k in kinds if not k.startswith("json"))
    return ConstraintScope(kinds=kinds, syntaxes=("ebnf",), whitespace=(True,), json_backend=backend,
                           reasoning_end=reasoning_end)


class SearchJudge:
    """Greedy tokens, judged as `GreedyJudge` judges them, on the requests the search draws."""

    mode: Mode = "greedy"

    def open(self, oracle: SearchOracle) -> None:
        oracle.open_greedy()

    def run(self, engine: str, batch_size: int, oracle: SearchOracle, progress: Any = None) -> Run:
        return run_from_json(oracle.greedy_run(engine, batch_size, show_progress=progress is not None))
