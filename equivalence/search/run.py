"""The search of one engine at one batch size: Hypothesis drives the state machine (equivalence/search/machine.py)
within the budget, shrinks the first failing mix, and the shrunk case is judged again with the full diagnosis and
written as a repro bundle (equivalence/search/bundle.py).

Hypothesis's own bookkeeping: the example database under `OUT/hypothesis/` (`DirectoryBasedExampleDatabase`: a
failing mix found once is tried first next time), the seed (`--seed`, printed; on a fresh `OUT` the same seed
draws the same examples on the same code), `target()` toward mixes with more parameter families, longer shared
prefixes and more requests in flight, and its health checks (all but `too_slow`: every example is a real run).
The budget is a number of examples (Hypothesis's `max_examples`) or minutes: past the deadline every new example
is rejected at once and Hypothesis ends its run. One record comes back: the run of every judged example's requests
(`audit.json`'s run, its divergences the shrunk finding's), with what the search covered under `search`.
"""

from __future__ import annotations

import sys
import time
import urllib.error
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as hypothesis_settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import get_state_machine_test

from specaudit.equivalence.pipeline.settings import SearchSettings
from specaudit.equivalence.search.judging import Judging, failed
from specaudit.equivalence.search.machine import MachineContext, machine_for
from specaudit.equivalence.search.model import Coverage, Mix
from specaudit.equivalence.search.strategies import FAMILIES

UNBOUNDED_EXAMPLES = 10 ** 6  # a minutes budget: Hypothesis's count never ends the search first


@dataclass
class SearchResult:
    run: dict[str, Any]  # the one run record (module docstring)
    finding: Mix | None  # the shrunk mix, or None when every example passed
    bundle: Path | None
    coverage: Coverage
    examples: int  # judged, shrinking included
    found_after: int | None  # examples judged when the first failure was seen
    seconds: float
    events: dict[str, Any] = field(default_factory=dict)  # server-side counters moved by the search


def server_counters(url: str | None) -> dict[str, float] | None:
    """A vLLM server's prefix-cache and preemption counters from `/metrics` (None: no server, or none there)."""
    if url is None:
        return None
    from specaudit.engines.adapters.server_metrics import get_text, join_url, parse_prometheus

    try:
        status, text = get_text(join_url(url, "/metrics"), timeout=5.0, what="server metrics endpoint")
    except (OSError, urllib.error.URLError, ValueError, RuntimeError):
        return None
    if status != 200:
        return None
    totals = parse_prometheus(text)
    wanted = ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")
    found = {name: value for name, value in totals.items()
             if any(w in name for w in wanted) and not name.endswith("_created")}
    return found or None


def search(judging: Judging, *, search_settings: SearchSettings, pool: list[list[int]], vocab_size: int,
           out_dir: Path, bad_words_as_text: bool = False, max_prompt_length: int = 64,
           progress: bool = True, log: Callable[[str], None] | None = None, bundles: bool = True,
           target: str | None = None) -> SearchResult:
    """Search one engine (module docstring); the finding's bundle under `out_dir/bundles/` (`bundles`), its replay
    command naming `target` (the reference's folder) where given."""
    say = log or (lambda line: print(line, file=sys.stderr))
    budget = (f"{search_settings.examples} examples" if search_settings.examples is not None
              else f"{search_settings.minutes:g} minutes")
    database = out_dir / "hypothesis"
    say(f"search: {judging.settings.engine_name} B={judging.settings.batch_size}: seed {search_settings.seed}, "
        f"budget {budget}, up to {search_settings.max_requests} requests an example, database {database}")
    started = time.monotonic()
    deadline = None if search_settings.minutes is None else started + 60 * search_settings.minutes
    coverage = Coverage()
    judged: list[tuple[Mix, dict[str, Any]]] = []
    state = {"found_after": None}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = (tqdm(total=search_settings.examples, unit="example", file=sys.stderr, dynamic_ncols=True, leave=False)
               if search_settings.examples is not None else
               tqdm(total=int(60 * search_settings.minutes), unit="s", file=sys.stderr, dynamic_ncols=True,
                    leave=False))

    def judge_more() -> bool:
        """Whether a mix is still judged: always once a failure was found (shrinking is judged past the budget), else
        while fewer than the budget's examples were judged. Hypothesis may run a test case beyond `max_examples` (one
        it replays or does not count as valid): the budget counts what was judged, on any machine."""
        examples = search_settings.examples
        return examples is None or state["found_after"] is not None or len(judged) < examples

    def on_judged(mix: Mix, run: dict[str, Any], bad: bool) -> None:
        judged.append((mix, run))
        coverage.add(mix, run)
        if bad and state["found_after"] is None:
            state["found_after"] = len(judged)
        if bar is not None:
            if search_settings.examples is not None:
                bar.update(1)
            else:
                bar.n = min(bar.total, int(time.monotonic() - started))
                bar.refresh()
            if state["found_after"] is not None:
                bar.set_postfix_str("shrinking")

    context = MachineContext(
        judging=judging, pool=pool, vocab_size=vocab_size, max_prompt_length=max_prompt_length,
        families=tuple(search_settings.families or FAMILIES), bad_words_as_text=bad_words_as_text,
        diagnosis=search_settings.diagnosis,
        expired=(lambda: deadline is not None and time.monotonic() > deadline), judge_more=judge_more,
        on_judged=on_judged)
    machine = hypothesis_seed(search_settings.seed)(machine_for(context))
    # from Hypothesis's own defaults, not the profile a test session or the plugin loaded (a derandomized profile
    # would override the seed): the same seed draws the same examples wherever the search runs
    settings = hypothesis_settings(
        parent=hypothesis_settings.get_profile("default"), derandomize=False,
        max_examples=search_settings.examples or UNBOUNDED_EXAMPLES, stateful_step_count=search_settings.max_requests,
        deadline=None, database=DirectoryBasedExampleDatabase(str(database)), report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        verbosity=Verbosity.quiet)
    counters_before = server_counters(getattr(judging.engine, "url", None))
    error = None
    try:
        get_state_machine_test(machine, settings=settings)()
    except Unsatisfiable:  # the deadline passed before any example was judged
        pass
    except Exception as exc:  # a failing mix, shrunk (MixFailed), or Hypothesis saying the engine is flaky
        error = exc
    finally:
        if bar is not None:
            bar.close()
    counters_after = server_counters(getattr(judging.engine, "url", None))
    events: dict[str, Any] = {}
    if counters_before is not None and counters_after is not None:
        events = {name: counters_after.get(name, 0.0) - counters_before.get(name, 0.0) for name in counters_after}
    finding = context.failures[-1][0] if context.failures else None
    final, bundle = None, None
    if finding is not None:  # the shrunk case, fewer requests where it still fails, judged with the full diagnosis
        finding = fewest_requests(judging, finding, search_settings.diagnosis, on_judged)
        final = judging.judge(finding, "full")
        say(f"search: found after {state['found_after']} examples, shrunk to {len(finding.requests)} request(s) in "
            f"{len(finding.waves())} wave(s)" + ("" if type(error).__name__ == "MixFailed" else
                                                  f" ({type(error).__name__}: the failure did not always reproduce)"))
        if bundles:
            from specaudit.equivalence.search.bundle import write_search_bundle

            bundle = write_search_bundle(out_dir / "bundles", finding, final, judging, search_settings.seed, target)
            say(f"search: the shrunk case is {bundle}; replay it with: specaudit replay {bundle} --engine "
                f"{judging.settings.engine_name}" + (f" --target {target}" if target else ""))
    elif error is not None:
        raise error
    seconds = time.monotonic() - started
    result = SearchResult({}, finding, bundle, coverage, len(judged), state["found_after"], seconds, events)
    result.run = merged_record(judged, finding, final, result, search_settings, judging)
    return result


def without(mix: Mix, index: int) -> Mix:
    """`mix` without its request `index` (a later request that shared with it keeps its prompt as drawn)."""
    kept = []
    for i, request in enumerate(mix.requests):
        if i == index:
            continue
        shared = request.shared_with
        if shared is not None:
            shared = None if shared == index else shared - (shared > index)
        kept.append(replace(request, shared_with=shared))
    return Mix(kept)


def fewest_requests(judging: Judging, mix: Mix, diagnosis: str,
                    on_judged: Callable[[Mix, dict[str, Any], bool], None]) -> Mix:
    """Hypothesis's shrunk mix with every request left out that the failure does not need (one request at a time,
    the last first, until none can go): Hypothesis fills a shortened run of steps with its simplest request, which
    this drops."""
    changed = True
    while changed and len(mix.requests) > 1:
        changed = False
        for index in reversed(range(len(mix.requests))):
            candidate = without(mix, index)
            run = judging.judge(candidate, diagnosis)
            bad = failed(run)
            on_judged(candidate, run, bad)
            if bad:
                mix, changed = candidate, True
                break
    return mix


def merged_record(judged: list[tuple[Mix, dict[str, Any]]], finding: Mix | None, final: dict[str, Any] | None,
                  result: SearchResult, search_settings: SearchSettings, judging: Judging) -> dict[str, Any]:
    """The one run record of the search: every judged example's requests as its prompts (each with its
    `example`), the shrunk finding (judged last, full diagnosis) as its divergences, and `search`: the budget,
    the counts, the time split, the coverage and the server's events."""
    s = judging.settings
    examples = judged + ([(finding, final)] if finding is not None and final is not None else [])
    prompts: list[dict[str, Any]] = []
    request_params: list[Any] = []
    refused: list[dict[str, Any]] = []
    offset = 0
    for number, (mix, run) in enumerate(examples):
        records = run.get("prompts") or [{"index": i, "exact": False, "failed": True} for i in range(len(mix.requests))]
        for record in records:
            prompts.append({**record, "index": offset + int(record.get("index", 0)), "example": number})
        request_params += [r.params.to_dict() for r in mix.requests]
        refused += [{**r, "prompt_index": offset + int(r["prompt_index"])} for r in run.get("refused_parameters") or []]
        last_offset = offset
        offset += len(mix.requests)
    base = dict(final if final is not None else (examples[-1][1] if examples else {}))
    divergences = []
    if final is not None:
        for divergence in final.get("divergences") or []:
            divergences.append({**divergence, "prompt_index": last_offset + int(divergence.get("prompt_index") or 0)})
    structural = sum(d.get("kind") == "structural" for d in divergences)
    base.update({
        "engine": s.engine_name, "mode": "greedy", "pair": judging.pair.name, "batch_size": s.batch_size,
        "dtype": s.dtype, "device": s.device, "num_prompts": len(prompts), "prompts": prompts,
        "exact_matches": sum(1 for p in prompts if p.get("exact") is True), "divergences": divergences,
        "structural_divergences": structural, "numerical_divergences": len(divergences) - structural,
        "equivalent": finding is None, "request_params": request_params, "refused_parameters": refused,
        "seconds": judging.engine_seconds,
        "search": {
            "seed": search_settings.seed, "budget": search_settings.to_dict(), "examples": result.examples,
            "found_after": result.found_after, "seconds": result.seconds,
            "engine_seconds": judging.engine_seconds, "reference_seconds": judging.reference_seconds,
            "examples_per_minute": 60 * result.examples / result.seconds if result.seconds else None,
            "finding": None if finding is None else {
                "requests": len(finding.requests), "waves": finding.waves(), "prompt_offset": last_offset,
                "bundle": None if result.bundle is None else f"bundles/{result.bundle.name}"},
            "coverage": result.coverage.to_dict(), "server_events": result.events or None},
    })
    if finding is None:
        base["error"] = None
        base.pop("failed", None)
    return base
