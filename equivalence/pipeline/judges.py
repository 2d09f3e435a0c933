"""The two judges of the pipeline and the two oracles they judge against (equivalence/pipeline/runner.py).

An `Oracle` is what a group of runs is judged against: the weights of one pair in one dtype
(equivalence/pipeline/weights.py `WeightsOracle`) or a served reference, no weights (equivalence/pipeline/served.py
`ServedOracle`). It resolves the prompts it can judge (equivalence/pipeline/prompt_set.py), holds the reference
continuation (greedy) or the teacher forcing (sampled), builds the engines its runs need, and checks its own
inputs before anything is loaded (`preflight`, in the runner's `compose`).

A `Judge` is how outputs are judged: `GreedyJudge` compares tokens with the reference under each prompt's own
request parameters and structured outputs, rules every divergence, runs the plain control, the diagnosis, the
acceptance and the payoff (equivalence/audit.py `audit_engine` against the weights; equivalence/rulings/served.py
against a served reference); `SampledJudge` tests samples against the target's distribution by teacher forcing
(equivalence/sampling/). A judge opens an oracle for what it needs and runs one engine at one batch size against
it, returning the run as one frozen record (`equivalence/records` `Run`, every mode and every failed run alike;
`records/serialize.py` writes it into `audit.json`); a run never raises but for Ctrl-C.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from specaudit.equivalence.records import Run
from specaudit.equivalence.records.serialize import run_from_json

Mode = Literal["greedy", "sampled"]


class Oracle(Protocol):
    """The runs of one group are judged against it: a pair's weights in one dtype, or a served reference."""

    title: str

    def open_greedy(self) -> None: ...  # the prompts and the reference's continuations
    def open_sampled(self) -> None: ...  # the prompts, the teacher forcing and the sampled engines
    def greedy_run(self, engine: str, batch_size: int) -> dict[str, Any]: ...
    def sampled_run(self, engine: str, batch_size: int, progress: Any = None) -> dict[str, Any]: ...
    def describe(self, audit: dict[str, Any]) -> None: ...  # what the audit's top level says of the group
    def failed_runs(self, exc: BaseException) -> list[dict[str, Any]]: ...  # a group that failed to open
    def close(self) -> None: ...


class Judge(Protocol):
    mode: Mode

    def open(self, oracle: Oracle) -> None: ...
    def run(self, engine: str, batch_size: int, oracle: Oracle, progress: Any = None) -> Run: ...


class GreedyJudge:
    """Greedy tokens: exact against the reference, a flip below float64 numerical only where a control
    measured on the run explains it, every structural divergence diagnosed."""

    mode: Mode = "greedy"

    def open(self, oracle: Oracle) -> None:
        oracle.open_greedy()

    def run(self, engine: str, batch_size: int, oracle: Oracle, progress: Any = None) -> Run:
        return run_from_json(oracle.greedy_run(engine, batch_size))


class SampledJudge:
    """Sampled statistics (`--temperature`): the samples' teacher-forced PIT values and goodness-of-fit tests
    with power, acceptance against sum min(p, q)."""

    mode: Mode = "sampled"

    def open(self, oracle: Oracle) -> None:
        oracle.open_sampled()

    def run(self, engine: str, batch_size: int, oracle: Oracle, progress: Any = None) -> Run:
        return run_from_json(oracle.sampled_run(engine, batch_size, progress))
