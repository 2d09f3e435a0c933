"""`specaudit bench --engine vllm:URL`: a live server timed on the bench's requests (bench/server.py).

Two local OpenAI-style fakes (tests/fake_server.py) stand in for a plain and a speculative vLLM
server of tiny-llama: they answer with a fixed token, sleep a set time per request, count how many
requests were in flight, and expose Prometheus speculation counters that move with each answer
(the plain one's never move). Nothing here needs vLLM.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from cli_run import cli
from fake_server import FakeServer, SpeculationMetrics
from specaudit.bench.server import speculative_over_plain, summarise_servers
from specaudit.engines.models.pair import ByteTokenizer

PAIR = "tiny-llama"
TOKEN = 7  # every answer's token (never tiny-llama's EOS)


def answer_with():
    """/v1/completions answered with `max_tokens` copies of TOKEN."""
    def respond(path: str, body: dict) -> tuple[int, dict]:
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        tokens = [TOKEN] * body["max_tokens"]
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": "length",
                                  "stop_reason": None, "logprobs": None}]}
    return respond


def bench(*args: str, out) -> dict:
    result = cli("bench", "--pair", PAIR, "--clock", "cpu", "--out", str(out), *args)
    assert result.returncode == 0, result.stderr + result.stdout
    return json.loads((out / "bench.json").read_text())


def test_servers_are_timed_on_the_same_requests_with_b_in_flight_and_their_counters(tmp_path):
    spec_metrics, plain_metrics = SpeculationMetrics("vllm"), SpeculationMetrics("vllm", drafts=False)
    with FakeServer(answer_with(), delay_s=0.05, metrics=spec_metrics) as fast, \
            FakeServer(answer_with(), delay_s=0.1, metrics=plain_metrics) as slow:
        spec, plain = f"vllm:{fast.url}", f"vllm:{slow.url}"
        out = tmp_path / "out"
        result = bench("--engine", "batched", "--engine", "eqspec", "--engine", spec, "--plain-engine", plain,
                       "--batch-size", "3", "--num-prompts", "7", "--max-new-tokens", "5",
                       "--output-lengths", "uniform:2:5", "--repeats", "2", "--warmup", "1", "--acceptance", "0.5",
                       out=out)
        drafted_total = spec_metrics.totals()["drafted"]
    budgets = result["workload"]["budgets"]
    assert len(budgets) == 7 and len(set(budgets)) > 1

    # what the server was asked: warm-up (3 requests of at most 8 tokens), then 2 repeats of all 7 requests
    for server in (fast, slow):
        completions = [body for path, body in server.requests if path == "/v1/completions"]
        assert len(completions) == 3 + 2 * 7
        timed = completions[3:]
        prompts = [c["prompt"] for c in timed[:7]]
        assert sorted(c["max_tokens"] for c in timed[:7]) == sorted(budgets)  # each request its own budget
        assert all(c["temperature"] == 0.0 and c["stop_token_ids"] == [ByteTokenizer.eos_token_id] for c in timed)  # greedy, the pair's EOS
        assert all("logprobs" not in c for c in completions)  # timing asks for no log-probabilities
        assert len(set(map(tuple, prompts))) > 1
        assert server.max_in_flight == 3  # B = 3 requests in flight, never more

    runs = {r["engine"]: r for r in result["runs"]}
    assert set(runs) == {"batched", "eqspec", spec, plain}
    for name in (spec, plain):
        run = runs[name]
        assert run["clock"] == "client wall" and run["cpu_seconds"] is None
        assert run["tokens"] == sum(budgets)  # every answer's tokens, cut at each request's budget
        assert run["tokens_per_second"] == pytest.approx(statistics.median(run["tokens_per_second_repeats"]))
        assert run["tokens"] / run["wall_seconds"] in run["tokens_per_second_repeats"]  # the median repeat's details
        assert run["server"] == {"dialect": "vllm", "url": name.partition(":")[2], "requests_in_flight": 3}
        # 7 requests, 3 at a time, each at least the fake's delay: 3 rounds
        assert run["wall_seconds"] >= 3 * (0.05 if name == spec else 0.1)
        assert run["latency_seconds"]["mean"] >= (0.05 if name == spec else 0.1)
    assert runs[spec]["role"] == "speculative" and runs[spec]["plain_engine"] == plain
    assert runs[plain]["role"] == "plain" and runs[plain]["ratio_to_plain"] is None
    assert runs[spec]["ratio_to_plain"] == pytest.approx(runs[spec]["tokens_per_second"] / runs[plain]["tokens_per_second"])
    # counters: the fake drafts 4 * ceil(n / 2) and accepts n // 2 per answer of n tokens
    speculation = runs[spec]["speculation"]
    assert speculation["drafted_tokens"] == sum(4 * ((n + 1) // 2) for n in budgets)
    assert speculation["accepted_tokens"] == sum(n // 2 for n in budgets)
    assert speculation["acceptance_rate"] == pytest.approx(speculation["accepted_tokens"] / speculation["drafted_tokens"])
    assert runs[spec]["drafted_tokens_repeats"] == [speculation["drafted_tokens"]] * 2
    assert drafted_total == 3 * 4 * 3 + 2 * speculation["drafted_tokens"]  # warm-up: 3 requests of 5 tokens, untimed
    assert runs[plain]["speculation"]["drafted_tokens"] == 0 and "warning" not in runs[plain]
    assert runs["eqspec"]["ratio_to_plain"] == pytest.approx(
        runs["eqspec"]["tokens_per_second"] / runs["batched"]["tokens_per_second"])  # built-ins: against batched

    rows = {row["system"]: row for row in result["speculative_over_plain"]}
    assert rows["vllm"]["ratio"] == runs[spec]["ratio_to_plain"] and rows["vllm"]["clock"] == "client wall"
    assert rows["vllm"]["acceptance_rate"] == speculation["acceptance_rate"]
    assert rows["specaudit"]["speculative"] == "eqspec k=4" and rows["specaudit"]["clock"] == "cpu"
    assert rows["specaudit"]["ratio"] == runs["eqspec"]["ratio_to_plain"]
    accepted = runs["eqspec"]["mean_accepted_per_step"]  # per row and step, as vLLM's accepted / drafts
    assert rows["specaudit"]["tokens_per_step"] == 1 + accepted and rows["specaudit"]["acceptance_rate"] == accepted / 4
    assert "client wall clock" in result["server_clock"]
    assert [s["url"] for s in result["servers"]] == [fast.url, slow.url]

    report = (out / "bench.md").read_text()
    assert f"| {spec} | speculative | 3 |" in report and f"| {plain} | plain | 3 |" in report
    assert "Speculative / plain, each system" in report and "| vllm | 3 |" in report and "| specaudit | 3 |" in report
    assert f"| {spec} |" not in report.split("Servers (")[0]  # not in the built-in engines' table


def test_a_plain_server_that_drafts_and_a_speculative_one_that_does_not_are_named(tmp_path):
    with FakeServer(answer_with(), metrics=SpeculationMetrics("vllm", drafts=False)) as idle, \
            FakeServer(answer_with(), metrics=SpeculationMetrics("vllm")) as drafting:
        result = bench("--engine", f"vllm:{idle.url}", "--plain-engine", f"vllm:{drafting.url}", "--batch-size", "2",
                       "--num-prompts", "4", "--max-new-tokens", "3", "--repeats", "1", "--warmup", "0",
                       out=tmp_path / "out")
    runs = {r["engine"]: r for r in result["runs"]}
    assert runs[f"vllm:{idle.url}"]["warning"].startswith("speculation not observed")
    assert "it speculates" in runs[f"vllm:{drafting.url}"]["warning"]
    assert result["pass_costs"] == [] and not result["prefill_costs"]  # a server-only bench times no local pass
    assert "Warning: vllm:" in (tmp_path / "out" / "bench.md").read_text()


def test_summary_pairs_only_the_servers_of_the_plain_ones_kind():
    bench = {"config": {"plain_engines": ["vllm:http://p"]}, "clock": "wall", "acceptance": None, "runs": [
        {"engine": e, "batch_size": 8, "draft_tokens": None, "tokens_per_second": tps,
         "server": {"dialect": e.partition(":")[0]}, "speculation": {"drafted_tokens": d}}
        for e, tps, d in (("vllm:http://p", 10.0, 0), ("vllm:http://s", 15.0, 40), ("llamacpp:http://l", 20.0, 9))]}
    summarise_servers(bench)
    runs = {r["engine"]: r for r in bench["runs"]}
    assert runs["vllm:http://s"]["ratio_to_plain"] == 1.5
    assert runs["llamacpp:http://l"]["ratio_to_plain"] is None and runs["llamacpp:http://l"]["role"] == "server"
    assert [row["speculative"] for row in speculative_over_plain(bench)] == ["vllm:http://s"]
    assert math.isclose(bench["speculative_over_plain"][0]["ratio"], 1.5)


@pytest.mark.parametrize("plain", [["--plain-engine", "batched"],
                                   ["--plain-engine", "vllm:http://127.0.0.1:1", "--plain-engine", "vllm:http://127.0.0.1:2"]])
def test_plain_engine_must_be_one_server_per_kind(tmp_path, plain):
    result = cli("bench", "--engine", "vllm:http://127.0.0.1:3", *plain, "--pair", PAIR, "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "--plain-engine" in result.stderr


def test_a_server_that_dies_mid_bench_is_named_as_dead(tmp_path):
    with FakeServer(answer_with(), metrics=SpeculationMetrics("vllm"), die_after=3) as server:
        result = cli("bench", "--pair", PAIR, "--engine", f"vllm:{server.url}", "--batch-size", "1", "--num-prompts",
                     "6", "--max-new-tokens", "3", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    (run,) = json.loads((tmp_path / "out" / "bench.json").read_text())["runs"]
    assert "died during the run" in run["error"] and "answered 5 time(s)" in run["error"]  # 3 answers, 2 metrics reads
