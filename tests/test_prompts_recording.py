"""A recording (engines/adapters/recorded.py) read as a prompt set: `--prompts run.jsonl`, the prompts of its
`prompt_ids`, each distinct prompt once (a sampled run's recording repeats its prompt once per sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import audit
from specaudit.engines.adapters.recorded import write_recording
from specaudit.engines.models import zoo
from specaudit.equivalence.prompts import PromptError, load_prompts

PROMPTS = [[72, 101, 108], [87, 111], [1, 2, 3, 4]]


def test_a_greedy_recording_is_read_as_its_prompt_ids(tmp_path: Path) -> None:
    path = write_recording(tmp_path / "run.jsonl", PROMPTS, [[5, 6], [7], [8, 9, 10]],
                           metadata={"max_new_tokens": 4})
    assert load_prompts(str(path), None, vocab_size=259) == PROMPTS
    assert load_prompts(str(path), None, 2, vocab_size=259) == PROMPTS[:2]


def test_a_sampled_recording_yields_each_prompt_once_in_order(tmp_path: Path) -> None:
    # one line per sample, the prompt repeated: 0 0 1 0 2 1 2
    order = [0, 0, 1, 0, 2, 1, 2]
    path = write_recording(tmp_path / "samples.jsonl", [PROMPTS[i] for i in order],
                           [[i, 9] for i in range(len(order))])
    assert load_prompts(str(path), None, vocab_size=259) == PROMPTS
    assert load_prompts(str(path), None, 2, vocab_size=259) == PROMPTS[:2]  # --num-prompts counts distinct ones


def test_a_prompts_file_keeps_a_prompt_given_twice(tmp_path: Path) -> None:
    # without output_ids the lines are a prompt set, not a recording: a repeat is on purpose
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in [PROMPTS[0], PROMPTS[0], PROMPTS[1]]))
    assert load_prompts(str(path), None, vocab_size=259) == [PROMPTS[0], PROMPTS[0], PROMPTS[1]]


def test_bad_prompt_ids_name_the_field_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": [3]}) + "\n"
                    + json.dumps({"prompt_ids": ["a"], "output_ids": [3]}) + "\n")
    with pytest.raises(PromptError, match=r"bad\.jsonl:2: prompt_ids must be a list of integer token ids"):
        load_prompts(str(path), None)
    path.write_text(json.dumps({"prompt_ids": [1, 300], "output_ids": [3]}) + "\n")
    with pytest.raises(PromptError, match=r"bad\.jsonl:1: token id 300 is outside the model's vocabulary"):
        load_prompts(str(path), None, vocab_size=259)


@pytest.mark.parametrize("num_prompts, audited", [(None, 3), ("2", 2)])
def test_a_recording_as_prompts_audits_an_in_process_engine(tmp_path: Path, num_prompts: str | None,
                                                            audited: int) -> None:
    prompts = zoo.builtin_prompts()[:3]
    order = [0, 0, 1, 1, 2]  # a sampled recording: prompts 0 and 1 twice
    path = write_recording(tmp_path / "rec.jsonl", [prompts[i] for i in order], [[1, 2]] * len(order),
                           metadata={"max_new_tokens": 4})
    limit = ["--num-prompts", num_prompts] if num_prompts else []
    result = audit("--engine", "eqspec", "--pair", "tiny-llama", "--prompts", str(path), *limit,
                   "--max-new-tokens", "4", "--no-adversarial", "--batch-size", "2", out=tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads((tmp_path / "out" / "audit.json").read_text())["runs"]
    assert [run["num_prompts"] for run in runs] == [audited]  # each distinct prompt once
    assert "every audited engine is equivalent" in result.stdout


def test_a_servers_recording_is_the_prompt_set_of_a_live_server_audit(tmp_path: Path) -> None:
    """`specaudit record` of a server, then `specaudit audit --engine llamacpp:URL --prompts` that recording:
    the server is asked exactly the recording's prompts."""
    from fake_server import FakeServer

    from cli_run import cli
    from specaudit.engines.adapters.recorded import read_recording
    from specaudit.engines.reference import greedy_decode

    pair = zoo.load_pair("tiny-llama")

    def respond(path: str, body: dict) -> tuple[int, dict]:
        tokens, _ = greedy_decode(pair.target, body["prompt"], body["n_predict"],
                                  None if body["ignore_eos"] else pair.eos_token_id)
        return 200, {"tokens": tokens, "stop_type": "limit", "completion_probabilities": []}

    recording = tmp_path / "run.jsonl"
    with FakeServer(respond) as server:
        made = cli("record", "--engine", f"llamacpp:{server.url}", "--pair", "tiny-llama", "--num-prompts", "3",
                   "--max-new-tokens", "4", "--out", str(recording))
        assert made.returncode == 0, made.stderr
    with FakeServer(respond) as server:
        result = audit("--engine", f"llamacpp:{server.url}", "--pair", "tiny-llama", "--prompts", str(recording),
                       "--max-new-tokens", "4", "--no-adversarial", "--batch-size", "2", out=tmp_path / "out")
        asked = sorted(body["prompt"] for _, body in server.requests if "prompt" in body)
    assert result.returncode == 0, result.stdout + result.stderr
    assert asked == sorted(line.prompt_ids for line in read_recording(recording))


def test_a_recordings_params_follow_its_distinct_prompts(tmp_path: Path) -> None:
    """A recording's `params` are matched to each distinct prompt as the reader yields it (the repeated samples of
    a prompt give no prompt and no parameters of their own)."""
    from specaudit.engines.requests import RequestParams
    from specaudit.equivalence.blackbox.requests_run import prompt_params
    from specaudit.equivalence.prompts import load_prompts

    lines = [{"prompt_ids": [5, 6], "output_ids": [1], "params": {"min_tokens": 1}},
             {"prompt_ids": [5, 6], "output_ids": [2], "params": {"min_tokens": 1}},
             {"prompt_ids": [7], "output_ids": [3], "params": {"min_tokens": 2}}]
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = load_prompts(str(path), None)
    params = prompt_params(str(path), len(prompts), RequestParams())
    assert prompts == [[5, 6], [7]]
    assert [p.min_tokens for p in params] == [1, 2]
