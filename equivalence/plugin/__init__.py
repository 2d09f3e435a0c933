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

Seeds (`seed.py`): `--specaudit-seed N`, else `SPECAUDIT_SEED`, else a fixed seed when `CI` is set
(the same examples on every run of the same code), else a fresh random seed; whichever it is, the
terminal summary and every failure print it, so any run can be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    batch_sizes = config.getoption("specaudit_batch_size") or DEFAULT_BATCH_SIZES
    for engine in engines:
        for pair in pairs:
            for batch_size in batch_sizes:
                items.append(EquivalenceItem.from_parent(
                    session, name=f"specaudit[{engine}|{pair}|B{batch_size}]",
                    engine=engine, pair=pair, batch_size=batch_size,
                ))


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
    found = dict(report.user_properties).get("specaudit")
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
    results = dict(_results)
    _results.clear()
    if not results:
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
