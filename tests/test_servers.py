"""Live-server clients against a local HTTP server answering each server's documented shapes.

The requests each client sends are checked field by field; so are stopping at EOS, the log-
probabilities kept, N requests in flight for batch size N, the per-request timeout, and the one-line
error when nothing listens. (llama.cpp is also run for real in its own end-to-end test; vLLM, SGLang
and TensorRT-LLM only here.)
"""

from __future__ import annotations

import time

import pytest
from fake_server import FakeServer, free_port_with_nothing_listening

from specaudit.engines.adapters._http import ServerError, ServerTimeout, ServerUnreachable
from specaudit.engines.adapters.servers import LlamaCppEngine
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
    with FakeServer(lambda path, body: (200, {"choices": []})) as server:
        with pytest.raises(ServerError):
            LlamaCppEngine(server.url).generate([[1]], 2, EOS)


def test_registry_dispatches_prefixes_before_module_factory():
    assert black_box_prefix("llamacpp:http://127.0.0.1:8080") == "llamacpp"
    assert black_box_prefix("recorded:/tmp/a.jsonl") == "recorded"
    assert black_box_prefix("mypkg.engine:make") is None
    assert black_box_prefix("eqspec") is None
