"""A crash on one prompt never hides the others: the runner bisects a failing run to the prompts that
make the engine fail (failure findings with reason and traceback) and judges every other prompt; a
live server's request that errors is a finding for its prompt alone."""

from __future__ import annotations

from specaudit.engines.adapters.servers import LlamaCppEngine
from specaudit.engines.reference import ReferenceDecoder
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.isolate import isolate_failures
from specaudit.testing import models

from fake_server import FakeServer
from test_servers import EOS, llamacpp_answer

POISON = 99  # a prompt holding this token makes the engines below fail


class FailsOnPoison:
    """Greedy decoding, except that any run holding a poisoned prompt raises."""

    def __init__(self, target) -> None:
        self.reference = ReferenceDecoder(target)
        self.calls = 0

    def generate(self, prompts, max_new_tokens, eos_token_id):
        self.calls += 1
        if any(POISON in p for p in prompts):
            raise IndexError("index 0 is out of bounds")
        return self.reference.generate(prompts, max_new_tokens, eos_token_id)


def test_bisection_finds_each_failing_prompt_within_its_budget() -> None:
    poisoned = {3, 11}

    def run_subset(indices):
        if poisoned & set(indices):
            raise ValueError(f"fails on {sorted(poisoned & set(indices))}")
        return [[i] for i in indices]

    result = isolate_failures(run_subset, 16, ValueError("whole run"), budget=32)
    assert [f["prompt_index"] for f in result.failures] == [3, 11]
    assert all(f["reason"].startswith("ValueError") and f["traceback"] for f in result.failures)
    assert [out for i, out in enumerate(result.outputs) if i not in poisoned] == [[i] for i in range(16) if i not in poisoned]
    assert result.reruns <= 16
    # a budget too small to isolate leaves the rest as findings that say so, never as judged prompts
    small = isolate_failures(run_subset, 16, ValueError("whole run"), budget=2)
    assert {3, 11} <= {f["prompt_index"] for f in small.failures}
    assert any("budget" in f["reason"] for f in small.failures)


def test_a_crash_on_one_prompt_leaves_the_others_judged() -> None:
    pair = models.pair("tiny-llama", "float64")
    prompts = [[5, 6, 7], [8, POISON, 9], [10, 11], [12, 13, 14, 15], [16]]
    engine = FailsOnPoison(pair.target)
    record = audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=4, eos_token_id=EOS, dtype="float64", batch_size=4))
    assert [f["prompt_index"] for f in record["failures"]] == [1]
    assert "IndexError" in record["failures"][0]["reason"] and "in generate" in record["failures"][0]["traceback"]
    assert record["exact_matches"] == 4 and not record["equivalent"] and record["error"] is None
    assert record["prompts"][1]["failed"] and not record["divergences"]


def test_a_server_request_that_errors_is_a_finding_for_its_prompt() -> None:
    ok = llamacpp_answer()

    def answer(path, body):
        if POISON in body["prompt"]:
            return 400, {"error": "the prompt is too long"}
        return ok(path, body)

    with FakeServer(answer) as server:
        engine = LlamaCppEngine(server.url, batch_size=2)
        outputs = engine.generate([[1, 2], [3, POISON], [4]], 5, EOS)
        assert outputs[1] == [] and len(outputs[0]) == len(outputs[2]) == 5
        assert [index for index, _ in engine.last_failures] == [1]
        pair = models.pair("tiny-llama", "float64")
        record = audit_engine(engine, pair, [[1, 2], [3, POISON], [4]], RunSettings(max_new_tokens=5, eos_token_id=EOS, dtype="float64", batch_size=2))
    assert [f["prompt_index"] for f in record["failures"]] == [1] and "400" in record["failures"][0]["reason"]
    assert not record["equivalent"]
    assert {d["prompt_index"] for d in record["divergences"]} <= {0, 2}  # judged: the fake server is not greedy
