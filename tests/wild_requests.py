"""Requests with request parameters for the table model (tests/wild_models.py), sent to a server
with speculation and to the same server without it, and the differences between the two answers.

Under greedy decoding every parameter here is deterministic, so a speculative server must answer
each request exactly as the plain one does: the same tokens, text, finish reason, usage, and the
same log-probabilities (float32, up to 1e-3). `differences(plain, speculative)` lists every field
where they part; `past_stop(choice)` checks one answer on its own (tokens kept after the stop string
that the text was cut at).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
CYCLE_PROMPT = list((ALPHABET + "abcdefghij").encode())  # continues "klmnop...": n-gram drafts match the prompt
DIGITS_PROMPT = list(b"0123456789 0123456")  # continues "789" then EOS
_COUNTING = list(b"klmnopqrstuv0123456")
EOS_IN_DRAFT_PROMPT = _COUNTING + list(b"789") + [258] + list(b"xyz " + b"abcdefghijklmnopqrstuvwxyz " * 2) + _COUNTING
LOGPROB_TOLERANCE = 1e-3


def ids(text: str) -> list[int]:
    return list(text.encode())


def vllm_requests(max_tokens: int = 40) -> dict[str, dict[str, Any]]:
    """{name: body of a /v1/completions request}, every one greedy, asking for token ids and
    log-probabilities."""
    def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                "return_token_ids": True, **extra}

    return {
        "plain": body(CYCLE_PROMPT),
        "stop-2": body(CYCLE_PROMPT, stop=["mn"]),
        "stop-3": body(CYCLE_PROMPT, stop=["qrs"]),
        "stop-space": body(CYCLE_PROMPT, stop=["z a"]),
        "stop-include": body(CYCLE_PROMPT, stop=["mn"], include_stop_str_in_output=True),
        # two stop strings completed in one burst (`lmnop`), the later one first in the list (vllm #49391)
        "stop-order": body(CYCLE_PROMPT, stop=["op", "mn"]),
        "stop-token": body(CYCLE_PROMPT, stop_token_ids=[ord("q")]),
        "bias-ban": body(CYCLE_PROMPT, logit_bias={str(ord("m")): -100}),
        "bias-boost": body(CYCLE_PROMPT, logit_bias={str(ord("M")): 5}),
        "repetition": body(CYCLE_PROMPT, repetition_penalty=1.3),
        "presence": body(CYCLE_PROMPT, presence_penalty=2.0, max_tokens=64),
        "frequency": body(CYCLE_PROMPT, frequency_penalty=1.0, max_tokens=64),
        "bad-words": body(CYCLE_PROMPT, bad_words=["mn"]),
        "allowed": body(CYCLE_PROMPT, allowed_token_ids=[ord(c) for c in ALPHABET if c != "p"] + [ord("P")]),
        "min-p": body(CYCLE_PROMPT, min_p=0.5),
        "top-k": body(CYCLE_PROMPT, top_k=1),
        "logprobs-5": body(CYCLE_PROMPT, logprobs=5),
        "prompt-logprobs": body(CYCLE_PROMPT, prompt_logprobs=1, max_tokens=8),
        "max-tokens-5": body(CYCLE_PROMPT, max_tokens=5),
        "eos": body(DIGITS_PROMPT),
        "min-tokens": body(DIGITS_PROMPT, min_tokens=6),
        "ignore-eos": body(DIGITS_PROMPT, ignore_eos=True, max_tokens=12),
        "min-tokens-stop": body(CYCLE_PROMPT, min_tokens=6, stop=["kl", "op"]),
        # EOS / a stop token id right after 4 drafts that n-gram and the draft model both propose
        "min-tokens-bonus": body(ids("0123456789 01234"), min_tokens=5),
        "stop-token-bonus": body(ids("0123456789 0123"), min_tokens=3, stop_token_ids=[ord("9")]),
    }


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST JSON; an HTTP error comes back as {"http_error": status, "body": text}."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return {"http_error": error.code, "body": error.read().decode(errors="replace")[:500]}


def post_stream(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST a streaming completion request and join its server-sent events into the shape of a
    non-streamed vLLM answer: the text, token ids and log-probabilities concatenated, the last
    finish and stop reasons, and the usage of the final chunk (`stream_options.include_usage`)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    joined: dict[str, Any] = {"text": "", "token_ids": [], "finish_reason": None, "stop_reason": None,
                              "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": []}}
    usage = None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:  # a refusal after the stream started: an error event, status 200
                    error = chunk["error"]
                    return {"http_error": error.get("code", 200) if isinstance(error, dict) else 200,
                            "body": json.dumps(chunk)[:500]}
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    joined["text"] += choice.get("text", "")
                    joined["token_ids"] += choice.get("token_ids") or []
                    for key in ("finish_reason", "stop_reason"):
                        if choice.get(key) is not None:
                            joined[key] = choice[key]
                    for key, values in (choice.get("logprobs") or {}).items():
                        if key in joined["logprobs"]:
                            joined["logprobs"][key] += values or []
    except urllib.error.HTTPError as error:
        return {"http_error": error.code, "body": error.read().decode(errors="replace")[:500]}
    return {"choices": [joined], "usage": usage or {"completion_tokens": None}}


def vllm_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The parts of a vLLM completion answer that a speculative server must reproduce."""
    if "http_error" in answer:
        return {"http_error": answer["http_error"], "body": answer["body"]}
    choice = answer["choices"][0]
    logprobs = choice.get("logprobs") or {}
    return {
        "token_ids": choice.get("token_ids"),
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "stop_reason": choice.get("stop_reason"),
        "completion_tokens": answer["usage"]["completion_tokens"],
        "tokens": logprobs.get("tokens"),
        "token_logprobs": logprobs.get("token_logprobs"),
        "top_logprobs": logprobs.get("top_logprobs"),
        "prompt_logprobs": answer.get("prompt_logprobs") or choice.get("prompt_logprobs"),
    }


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOLERANCE
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def differences(plain: dict[str, Any], speculative: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (plain's value, the speculative server's value)} for every field that differs."""
    return {key: (plain.get(key), speculative.get(key)) for key in sorted(set(plain) | set(speculative))
            if not _close(plain.get(key), speculative.get(key))}


def past_stop(choice: dict[str, Any]) -> list[int]:
    """The token ids a stop-string answer reports after the token whose text completes its stop
    string (empty when the answer is consistent): the text is the decoded token ids cut at the stop,
    so every token id beyond len(text) + len(stop) bytes (a byte tokenizer) is surplus."""
    if choice.get("finish_reason") != "stop" or not isinstance(choice.get("stop_reason"), str):
        return []
    kept_bytes = len(choice["text"].encode()) + len(choice["stop_reason"].encode())
    return list(choice["token_ids"][kept_bytes:])


def llamacpp_requests(max_tokens: int = 40) -> dict[str, dict[str, Any]]:
    """{name: body of a llama.cpp /completion request}, every one greedy (temperature 0), asking
    for the generated token ids and the top-2 probabilities of each."""
    def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "n_probs": 2, "return_tokens": True,
                "cache_prompt": False, **extra}

    return {
        "plain": body(CYCLE_PROMPT),
        "stop-2": body(CYCLE_PROMPT, stop=["mn"]),
        "stop-3": body(CYCLE_PROMPT, stop=["qrs"]),
        "stop-space": body(CYCLE_PROMPT, stop=["z a"]),
        "bias-ban": body(CYCLE_PROMPT, logit_bias=[[ord("m"), -100]]),
        "bias-boost": body(CYCLE_PROMPT, logit_bias=[[ord("M"), 5]]),
        "bias-false": body(CYCLE_PROMPT, logit_bias=[[ord("m"), False]]),
        "repetition": body(CYCLE_PROMPT, repeat_penalty=1.3, repeat_last_n=64),
        "presence": body(CYCLE_PROMPT, presence_penalty=2.0, repeat_last_n=64, n_predict=64),
        "frequency": body(CYCLE_PROMPT, frequency_penalty=1.0, repeat_last_n=64, n_predict=64),
        "min-p": body(CYCLE_PROMPT, min_p=0.5),
        "top-k": body(CYCLE_PROMPT, top_k=1),
        "max-tokens-5": body(CYCLE_PROMPT, n_predict=5),
        "eos": body(DIGITS_PROMPT),
        "ignore-eos": body(DIGITS_PROMPT, ignore_eos=True, n_predict=12),
        "n-probs-0": body(CYCLE_PROMPT, n_probs=0),
        # the prompt holds "789 EOS xyz ab..." after the same 19 tokens it ends with, so that n-gram
        # drafts run past the EOS the target ends with (llama.cpp #28049: drafts accepted after EOS
        # kept in the slot's state and statistics; `tokens_cached` shows the slot's length)
        "eos-in-draft": body(EOS_IN_DRAFT_PROMPT),
    }


def llamacpp_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The parts of a llama.cpp /completion answer that a speculative server must reproduce."""
    if "http_error" in answer:
        return {"http_error": answer["http_error"], "body": answer["body"]}
    probabilities = answer.get("completion_probabilities") or []
    return {
        "token_ids": answer.get("tokens"),
        "text": answer["content"],
        "stop_type": answer.get("stop_type"),
        "stopping_word": answer.get("stopping_word"),
        "tokens_predicted": answer.get("tokens_predicted"),
        "tokens_cached": answer.get("tokens_cached"),
        "predicted_n": (answer.get("timings") or {}).get("predicted_n"),
        "probability_ids": [entry["id"] for entry in probabilities],
        # `post_sampling_probs` answers with probabilities ("prob", "top_probs") instead
        "logprobs": [entry.get("logprob", entry.get("prob")) for entry in probabilities],
        "top_logprobs": [[(top["id"], top.get("logprob", top.get("prob")))
                          for top in entry.get("top_logprobs", entry.get("top_probs", []))]
                         for entry in probabilities],
    }
