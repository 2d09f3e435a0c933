"""`specaudit audit` end to end: exit status, audit.json fields, user engines, bad usage."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from specaudit.cli import main

TESTS = Path(__file__).resolve().parent
RUN_FIELDS = {"engine", "mode", "pair", "batch_size", "dtype", "device", "num_prompts", "exact_matches", "max_logit_error", "divergences"}
DIVERGENCE_FIELDS = {"prompt_index", "position", "step", "reference_token", "engine_token", "margin", "kind"}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def specaudit(*args: str, out: Path | None = None) -> Result:
    """`specaudit audit ...` in this process (the console script runs the same `main`)."""
    argv = ["audit", "--no-progress", *args] + (["--out", str(out)] if out is not None else [])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return Result(code, stdout.getvalue(), stderr.getvalue())


def test_console_script_runs() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "specaudit.cli", "audit", "--help"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0
    for option in ("--engine", "--pair", "--batch-size", "--dtype", "--device", "--prompts", "--num-prompts",
                   "--max-new-tokens", "--draft-tokens", "--out", "--target", "--draft"):
        assert option in result.stdout
    assert "(default: 32)" in result.stdout  # defaults are shown


def load(out: Path) -> dict:
    return json.loads((out / "audit.json").read_text())


def test_eqspec_audit_exits_0_with_all_fields(tmp_path: Path) -> None:
    result = specaudit("--engine", "eqspec", "--engine", "reference", "--pair", "tiny-qwen3", "--batch-size", "1", "4",
                       "--num-prompts", "6", "--max-new-tokens", "10", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    audit = load(tmp_path)
    assert {"torch", "transformers", "device_name"} <= set(audit["machine"])
    assert len(audit["runs"]) == 4
    for run in audit["runs"]:
        assert RUN_FIELDS <= set(run)
        # 6 built-in prompts, then the adversarial ones
        assert run["exact_matches"] == run["num_prompts"] == 6 + len(run["adversarial"]["cases"])
        assert run["max_logit_error"] < 1e-9
    assert "every audited engine is equivalent" in result.stdout


def test_user_engine_correct_passes(tmp_path: Path) -> None:
    result = specaudit("--engine", "sample_engines:make_correct", "--pair", "tiny-gpt2", "--batch-size", "4",
                       "--num-prompts", "6", "--max-new-tokens", "10", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = load(tmp_path)["runs"][0]
    assert run["exact_matches"] == run["num_prompts"] == 6 + len(run["adversarial"]["cases"])


@pytest.mark.parametrize("pair_name", ["tiny-gpt2", "tiny-llama"])
def test_user_engine_with_row_position_bug_fails_structural(tmp_path: Path, pair_name: str) -> None:
    result = specaudit("--engine", "sample_engines:make_row_zero_position_bug", "--pair", pair_name,
                       "--batch-size", "4", "--num-prompts", "4", "--max-new-tokens", "16", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    run = load(tmp_path)["runs"][0]
    assert run["divergences"], "the bug was not reported"
    for divergence in run["divergences"]:
        assert DIVERGENCE_FIELDS <= set(divergence)
        assert divergence["kind"] == "structural"
    # only row 0 is wrong, and the fault starts after its first rejection, in a speculative step
    assert {d["prompt_index"] for d in run["divergences"]} == {0}
    first = run["divergences"][0]
    assert first["step"] is not None and first["step"] >= 1
    assert first["batch"]["rows"][0] == 0
    assert first["accepted_history"] and min(first["accepted_history"][:-1] or [0]) < 4


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    assert specaudit("--engine", "no-such-engine", "--pair", "tiny-gpt2", out=tmp_path).returncode == 2
    assert specaudit("--engine", "eqspec", "--pair", "tiny-nothing", out=tmp_path).returncode == 2
    assert specaudit("--engine", "eqspec", "--pair", "tiny-gpt2", "--batch-size", "0", out=tmp_path).returncode == 2
    assert specaudit("--engine", "eqspec", "--target", str(tmp_path), out=tmp_path).returncode == 2
    missing = specaudit("--engine", "eqspec", "--pair", "tiny-gpt2", "--prompts", str(tmp_path / "none.jsonl"), out=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_engine_that_raises_is_recorded_and_fails(tmp_path: Path) -> None:
    result = specaudit("--engine", "failing_engines:make_raising", "--engine", "eqspec", "--pair", "tiny-gpt2",
                       "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "4", out=tmp_path)
    assert result.returncode == 1
    runs = load(tmp_path)["runs"]
    assert "planted failure inside generate" in runs[0]["error"]
    assert runs[1]["exact_matches"] == runs[1]["num_prompts"] > 2  # the failure did not stop the next run


def test_jsonl_prompts_text_and_turns(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Hello"}, {"text": "a"}, {"turns": ["What is two plus two?", "ignored"]}, {"input_ids": [72, 105]},
    ]))
    result = specaudit("--engine", "eqspec", "--pair", "tiny-gpt2", "--batch-size", "4", "--prompts", str(prompts),
                       "--max-new-tokens", "6", out=tmp_path / "out")
    assert result.returncode == 0, result.stderr
    run = load(tmp_path / "out")["runs"][0]
    assert run["num_prompts"] == 4 + len(run["adversarial"]["cases"])
    assert [p["reference_length"] for p in run["prompts"][:4]] == [6] * 4


def test_bsp_and_dsd_audits_exit_1_with_structural_divergences(tmp_path: Path) -> None:
    result = specaudit("--engine", "bsp", "--engine", "dsd", "--pair", "tiny-gpt2", "--batch-size", "4",
                       "--dtype", "float64", "--num-prompts", "8", "--max-new-tokens", "12", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    runs = {run["engine"]: run for run in load(tmp_path)["runs"]}
    for engine in ("bsp", "dsd"):
        assert runs[engine]["structural_divergences"] > 0
        assert all(d["kind"] == "structural" for d in runs[engine]["divergences"])
    # BSP keeps counting positions past masked columns; DSD keeps the first rejected draft token
    assert {d["diagnosis"]["class"] for d in runs["bsp"]["divergences"]} == {"position_ids"}
    assert {d["diagnosis"]["class"] for d in runs["dsd"]["divergences"]} == {"acceptance_rule"}
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()


def test_ctrl_c_keeps_finished_runs_and_writes_reports(tmp_path: Path) -> None:
    result = specaudit("--engine", "eqspec", "--engine", "sample_engines:make_interrupting", "--engine", "exspec",
                       "--pair", "tiny-gpt2", "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "4",
                       out=tmp_path)
    assert result.returncode == 130
    audit = load(tmp_path)
    assert [run["engine"] for run in audit["runs"]] == ["eqspec"] and not audit["complete"]
    assert audit["runs"][0]["exact_matches"] == audit["runs"][0]["num_prompts"] > 2
    assert (tmp_path / "report.md").exists() and "interrupted" in result.stderr


@pytest.mark.parametrize("command", ["audit", "bench"])
def test_no_cuda_graphs_turns_the_fixed_shape_engines_graphs_off_unless_an_engine_option_says_otherwise(command: str) -> None:
    from specaudit.cli import build_parser
    from specaudit.equivalence.cli.args import engine_options

    def options(*extra: str) -> dict:
        return engine_options(build_parser().parse_args([command, "--engine", "fixedshape", "--out", "out", *extra]))

    assert options() == {}
    assert options("--no-cuda-graphs") == {"cuda_graphs": False}
    assert options("--no-cuda-graphs", "--engine-option", "cuda_graphs=true") == {"cuda_graphs": True}


def test_engines_lists_every_name_with_what_it_can_do(capsys: pytest.CaptureFixture[str]) -> None:
    """`specaudit engines` prints the registry's one table: each name, whether the greedy audit runs it, and
    how the sampled audit draws from it (its own factory, or the engine given sampled request parameters)."""
    from specaudit.engines.registry import ENGINES, REQUESTS

    assert main(["engines"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(ENGINES)
    for name, entry in ENGINES.items():
        line = lines[name]
        assert ("greedy" in line) == (entry.greedy is not None), line
        assert ("sampled (request parameters)" in line) == (entry.sampled == REQUESTS), line
        assert ("sampled" in line) == (entry.sampled is not None), line
