"""The search of one engine at one batch size: Hypothesis drives the state machine (equivalence/search/machine.py)
within the budget, shrinks a failing mix, and the shrunk case is judged again with the full diagnosis and written
as a repro bundle (equivalence/search/bundle.py). Then the search goes on with what is left of the budget, and a
failure counts only where it is a new one: a failure signature (`signatures`: each structural divergence's class and
the request parameter its evidence names, a failed request, an engine that failed) not among the findings' so far.
So an engine with several bugs gives one shrunk finding per bug, up to `SearchSettings.max_findings`, and a bug
found once does not spend the rest of the budget being found again.

Hypothesis's own bookkeeping: the example database under `OUT/hypothesis/` (`DirectoryBasedExampleDatabase`: a
failing mix found once is tried first next time), the seed (`--seed`, printed; on a fresh `OUT` the same seed
draws the same examples on the same code), `target()` toward mixes with more parameter families, longer shared
prefixes and more requests in flight, and its health checks (all but `too_slow`: every example is a real run).
Each round of the search is one Hypothesis run with its own seed (`--seed` plus the round) and database
(`OUT/hypothesis/round-K`): under a budget of examples (drawn ones; shrinking's not counted), what is left of it,
a round ending at a finding or when the budget is spent; under a budget of minutes, `ROUND_EXAMPLES` at a time
until the deadline (past it, every example passes unjudged; a shrink under way gets `SHRINK_GRACE` of the budget
more). One record comes back: the run of every judged
example's requests (`audit.json`'s run, its divergences the shrunk findings'), with what the search covered under
`search`.
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
from hypothesis.errors import Flaky, Unsatisfiable
from hypothesis.stateful import get_state_machine_test

from specaudit.equivalence.pipeline.settings import SearchSettings
from specaudit.equivalence.run_record import passed
from specaudit.equivalence.errors import one_line
from specaudit.engines.limits import eos_ids
from specaudit.equivalence.search.judging import Judging, failed
from specaudit.equivalence.search.machine import MachineContext, machine_for
from specaudit.equivalence.search.model import Coverage, Mix
from specaudit.equivalence.search.strategies import FAMILIES, PROBES, ConstraintScope, text_tokens

# examples of one Hypothesis run under a minutes budget: the deadline ends the search between runs (and, within one,
# every example past it passes unjudged: an example that stops drawing early would make Hypothesis's draws flaky)
ROUND_EXAMPLES = 25


SHRINK_GRACE = 0.25  # of a minutes budget: a failure found near the deadline is still shrunk
SHRINK_EXAMPLES = 120  # judged while one failure is shrunk by Hypothesis; past it, the shrink's mixes pass
SHRINK_SHARE = 0.15  # of a minutes budget: the most one failure's shrinking may take


Signature = tuple[str, str | None]  # (class, or what failed; the request parameter its evidence names)


def signatures(run: dict[str, Any]) -> frozenset[Signature]:
    """What makes a failing run fail, as the search tells one bug from another: each structural divergence's class
    (`unexplained` without one) and the processor or parameter its evidence names, an engine that failed, a request
    that failed."""
    found: set[Signature] = set()
    if run.get("error"):
        found.add(("engine failed", None))
    for divergence in run.get("divergences") or []:
        if divergence.get("kind") != "structural":
            continue
        cls = (divergence.get("diagnosis") or {}).get("class") or "unexplained"
        evidence = divergence.get("evidence")
        named = evidence.get("processor") if isinstance(evidence, dict) else None
        found.add((cls, str(named) if named else None))
    if run.get("failures"):
        found.add(("request failed", None))
    if not found and not passed(run):
        found.add(("not equivalent", None))
    return frozenset(found)


@dataclass
class Finding:
    """One shrunk failure: the mix, its run judged with the full diagnosis, its bundle and what it was told by."""

    mix: Mix
    run: dict[str, Any]
    signatures: frozenset[Signature]
    found_after: int  # examples drawn (shrinking's not counted) when its first failure was seen
    bundle: Path | None = None
    reproducible: bool = True  # False: Hypothesis saw the failure come and go while shrinking


@dataclass
class SearchResult:
    run: dict[str, Any]  # the one run record (module docstring)
    findings: list[Finding]
    coverage: Coverage
    examples: int  # judged, shrinking included
    seconds: float
    events: dict[str, Any] = field(default_factory=dict)  # server-side counters moved by the search

    @property
    def finding(self) -> Mix | None:
        """The first finding's shrunk mix (None: every example passed)."""
        return self.findings[0].mix if self.findings else None

    @property
    def bundle(self) -> Path | None:
        return self.findings[0].bundle if self.findings else None

    @property
    def found_after(self) -> int | None:
        return self.findings[0].found_after if self.findings else None


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
           target: str | None = None, constraint_scope: ConstraintScope = ConstraintScope()) -> SearchResult:
    """Search one engine (module docstring); each finding's bundle under `out_dir/bundles/` (`bundles`), its replay
    command naming `target` (the reference's folder) where given."""
    say = log or (lambda line: print(line, file=sys.stderr))
    budget = (f"{search_settings.examples} examples" if search_settings.examples is not None
              else f"{search_settings.minutes:g} minutes")
    say(f"search: {judging.settings.engine_name} B={judging.settings.batch_size}: seed {search_settings.seed}, "
        f"budget {budget}, up to {search_settings.max_requests} requests an example and "
        f"{search_settings.max_findings} findings, database {out_dir / 'hypothesis'}")
    started = time.monotonic()
    deadline = None if search_settings.minutes is None else started + 60 * search_settings.minutes
    grace = 0.0 if search_settings.minutes is None else 60 * search_settings.minutes * SHRINK_GRACE
    coverage = Coverage()
    judged: list[tuple[Mix, dict[str, Any]]] = []
    findings: list[Finding] = []
    known: set[Signature] = set()
    # drawn: examples judged outside shrinking; found_at: the drawn examples when this round's failure was seen
    state: dict[str, Any] = {"drawn": 0, "found_at": None}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = (tqdm(total=search_settings.examples, unit="example", file=sys.stderr, dynamic_ncols=True, leave=False)
               if search_settings.examples is not None else
               tqdm(total=int(60 * search_settings.minutes), unit="s", file=sys.stderr, dynamic_ncols=True,
                    leave=False))

    def shrinking() -> bool:
        return state["found_at"] is not None

    def expired() -> bool:
        return deadline is not None and time.monotonic() > deadline + (grace if shrinking() else 0.0)

    def judge_more() -> bool:
        """Whether a mix is still judged: while a failure is shrunk, up to its shrink budget (`SHRINK_EXAMPLES`, and
        `SHRINK_SHARE` of a minutes budget: a failure that comes and goes would shrink for ever); else while fewer
        than the budget's examples were drawn. Hypothesis may run a test case beyond `max_examples` (one it replays
        or does not count as valid): the budget counts what was judged, on any machine. A mix not judged passes."""
        if shrinking():
            spent = len(judged) - state["found_at_judged"]
            late = (search_settings.minutes is not None
                    and time.monotonic() - state["found_time"] > 60 * search_settings.minutes * SHRINK_SHARE)
            return spent < SHRINK_EXAMPLES and not late
        examples = search_settings.examples
        return examples is None or state["drawn"] < examples

    def is_new_failure(run: dict[str, Any]) -> bool:
        """The run fails, and not only as a finding so far failed."""
        return failed(run) and not signatures(run) <= known

    def on_judged(mix: Mix, run: dict[str, Any], bad: bool) -> None:
        judged.append((mix, run))
        if not shrinking():  # what the search drew; shrinking's simpler mixes would drown it
            coverage.add(mix, run)
            state["drawn"] += 1
        if bad and not shrinking():
            state["found_at"] = state["drawn"]
            state["found_at_judged"], state["found_time"] = len(judged), time.monotonic()
        if bar is not None:
            if search_settings.examples is not None:
                bar.n = min(bar.total, state["drawn"])
            else:
                bar.n = min(bar.total, int(time.monotonic() - started))
            bar.set_postfix_str(f"{len(findings)} found" + (", shrinking" if shrinking() else ""))
            bar.refresh()

    tokens = text_tokens(judging.pair.tokenizer, vocab_size)
    counters_before = server_counters(getattr(judging.engine, "url", None))
    round_index = 0
    while len(findings) < search_settings.max_findings and not expired():
        if search_settings.examples is not None:
            round_examples = search_settings.examples - state["drawn"]
            if round_examples <= 0:
                break
        else:
            round_examples = ROUND_EXAMPLES
        state["found_at"] = None
        drawn_before = state["drawn"]
        context = MachineContext(
            judging=judging, pool=pool, vocab_size=vocab_size, tokens=tokens, max_prompt_length=max_prompt_length,
            eos_ids=tuple(eos_ids(judging.settings.eos_token_id)),
            sampled="seeded" in (search_settings.families or PROBES) and judging.sampled,
            families=tuple(f for f in search_settings.families or FAMILIES if f in FAMILIES), bad_words_as_text=bad_words_as_text,
            constraint_scope=constraint_scope, diagnosis=search_settings.diagnosis, expired=expired, judge_more=judge_more, on_judged=on_judged,
            is_failure=is_new_failure)
        error = hypothesis_round(context, search_settings, out_dir / "hypothesis" / f"round-{round_index}",
                                 search_settings.seed + round_index, round_examples)
        round_index += 1
        if not context.failures:
            if error is not None and not isinstance(error, Flaky):
                raise error
            if error is not None:  # no failure, and Hypothesis saw the draws change: said, the search goes on
                say(f"search: round {round_index - 1}: {type(error).__name__}: {one_line(str(error))[:200]}")
            if search_settings.examples is not None:
                say(f"search: no new failure in the last {state['drawn'] - drawn_before} examples")
                break
            continue  # a minutes budget: the next round, until the deadline
        mix, search_run = context.failures[-1]
        # the shrunk case, fewer requests where it still fails anew, judged with the full diagnosis
        mix, search_run = fewest_requests(judging, mix, search_run, search_settings.diagnosis, on_judged,
                                          is_new_failure)
        final = judging.judge(mix, "full")
        finding = Finding(mix, final, signatures(search_run), state["found_at"],
                          reproducible=type(error).__name__ == "MixFailed")
        known |= finding.signatures | signatures(final)
        number = len(findings) + 1
        say(f"search: finding {number} after {finding.found_after} examples, shrunk to {len(mix.requests)} "
            f"request(s) in {len(mix.waves())} wave(s): {describe(finding.signatures)}"
            + ("" if finding.reproducible else f" (the failure did not always reproduce: {type(error).__name__}: "
                                                 f"{one_line(str(error))[:200]})"))
        if bundles:
            from specaudit.equivalence.search.bundle import write_search_bundle

            finding.bundle = write_search_bundle(out_dir / "bundles", mix, final, judging, search_settings.seed,
                                                 target, number)
            say(f"search: the shrunk case is {finding.bundle}; replay it with: specaudit replay {finding.bundle} "
                f"--engine {judging.settings.engine_name}" + (f" --target {target}" if target else ""))
        findings.append(finding)
        state["found_at"] = None
    if bar is not None:
        bar.close()
    counters_after = server_counters(getattr(judging.engine, "url", None))
    events: dict[str, Any] = {}
    if counters_before is not None and counters_after is not None:
        events = {name: counters_after.get(name, 0.0) - counters_before.get(name, 0.0) for name in counters_after}
    result = SearchResult({}, findings, coverage, len(judged), time.monotonic() - started, events)
    result.run = merged_record(judged, result, search_settings, judging)
    return result


def describe(found: frozenset[Signature]) -> str:
    return ", ".join(cls + (f" ({named})" if named else "") for cls, named in sorted(found, key=str))


def hypothesis_round(context: MachineContext, search_settings: SearchSettings, database: Path,
                     seed: int, examples: int) -> BaseException | None:
    """One Hypothesis run of the state machine until its first (new) failure is shrunk, or the budget is spent;
    the exception it ended with (a shrunk `MixFailed`, or Hypothesis saying the engine is flaky), else None."""
    machine = hypothesis_seed(seed)(machine_for(context))
    # from Hypothesis's own defaults, not the profile a test session or the plugin loaded (a derandomized profile
    # would override the seed): the same seed draws the same examples wherever the search runs
    settings = hypothesis_settings(
        parent=hypothesis_settings.get_profile("default"), derandomize=False,
        max_examples=examples, stateful_step_count=search_settings.max_requests,
        deadline=None, database=DirectoryBasedExampleDatabase(str(database)), report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        verbosity=Verbosity.quiet)
    try:
        get_state_machine_test(machine, settings=settings)()
    except Unsatisfiable:  # the deadline passed before any example was judged
        return None
    except Exception as exc:  # a failing mix, shrunk (MixFailed), or Hypothesis saying the engine is flaky
        return exc
    return None


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


def fewest_requests(judging: Judging, mix: Mix, run: dict[str, Any], diagnosis: str,
                    on_judged: Callable[[Mix, dict[str, Any], bool], None],
                    is_failure: Callable[[dict[str, Any]], bool]) -> tuple[Mix, dict[str, Any]]:
    """Hypothesis's shrunk mix (and its run) with every request left out that the failure does not need (one
    request at a time, the last first, until none can go): Hypothesis fills a shortened run of steps with its
    simplest request, which this drops."""
    changed = True
    while changed and len(mix.requests) > 1:
        changed = False
        for index in reversed(range(len(mix.requests))):
            candidate = without(mix, index)
            candidate_run = judging.judge(candidate, diagnosis)
            bad = is_failure(candidate_run)
            on_judged(candidate, candidate_run, bad)
            if bad:
                mix, run, changed = candidate, candidate_run, True
                break
    return mix, run


def merged_record(judged: list[tuple[Mix, dict[str, Any]]], result: SearchResult, search_settings: SearchSettings,
                  judging: Judging) -> dict[str, Any]:
    """The one run record of the search: every judged example's requests as its prompts (each with its
    `example`), the shrunk findings (each judged last in its round, full diagnosis) after them, their divergences
    the run's, and `search`: the budget, the counts, the time split, the findings, the coverage and the server's
    events."""
    s = judging.settings
    examples = judged + [(f.mix, f.run) for f in result.findings]
    prompts: list[dict[str, Any]] = []
    request_params: list[Any] = []
    refused: list[dict[str, Any]] = []
    offsets: list[int] = []
    offset = 0
    for number, (mix, run) in enumerate(examples):
        records = run.get("prompts") or [{"index": i, "exact": False, "failed": True} for i in range(len(mix.requests))]
        for record in records:
            prompts.append({**record, "index": offset + int(record.get("index", 0)), "example": number})
        request_params += [r.params.to_dict() for r in mix.requests]
        refused += [{**r, "prompt_index": offset + int(r["prompt_index"])} for r in run.get("refused_parameters") or []]
        offsets.append(offset)
        offset += len(mix.requests)
    finding_offsets = offsets[len(judged):]
    base = dict(result.findings[0].run if result.findings else (examples[-1][1] if examples else {}))
    divergences = []
    for finding, finding_offset in zip(result.findings, finding_offsets):
        for divergence in finding.run.get("divergences") or []:
            divergences.append({**divergence,
                                "prompt_index": finding_offset + int(divergence.get("prompt_index") or 0)})
    structural = sum(d.get("kind") == "structural" for d in divergences)
    findings = [{"requests": len(f.mix.requests), "waves": f.mix.waves(), "prompt_offset": o,
                 "found_after": f.found_after, "signatures": [list(x) for x in sorted(f.signatures, key=str)],
                 "reproducible": f.reproducible,
                 "bundle": None if f.bundle is None else f"bundles/{f.bundle.name}"}
                for f, o in zip(result.findings, finding_offsets)]
    base.update({
        "engine": s.engine_name, "mode": "greedy", "pair": judging.pair.name, "batch_size": s.batch_size,
        "dtype": s.dtype, "device": s.device, "num_prompts": len(prompts), "prompts": prompts,
        "exact_matches": sum(1 for p in prompts if p.get("exact") is True), "divergences": divergences,
        "structural_divergences": structural, "numerical_divergences": len(divergences) - structural,
        "equivalent": not result.findings, "request_params": request_params, "refused_parameters": refused,
        "seconds": judging.engine_seconds,
        "search": {
            "seed": search_settings.seed, "budget": search_settings.to_dict(), "examples": result.examples,
            "found_after": result.found_after, "seconds": result.seconds,
            "engine_seconds": judging.engine_seconds, "reference_seconds": judging.reference_seconds,
            "answer_seconds": judging.answer_seconds,
            "examples_per_minute": 60 * result.examples / result.seconds if result.seconds else None,
            # the search's speed against the engine answering the same requests alone: its answer time's share
            "speed_of_engine_alone": judging.answer_seconds / result.seconds if result.seconds else None,
            "finding": findings[0] if findings else None, "findings": findings,
            "coverage": result.coverage.to_dict(), "server_events": result.events or None},
    })
    if not result.findings:
        base["error"] = None
        base.pop("failed", None)
    return base
