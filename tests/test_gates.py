"""Gates say what they did (equivalence/gates.py): a gate that was asked for and could not be evaluated fails the
audit (exit 1) with one line naming what is missing and how to give it, grouped over the runs that share it.

- `--require-acceptance` against a fake vLLM server of tiny-llama (a built-in pair: no draft the server was
  given, no proposer stated): no expectation, exit 1, one line for both batch sizes; without the gate, exit 0;
- `--require-speculation` against a server without `/metrics`: exit 1, one line naming the missing counters;
- `--draft` given for a server (the target and draft as model folders) implies the draft-model proposer: the
  run's acceptance has an expectation and says it was implied; `--speculation` still decides where given;
- `gate_failures` on records: identical reasons grouped, each short run its own line, failed runs left to
  their own failure.
"""

from __future__ import annotations

import pytest
from cli_run import audit, runs
from fake_server import FakeServer, SpeculationMetrics

from specaudit.engines.reference import greedy_decode
from specaudit.equivalence.acceptance.run import implied_spec
from specaudit.equivalence.gates import ACCEPTANCE, SPECULATION, gate_failures
from specaudit.equivalence.pipeline.runner import exit_status

SMALL = ("--num-prompts", "3", "--max-new-tokens", "6", "--no-adversarial")


def greedy_server(model):
    """/v1/completions answered with `model`'s greedy decoding (every audit of it is exact)."""
    def respond(path, body):
        eos = body["stop_token_ids"][0] if "stop_token_ids" in body else None
        tokens, _ = greedy_decode(model, body["prompt"], body["max_tokens"], eos)
        finish = "stop" if eos is not None and tokens and tokens[-1] == eos else "length"
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish,
                                  "stop_reason": None, "logprobs": None}]}
    return respond


@pytest.fixture(scope="module")
def pair():
    from specaudit.engines.models import zoo

    return zoo.load_pair("tiny-llama")


@pytest.fixture(scope="module")
def folders(pair, tmp_path_factory):
    """tiny-llama's target and draft as Hugging Face folders (float64 safetensors)."""
    root = tmp_path_factory.mktemp("tiny-llama")
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        model.save_pretrained(root / role, safe_serialization=True)
    return root / "target", root / "draft"


def gate_lines(stderr: str, gate: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(gate)]


def test_require_acceptance_with_no_expectation_fails_with_one_line(tmp_path, pair):
    with FakeServer(greedy_server(pair.target), metrics=SpeculationMetrics("vllm")) as server:
        gated = audit("--engine", f"vllm:{server.url}", "--pair", "tiny-llama", "--batch-size", "2", "4", *SMALL,
                      "--require-acceptance", "0.8", out=tmp_path / "gated")
        plain = audit("--engine", f"vllm:{server.url}", "--pair", "tiny-llama", "--batch-size", "2", "4", *SMALL,
                      out=tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr  # the same runs pass where no gate was asked for
    assert gated.returncode == 1, gated.stdout + gated.stderr
    assert all(run["exact_matches"] == run["num_prompts"] for run in runs(tmp_path / "gated"))
    (line,) = gate_lines(gated.stderr, ACCEPTANCE)  # one line for both runs
    assert line.startswith(f"{ACCEPTANCE} 0.8 was not applied to vllm:{server.url} tiny-llama B=2, 4 float64: "
                           "no expectation (the engine's proposer is not known"), line
    assert "--speculation draft:k=4" in line and "--acceptance-baseline FILE" in line
    verdict = [text for text in gated.stdout.splitlines() if text.startswith("verdict:")][-1]
    assert "--require-acceptance 0.8 not applied to 2 run(s) (exit 1)" in verdict
    assert "was not applied to" in (tmp_path / "gated" / "report.md").read_text().split("\n")[2]
    assert "verdict-fail" in (tmp_path / "gated" / "report.html").read_text()


def test_require_speculation_on_a_server_without_counters_names_them(tmp_path, pair):
    with FakeServer(greedy_server(pair.target)) as server:  # GET /metrics: 404
        result = audit("--engine", f"vllm:{server.url}", "--pair", "tiny-llama", "--batch-size", "2", *SMALL,
                       "--require-speculation", out=tmp_path)
    assert result.returncode == 1
    (line,) = gate_lines(result.stderr, SPECULATION)
    assert line.startswith(f"{SPECULATION} could not be checked on vllm:{server.url} tiny-llama B=2 float64: "
                           "no draft counters (")
    assert "HTTP 404" in line and "--speculative-config" in line and "/metrics" in line


def test_a_draft_given_for_a_server_implies_the_draft_model_proposer(tmp_path, pair, folders):
    target, draft = folders
    base = ("--target", str(target), "--batch-size", "2", *SMALL)
    with FakeServer(greedy_server(pair.target), metrics=SpeculationMetrics("vllm")) as server:
        given = audit("--engine", f"vllm:{server.url}", *base, "--draft", str(draft), out=tmp_path / "draft")
        alone = audit("--engine", f"vllm:{server.url}", *base, "--require-acceptance", "0.8", out=tmp_path / "alone")
        stated = audit("--engine", f"vllm:{server.url}", *base, "--draft", str(draft), "--speculation",
                       "ngram:k=4,min=1,max=3", out=tmp_path / "ngram")
    assert given.returncode == 0, given.stderr
    record = runs(tmp_path / "draft")[0]["acceptance"]
    assert record["expected"] is not None and record["expected"]["method"] == "draft-model replay", record
    assert record["expected"]["k"] == 4
    assert record["implied"].startswith(f"implied by --draft {draft} for the server vllm:{server.url}")
    assert "proposer: implied by --draft" in (tmp_path / "draft" / "report.md").read_text()
    # the target alone: nothing implied, and the gate says so
    assert alone.returncode == 1 and "implied" not in runs(tmp_path / "alone")[0]["acceptance"]
    (line,) = gate_lines(alone.stderr, ACCEPTANCE)
    assert "no expectation" in line and "(with --draft)" in line
    # --speculation says otherwise: the stated n-gram proposer, nothing implied
    record = runs(tmp_path / "ngram")[0]["acceptance"]
    assert stated.returncode == 0 and "implied" not in record
    assert record["expected"]["method"].startswith("n-gram"), record["expected"]


def test_implied_spec_only_for_a_server_with_a_draft_folder(pair, folders):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(folders[1]))
    assert implied_spec("vllm:http://127.0.0.1:1", draft, 4)[0] == "draft:k=4"
    assert implied_spec("llamacpp:http://127.0.0.1:1", draft, 3)[0] == "draft:k=3"
    assert implied_spec("recorded:run.jsonl", draft, 4) is None  # a recording: whatever proposer it recorded
    assert implied_spec("eqspec", draft, 4) is None  # in process, the engine's own drafter says
    assert implied_spec("vllm:http://127.0.0.1:1", pair.draft, 4) is None  # a built-in pair: no folder given
    assert implied_spec("vllm:http://127.0.0.1:1", None, 4) is None
    assert implied_spec("vllm:http://127.0.0.1:1", draft, None) is None


def _run(engine: str, batch_size: int, acceptance: dict | None, **more) -> dict:
    return {"engine": engine, "pair": "p", "batch_size": batch_size, "dtype": "float64", "equivalent": True,
            "exact_matches": 2, "num_prompts": 2, "divergences": [], "acceptance": acceptance, **more}


def _record(positions=(), expected=None, below=(), unavailable=None) -> dict:
    return {"positions": list(positions), "expected": expected, "below_required": list(below), "required": 0.9,
            "unavailable": unavailable, "overall": {}, "findings": []}


def test_gate_failures_group_reasons_and_name_each_short_run() -> None:
    compared = _record(positions=[{"position": 0}], expected={"method": "replay"})
    short = _record(positions=[{"position": 0}], expected={"method": "replay"}, below=[0])
    unknown = _record(unavailable="the engine's proposer is not known")
    audit = {"config": {"require_acceptance": 0.9, "draft_tokens": 3},
             "runs": [_run("a", 1, compared), _run("a", 2, short), _run("b", 1, unknown), _run("b", 4, unknown),
                      _run("c", 1, None), _run("d", 1, unknown, error="boom")]}
    failures = gate_failures(audit)
    assert [(f.gate, f.applied, f.runs) for f in failures] == [
        (ACCEPTANCE, True, ("a p B=2 float64",)),
        (ACCEPTANCE, False, ("b p B=1 float64", "b p B=4 float64")),
        (ACCEPTANCE, False, ("c p B=1 float64",))]
    assert failures[0].message.startswith("acceptance short: a p B=2 float64: below --require-acceptance 0.9")
    assert failures[1].message.startswith(f"{ACCEPTANCE} 0.9 was not applied to b p B=1, 4 float64: no expectation")
    assert "--speculation draft:k=3" in failures[1].message
    assert "no acceptance record" in failures[2].message
    assert exit_status(audit) == 1 and exit_status({**audit, "runs": audit["runs"][:1]}) == 0
    assert gate_failures({**audit, "config": {}}) == []  # no gate asked for: nothing fails
    served = {"config": {"require_acceptance": 0.9, "reference": "vllm:http://x"}, "runs": [_run("b", 1, unknown)]}
    assert "give --acceptance-baseline FILE" in gate_failures(served)[0].message
    counted = {"config": {"require_acceptance": 0.9},
               "runs": [_run("b", 1, _record(expected={"method": "replay"},
                                             unavailable="no per-position counters were observed"))]}
    assert "no per-position counters observed" in gate_failures(counted)[0].message


def test_gate_failures_on_speculation_say_what_the_counters_showed() -> None:
    drafted = {"drafted_tokens": 8, "accepted_tokens": 3, "preemptions": None}
    none = {"drafted_tokens": 0, "accepted_tokens": 0, "preemptions": None}
    audit = {"config": {"require_speculation": True},
             "runs": [_run("eqspec", 1, None, speculation=drafted), _run("llamacpp:http://h", 1, None, speculation=None),
                      _run("llamacpp:http://h", 2, None, speculation=None), _run("vllm:http://v", 1, None,
                                                                                   speculation=none)]}
    failures = gate_failures(audit)
    assert [(f.applied, f.runs) for f in failures] == [
        (False, ("llamacpp:http://h p B=1 float64", "llamacpp:http://h p B=2 float64")),
        (True, ("vllm:http://v p B=1 float64",))]
    assert "no draft counters" in failures[0].message and "--metrics" in failures[0].message
    assert "speculation not observed: the engine drafted no token" in failures[1].message


def test_a_run_whose_every_prompt_s_parameters_were_refused_judged_nothing_and_fails(tmp_path) -> None:
    """transformers' assisted generation has no frequency penalty: it refuses it on every prompt, so the run judged
    no prompt; its 'equivalent' proves nothing, and the audit says so in one line and exits 1."""
    result = audit("--engine", "hf-assisted", "--pair", "tiny-llama", "--batch-size", "1", "--num-prompts",
                           "2", "--max-new-tokens", "6", "--no-adversarial", "--frequency-penalty", "0.5", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("nothing was judged on hf-assisted")]
    assert len(lines) == 1 and "frequency_penalty" in lines[0], result.stderr
    assert "NOT shown equivalent" in result.stdout
    # with one prompt judged (no parameter refused), the same engine passes
    fine = audit("--engine", "hf-assisted", "--pair", "tiny-llama", "--batch-size", "1", "--num-prompts",
                         "2", "--max-new-tokens", "6", "--no-adversarial", "--repetition-penalty", "1.3",
                         out=tmp_path / "fine")
    assert fine.returncode == 0, fine.stdout + fine.stderr
