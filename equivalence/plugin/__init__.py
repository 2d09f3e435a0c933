"""pytest plugin: audit any engine's equivalence with greedy decoding inside a test run.

    pytest --specaudit-engine mypkg.engine:make [--specaudit-pair tiny-gpt2] [--specaudit-batch-size 4]

adds one test per (engine, pair, batch size) that runs the Hypothesis equivalence property
(`specaudit.testing.properties.check_equivalence` over `specaudit.testing.strategies.decoding_cases`:
ragged prompt lengths, EOS at any step, k from 1 to the maximum) against the engine, then audits it
on the adversarial prompts (`equivalence/adversarial.py`; `--specaudit-no-adversarial` skips them).
A failure message starts with the diagnosis of the divergence (class, evidence, fix), then shows
the shrunk counterexample, the search's seed and the command that replays it; the run ends with
equivalence per engine and batch size. The run's exit status gates CI. Hooks here only hand off to
the harness modules.

With `--specaudit-require-acceptance R` it also adds one acceptance test per (engine, pair, batch size)
(`acceptance.py`): observed acceptance per draft position against what the proposer reaches, failing below
R x expected.

With `--specaudit-temperature T` it also adds one sampled test per (engine, pair): the sampled audit of the
engine's samples against the target's distribution (`sampled.py`), failing with the finding in words; with
`--specaudit-require-acceptance R` too, also where its acceptance is below R x the expected overlap of target
and draft (equivalence/acceptance/sampled.py).

With `--specaudit-target DIR`, a live server engine (`--specaudit-engine vllm:URL`, `llamacpp:URL`, ...) gets one
search test per batch size (`search.py`): the search over request mixes (docs/search.md) against the server, judged
against the weights in DIR; `--specaudit-search` adds the same test for each in-process engine and built-in pair.
A failure prints each finding's shrunk requests, its bundle and the command that replays it.

Seeds (`seed.py`): `--specaudit-seed N`, else `SPECAUDIT_SEED`, else a fixed seed when `CI` is set
(the same examples on every run of the same code), else a fresh random seed; whichever it is, the
terminal summary and every failure print it, so any run can be replayed. The sampled tests seed the
engine's requests with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from specaudit.equivalence.plugin.seed import SEED, Seed, replay_command, search_seed

DEFAULT_PAIRS = ["tiny-llama", "tiny-gpt2"]
DEFAULT_BATCH_SIZES = [1, 4, 8]


@dataclass
class Outcome:
    passed: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)


_results: dict[tuple[str, int], Outcome] = {}  # filled on the controller (the only process with no xdist)
_sampled_results: dict[str, Outcome] = {}  # engine -> its sampled tests' outcome, likewise


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specaudit", "specaudit: equivalence of batched speculative decoding")
    group.addoption("--specaudit-engine", action="append", default=[], metavar="E",
                    help="engine to audit: built-in name or package.module:factory (repeatable; none: no tests added)")
    group.addoption("--specaudit-pair", action="append", default=[], metavar="P",
                    help=f"built-in model pair (repeatable; default: {' '.join(DEFAULT_PAIRS)})")
    group.addoption("--specaudit-batch-size", action="append", type=int, default=[], metavar="N",
                    help=f"batch size (repeatable; default: {' '.join(map(str, DEFAULT_BATCH_SIZES))})")
    group.addoption("--specaudit-max-examples", type=int, default=25, metavar="N",
                    help="Hypothesis examples per (engine, pair, batch size) (default: 25)")
    group.addoption("--specaudit-max-new-tokens", type=int, default=16, metavar="N",
                    help="largest max_new_tokens drawn (default: 16)")
    group.addoption("--specaudit-max-draft-tokens", type=int, default=8, metavar="K",
                    help="largest k drawn (default: 8)")
    group.addoption("--specaudit-max-prompt-length", type=int, default=32, metavar="N",
                    help="longest synthetic prompt drawn; small prompts shrink fast (default: 32)")
    group.addoption("--specaudit-seed", type=int, default=None, metavar="N",
                    help="seed of the property search: the same seed draws the same examples (default: "
                         "SPECAUDIT_SEED, else 0 when CI is set, else a random seed, printed in the summary)")
    group.addoption("--specaudit-no-adversarial", action="store_true", default=False,
                    help="skip the adversarial prompts (pad, EOS and BOS ids inside prompts, identical prompts, "
                         "one-token and very long prompts) run after the search (default: run them)")
    group.addoption("--specaudit-require-acceptance", type=float, default=None, metavar="R",
                    help="also add one acceptance test per (engine, pair, batch size): it fails when the engine's "
                         "observed acceptance is below R x expected at some draft position, significantly "
                         "(0 < R <= 1; default: no acceptance test)")
    sampled = parser.getgroup("specaudit-sampled", "specaudit: sampled outputs against the target's distribution")
    sampled.addoption("--specaudit-temperature", type=float, default=None, metavar="T",
                      help="also test each engine's sampled outputs at temperature T (default: none, greedy only)")
    sampled.addoption("--specaudit-top-k", type=int, default=0, metavar="K", help="top-k of the sampled test (default: 0, off)")
    sampled.addoption("--specaudit-top-p", type=float, default=1.0, metavar="P", help="top-p of the sampled test (default: 1.0, off)")
    sampled.addoption("--specaudit-samples", type=int, default=300, metavar="N",
                      help="samples of the built-in prompt per (engine, pair) (default: 300)")
    sampled.addoption("--specaudit-sampled-new-tokens", type=int, default=3, metavar="N",
                      help="new tokens per sample (default: 3)")
    sampled.addoption("--specaudit-sampled-draft-tokens", type=int, default=2, metavar="K",
                      help="draft tokens per step of the sampled test: with a few new tokens, a small k reaches the "
                           "bonus token often (default: 2)")
    sampled.addoption("--specaudit-alpha", type=float, default=0.01, metavar="A",
                      help="family-wise false-positive rate of the sampled tests (default: 0.01)")
    sampled.addoption("--specaudit-request-params", default=None, metavar="JSON",
                      help='request parameters of the sampled test, a JSON object such as {"presence_penalty": 0.5, '
                           '"logit_bias": {"101": 2.0}} (the penalties, logit_bias, bad_words as ids, min_tokens, '
                           'min_p; default: none)')


    search = parser.getgroup("specaudit-search", "specaudit: the search over request mixes (docs/search.md)")
    search.addoption("--specaudit-target", default=None, metavar="DIR",
                     help="the weights a server engine serves (a Hugging Face folder with its tokenizer): each "
                          "server engine gets one search test per batch size against them (default: none)")
    search.addoption("--specaudit-search", action="store_true", default=False,
                     help="also search each in-process engine on each pair (default: servers only)")
    search.addoption("--specaudit-search-budget", default=None, metavar="N|Nm",
                     help="examples per search test (50), or minutes (10m) (default: 50)")
    search.addoption("--specaudit-dtype", default="float64", metavar="D",
                     help="the reference's dtype for a search test (default: float64)")
    search.addoption("--specaudit-prompts", default="builtin", metavar="FILE",
                     help="the prompts fresh ones are cut from, a JSONL file (default: the built-in set)")
    search.addoption("--specaudit-out", default=None, metavar="DIR",
                     help="where each search test writes its audit.json, reports and bundles, one folder per test "
                          "(default: under pytest's temporary directory; printed on failure)")


def pytest_configure(config: pytest.Config) -> None:
    """One seed for the whole run: the controller chooses it, pytest-xdist's workers are handed it."""
    given = getattr(config, "workerinput", {}).get("specaudit_seed")
    config.stash[SEED] = Seed(*given) if given else search_seed(config.getoption("specaudit_seed"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # pytest-xdist: a worker is being started
    seed = node.config.stash[SEED]
    node.workerinput["specaudit_seed"] = (seed.value, seed.source)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    engines = config.getoption("specaudit_engine")
    if not engines:
        return
    from specaudit.engines.registry import EngineSpecError, resolve
    from specaudit.engines.models.zoo import builtin_pair_names

    pairs = config.getoption("specaudit_pair") or DEFAULT_PAIRS
    unknown = [p for p in pairs if p not in builtin_pair_names()]
    if unknown:
        raise pytest.UsageError(f"--specaudit-pair: unknown {unknown}; built-in: {builtin_pair_names()}")
    for engine in engines:
        try:
            resolve(engine)
        except EngineSpecError as exc:
            raise pytest.UsageError(f"--specaudit-engine: {exc}") from exc
    engines = _search_items(session, config, engines, pairs, items)
    batch_sizes = config.getoption("specaudit_batch_size") or DEFAULT_BATCH_SIZES
    for engine in engines:
        for pair in pairs:
            for batch_size in batch_sizes:
                items.append(EquivalenceItem.from_parent(
                    session, name=f"specaudit[{engine}|{pair}|B{batch_size}]",
                    engine=engine, pair=pair, batch_size=batch_size,
                ))
    required = config.getoption("specaudit_require_acceptance")
    if required is not None:
        from specaudit.equivalence.plugin.acceptance import check_ratio

        try:
            check_ratio(required)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        for engine in engines:
            for pair in pairs:
                for batch_size in batch_sizes:
                    items.append(AcceptanceItem.from_parent(
                        session, name=f"specaudit-acceptance[{engine}|{pair}|B{batch_size}]",
                        engine=engine, pair=pair, batch_size=batch_size))
    from specaudit.equivalence.plugin.sampled import check_setting, setting_from

    setting = setting_from(config)
    if setting is None:
        return
    try:
        check_setting(setting)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    for engine in engines:
        for pair in pairs:
            items.append(SampledItem.from_parent(
                session, name=f"specaudit-sampled[{engine}|{pair}|T{setting.temperature:g}]", engine=engine, pair=pair))


def _search_items(session: pytest.Session, config: pytest.Config, engines: list[str], pairs: list[str],
                  items: list[pytest.Item]) -> list[str]:
    """Add the search tests to `items`; the in-process engines, which the other tests are for."""
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.plugin.search import DEFAULT_BUDGET, DEFAULT_SERVER_BATCH_SIZES, check_budget
    from specaudit.equivalence.search.pipeline import SERVERS

    servers = [e for e in engines if black_box_prefix(e) in SERVERS]
    others = [e for e in engines if e not in servers]
    target = config.getoption("specaudit_target")
    if servers and target is None:
        raise pytest.UsageError(f"--specaudit-engine {servers[0]} is a server: give --specaudit-target DIR, the "
                                "weights it serves, for its search test")
    if target is not None and not Path(target).is_dir():
        raise pytest.UsageError(f"--specaudit-target: {target} is not a folder")
    budget = config.getoption("specaudit_search_budget") or DEFAULT_BUDGET
    try:
        check_budget(budget)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    searched = [(e, None) for e in servers]
    if config.getoption("specaudit_search"):
        searched += [(e, p) for e in others for p in pairs]
    for engine, pair in searched:
        sizes = config.getoption("specaudit_batch_size") or (DEFAULT_SERVER_BATCH_SIZES if pair is None
                                                             else DEFAULT_BATCH_SIZES)
        for batch_size in sizes:
            name = f"specaudit-search[{engine}|{pair or Path(target).name}|B{batch_size}]"
            items.append(SearchItem.from_parent(session, name=name, engine=engine, pair=pair, batch_size=batch_size,
                                                budget=budget))
    return others


class SearchItem(pytest.Item):
    """The search over request mixes against one engine at one batch size (`search.py`)."""

    def __init__(self, *, engine: str, pair: str | None, batch_size: int, budget: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine, self.pair, self.batch_size, self.budget = engine, pair, batch_size, budget

    def search_test(self) -> Any:
        from specaudit.equivalence.plugin.search import SearchTest

        config = self.config
        given = config.getoption("specaudit_out")
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        out = Path(given) / slug if given else config._tmp_path_factory.mktemp("specaudit-search", numbered=True)
        return SearchTest(engine=self.engine, batch_size=self.batch_size, seed=config.stash[SEED].value,
                          budget=self.budget, max_new_tokens=config.getoption("specaudit_max_new_tokens"),
                          dtype=config.getoption("specaudit_dtype"), out=out,
                          target=config.getoption("specaudit_target") if self.pair is None else None,
                          pair=self.pair, prompts=config.getoption("specaudit_prompts"))

    def runtest(self) -> None:
        from specaudit.equivalence.plugin.search import run_search

        self.user_properties.append(("specaudit", (self.engine, self.pair or "search", self.batch_size)))
        run_search(self.search_test())

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        from specaudit.equivalence.plugin.search import SearchFound

        if isinstance(excinfo.value, SearchFound):
            seed = self.config.stash[SEED]
            return f"{excinfo.value}\nseed: {seed.value} ({seed.source})"
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "specaudit", None, self.name


class EquivalenceItem(pytest.Item):
    """The equivalence property for one (engine, pair, batch size)."""

    def __init__(self, *, engine: str, pair: str, batch_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine, self.pair, self.batch_size = engine, pair, batch_size

    def runtest(self) -> None:
        from specaudit.equivalence.plugin.property import run_adversarial, run_property

        # carried on the report, so the summary works under pytest-xdist too
        self.user_properties.append(("specaudit", (self.engine, self.pair, self.batch_size)))
        run_property(
            self.engine, self.pair, self.batch_size,
            max_examples=self.config.getoption("specaudit_max_examples"),
            max_new_tokens=self.config.getoption("specaudit_max_new_tokens"),
            max_draft_tokens=self.config.getoption("specaudit_max_draft_tokens"),
            max_prompt_length=self.config.getoption("specaudit_max_prompt_length"),
            seed=self.config.stash[SEED].value,
        )
        if not self.config.getoption("specaudit_no_adversarial"):
            run_adversarial(self.engine, self.pair, self.batch_size,
                            max_new_tokens=self.config.getoption("specaudit_max_new_tokens"),
                            draft_tokens=min(4, self.config.getoption("specaudit_max_draft_tokens")))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        if _is_divergence(excinfo.value):
            # float64 on the CPU: any token or logit mismatch is a bug, never a near-tie
            # the plugin's own "shrunk counterexample" note, then Hypothesis' own notes, whatever their wording
            notes = "\n".join(getattr(excinfo.value, "__notes__", []))
            return (f"{_diagnosis_lines(excinfo.value)}\n{self.engine} on {self.pair}, batch size {self.batch_size}: "
                    f"structural divergence (float64)\n{excinfo.value}\n{notes}\n{self.replay_lines()}")
        return super().repr_failure(excinfo)

    def replay_lines(self) -> str:
        """The search's seed and the command that draws the same examples for this engine, pair and batch size."""
        seed = self.config.stash[SEED]
        return (f"seed: {seed.value} ({seed.source})\n"
                f"replay: {replay_command(self.config, self.engine, self.pair, self.batch_size, seed.value)}")

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "specaudit", None, self.name


class AcceptanceItem(pytest.Item):
    """The acceptance gate for one (engine, pair, batch size) (`acceptance.py`)."""

    def __init__(self, *, engine: str, pair: str, batch_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine, self.pair, self.batch_size = engine, pair, batch_size

    def runtest(self) -> None:
        from specaudit.equivalence.plugin.acceptance import run_acceptance

        run_acceptance(self.engine, self.pair, self.batch_size, self.config.getoption("specaudit_require_acceptance"),
                       max_new_tokens=self.config.getoption("specaudit_max_new_tokens"))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        from specaudit.equivalence.plugin.acceptance import AcceptanceShort

        if isinstance(excinfo.value, AcceptanceShort):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "specaudit", None, self.name


class SampledItem(pytest.Item):
    """The sampled audit of one (engine, pair)."""

    def __init__(self, *, engine: str, pair: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine, self.pair = engine, pair

    def runtest(self) -> None:
        from specaudit.equivalence.plugin.sampled import run_sampled, setting_from

        self.user_properties.append(("specaudit-sampled", self.engine))
        run_sampled(self.engine, self.pair, setting_from(self.config), self.config.stash[SEED].value,
                    self.config.getoption("specaudit_require_acceptance"))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        from specaudit.equivalence.plugin.sampled import SampledDeparture, SampledRunFailed, replay_command

        if isinstance(excinfo.value, (SampledDeparture, SampledRunFailed)):
            seed = self.config.stash[SEED]
            return (f"{excinfo.value}\nseed: {seed.value} ({seed.source})\n"
                    f"replay: {replay_command(self.config, self.engine, self.pair, seed.value)}")
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "specaudit", None, self.name


def _diagnosis_lines(exc: BaseException) -> str:
    """`diagnosis: <class>: <evidence>` and `fix: <sentence>`: the first lines of a failure."""
    from specaudit.equivalence.diagnosis.core import FIXES

    found = getattr(exc, "specaudit_diagnosis", None)
    if isinstance(exc, BaseExceptionGroup) and found is None:
        found = next((getattr(e, "specaudit_diagnosis", None) for e in exc.exceptions
                      if getattr(e, "specaudit_diagnosis", None)), None)
    if not found:
        return "diagnosis: unknown: the failing case could not be audited again"
    cls = found.get("class", "unknown")
    where = ""
    if found.get("prompt_index") is not None:
        where = f" (prompt {found['prompt_index']}, new token {found.get('position')})"
    return f"diagnosis: {cls}{where}: {found.get('evidence')}\nfix: {FIXES.get(cls, FIXES['unknown'])}"


def _is_divergence(exc: BaseException) -> bool:
    """An equivalence failure, or a group of them (Hypothesis reports distinct failures together)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_divergence(e) for e in exc.exceptions)
    return isinstance(exc, AssertionError)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    properties = dict(report.user_properties)
    if report.when == "call" and "specaudit-sampled" in properties:
        outcome = _sampled_results.setdefault(properties["specaudit-sampled"], Outcome())
        outcome.passed += report.passed
        outcome.failed += not report.passed
        if not report.passed:
            outcome.failures.append(str(report.longrepr).splitlines()[0] if report.longrepr else "failed")
    found = properties.get("specaudit")
    if found is None or report.when != "call":
        return
    engine, pair, batch_size = found
    outcome = _results.setdefault((engine, int(batch_size)), Outcome())
    if report.passed:
        outcome.passed += 1
    else:
        outcome.failed += 1
        message = str(report.longrepr).splitlines() if report.longrepr else []
        outcome.failures.append(f"{pair}: {message[0] if message else 'failed'}")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results, sampled = dict(_results), dict(_sampled_results)
    _results.clear()
    _sampled_results.clear()
    if not results and not sampled:
        return
    terminalreporter.section("specaudit equivalence")
    seed = config.stash.get(SEED, None)
    if seed is not None and config.getoption("specaudit_engine"):
        terminalreporter.write_line(f"property search seed: {seed.value} ({seed.source}); the same examples again: "
                                    f"--specaudit-seed {seed.value}")
    for (engine, batch_size), outcome in sorted(results.items()):
        total = outcome.passed + outcome.failed
        verdict = "equivalent" if not outcome.failed else "NOT equivalent"
        terminalreporter.write_line(f"{engine:<32} B={batch_size:<3} {outcome.passed}/{total} pairs pass  {verdict}")
        for failure in outcome.failures:
            terminalreporter.write_line(f"    {failure}")
    for engine, outcome in sorted(sampled.items()):
        total = outcome.passed + outcome.failed
        verdict = "no departure found" if not outcome.failed else "DEPARTS (or its run failed)"
        terminalreporter.write_line(f"{engine:<32} sampled {outcome.passed}/{total} pairs pass  {verdict}")
        for failure in outcome.failures:
            terminalreporter.write_line(f"    {failure}")
