"""The harness can fail: every planted fault is caught, classified structural, diagnosed as its
own class (`property_tests/faults/classes.py`), and shown as a shrunk minimal counterexample.

For each fault engine (`property_tests/faults/`) and each pair it is hunted on, Hypothesis
searches for a decoding case where the fault breaks its property, shrinks it, and the audit
classifies the minimal case. The terminal summary of the run prints every minimal
counterexample and the table of `reports/faults.md` (`python -m specaudit.testing.faults.table`),
whether or not output capture is on. A hunt whose outcome was kept by an earlier run of the same code replays
its minimal counterexample instead of searching again (`property_tests/faults/hunt.py`, `SPECAUDIT_HUNT_MEMO`).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

import specaudit.engines.eqspec
from specaudit.engines.eqspec import EQSpec
from specaudit.testing.faults import FAULTS, FaultEngine
from specaudit.testing.faults.classes import ALSO_SEEN, EXPECTED_CLASS, INVISIBLE_BELOW_FLOAT64
from specaudit.testing.faults.draft_check import check_draft_proposals
from specaudit.testing.faults.hunt import Finding, check_fault, fault_cases, hunt, hunt_below_float64
from specaudit.testing.faults.table import render_table
from specaudit.testing.properties import check_equivalence

SUMMARY_PLUGIN = "specaudit-planted-faults"

# one process runs this file (scripts/test.sh: `--dist loadfile`), so each bfloat16 hunt starts from its float64
# hunt's minimal counterexample (`exact_hunt`, once per process) without searching again
HUNTS = [pytest.param(fault, pair, id=f"{fault.slug()}-{pair}") for fault in FAULTS for pair in fault.pairs]


@functools.lru_cache(maxsize=None)
def exact_hunt(fault: type[FaultEngine], pair: str) -> Finding:
    """The float64 hunt of `fault` on `pair`, once per process."""
    return hunt(fault, pair)


class FaultSummary:
    """Collects the findings of the run; prints them at the end, capture or not."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.findings:
            return
        terminalreporter.section("planted faults: minimal counterexamples")
        for finding in self.findings:
            terminalreporter.write_line(finding.report())
            terminalreporter.write_line("")
        terminalreporter.write_line(render_table(self.findings))


@pytest.fixture(scope="session")
def fault_summary(pytestconfig) -> FaultSummary:
    summary = pytestconfig.pluginmanager.get_plugin(SUMMARY_PLUGIN)
    if summary is None:
        summary = FaultSummary()
        pytestconfig.pluginmanager.register(summary, SUMMARY_PLUGIN)
    return summary


@pytest.mark.parametrize("fault, pair", HUNTS)
def test_planted_fault_is_caught(fault: type[FaultEngine], pair: str, fault_summary: FaultSummary, record_property) -> None:
    finding = exact_hunt(fault, pair)
    fault_summary.findings.append(finding)
    record_property("minimal_counterexample", finding.report())
    print(finding.report())
    assert finding.case is not None, finding.report()
    if fault.drafter_kind == "model":
        # a draft-cache fault cannot change an output; the audit's draft-fidelity check reports it
        assert finding.detected_by == "draft tokens", finding.report()
        assert finding.divergences, "the audit reported nothing on the minimal counterexample:\n" + finding.report()
        assert {d["detected_by"] for d in finding.divergences} == {"draft"}, finding.report()
        assert finding.kinds == {"structural"}, finding.report()
    else:
        assert finding.detected_by in ("tokens", "logits"), finding.report()
        assert finding.divergences, "the audit reported nothing on the minimal counterexample:\n" + finding.report()
        assert finding.kinds == {"structural"}, finding.report()
    # the diagnosis names the fault's own class on every divergence of its minimal example
    diagnosed = {(d.get("diagnosis") or {}).get("class") for d in finding.divergences}
    assert diagnosed == {EXPECTED_CLASS[fault.slug()]}, finding.report()


@pytest.mark.precision  # which cases rounding leaves a fault visible in is the kernels'
@pytest.mark.parametrize("fault, pair", HUNTS)
def test_planted_fault_is_caught_in_bfloat16(fault: type[FaultEngine], pair: str, fault_summary: FaultSummary,
                                             record_property) -> None:
    """The same hunt below float64, where a correct engine flips near-ties: the audit in bfloat16 (its
    rulings with controls, `equivalence/rulings/ruler.py`) still rules the fault structural and names it,
    on the float64 minimal counterexample where rounding leaves it visible, else on a bfloat16 search.
    A fault that rounding hides on every case searches 100 cases and must find none."""
    if (fault.slug(), pair) in INVISIBLE_BELOW_FLOAT64:
        finding = hunt(fault, pair, dtype="bfloat16", max_examples=100)
    else:
        finding = hunt_below_float64(fault, pair, exact_hunt(fault, pair))
    fault_summary.findings.append(finding)
    record_property("minimal_counterexample", finding.report())
    print(finding.report())
    if (fault.slug(), pair) in INVISIBLE_BELOW_FLOAT64:  # rounding only: no structural ruling in any case searched
        assert finding.case is None and finding.examples >= 100, finding.report()
        return
    assert finding.case is not None, finding.report()
    assert finding.detected_by == ("draft tokens" if fault.drafter_kind == "model" else "tokens"), finding.report()
    structural = [d for d in finding.divergences if d["kind"] == "structural"]
    assert structural, "the audit of the minimal counterexample ruled nothing structural:\n" + finding.report()
    named = {(d.get("diagnosis") or {}).get("class") for d in structural}
    expected = EXPECTED_CLASS[fault.slug()]
    assert expected in named and named - {expected} <= ALSO_SEEN.get(fault.slug(), frozenset()), finding.report()


def test_fault_engines_leave_the_shipped_engines_alone() -> None:
    shipped = {name: Path(inspect.getfile(module)).read_text() for name, module in
               [("eqspec", specaudit.engines.eqspec), ("batch", specaudit.engines.batch), ("ragged", specaudit.engines.ops.ragged)]}
    step = specaudit.engines.eqspec.speculative_step
    for fault in FAULTS:
        modules = fault.modules()
        assert modules["specaudit.engines.eqspec"] is not specaudit.engines.eqspec
        assert modules["specaudit.engines.eqspec"].batch_ops is modules["specaudit.engines.batch"]
        assert "Planted by:" in (fault.__doc__ or ""), f"{fault.__name__} names no planted line"
    assert specaudit.engines.eqspec.speculative_step is step
    assert specaudit.engines.eqspec.batch_ops is specaudit.engines.batch
    for name, module in [("eqspec", specaudit.engines.eqspec), ("batch", specaudit.engines.batch), ("ragged", specaudit.engines.ops.ragged)]:
        assert Path(inspect.getfile(module)).read_text() == shipped[name]


CONTROL = settings(max_examples=8, derandomize=True, database=None, deadline=None,
                   suppress_health_check=list(HealthCheck))


@CONTROL
@given(case=fault_cases(FAULTS[0], "tiny-llama"))
def test_correct_eqspec_passes_the_hunted_property(case) -> None:
    check_equivalence(EQSpec, case, drafter="scripted")


@CONTROL
@given(case=fault_cases(next(f for f in FAULTS if f.drafter_kind == "model"), "tiny-llama"))
def test_correct_model_drafter_passes_the_draft_proposal_check(case) -> None:
    check_draft_proposals(EQSpec, case)


class NoFault(FaultEngine):
    """No fault: EQSPEC as shipped, rebuilt the way the fault engines are"""


class NoFaultModelDrafter(FaultEngine):
    """No fault: EQSPEC as shipped, drafting with the draft model"""

    drafter_kind = "model"


@pytest.mark.precision
@CONTROL
@given(case=fault_cases(FAULTS[0], "tiny-llama", "bfloat16"))
def test_correct_eqspec_gets_no_structural_ruling_in_bfloat16(case) -> None:
    check_fault(NoFault, case)


@pytest.mark.precision
@CONTROL
@given(case=fault_cases(NoFaultModelDrafter, "tiny-llama", "bfloat16"))
def test_correct_model_drafter_gets_no_structural_ruling_in_bfloat16(case) -> None:
    check_fault(NoFaultModelDrafter, case)


def test_the_hunts_run_on_the_device_named_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECAUDIT_TEST_DEVICE puts the cached pairs (property tests, hunts) on that device; the report says where."""
    from specaudit.testing import models
    from specaudit.testing.faults import table

    asked: list[str] = []
    monkeypatch.setattr(models.zoo, "load_pair", lambda name, *, dtype, device: asked.append(device))
    monkeypatch.setenv("SPECAUDIT_TEST_DEVICE", "cpu:0")
    models.pair.__wrapped__("tiny-llama")
    assert asked == ["cpu:0"]
    assert "s on cpu:0." in table.render_report([], 12.0)
    monkeypatch.delenv("SPECAUDIT_TEST_DEVICE")
    models.pair.__wrapped__("tiny-llama")
    assert asked == ["cpu:0", "cpu"] and "s on one CPU thread." in table.render_report([], 12.0)
