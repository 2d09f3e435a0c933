"""Speculation evidence from a server's own metrics (engines/adapters/server_metrics.py,
equivalence/speculation.py), and a server that dies during a run.

A fake vLLM server decodes tiny-llama greedily (so every audit is exact) and exposes Prometheus
counters on GET /metrics that move with every completion (or never move: a server started without
speculation). The audit must record the run's difference of those counters, show it in every
report, say "speculation not observed" when nothing was drafted, fail on that with
--require-speculation, and call a server that answered and then went away a server that died.
"""

from __future__ import annotations

import json
import math

import pytest
from cli_run import audit
from fake_server import FakeServer, SpeculationMetrics

from specaudit.engines.adapters.server_metrics import parse_prometheus
from specaudit.engines.adapters.servers import LlamaCppEngine, TRTLLMEngine
from specaudit.engines.reference import greedy_decode

SMALL = ("--pair", "tiny-llama", "--num-prompts", "3", "--max-new-tokens", "6", "--no-adversarial")


def test_prometheus_text_is_summed_over_label_sets():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_draft_tokens_total drafted {not a sample} 99",
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="a } b \\"}\\" {d"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="1"} 2.5e1 1700000000000',  # with a timestamp
        "vllm:spec_decode_num_draft_tokens_created 1.7e9",
        "vllm:num_preemptions_total 3",
        "vllm:gauge_nan NaN",
        'broken{label="never closed 7',
        "no_value_here",
        "",
        "\tllamacpp:spec_decode_num_accepted_tokens_total  4  ",
    ])
    totals = parse_prometheus(text)
    assert totals["vllm:spec_decode_num_draft_tokens_total"] == 35.0
    assert totals["vllm:spec_decode_num_draft_tokens_created"] == 1.7e9  # its own name, not added to _total
    assert totals["vllm:num_preemptions_total"] == 3.0
    assert totals["llamacpp:spec_decode_num_accepted_tokens_total"] == 4.0
    assert set(totals) == {"vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_created",
                           "vllm:num_preemptions_total", "llamacpp:spec_decode_num_accepted_tokens_total"}


@pytest.fixture(scope="module")
def pair():
    from specaudit.engines.models import zoo

    return zoo.load_pair("tiny-llama")


def vllm_reference(pair):
    """/v1/completions answered with tiny-llama's greedy decoding."""
    def respond(path, body):
        eos = body["stop_token_ids"][0] if "stop_token_ids" in body else None
        tokens, _ = greedy_decode(pair.target, body["prompt"], body["max_tokens"], eos)
        finish = "stop" if eos is not None and tokens and tokens[-1] == eos else "length"
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish,
                                  "stop_reason": None, "logprobs": None}]}
    return respond


def test_counters_of_the_run_are_recorded_and_shown_in_every_report(tmp_path, pair):
    metrics = SpeculationMetrics("vllm")
    with FakeServer(vllm_reference(pair), metrics=metrics) as server:
        metrics.count(5)  # traffic before the audit: not the run's
        before = metrics.totals()
        result = audit("--engine", f"vllm:{server.url}", "--batch-size", "2", *SMALL, out=tmp_path)
    assert result.returncode == 0, result.stderr
    after = metrics.totals()
    (run,) = json.loads((tmp_path / "audit.json").read_text())["runs"]
    evidence = run["speculation"]
    assert evidence["drafted_tokens"] == after["drafted"] - before["drafted"] > 0
    assert evidence["accepted_tokens"] == after["accepted"] - before["accepted"] > 0
    assert evidence["preemptions"] == after["preemptions"] - before["preemptions"] == 1
    assert math.isclose(evidence["acceptance_rate"], evidence["accepted_tokens"] / evidence["drafted_tokens"])
    assert "vllm:spec_decode_num_draft_tokens_total" in evidence["source"]
    assert run["speculation_observed"] is True
    shown = f"{evidence['drafted_tokens']}/{evidence['accepted_tokens']}"
    assert shown in result.stdout and "speculation observed" in result.stdout
    for report in ("report.md", "report.html"):
        text = (tmp_path / report).read_text()
        assert shown in text and "speculation observed" in text, report


def test_a_server_that_never_drafts_says_so_and_fails_when_speculation_is_required(tmp_path, pair):
    for required, expected in ((False, 0), (True, 1)):
        out = tmp_path / str(required)
        with FakeServer(vllm_reference(pair), metrics=SpeculationMetrics("vllm", drafts=False)) as server:
            result = audit("--engine", f"vllm:{server.url}", "--batch-size", "2", *SMALL,
                           *(["--require-speculation"] if required else []), out=out)
        assert result.returncode == expected, result.stdout
        (run,) = json.loads((out / "audit.json").read_text())["runs"]
        assert run["exact_matches"] == 3 and run["speculation"]["drafted_tokens"] == 0
        assert run["speculation_observed"] is False
        verdict_line = [line for line in result.stdout.splitlines() if line.startswith("verdict:")][0]
        assert "speculation not observed" in verdict_line
        for report in ("report.md", "report.html"):
            assert "speculation not observed" in (out / report).read_text().lower(), report


def test_a_server_without_counters_cannot_meet_required_speculation(tmp_path, pair):
    with FakeServer(vllm_reference(pair)) as server:  # GET /metrics: 404
        result = audit("--engine", f"vllm:{server.url}", "--batch-size", "2", *SMALL, "--require-speculation",
                       out=tmp_path)
    assert result.returncode == 1
    (run,) = json.loads((tmp_path / "audit.json").read_text())["runs"]
    assert run["speculation"] is None and run["speculation_observed"] is None and run["exact_matches"] == 3
    assert "HTTP 404" in run["engine_description"]["metrics_note"]
    assert "not measured" in (tmp_path / "report.md").read_text()
    verdict_line = [line for line in result.stdout.splitlines() if line.startswith("verdict:")][0]
    assert "speculation not measured" in verdict_line and "--require-speculation" in verdict_line


def test_a_server_that_dies_mid_run_is_reported_as_died_with_its_last_answer(tmp_path, pair):
    with FakeServer(vllm_reference(pair), metrics=SpeculationMetrics("vllm"), die_after=2) as server:
        result = audit("--engine", f"vllm:{server.url}", "--batch-size", "1", "--engine-option", "retries=1",
                       *SMALL, out=tmp_path)
    assert result.returncode == 1
    (run,) = json.loads((tmp_path / "audit.json").read_text())["runs"]
    assert run["failed"] and "died during the run" in run["error"]
    assert "cannot reach" not in run["error"]
    assert "HTTP 500" in run["error"] and "planted: EngineCore encountered an issue" in run["error"]
    assert run["server_died"]["last_answer"].startswith("HTTP 500")
    assert run["server_died"]["connection_error"]  # what the next connection met
    assert "died during the run" in (tmp_path / "report.md").read_text()


def test_a_server_that_was_never_there_is_still_unreachable(tmp_path):
    from fake_server import free_port_with_nothing_listening

    url = f"http://127.0.0.1:{free_port_with_nothing_listening()}"
    result = audit("--engine", f"vllm:{url}", "--engine-option", "retries=0", *SMALL, out=tmp_path)
    assert result.returncode == 2 and "cannot reach" in result.stderr and "died" not in result.stderr


def test_llamacpp_counters_have_their_own_names():
    metrics = SpeculationMetrics("llamacpp")

    def answer(path, body):
        return 200, {"tokens": [1, 2, 3, 4][: body["n_predict"]], "stop_type": "limit"}

    with FakeServer(answer, metrics=metrics) as server:
        engine = LlamaCppEngine(server.url, batch_size=2)
        engine.generate([[5], [6], [7]], 4, None)
    evidence = engine.last_speculation
    assert evidence["drafted_tokens"] == metrics.totals()["drafted"] > 0
    assert evidence["accepted_tokens"] == metrics.totals()["accepted"] > 0
    assert evidence["preemptions"] is None  # llama.cpp has no such counter
    assert "llamacpp:spec_decode_num_draft_tokens_total" in evidence["source"]


class TRTLLMIterations:
    """TensorRT-LLM's JSON /metrics: the iteration statistics since the last read (drained by reading)."""

    def __init__(self) -> None:
        self.pending: list[dict] = []

    def count(self, new_tokens: int) -> None:
        self.pending.append({"iter": len(self.pending), "specDecodingStats": {
            "numDraftTokens": 3 * new_tokens, "numAcceptedTokens": new_tokens, "numRequestsWithDraftTokens": 1}})
        self.pending.append({"iter": len(self.pending)})  # an iteration without speculation statistics

    def text(self) -> str:
        rows, self.pending = self.pending, []
        return json.dumps(rows)


def test_trtllm_iteration_statistics_are_summed():
    metrics = TRTLLMIterations()

    def answer(path, body):
        return 200, {"choices": [{"token_ids": [3, 4], "finish_reason": "length"}]}

    with FakeServer(answer, metrics=metrics) as server:
        metrics.count(100)  # before the run: drained by the first read
        engine = TRTLLMEngine(server.url, batch_size=1)
        engine.generate([[5], [6]], 2, None)
    assert engine.last_speculation["drafted_tokens"] == 12 and engine.last_speculation["accepted_tokens"] == 4
