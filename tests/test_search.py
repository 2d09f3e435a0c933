"""The search over workloads (equivalence/search/) against a fake vLLM that decodes with the tiny model
(tests/request_server.py), with two bugs planted that the fixed audit (the built-in prompts, no parameters)
does not see: a stop string completed inside an accepted burst (vllm #47616) and the frequency and presence
penalties dropped (vllm #18902). The search finds each within a small budget, shrinks it to at most 3 requests and writes a
bundle that replays; the correct server gives no finding in the same budget; the same seed draws the same."""

from __future__ import annotations

import json

import pytest
from hex_tokenizer import hex_pair
from fake_server import FakeServer
from request_server import vllm_answer
from sampling_server import sampled_vllm_answer

import cli_run
from specaudit.engines.adapters.servers import VLLMEngine
from specaudit.engines.models import zoo
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.pipeline.settings import SearchSettings
from specaudit.equivalence.search.bundle import replay_search_bundle
from specaudit.equivalence.search.judging import Judging, JudgingSettings
from specaudit.equivalence.search.run import search

EOS = 258
MAX_NEW = 10
BUDGET = 30  # examples
# what the fake server implements (it reads no bad words and reports one log-probability per token)
FAMILIES = ("stop", "stop_token_ids", "max_tokens", "min_tokens", "penalties", "logit_bias")


@pytest.fixture(scope="module")
def pair():
    return hex_pair()


def pool():
    return [list(t.encode()) for t in ("The cat sat on the mat by the door", "Hello there, how are you today?")]


def penalties_dropped(pair):
    """vllm #18902: the frequency and presence penalties not applied."""
    correct = vllm_answer(pair.target, pair.tokenizer, EOS)

    def answer(path, body):
        return correct(path, {**body, "frequency_penalty": 0.0, "presence_penalty": 0.0})

    return answer


ANSWERS = {"stop_tail": lambda pair: vllm_answer(pair.target, pair.tokenizer, EOS, "stop_tail"),
           "penalties": penalties_dropped,
           "correct": lambda pair: vllm_answer(pair.target, pair.tokenizer, EOS)}


def searched(pair, answer, tmp_path, seed=0, examples=BUDGET):
    with FakeServer(answer) as server:
        judging = Judging(pair, VLLMEngine(server.url), JudgingSettings("vllm:fake", 1, "float64", MAX_NEW, EOS))
        result = search(judging, search_settings=SearchSettings(examples=examples, seed=seed, max_requests=4,
                                                                families=FAMILIES),
                        pool=pool(), vocab_size=259, out_dir=tmp_path, progress=False, log=lambda line: None)
    return result


def fixed_audit(pair, answer):
    """The audit with the built-in prompts and no request parameters."""
    prompts = zoo.builtin_prompts()
    with FakeServer(answer) as server:
        return audit_engine(VLLMEngine(server.url, batch_size=8), pair, prompts, RunSettings(
            max_new_tokens=MAX_NEW, eos_token_id=EOS, dtype="float64", engine_name="vllm:fake", batch_size=1))


@pytest.mark.parametrize("bug, expected", [("stop_tail", "stop_string"), ("penalties", "logits_processor")])
def test_search_finds_what_the_fixed_audit_misses_and_shrinks_it(pair, tmp_path, bug, expected):
    fixed = fixed_audit(pair, ANSWERS[bug](pair))
    assert fixed["equivalent"] and fixed["divergences"] == [], fixed["divergences"]

    result = searched(pair, ANSWERS[bug](pair), tmp_path)
    print(f"{bug}: found after {result.found_after} examples, {result.examples} judged with shrinking")
    assert result.finding is not None and result.found_after <= BUDGET, result.run["search"]
    assert len(result.finding.requests) <= 3
    run = result.run
    assert not run["equivalent"] and run["structural_divergences"] >= 1
    classes = {d["diagnosis"]["class"] for d in run["divergences"] if d["kind"] == "structural"}
    if expected is not None:
        assert expected in classes, run["divergences"]
    # the divergences point at the shrunk cases, the last requests of the record's prompts
    offset = run["search"]["finding"]["prompt_offset"]
    assert all(d["prompt_index"] >= offset for d in run["divergences"])
    last = result.findings[-1]
    assert run["num_prompts"] == len(run["prompts"]) == run["search"]["findings"][-1]["prompt_offset"] + len(
        last.mix.requests)

    # the bundle: the requests as sent, the answers, and a replay that judges them again
    bundle = json.loads(result.bundle.read_text())
    assert [r["prompt_ids"] for r in bundle["requests"]] == [list(r.prompt) for r in result.finding.requests]
    assert len(bundle["engine_outputs"]) == len(bundle["reference_outputs"]) == len(bundle["requests"])
    assert bundle["engine_outputs"] != bundle["reference_outputs"]
    for answer, status in ((ANSWERS[bug](pair), 1), (ANSWERS["correct"](pair), 0)):
        with FakeServer(answer) as server:
            replayed = replay_search_bundle(bundle, pair, VLLMEngine(server.url), "vllm:fake")
        assert replayed["exit_status"] == status, replayed["message"]


def test_a_server_with_three_bugs_gives_three_findings_each_shrunk(pair, tmp_path):
    """One server, three planted bugs of different kinds: the search does not stop at the first; each later
    finding is a failure of a kind not found before, shrunk on its own, with its own bundle."""
    with_bugs = vllm_answer(pair.target, pair.tokenizer, EOS, ("stop_tail", "bias_skipped"))

    def answer(path, body):
        return with_bugs(path, {**body, "frequency_penalty": 0.0, "presence_penalty": 0.0})

    fixed = fixed_audit(pair, answer)
    assert fixed["equivalent"], fixed["divergences"]
    result = searched(pair, answer, tmp_path, examples=3 * BUDGET)
    told = [set(map(tuple, f["signatures"])) for f in result.run["search"]["findings"]]
    print("findings:", told, "after", [f.found_after for f in result.findings], "of", result.examples)
    assert all(len(f.mix.requests) <= 3 for f in result.findings)
    named = {named for found in told for _cls, named in found}
    assert {"logit_bias"} <= named and any(cls == "stop_string" for found in told for cls, _ in found), told
    assert any(n and "frequency" in n for n in named), told  # the penalties' processor
    for earlier, later in zip(told, told[1:]):  # each finding tells something new
        assert not later <= earlier
    bundles = sorted(p.name for p in (tmp_path / "bundles").glob("search-*.json"))
    assert len(bundles) == len(result.findings) >= 3, bundles


def sampling_router(pair, bug=None):
    """A fake vLLM that decodes greedy requests as request_server does and samples the others as sampling_server
    does (with its planted `bug`)."""
    greedy = vllm_answer(pair.target, pair.tokenizer, EOS)
    sampled = sampled_vllm_answer(pair.target, pair.draft, bug)

    def answer(path, body):
        return sampled(path, body) if float(body.get("temperature") or 0.0) > 0 else greedy(path, body)

    return answer


@pytest.mark.parametrize("bug, fact", [(None, None), ("seed_ignored", "same seed"),
                                       ("unseeded_shared", "unseeded")])
def test_sampled_probes_judge_what_a_seed_promises(pair, tmp_path, bug, fact):
    """The search's seeded probes on a fake vLLM that samples with the project's speculative sampler: the correct
    one gives no finding; one that ignores seeds, and one whose unseeded requests share one stream, are each named
    `seeded_sampling` with the fact that failed."""
    with FakeServer(sampling_router(pair, bug)) as server:
        judging = Judging(pair, VLLMEngine(server.url), JudgingSettings("vllm:fake", 1, "float64", 6, EOS))
        result = search(judging, search_settings=SearchSettings(examples=20, seed=2, max_requests=3,
                                                                families=("seeded",)),
                        pool=pool(), vocab_size=259, out_dir=tmp_path, progress=False, log=lambda line: None)
    coverage = result.run["search"]["coverage"]
    assert coverage["seed_probes"] > 0, coverage
    told = {sig for f in result.run["search"]["findings"] for sig in map(tuple, f["signatures"])}
    if fact is None:
        assert result.finding is None, told
        return
    assert ("seeded_sampling", fact) in told, told
    finding = next(f for f in result.findings if ("seeded_sampling", fact) in f.signatures)
    assert finding.mix.probes and len(finding.mix.requests) <= 2
    bundle = json.loads(finding.bundle.read_text())
    assert bundle["probes"] and bundle["seed_probes"]


def test_correct_server_gives_no_finding_and_the_same_seed_draws_the_same(pair, tmp_path):
    first = searched(pair, ANSWERS["correct"](pair), tmp_path / "a", seed=7)
    assert first.finding is None and first.run["equivalent"] and first.run["divergences"] == []
    assert first.examples == BUDGET and first.run["search"]["coverage"]["examples"] == BUDGET
    again = searched(pair, ANSWERS["correct"](pair), tmp_path / "b", seed=7)
    assert again.run["request_params"] == first.run["request_params"]
    assert [p["reference_finish"] for p in again.run["prompts"]] == [p["reference_finish"] for p in first.run["prompts"]]
    other = searched(pair, ANSWERS["correct"](pair), tmp_path / "c", seed=8)
    assert other.run["request_params"] != first.run["request_params"]


def test_the_same_seed_gives_the_same_finding(pair, tmp_path):
    found = [searched(pair, ANSWERS["penalties"](pair), tmp_path / name, seed=3) for name in ("a", "b")]
    assert found[0].finding is not None
    assert found[0].finding == found[1].finding and found[0].found_after == found[1].found_after


def test_coverage_says_what_was_reached_and_what_not(pair, tmp_path):
    result = searched(pair, ANSWERS["correct"](pair), tmp_path, examples=4)
    coverage = result.run["search"]["coverage"]
    assert coverage["requests"] == sum(coverage["shapes"].get(k, 0) for k in ("fresh", "shared", "identical"))
    missing = coverage["not_reached"]
    assert "no request with bad_words" in missing and "no request with seed" in missing  # not drawn here
    for family in FAMILIES:
        assert (coverage["families"].get(family, 0) > 0) == (f"no request with {family}" not in missing)


def test_a_recording_cannot_be_searched(tmp_path):
    recording = tmp_path / "run.jsonl"
    recording.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": [3]}) + "\n")
    result = cli_run.audit("--engine", f"recorded:{recording}", "--pair", "tiny-llama", "--search",
                           out=tmp_path / "out")
    cli_run.usage_error(result, "a recording cannot be searched")


def test_audit_search_of_an_in_process_engine_writes_the_audit_and_coverage(tmp_path):
    out = tmp_path / "out"
    result = cli_run.audit("--engine", "eqspec", "--pair", "tiny-llama", "--search", "--budget", "3", "--seed", "5",
                           "--max-new-tokens", "6", "--batch-size", "2", out=out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 5" in result.stderr
    audit = json.loads((out / "audit.json").read_text())
    assert audit["config"]["search"]["seed"] == 5 and audit["complete"]
    (run,) = audit["runs"]
    assert run["equivalent"] and run["search"]["examples"] == 3 and run["num_prompts"] == len(run["prompts"]) > 0
    assert "no finding" in (out / "search.md").read_text()
    assert (out / "report.md").is_file()
    from specaudit import read_report

    assert read_report(out).records[0].engine == "eqspec"


def test_a_budget_of_minutes_ends_at_its_deadline_with_examples_judged(tmp_path):
    """Under a budget of minutes the search runs Hypothesis round after round until the deadline, and an example
    past it passes unjudged (no example stops drawing early: Hypothesis's draws stay consistent)."""
    out = tmp_path / "out"
    result = cli_run.audit("--engine", "eqspec", "--pair", "tiny-llama", "--search", "--budget", "6s",
                           "--max-new-tokens", "4", "--batch-size", "2", out=out)
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = json.loads((out / "audit.json").read_text())["runs"]
    assert run["equivalent"] and run["search"]["examples"] >= 1 and run["search"]["budget"]["minutes"] == 0.1
    assert "budget 0.1 minutes" in (out / "search.md").read_text()
