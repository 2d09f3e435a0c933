"""The public Python API at `specaudit`."""

from __future__ import annotations

from pathlib import Path

import pytest

import specaudit


def test_audit_writes_and_reads_back_a_report(tmp_path: Path) -> None:
    report = specaudit.audit(["eqspec", "bsp"], pairs=["tiny-gpt2"], batch_sizes=[2], num_prompts=4,
                             max_new_tokens=8, out=tmp_path / "out")
    assert [run["engine"] for run in report.runs] == ["eqspec", "bsp"]
    first = report.runs[0]  # 4 built-in prompts plus the adversarial ones
    assert first["num_prompts"] > 4 and first["exact_matches"] == first["num_prompts"] and first["equivalent"]
    assert not report.equivalent and report.exit_status == 1  # BSP counts positions past rejections
    assert report.divergences and {d["engine"] for d in report.divergences} == {"bsp"}
    assert (tmp_path / "out" / "report.html").is_file()
    again = specaudit.read_report(tmp_path / "out")
    assert again.data == report.data and again.path == tmp_path / "out" / "audit.json"
    assert "tiny-gpt2" in again.summary()


def test_load_pair_and_argument_errors() -> None:
    pair = specaudit.load_pair("tiny-llama")
    assert pair.eos_token_id == 258 and pair.target.dtype.is_floating_point
    with pytest.raises(ValueError, match="needs a draft"):
        specaudit.audit("eqspec", target="somewhere")  # a target alone serves only recordings and servers
    with pytest.raises(ValueError, match="needs its target"):
        specaudit.audit("eqspec", pairs=["tiny-llama"], draft="somewhere")
    with pytest.raises(ValueError, match="at least one engine and one pair"):
        specaudit.audit("eqspec")
    assert specaudit.__version__.count(".") >= 2


def test_audit_takes_every_setting_by_name_and_refuses_unknown_ones(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="batch_size.*the options are:.*batch_sizes"):
        specaudit.audit("eqspec", pairs=["tiny-gpt2"], batch_size=[2])
    report = specaudit.audit("eqspec", pairs=["tiny-gpt2"], batch_sizes=(2,), num_prompts=2, max_new_tokens=4,
                             adversarial=False, diagnosis="quick", speculation="draft:k=4", require_acceptance=0.5)
    [run] = report.runs
    assert run["equivalent"] and report.data["config"]["require_acceptance"] == 0.5
    assert run["acceptance"]["required"] == 0.5 and report.exit_status == 0
