"""Three-way rulings (equivalence/rulings/plain.py): the reference, a plain run of the same engine,
and the speculative run.

Two fake llama.cpp servers serve tiny-llama's float64 greedy outputs with planted flips: the
"speculative" one flips prompt A at its smallest top-2 margin and prompt B at position 2; the "plain"
one (the same model without speculation) makes flip A only. In a float64 audit with no noise band
every flip is structural; beside the plain run, flip A (same position, same token) is the engine's
precision and must be ruled numerical, while flip B stays structural with the plain run's token beside
it. A recording of the plain run (`recorded:FILE`) must rule the same.
"""

from __future__ import annotations

import json

import pytest
from cli_run import audit
from test_blackbox import llamacpp_server, served_outputs

from specaudit.engines.models import zoo
from specaudit.equivalence.audit import Reference
from specaudit.equivalence.prompts import load_prompts

MAX_NEW = 16
ARGS = ("--pair", "tiny-llama", "--num-prompts", "4", "--max-new-tokens", str(MAX_NEW), "--no-adversarial",
        "--batch-size", "2")


@pytest.fixture(scope="module")
def planted():
    pair = zoo.load_pair("tiny-llama")
    prompts = load_prompts("builtin", pair.tokenizer, 4)
    reference = Reference(pair, prompts, MAX_NEW, pair.eos_token_id)
    margins = []
    for index, logits in enumerate(reference.logits):
        top = logits.topk(2).values
        gaps = top[:, 0] - top[:, 1]
        position = int(gaps[:-1].argmin())
        margins.append((float(gaps[position]), index, position))
    _, flip_a, position_a = min(margins)
    flip_b, flip_c = [i for i in range(len(prompts)) if i != flip_a][:2]
    plain = served_outputs(pair, prompts, reference, flip_a, position_a)
    # prompt C: both runs diverge at position 3, with different tokens (ranks 1 and 2)
    plain[flip_c] = served_outputs(pair, prompts, reference, flip_c, 3, flip_rank=1)[flip_c]
    speculative = [list(o) for o in plain]
    speculative[flip_b] = served_outputs(pair, prompts, reference, flip_b, 2)[flip_b]
    speculative[flip_c] = served_outputs(pair, prompts, reference, flip_c, 3, flip_rank=2)[flip_c]
    return pair, prompts, reference, plain, speculative, (flip_a, position_a), (flip_b, flip_c)


def _run(out) -> dict:
    (run,) = json.loads((out / "audit.json").read_text())["runs"]
    return run


def test_plain_run_rules_its_own_flip_numerical_and_leaves_the_speculative_one_structural(tmp_path, planted):
    pair, prompts, reference, plain, speculative, (flip_a, position_a), (flip_b, flip_c) = planted
    with llamacpp_server(pair, prompts, speculative, None) as spec, llamacpp_server(pair, prompts, plain, None) as base:
        alone = audit("--engine", f"llamacpp:{spec.url}", *ARGS, out=tmp_path / "alone")
        beside = audit("--engine", f"llamacpp:{spec.url}", "--plain-engine", f"llamacpp:{base.url}", *ARGS,
                       out=tmp_path / "beside")
    assert alone.returncode == 1
    assert all(d["kind"] == "structural" for d in _run(tmp_path / "alone")["divergences"])  # the control
    assert beside.returncode == 1, beside.stderr
    run = _run(tmp_path / "beside")
    by_prompt = {d["prompt_index"]: d for d in run["divergences"]}
    a, b = by_prompt[flip_a], by_prompt[flip_b]
    assert a["position"] == position_a and a["kind"] == "numerical" and a["decided_by"] == "plain-control"
    assert a["plain_token"] == a["engine_token"] != a["reference_token"]
    assert a["evidence"]["band_kind"] == "structural"  # what the band alone said, kept
    assert b["position"] == 2 and b["kind"] == "structural" and b["decided_by"] == "float64-replay"
    assert b["plain_token"] == b["reference_token"] and b["plain_first_divergence"] is None
    c = by_prompt[flip_c]  # same position, another token: the speculative run's own
    assert c["position"] == 3 and c["plain_first_divergence"] == 3 and c["kind"] == "structural"
    assert c["plain_token"] not in (c["engine_token"], c["reference_token"])
    summary = run["plain_engine"]
    assert summary["exact_matches"] == 2 and summary["same_as_plain"] == 1 and summary["ruled_numerical_by_plain"] == 1
    for report in ("report.md", "report.html"):
        text = (tmp_path / "beside" / report).read_text()
        assert "Three-way rulings" in text and "plain-control" in text, report
    assert "exactly as the plain run does" in beside.stdout


def test_only_plain_flips_pass_and_a_recording_of_the_plain_run_rules_the_same(tmp_path, planted):
    pair, prompts, reference, plain, _, (flip_a, _), (_, flip_c) = planted
    recording = tmp_path / "plain.jsonl"
    recording.write_text("".join(json.dumps({"prompt_ids": p, "output_ids": o, "max_new_tokens": MAX_NEW}) + "\n"
                                 for p, o in zip(prompts, plain)))
    with llamacpp_server(pair, prompts, plain, None) as spec:
        result = audit("--engine", f"llamacpp:{spec.url}", "--plain-engine", f"recorded:{recording}", *ARGS,
                       out=tmp_path / "out")
        import specaudit

        for plain_engine, expected in ((None, 1), (f"recorded:{recording}", 0)):  # the Python API's keyword
            report = specaudit.audit(f"llamacpp:{spec.url}", pairs=["tiny-llama"], num_prompts=4, batch_sizes=[2],
                                     max_new_tokens=MAX_NEW, adversarial=False, plain_engine=plain_engine)
            assert report.exit_status == expected
    assert result.returncode == 0, result.stdout + result.stderr
    divergences = _run(tmp_path / "out")["divergences"]
    assert sorted(d["prompt_index"] for d in divergences) == sorted([flip_a, flip_c])
    assert all(d["kind"] == "numerical" and d["decided_by"] == "plain-control" for d in divergences)


def test_a_plain_run_that_fails_leaves_the_rulings_alone(tmp_path, planted):
    pair, prompts, _, plain, _, _, _ = planted
    with llamacpp_server(pair, prompts, plain, None) as spec:
        result = audit("--engine", f"llamacpp:{spec.url}", "--plain-engine", f"recorded:{tmp_path / 'missing.jsonl'}",
                       *ARGS, out=tmp_path / "out")
    assert result.returncode == 1
    run = _run(tmp_path / "out")
    assert run["plain_engine"]["error"] and all(d["kind"] == "structural" for d in run["divergences"])


def test_a_divergence_carries_one_field_for_what_ruled_it(tmp_path, planted):
    """`decided_by` alone: no second name for the same field."""
    pair, prompts, _, plain, speculative, _, _ = planted
    with llamacpp_server(pair, prompts, speculative, None) as spec, llamacpp_server(pair, prompts, plain, None) as base:
        audit("--engine", f"llamacpp:{spec.url}", "--plain-engine", f"llamacpp:{base.url}", *ARGS, out=tmp_path)
    divergences = _run(tmp_path)["divergences"]
    assert divergences and all("ruled_by" not in d and d["decided_by"] for d in divergences)
