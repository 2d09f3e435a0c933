"""Live-server clients against a local HTTP server answering each server's documented shapes.

The requests each client sends are checked field by field; so are stopping at EOS, the log-
probabilities kept, N requests in flight for batch size N, the per-request timeout, and the one-line
error when nothing listens. (llama.cpp is also run for real in its own end-to-end test; vLLM, SGLang
and TensorRT-LLM only here.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_server import FakeServer, free_port_with_nothing_listening

from specaudit.engines.adapters._http import ServerError, ServerTimeout, ServerUnreachable
from specaudit.engines.adapters.servers import LlamaCppEngine, SGLangEngine, TRTLLMEngine, VLLMEngine
from specaudit.engines.registry import black_box_prefix, make_engine

EOS = 258


def continuation(prompt: list[int], n: int) -> list[int]:
    """What the fake servers 'generate': a deterministic function of the prompt."""
    return [(sum(prompt) + 7 * i) % 250 for i in range(n)]


# --- llama.cpp ---------------------------------------------------------------------------------

def llamacpp_answer(eos_after: int | None = None, probs: str = "per-token"):
    def answer(path: str, body: dict) -> tuple[int, dict]:
        assert path == "/completion"
        tokens = continuation(body["prompt"], body["n_predict"])
        stop_type = "limit"
        if eos_after is not None and eos_after < len(tokens):
            tokens, stop_type = tokens[:eos_after], "eos"  # the server does not return the EOS id
        if probs == "per-token":
            entries = [{"id": t, "logprob": -0.1, "token": "x", "bytes": [120],
                        "top_logprobs": [{"id": t, "logprob": -0.1, "token": "x", "bytes": [120]},
                                         {"id": t + 1, "logprob": -2.5, "token": "y", "bytes": [121]}]}
                       for t in tokens]
        elif probs == "speculative":  # what llama.cpp gives under speculation
            entries = [{"id": t, "logprob": 0.0, "token": "x", "bytes": [120], "top_logprobs": []} for t in tokens]
        else:  # one entry per text piece: fewer entries than tokens
            entries = [{"id": tokens[0], "logprob": -0.1, "top_logprobs": [{"id": tokens[0], "logprob": -0.1}]}]
        return 200, {"content": "text", "tokens": tokens, "stop": True, "stop_type": stop_type,
                     "stopping_word": "", "completion_probabilities": entries, "tokens_cached": 0}
    return answer


def test_llamacpp_request_field_by_field():
    with FakeServer(llamacpp_answer()) as server:
        engine = make_engine(f"llamacpp:{server.url}", None, None, batch_size=1, draft_tokens=4)
        assert isinstance(engine, LlamaCppEngine)
        outputs = engine.generate([[5, 6, 7]], 6, EOS)
    assert outputs == [continuation([5, 6, 7], 6)]
    path, body = server.requests[0]
    assert path == "/completion"
    assert body["prompt"] == [5, 6, 7]
    assert body["n_predict"] == 6
    assert body["temperature"] == 0
    assert body["return_tokens"] is True
    assert body["n_probs"] == 2
    assert body["cache_prompt"] is False
    assert body["stream"] is False
    assert body["ignore_eos"] is False
    assert body["repeat_penalty"] == 1.0 and body["presence_penalty"] == 0 and body["frequency_penalty"] == 0
    assert engine.last_logprobs[0][0] == {outputs[0][0]: -0.1, outputs[0][0] + 1: -2.5}


def test_llamacpp_eos_appended_and_no_eos_means_ignore_eos():
    with FakeServer(llamacpp_answer(eos_after=3)) as server:
        engine = LlamaCppEngine(server.url)
        outputs = engine.generate([[1, 2], [3]], 8, EOS)
        assert outputs == [continuation([1, 2], 3) + [EOS], continuation([3], 3) + [EOS]]
        assert engine.last_logprobs == [None, None]  # none for the appended EOS: dropped, not misaligned
        engine.generate([[1, 2]], 8, None)
    assert server.requests[-1][1]["ignore_eos"] is True


@pytest.mark.parametrize("probs", ["speculative", "per-piece"])
def test_llamacpp_unusable_logprobs_are_not_kept(probs):
    with FakeServer(llamacpp_answer(probs=probs)) as server:
        engine = LlamaCppEngine(server.url)
        outputs = engine.generate([[9, 9]], 4, EOS)
    assert outputs == [continuation([9, 9], 4)]
    assert engine.last_logprobs == [None]
    assert engine.last_details[0]["notes"]


def test_client_cuts_at_eos_and_max_new_tokens():
    def answer(path, body):  # a server that runs on past EOS and past n_predict
        return 200, {"tokens": [1, EOS, 2, 3, 4, 5, 6, 7, 8, 9], "stop_type": "limit"}

    with FakeServer(answer) as server:
        engine = LlamaCppEngine(server.url)
        assert engine.generate([[1]], 4, EOS) == [[1, EOS]]
        assert engine.generate([[1]], 4, None) == [[1, EOS, 2, 3]]


def test_batch_size_means_concurrent_requests():
    with FakeServer(llamacpp_answer(), delay_s=0.3) as server:
        engine = LlamaCppEngine(server.url, batch_size=4)
        prompts = [[i + 1] for i in range(8)]
        started = time.perf_counter()
        outputs = engine.generate(prompts, 3, EOS)
        seconds = time.perf_counter() - started
    assert outputs == [continuation(p, 3) for p in prompts]  # order kept
    assert server.max_in_flight == 4
    assert seconds < 8 * 0.3  # not one after another


def test_batch_size_one_is_sequential():
    with FakeServer(llamacpp_answer(), delay_s=0.05) as server:
        LlamaCppEngine(server.url, batch_size=1).generate([[1], [2], [3]], 2, EOS)
    assert server.max_in_flight == 1


def test_unreachable_server_is_one_clear_line():
    url = f"http://127.0.0.1:{free_port_with_nothing_listening()}"
    engine = make_engine(f"llamacpp:{url}", None, None, batch_size=2, draft_tokens=4, retries=1)
    with pytest.raises(ServerUnreachable) as info:
        engine.generate([[1], [2]], 4, EOS)
    message = str(info.value)
    assert "\n" not in message and url in message and "URL" in message


def test_per_request_timeout():
    with FakeServer(llamacpp_answer(), delay_s=2.0) as server:
        engine = LlamaCppEngine(server.url, timeout=0.3)
        started = time.perf_counter()
        with pytest.raises(ServerTimeout) as info:
            engine.generate([[1]], 2, EOS)
        assert time.perf_counter() - started < 1.5  # not retried
    assert server.url in str(info.value)


def test_http_error_and_wrong_shape_are_server_errors():
    with FakeServer(lambda path, body: (400, {"error": "bad prompt"})) as server:
        with pytest.raises(ServerError) as info:
            LlamaCppEngine(server.url).generate([[1]], 2, EOS)
        assert "400" in str(info.value) and "bad prompt" in str(info.value)
        assert "prompt 0 (1 tokens)" in str(info.value)  # which prompt the server refused
    with FakeServer(lambda path, body: (200, {"choices": []})) as server:
        with pytest.raises(ServerError):
            LlamaCppEngine(server.url).generate([[1]], 2, EOS)


def test_registry_dispatches_prefixes_before_module_factory():
    assert black_box_prefix("llamacpp:http://127.0.0.1:8080") == "llamacpp"
    assert black_box_prefix("recorded:/tmp/a.jsonl") == "recorded"
    assert black_box_prefix("mypkg.engine:make") is None
    assert black_box_prefix("eqspec") is None


# --- vLLM, TensorRT-LLM, SGLang (documented shapes; not run against the real servers) -----------

def openai_answer(include_eos: bool, top_by: str = "id"):
    def answer(path: str, body: dict) -> tuple[int, dict]:
        assert path == "/v1/completions"
        tokens = continuation(body["prompt"], body["max_tokens"])
        finish, stop_reason = "length", None
        if len(tokens) > 3 and "stop_token_ids" in body:
            tokens, finish = tokens[:3] + ([body["stop_token_ids"][0]] if include_eos else []), "stop"
            stop_reason = body["stop_token_ids"][0]
        name = (lambda t: f"token_id:{t}") if top_by == "id" else (lambda t: chr(65 + t % 26))
        logprobs = {"text_offset": [0] * len(tokens), "token_logprobs": [-0.2] * len(tokens),
                    "tokens": [name(t) for t in tokens],
                    "top_logprobs": [{name(t): -0.2, name(t + 1): -1.7} for t in tokens]}
        choice = {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason, "token_ids": tokens}
        return 200, {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens),
                                                    "total_tokens": 1 + len(tokens)}}
    return answer


def test_vllm_request_field_by_field_and_logprobs_by_id():
    with FakeServer(openai_answer(include_eos=True)) as server:
        engine = make_engine(f"vllm:{server.url}", None, None, batch_size=2, draft_tokens=4, model="served")
        assert isinstance(engine, VLLMEngine)
        outputs = engine.generate([[4, 5], [6]], 8, EOS)
    assert outputs == [continuation([4, 5], 3) + [EOS], continuation([6], 3) + [EOS]]
    path, body = server.requests[0]
    assert path == "/v1/completions"
    assert body["prompt"] in ([4, 5], [6])
    assert body["max_tokens"] == 8
    assert body["temperature"] == 0
    assert body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 2
    assert body["stop_token_ids"] == [EOS]
    assert "ignore_eos" not in body
    assert body["stream"] is False and body["n"] == 1
    assert body["model"] == "served"
    first = outputs[0][0]
    assert engine.last_logprobs[0][0] == {first: -0.2, first + 1: -1.7}
    assert len(engine.last_logprobs[0]) == len(outputs[0])


def test_an_eos_set_is_sent_whole_and_the_client_stops_at_any_of_its_ids():
    second = 157  # a target whose generation config declares two EOS ids

    def stops_on_second(path, body):  # stopped on the set's second id, without returning it
        return 200, {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "stop_reason": second}]}

    with FakeServer(stops_on_second) as server:
        assert VLLMEngine(server.url).generate([[1]], 8, (EOS, second)) == [[5, 6, second]]
    assert server.requests[0][1]["stop_token_ids"] == [EOS, second]

    def runs_past(path, body):  # a server that runs on past an id of the set
        return 200, {"tokens": [1, second, 2, EOS, 3], "stop_type": "limit"}

    with FakeServer(runs_past) as server:
        assert LlamaCppEngine(server.url).generate([[1]], 8, [EOS, second]) == [[1, second]]
        assert LlamaCppEngine(server.url).generate([[1]], 8, EOS) == [[1, second, 2, EOS]]


def test_vllm_no_eos_asks_to_ignore_eos():
    with FakeServer(openai_answer(include_eos=True)) as server:
        outputs = VLLMEngine(server.url).generate([[4, 5]], 6, None)
    assert outputs == [continuation([4, 5], 6)]
    body = server.requests[0][1]
    assert body["ignore_eos"] is True and "stop_token_ids" not in body and "model" not in body


def test_trtllm_request_field_by_field():
    with FakeServer(openai_answer(include_eos=False, top_by="text")) as server:
        engine = make_engine(f"trtllm:{server.url}", None, None, batch_size=1, draft_tokens=4, model="served")
        assert isinstance(engine, TRTLLMEngine)
        outputs = engine.generate([[4, 5]], 8, EOS)
    assert outputs == [continuation([4, 5], 3) + [EOS]]  # stopped on EOS without returning it
    body = server.requests[0][1]
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
                         "presence_penalty", "frequency_penalty", "n", "stream", "detokenize", "logprobs",
                         "stop_token_ids"}  # its request model forbids unknown fields
    assert body["model"] == "served" and body["prompt"] == [4, 5] and body["max_tokens"] == 8
    assert body["temperature"] == 0 and body["detokenize"] is False and body["stop_token_ids"] == [EOS]
    assert engine.last_logprobs == [None]  # alternatives keyed by text cannot give a margin


def sglang_answer(path: str, body: dict) -> tuple[int, dict]:
    assert path == "/generate"
    params = body["sampling_params"]
    tokens = continuation(body["input_ids"], params["max_new_tokens"])
    finish = {"type": "length", "length": len(tokens)}
    if len(tokens) > 2 and "stop_token_ids" in params:
        tokens, finish = tokens[:2] + [params["stop_token_ids"][0]], {"type": "stop", "matched": params["stop_token_ids"][0]}
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(tokens),
            "output_token_logprobs": [[-0.3, t, None] for t in tokens],
            "output_top_logprobs": [[[-0.3, t, None], [-0.9, t + 2, None]] for t in tokens]}
    return 200, {"text": "", "output_ids": tokens, "meta_info": meta}


def test_sglang_request_field_by_field():
    with FakeServer(sglang_answer) as server:
        engine = make_engine(f"sglang:{server.url}", None, None, batch_size=3, draft_tokens=4)
        assert isinstance(engine, SGLangEngine)
        outputs = engine.generate([[7, 8, 9], [1], [2]], 5, EOS)
        assert outputs[0] == continuation([7, 8, 9], 2) + [EOS]
        first = outputs[0][0]
        assert engine.last_logprobs[0][0] == {first: -0.3, first + 2: -0.9}
        assert engine.generate([[1]], 5, None) == [continuation([1], 5)]
        engine.generate([[1]], 5, [EOS, 157])
    assert server.requests[-1][1]["sampling_params"]["stop_token_ids"] == [EOS, 157]  # the whole EOS set
    path, body = server.requests[0]
    assert path == "/generate"
    assert body["input_ids"] in ([7, 8, 9], [1], [2])
    assert body["sampling_params"]["temperature"] == 0
    assert body["sampling_params"]["max_new_tokens"] == 5
    assert body["sampling_params"]["stop_token_ids"] == [EOS]
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert server.requests[-2][1]["sampling_params"]["ignore_eos"] is True


# --- the whole audit against a fake server that decodes with the reference ------------------------

def reference_llamacpp(pair, corrupt: bool):
    """A /completion answer from tiny-llama's greedy decoding; with `corrupt`, a bug on prompts of odd length."""
    from specaudit.engines.reference import greedy_decode

    def respond(path, body):
        eos = None if body["ignore_eos"] else pair.eos_token_id
        tokens, _ = greedy_decode(pair.target, body["prompt"], body["n_predict"], eos)
        if corrupt and len(body["prompt"]) % 2 and len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % 256
        return 200, {"tokens": tokens, "stop_type": "limit", "completion_probabilities": []}
    return respond


def run_cli(*argv: str) -> int:
    import contextlib
    import io

    from specaudit.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(list(argv))


def test_audit_of_a_server_end_to_end(tmp_path):
    import json

    from specaudit.engines.models import zoo

    pair = zoo.load_pair("tiny-llama")
    # no adversarial prompts: the fake server decodes in this process, and their 2100-token prompt took 31 of
    # this test's 36 s (the built-in engines get them in tests/test_adversarial.py, a real llama.cpp server in
    # tests/test_llamacpp_e2e.py)
    for corrupt, expected in ((False, 0), (True, 1)):
        with FakeServer(reference_llamacpp(pair, corrupt)) as server:
            out = tmp_path / f"out-{corrupt}"
            code = run_cli("audit", "--engine", f"llamacpp:{server.url}", "--pair", "tiny-llama", "--batch-size", "4",
                           "--num-prompts", "4", "--max-new-tokens", "8", "--no-progress", "--no-adversarial", "--out", str(out))
        report = json.loads((out / "audit.json").read_text())
        (run,) = report["runs"]
        assert code == expected, run.get("error")
        assert server.max_in_flight > 1  # the runner's batch size reached the server as concurrency
        assert run["engine_description"]["dialect"] == "llamacpp"
        if corrupt:
            assert run["structural_divergences"] > 0
            assert all(d["kind"] == "structural" and d["position"] == 2 for d in run["divergences"])
            assert all(Path(out, d["bundle"]).is_file() for d in run["divergences"])


def test_record_two_runs_and_diff_them(tmp_path):
    from specaudit.engines.models import zoo
    from specaudit.engines.adapters.recorded import read_recording

    pair = zoo.load_pair("tiny-llama")
    paths = {}
    for corrupt in (False, True):
        with FakeServer(reference_llamacpp(pair, corrupt)) as server:
            paths[corrupt] = tmp_path / f"run-{corrupt}.jsonl"
            assert run_cli("record", "--engine", f"llamacpp:{server.url}", "--pair", "tiny-llama", "--num-prompts", "4",
                           "--max-new-tokens", "8", "--batch-size", "2", "--out", str(paths[corrupt])) == 0
    lines = read_recording(paths[False])
    assert len(lines) == 4 and lines[0].metadata["max_new_tokens"] == 8 and lines[0].metadata["eos_token_id"] == 258
    assert run_cli("diff", str(paths[False]), str(paths[False])) == 0
    assert run_cli("diff", str(paths[False]), str(paths[True])) == 1
    # the plain run's recording audits clean; the settings it was made with are checked
    assert run_cli("audit", "--engine", f"recorded:{paths[False]}", "--pair", "tiny-llama", "--max-new-tokens", "8",
                   "--no-progress", "--out", str(tmp_path / "audit")) == 0
    url = f"http://127.0.0.1:{free_port_with_nothing_listening()}"
    assert run_cli("record", "--engine", f"llamacpp:{url}", "--pair", "tiny-llama", "--num-prompts", "1",
                   "--engine-option", "retries=0", "--out", str(tmp_path / "x.jsonl")) == 1


def test_record_with_a_model_folder_stops_at_every_eos_id_its_generation_config_declares(tmp_path):
    import json

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specaudit.engines.adapters.recorded import read_recording

    folder = tmp_path / "model"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>", eos_token="<unk>").save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 157]}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [4, 5]}) + "\n")
    out = tmp_path / "run.jsonl"
    with FakeServer(openai_answer(include_eos=True)) as server:
        assert run_cli("record", "--engine", f"vllm:{server.url}", "--tokenizer", str(folder), "--prompts",
                       str(prompts), "--max-new-tokens", "6", "--out", str(out)) == 0
    assert server.requests[0][1]["stop_token_ids"] == [EOS, 157]  # not only the tokenizer's own EOS
    (line,) = read_recording(out)
    assert line.metadata["eos_token_id"] == [EOS, 157] and line.output_ids == continuation([4, 5], 3) + [EOS]
