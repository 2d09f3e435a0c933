"""The readers of a finished audit take its typed records or the JSON object of audit.json alike
(equivalence/records/serialize.py `as_audit`): the same reports, terminal lines and exit status from both."""

from __future__ import annotations

import json
from pathlib import Path

from specaudit.equivalence.gates import ACCEPTANCE, SPECULATION, gate_failures
from specaudit.equivalence.pipeline.runner import exit_status
from specaudit.equivalence.records import ABSENT, Audit, given, thaw
from specaudit.equivalence.records.serialize import as_audit, as_run
from specaudit.equivalence.reports.markdown import render_markdown
from specaudit.equivalence.reports.summary import summary_table, verdict, verdict_line

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "reports" / "gemma3-270m" / "audit.json"  # a committed audit: numerical flips, two dtypes


def test_an_audit_is_read_once_and_a_record_passes_through() -> None:
    data = json.loads(SAVED.read_text())
    record = as_audit(data)
    assert isinstance(record, Audit) and as_audit(record) is record and as_run(record.runs[0]) is record.runs[0]
    assert len(record.runs) == len(data["runs"]) and record.runs[0].engine == data["runs"][0]["engine"]
    gated = {**data, "config": {**data["config"], "require_acceptance": 0.9, "require_speculation": True}}
    for audit in (data, gated):
        typed = as_audit(audit)
        assert render_markdown(typed) == render_markdown(audit)
        assert summary_table(typed) == summary_table(audit) and verdict_line(typed) == verdict_line(audit)
        assert verdict(typed) == verdict(audit) and exit_status(typed) == exit_status(audit)
        assert gate_failures(typed) == gate_failures(audit)
    assert {f.gate for f in gate_failures(gated)} == {ACCEPTANCE, SPECULATION} and exit_status(gated) == 1


def test_a_hand_built_audit_leaves_out_what_it_does_not_need() -> None:
    empty = as_audit({})
    assert empty.runs == () and empty.config == {} and verdict({})[0] == "empty"
    run = as_run({"engine": "e", "acceptance": {"positions": [1, 2]}})
    assert run.pair == "?" and run.batch_size is None and run.error is None and run.greedy
    assert run.acceptance["positions"] == (1, 2) and thaw(run.acceptance) == {"positions": [1, 2]}
    assert run.noise_band is ABSENT and given(run.noise_band) is None and given(run.noise_band, 0) == 0
