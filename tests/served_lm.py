"""A toy language model served in vLLM's `/v1/completions` dialect by `fake_server.FakeServer`, for the
tests of the audit against a served reference (`--reference`).

`ToyLM` gives every prefix seeded logits over `VOCAB` tokens; every fifth prefix (by its hash) has a near
tie: its second token 0.01 below its first. `vllm_answer(lm, body, choose=...)` answers one request as vLLM
0.32.0 does with `return_token_ids`, `return_tokens_as_token_ids` and `prompt_logprobs`: greedy tokens
(or what `choose(prompt, position, logprobs)` picks: a planted bug), per-token top log-probabilities,
the prompt's log-probabilities, usage and finish reason; a request with a temperature is sampled with its
`seed`; a stop string ends the answer at the token that completes it (token texts: `text_of`), or
`tokens_after_stop` tokens later (the bug of a server that checks stop strings once per speculative burst). `noise` perturbs the logits by +-noise (even
ids up, odd ids down): a server of another precision, which flips only near ties.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

VOCAB = 300
EOS = 258
NEAR_TIE = 0.01

Choose = Callable[[list[int], int, list[float]], int]  # (prompt, new-token position, log-probs) -> token


class ToyLM:
    def __init__(self, noise: float = 0.0, eos_bias: float = -3.0) -> None:
        self.noise = noise
        self.eos_bias = eos_bias
        self._cache: dict[tuple[int, ...], list[float]] = {}

    def logits(self, prefix: list[int]) -> list[float]:
        key = tuple(prefix)
        if key not in self._cache:
            seed = hash(key) & 0xFFFFFFFF
            rng = random.Random(seed)
            values = [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]
            values[EOS] += self.eos_bias
            if seed % 5 == 0:  # a near tie: the runner-up just below the top
                order = sorted(range(VOCAB), key=lambda t: -values[t])
                values[order[1]] = values[order[0]] - NEAR_TIE
            self._cache[key] = values
        values = self._cache[key]
        if self.noise:
            values = [v + (self.noise if t % 2 == 0 else -self.noise) for t, v in enumerate(values)]
        return values

    def logprobs(self, prefix: list[int]) -> list[float]:
        values = self.logits(prefix)
        top = max(values)
        total = top + math.log(sum(math.exp(v - top) for v in values))
        return [v - total for v in values]


def text_of(token: int) -> str:
    """A token's text: one letter (stop strings are matched on the concatenation)."""
    return chr(ord("a") + token % 26)


def _top(lps: list[float], n: int) -> list[int]:
    return sorted(range(len(lps)), key=lambda t: -lps[t])[:n]


def vllm_answer(lm: ToyLM, body: dict[str, Any], choose: Choose | None = None,
                chosen_logprob: Callable[[float], float] | None = None, sampled_scale: float = 1.0,
                tokens_after_stop: int = 0) -> dict[str, Any]:
    prompt = [int(t) for t in body["prompt"]]
    n = int(body.get("logprobs") or 0)
    stops = set(body.get("stop_token_ids") or [])
    tokens: list[int] = []
    tops, chosen = [], []
    finish, stop_reason = "length", None
    stop_strings = list(body.get("stop") or [])
    past_stop = None  # tokens still to return after a stop string completes (0: stop there)
    temperature = float(body.get("temperature") or 0.0) * sampled_scale
    rng = random.Random(body.get("seed"))
    for position in range(int(body["max_tokens"])):
        lps = lm.logprobs(prompt + tokens)
        if temperature > 0:  # a sampled request: softmax(log p / T), drawn with the request's seed
            weights = [math.exp((v - max(lps)) / temperature) for v in lps]
            token = rng.choices(range(VOCAB), weights=weights)[0]
        else:
            token = max(range(VOCAB), key=lambda t: lps[t]) if choose is None else choose(prompt, position, lps)
        tokens.append(token)
        own = lps[token] if chosen_logprob is None else chosen_logprob(lps[token])
        chosen.append(own)
        entry = {f"token_id:{t}": lps[t] for t in _top(lps, n)}
        entry[f"token_id:{token}"] = own
        tops.append(entry)
        if token in stops:
            finish = "stop"
            break
        text = "".join(text_of(t) for t in tokens)
        if past_stop is None and any(text.endswith(stop) for stop in stop_strings):
            stop_reason = next(stop for stop in stop_strings if text.endswith(stop))
            past_stop = tokens_after_stop
        if past_stop is not None:
            if past_stop == 0:
                finish = "stop"
                break
            past_stop -= 1
    choice: dict[str, Any] = {
        "index": 0, "text": "", "token_ids": tokens, "finish_reason": finish, "stop_reason": stop_reason,
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": chosen, "top_logprobs": tops}
        if n else None}
    k = body.get("prompt_logprobs")
    if k is not None:
        entries: list[Any] = [None]
        for i in range(1, len(prompt)):
            lps = lm.logprobs(prompt[:i])
            entry = {str(t): {"logprob": lps[t], "rank": r + 1} for r, t in enumerate(_top(lps, int(k)))}
            entry[str(prompt[i])] = {"logprob": lps[prompt[i]], "rank": None}
            entries.append(entry)
        choice["prompt_logprobs"] = entries
    return {"id": "cmpl-toy", "object": "text_completion", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)}}


def server_answer(lm: ToyLM, choose: Choose | None = None, chosen_logprob: Callable[[float], float] | None = None,
                  sampled_scale: float = 1.0, tokens_after_stop: int = 0):
    """A `FakeServer` answer function: `/v1/completions` in vLLM's dialect, anything else 404. Sampled requests
    are drawn at `sampled_scale` times their temperature (1: a correct sampler)."""

    def answer(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        return 200, vllm_answer(lm, body, choose, chosen_logprob, sampled_scale, tokens_after_stop)

    return answer
