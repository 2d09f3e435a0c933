"""Observed acceptance from servers' own counters (equivalence/acceptance/counters.py).

A local server simulates speculative decoding with K=4 draft tokens: each request's verify steps accept a
known pattern of draft tokens, and it answers in each dialect's shape (vLLM `metrics.speculative_decoding`,
llama.cpp `timings.draft_n`, SGLang `meta_info.spec_*`, TensorRT-LLM `avg_decoded_tokens_per_iter`) while
its `/metrics` counters (drafts, draft tokens, accepted tokens, accepted tokens per position) move with
every answer. The client's record must give exactly the simulated counts, per position too; each planted
counter bug (the bonus token counted as accepted, a histogram off by one step, a mean that disagrees with
the counts, a per-position counter that skips a position) must be named by the identity it breaks, and the
honest server must break none. A recording that carries the counters gives the same record.
"""

from __future__ import annotations

import json
import threading

import pytest
from fake_server import FakeServer

from specaudit.engines.adapters.recorded import RecordedEngine, write_recording
from specaudit.engines.adapters.server_metrics import RequestCounters, labelled_values
from specaudit.engines.registry import make_engine
from specaudit.equivalence.acceptance import counters

K = 4
PATTERN = (0, 4, 2, 1, 0, 3)  # accepted draft tokens per verify step, cycled, offset by the prompt


def steps_for(prompt: list[int], n: int) -> list[int]:
    """The accepted counts of one request's verify steps: the first token from the prefill, then each step
    emits its accepted tokens and one more, the last step cut at `n`."""
    accepted, emitted, step = [], 1, sum(prompt)
    while emitted < n:
        count = PATTERN[step % len(PATTERN)]
        accepted.append(count)
        emitted += count + 1
        step += 1
    return accepted


class SimulatedCounters:
    """`/metrics` counters that move with every answer as vLLM's (or llama.cpp's) do; `plant` breaks one."""

    def __init__(self, prefix: str = "vllm", plant: str | None = None) -> None:
        self.prefix, self.plant = prefix, plant
        self.drafts = self.drafted = self.accepted = 0
        self.per_position = [0] * K
        self.lock = threading.Lock()

    def observe(self, accepted_counts: list[int]) -> None:
        with self.lock:
            for count in accepted_counts:
                self.drafts += 1
                self.drafted += K
                self.accepted += count + (1 if self.plant == "bonus counted as accepted" else 0)
                for k in range(count):
                    if not (self.plant == "position skipped" and k == 2):
                        self.per_position[k] += 1

    def count(self, new_tokens: int) -> None:  # FakeServer's hook; the answer function observes instead
        pass

    def text(self) -> str:
        p = self.prefix
        lines = [f"# TYPE {p}:spec_decode_num_drafts_total counter",
                 f'{p}:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(self.drafts)}',
                 f'{p}:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(self.drafted)}',
                 f'{p}:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {float(self.accepted)}']
        for k, value in enumerate(self.per_position):  # the position label first on odd positions
            labels = f'position="{k}",engine="0",model_name="m"' if k % 2 else f'engine="0",model_name="m",position="{k}"'
            lines.append(f"{p}:spec_decode_num_accepted_tokens_per_pos_total{{{labels}}} {float(value)}")
            lines.append(f"{p}:spec_decode_num_accepted_tokens_per_pos_created{{{labels}}} 1.7e9")
        return "\n".join(lines) + "\n"


def expected(prompts: list[list[int]], n: int) -> dict:
    steps = [steps_for(p, n) for p in prompts]
    flat = [c for s in steps for c in s]
    return {"verify_steps": len(flat), "drafted_tokens": K * len(flat), "accepted_tokens": sum(flat),
            "accepted_per_position": [sum(c > k for c in flat) for k in range(K)],
            "drafts_per_position": [len(flat)] * K}


def vllm_answer(metrics: SimulatedCounters | None, plant: str | None = None):
    def answer(path: str, body: dict) -> tuple[int, dict]:
        n = body["max_tokens"]
        tokens = [(sum(body["prompt"]) + 7 * i) % 250 for i in range(n)]
        accepted = steps_for(body["prompt"], n)
        if metrics is not None:
            metrics.observe(accepted)
        histogram = [accepted.count(j) for j in range(K + 1)]
        if plant == "histogram off by one":
            histogram[0] += 1
        spec = {"mean_acceptance_length": 1 + sum(accepted) / len(accepted) + (0.5 if plant == "mean" else 0),
                "draft_acceptance_rate": sum(accepted) / (K * len(accepted)), "acceptance_histogram": histogram,
                "num_spec_steps": len(accepted), "num_accepted_draft_tokens": sum(accepted),
                "num_draft_tokens": K * len(accepted), "num_spec_tokens": K,
                "per_step_accepted": accepted, "per_step_drafted": [K] * len(accepted)}
        return 200, {"choices": [{"token_ids": tokens, "finish_reason": "length", "stop_reason": None, "text": ""}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n},
                     "metrics": {"speculative_decoding": spec}}
    return answer


PROMPTS = [[5, 6, 7], [9, 1], [3, 3, 3, 3], [11], [2, 8], [40, 1, 2]]
NEW = 24


def run_server(dialect: str, answer, metrics=None) -> dict:
    with FakeServer(answer, metrics=metrics) as server:
        engine = make_engine(f"{dialect}:{server.url}", None, None, batch_size=3, draft_tokens=K)
        engine.generate([list(p) for p in PROMPTS], NEW, None)
        return engine.last_speculation


def test_vllm_endpoint_and_responses_give_the_simulated_counts_per_position():
    speculation = run_server("vllm", vllm_answer(metrics := SimulatedCounters()), metrics)
    observed = counters.from_server(speculation)
    want = expected(PROMPTS, NEW)
    assert observed is not None
    assert {name: getattr(observed, name) for name in want} == {
        name: tuple(v) if isinstance(v, list) else v for name, v in want.items()}
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{position}" in observed.source
    assert counters.inconsistencies(speculation, observed) == []


def test_vllm_responses_alone_give_the_same_record():
    speculation = run_server("vllm", vllm_answer(None))  # no /metrics: the per-response counters alone
    observed = counters.from_server(speculation)
    want = expected(PROMPTS, NEW)
    assert (observed.verify_steps, observed.accepted_tokens, list(observed.accepted_per_position),
            list(observed.drafts_per_position)) == (want["verify_steps"], want["accepted_tokens"],
                                                    want["accepted_per_position"], want["drafts_per_position"])
    assert "each response's metrics.speculative_decoding" in observed.source
    assert counters.inconsistencies(speculation, observed) == []


@pytest.mark.parametrize("plant, named", [
    ("bonus counted as accepted", "the responses' accepted tokens sum to"),
    ("position skipped", "accepted per position rise from position 2"),
])
def test_a_planted_endpoint_counter_bug_is_named(plant, named):
    speculation = run_server("vllm", vllm_answer(metrics := SimulatedCounters(plant=plant)), metrics)
    problems = counters.inconsistencies(speculation, counters.from_server(speculation))
    assert any(named in problem for problem in problems), problems


@pytest.mark.parametrize("plant, named", [
    ("histogram off by one", "acceptance histogram counts"),
    ("mean", "tokens per verify step, its counts give"),
])
def test_a_planted_response_counter_bug_is_named(plant, named):
    speculation = run_server("vllm", vllm_answer(None, plant))
    problems = counters.inconsistencies(speculation, counters.from_server(speculation))
    assert problems and all(problem.startswith("request ") for problem in problems), problems
    assert any(named in problem for problem in problems), problems


def llamacpp_answer(dropped: int = 0):
    def answer(path: str, body: dict) -> tuple[int, dict]:
        n = body["n_predict"]
        accepted = steps_for(body["prompt"], n)
        tokens = [(sum(body["prompt"]) + 7 * i) % 250 for i in range(n)]
        return 200, {"tokens": tokens[:n - dropped], "stop_type": "limit", "content": "",
                     "timings": {"predicted_n": n, "draft_n": K * len(accepted), "draft_n_accepted": sum(accepted)}}
    return answer


def test_llamacpp_tokens_counted_but_not_returned_are_named():
    """llama.cpp b8672 charges a whole accepted block to the slot and stops emitting at the limit: it counts
    tokens it never returns (reports/acceptance-served)."""
    speculation = run_server("llamacpp", llamacpp_answer(dropped=2))
    problems = counters.inconsistencies(speculation, counters.from_server(speculation))
    assert any(f"the server counts {NEW} tokens generated, its answer returned {NEW - 2}" in p for p in problems), problems
    honest = run_server("llamacpp", llamacpp_answer())
    assert counters.inconsistencies(honest, counters.from_server(honest)) == []


def test_llamacpp_timings_without_endpoint_counters():
    speculation = run_server("llamacpp", llamacpp_answer())
    observed = counters.from_server(speculation)
    want = expected(PROMPTS, NEW)
    assert (observed.drafted_tokens, observed.accepted_tokens) == (want["drafted_tokens"], want["accepted_tokens"])
    assert observed.verify_steps is None and observed.accepted_per_position is None  # llama.cpp does not say
    assert speculation["drafted_tokens"] == want["drafted_tokens"]  # "speculation observed" without /metrics


def sglang_answer(plant: str | None = None):
    def answer(path: str, body: dict) -> tuple[int, dict]:
        n = body["sampling_params"]["max_new_tokens"]
        accepted = steps_for(body["input_ids"], n)
        tokens = [(sum(body["input_ids"]) + 7 * i) % 250 for i in range(n)]
        meta = {"output_token_logprobs": [[-0.1, t, "x"] for t in tokens], "finish_reason": {"type": "length"},
                "completion_tokens": n, "spec_verify_ct": len(accepted),
                "spec_accept_length": n / len(accepted) * (1.25 if plant == "length" else 1.0),
                "spec_accept_token_num": sum(accepted), "spec_draft_token_num": K * len(accepted),
                "spec_accept_histogram": [accepted.count(j) for j in range(K + 1)]}
        return 200, {"text": "", "meta_info": meta}
    return answer


def test_sglang_meta_info_gives_steps_and_positions_from_its_histogram():
    speculation = run_server("sglang", sglang_answer())
    observed = counters.from_server(speculation)
    want = expected(PROMPTS, NEW)
    assert observed.verify_steps == want["verify_steps"]
    assert list(observed.accepted_per_position) == want["accepted_per_position"]
    assert list(observed.drafts_per_position) == want["drafts_per_position"]
    assert counters.inconsistencies(speculation, observed) == []
    planted = run_server("sglang", sglang_answer("length"))
    assert any("spec_accept_length" not in p and "tokens per verify step" in p
               for p in counters.inconsistencies(planted, counters.from_server(planted)))


def test_trtllm_tokens_per_iteration_give_steps_and_accepted_tokens():
    def answer(path: str, body: dict) -> tuple[int, dict]:
        n = body["max_tokens"]
        accepted = steps_for(body["prompt"], n)
        tokens = [(sum(body["prompt"]) + 7 * i) % 250 for i in range(n)]
        return 200, {"choices": [{"token_ids": tokens, "finish_reason": "length", "stop_reason": None, "text": "",
                                  "avg_decoded_tokens_per_iter": n / (len(accepted) + 1)}],  # the context step too
                     "usage": {"prompt_tokens": 1, "completion_tokens": n}}

    speculation = run_server("trtllm", answer)
    observed = counters.from_server(speculation)
    want = expected(PROMPTS, NEW)
    assert observed.verify_steps == want["verify_steps"] + len(PROMPTS)  # every iteration, the context one too
    assert observed.emitted_tokens == NEW * len(PROMPTS)
    assert observed.drafted_tokens is None and observed.accepted_per_position is None
    assert counters.inconsistencies(speculation, observed) == []


def test_a_recording_that_carries_the_counters_gives_the_same_record(tmp_path):
    speculation = run_server("vllm", vllm_answer(None))
    outputs = [[(sum(p) + 7 * i) % 250 for i in range(NEW)] for p in PROMPTS]
    path = write_recording(tmp_path / "run.jsonl", PROMPTS, outputs, metadata={"max_new_tokens": NEW},
                           per_line=[{"acceptance": r} for r in speculation["per_request"]])
    assert "acceptance" in json.loads(path.read_text().splitlines()[0])
    engine = RecordedEngine(str(path))
    engine.generate([list(p) for p in PROMPTS], NEW, None)
    recorded = counters.from_server(engine.last_speculation)
    live = counters.from_server(speculation)
    assert (recorded.verify_steps, recorded.accepted_tokens, recorded.accepted_per_position,
            recorded.drafts_per_position) == (live.verify_steps, live.accepted_tokens, live.accepted_per_position,
                                              live.drafts_per_position)
    assert "accepted_histogram" not in engine.describe()["metadata"] and "acceptance" not in engine.describe()["metadata"]


def test_specaudit_record_keeps_each_requests_counters(tmp_path):
    from specaudit import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    with FakeServer(vllm_answer(None)) as server:
        status = cli.main(["record", "--engine", f"vllm:{server.url}", "--prompts", str(prompts), "--max-new-tokens",
                           str(NEW), "--eos-token-id", "none", "--batch-size", "3", "--out", str(tmp_path / "r.jsonl")])
    assert status == 0
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [line["acceptance"]["per_step_accepted"] for line in lines] == [steps_for(p, NEW) for p in PROMPTS]
    engine = RecordedEngine(str(tmp_path / "r.jsonl"))
    engine.generate([list(p) for p in PROMPTS], NEW, None)
    observed = counters.from_server(engine.last_speculation)
    want = expected(PROMPTS, NEW)
    assert list(observed.accepted_per_position) == want["accepted_per_position"]
    assert list(observed.drafts_per_position) == want["drafts_per_position"]


def test_a_request_that_never_drafted_counts_as_empty_steps():
    """vLLM leaves `per_step_*` out of a request with no verify step (the n-gram proposer found no match)."""
    def answer(path: str, body: dict) -> tuple[int, dict]:
        status, payload = vllm_answer(None)(path, body)
        spec = payload["metrics"]["speculative_decoding"]  # the last step drafts only what it accepted, so
        spec["per_step_drafted"][-1] = spec["per_step_accepted"][-1]  # drafted != steps x K: only the arrays say
        spec["num_draft_tokens"] = sum(spec["per_step_drafted"])
        if body["prompt"] == PROMPTS[1]:
            payload["metrics"]["speculative_decoding"] = {
                "mean_acceptance_length": 1.0, "draft_acceptance_rate": 0.0, "acceptance_histogram": [0] * (K + 1),
                "num_spec_steps": 0, "num_accepted_draft_tokens": 0, "num_draft_tokens": 0, "num_spec_tokens": K}
        return status, payload

    speculation = run_server("vllm", answer)
    observed = counters.from_server(speculation)
    steps = [steps_for(p, NEW) for p in PROMPTS[:1] + PROMPTS[2:]]
    drafted = [count for s in steps for count in [K] * (len(s) - 1) + [s[-1]]]
    want = expected(PROMPTS[:1] + PROMPTS[2:], NEW)
    assert list(observed.drafts_per_position) == [sum(d > k for d in drafted) for k in range(K)]
    assert list(observed.accepted_per_position) == want["accepted_per_position"]
    assert counters.inconsistencies(speculation, observed) == []


def test_a_request_without_counters_leaves_the_sums_unknown():
    answered = run_server("vllm", vllm_answer(None))
    answered["per_request"][1] = None  # one answer said nothing
    observed = counters.from_server({**answered, "drafted_tokens": None, "accepted_tokens": None, "drafts": None})
    assert observed is None or (observed.accepted_tokens is None and observed.verify_steps is None)


def test_positions_first_exposed_during_the_run_count_from_zero():
    """llama.cpp b11549 exposes its per-position counter only once something was accepted."""
    class Fresh(SimulatedCounters):
        def text(self) -> str:
            return "\n".join(line for line in super().text().splitlines()
                             if "per_pos" not in line or self.accepted) + "\n"

    metrics = Fresh(prefix="llamacpp")

    def answer(path: str, body: dict) -> tuple[int, dict]:
        n = body["n_predict"]
        metrics.observe(steps_for(body["prompt"], n))
        return 200, {"tokens": [(sum(body["prompt"]) + 7 * i) % 250 for i in range(n)], "stop_type": "limit"}

    speculation = run_server("llamacpp", answer, metrics)
    assert speculation["accepted_per_position"] == expected(PROMPTS, NEW)["accepted_per_position"]


def test_position_label_read_in_any_label_order():
    text = ('x_total{position="1",engine="0"} 3\nx_total{engine="1",position="1"} 2\n'
            'x_total{engine="0",model_name="a,position=\\"9\\"",position="0"} 5\n# x_total{position="2"} 7\n')
    assert labelled_values(text, ("x_total", "x"), "position") == ("x_total", {"1": 5.0, "0": 5.0})


def test_request_counters_round_trip():
    counted = RequestCounters("metrics.speculative_decoding", verify_steps=3, accepted_histogram=(1, 1, 1))
    assert RequestCounters.from_json(json.loads(json.dumps(counted.to_json()))) == counted
