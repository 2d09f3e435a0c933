"""A fake vLLM `/v1/completions` that samples, for tests/fake_server.py's `FakeServer`: each request is
decoded by the project's speculative sampler (engines/sampling/engine.py `SampledSpeculative`, k = 2) with
the request's `temperature`, `top_k`, `top_p` and `seed`, on a tiny pair; optionally with a bug planted:

- "temperature_ignored": the request's temperature dropped (sampled at 1.0), top-k and top-p kept;
- "seed_ignored": each request drawn from a fresh stream whatever its seed (the same seed, other tokens);
- "unseeded_shared": every unseeded request drawn from one fixed stream (consecutive ones sample alike,
  TensorRT-LLM #19487);
- a fault of `specaudit.testing.faults.sampling` by name (e.g. "bonus_from_draft": the bonus token drawn
  from the draft's q instead of the target's p).

The answer holds `token_ids` (the EOS included when sampled: vLLM returns it), `finish_reason` and `usage`.
"""

from __future__ import annotations

import itertools
from typing import Any

from specaudit.engines.sampling.engine import SampledSpeculative

BUGS = ("temperature_ignored", "seed_ignored", "unseeded_shared")
DRAFT_TOKENS = 2


def sampled_vllm_answer(target: Any, draft: Any, bug: str | None = None):
    """`answer(path, body)` for `FakeServer`."""
    from specaudit.testing.faults.sampling import make_fault_engine

    fresh = itertools.count(10**9)  # the streams of "seed_ignored"

    def answer(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert path == "/v1/completions"
        top_k = int(body.get("top_k", -1))
        options = dict(temperature=1.0 if bug == "temperature_ignored" else float(body["temperature"]),
                       top_k=max(top_k, 0), top_p=float(body.get("top_p", 1.0)), draft_tokens=DRAFT_TOKENS)
        assert float(body.get("min_p", 0.0)) == 0.0, body
        engine = (make_fault_engine(target, draft, fault=bug, **options) if bug and bug not in BUGS
                  else SampledSpeculative(target, draft, **options))
        seed = next(fresh) if bug == "seed_ignored" or body.get("seed") is None else int(body["seed"])
        if bug == "unseeded_shared" and body.get("seed") is None:
            seed = 12345
        stops = [int(t) for t in body.get("stop_token_ids") or []]
        (tokens,) = engine.generate([[int(t) for t in body["prompt"]]], int(body["max_tokens"]), stops or None,
                                    seeds=[seed])
        stopped = bool(tokens) and tokens[-1] in stops
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": tokens,
                                  "finish_reason": "stop" if stopped else "length", "stop_reason": None}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens)}}

    return answer
