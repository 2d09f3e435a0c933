"""Live servers asked for sampled outputs, for the sampled audit (`specaudit audit --temperature T
--engine vllm:URL`, equivalence/sampling/).

A `SampledServer` wraps one dialect of engines/adapters/servers.py: each request is the dialect's own
greedy request (prompt as ids, no penalties, the EOS set as stop tokens) with the sampling fields
replaced by the audit's, and a seed of its own (`seeds`, one per request). Per dialect:

| field        | vLLM / TensorRT-LLM `/v1/completions` | SGLang `/generate` `sampling_params` | llama.cpp `/completion`          |
|--------------|---------------------------------------|--------------------------------------|----------------------------------|
| temperature  | `temperature`                         | `temperature`                        | `temperature`                    |
| top-k (off)  | `top_k` (-1; TensorRT-LLM 0)          | `top_k` (-1)                         | `top_k` (0)                      |
| top-p (off)  | `top_p` (1.0)                         | `top_p` (1.0)                        | `top_p` (1.0)                    |
| min-p        | `min_p` (0: off)                      | `min_p` (0: off)                     | `min_p` (0: off)                 |
| no other cut |                                       |                                      | `typical_p` 1, `top_n_sigma` -1, `xtc_probability` 0, `dynatemp_range` 0, `mirostat` 0 |
| order        | vLLM's: temperature, min-p, top-k, top-p | the same                          | `samplers` ["penalties", "top_k", "temperature", "min_p", "top_p"] (llama.cpp's default order puts temperature after top-p) |
| seed         | `seed`                                | `sampling_seed`                      | `seed`                           |

These are the cuts of engines/sampling/process.py (`SamplingParams`), so the target's distribution the
audit computes in float64 is the one the server was asked to sample from. With `request_params` (one
`RequestParams` per prompt of the next `generate`, set by the sampled audit) each request also carries that
prompt's penalties, logit bias, bad words and min_tokens in the dialect's names (the greedy requests' fields,
engines/adapters/request_fields.py), its sampling fields from the same record; `penalty_scope` is the
dialect's (llama.cpp counts presence and frequency over the whole context). The server computes in
float32 or bfloat16: its probabilities differ from the float64 ones by rounding (relative 1e-7 in
float32, 1e-3 in bfloat16 logits), orders of magnitude below the total variation a sample of
thousands can see (0.03 and more, reports/sampling/README.md).

`seed_requests=False` sends no seed (the server's own random stream: the unseeded path). No
log-probabilities are asked for. Around each `generate` the server's speculation counters are read
(engines/adapters/server_metrics.py) into `last_speculation`: a sampled audit that passes on a server
that never speculated says nothing about its speculative sampler.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from specaudit.engines.adapters._http import ServerError, join_url, map_concurrently, post_json
from specaudit.engines.adapters.server_base import ServerEngine, finish_output
from specaudit.engines.adapters.server_metrics import COUNTERS, safe_snapshot, speculation_between
from specaudit.engines.adapters.request_fields import PENALTY_SCOPE
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.sampled import sampling_of
from specaudit.engines.sampling.process import SamplingParams

SAMPLED_DIALECTS = ("vllm", "llamacpp", "sglang", "trtllm")
# llama.cpp's sampler chain, in vLLM's order (the penalties first; temperature before min-p and the nucleus:
# both are taken on the tempered distribution, as engines/sampling/process.py computes them; top-k commutes
# with the temperature). Its logit bias is applied before the chain.
LLAMACPP_SAMPLERS = ["penalties", "top_k", "temperature", "min_p", "top_p"]


def sampling_fields(dialect: str, params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """The request fields that ask `dialect` to sample with `params` (and `seed`, when not None)."""
    off_k = 0 if dialect in ("llamacpp", "trtllm") else -1
    fields: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                              "top_k": params.top_k if params.top_k > 0 else off_k, "min_p": params.min_p}
    if dialect == "llamacpp":
        fields.update(typical_p=1.0, top_n_sigma=-1.0, xtc_probability=0.0, dynatemp_range=0.0, mirostat=0,
                      samplers=list(LLAMACPP_SAMPLERS))
    if seed is not None:
        fields["sampling_seed" if dialect == "sglang" else "seed"] = int(seed)
    return fields


def sampled_request(server: ServerEngine, prompt: list[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None, params: SamplingParams, seed: int | None,
                    request: RequestParams | None = None) -> dict[str, Any]:
    """The dialect's request for `prompt` with its sampling fields replaced and no log-probabilities; with
    `request`, its request parameters in the dialect's names too (its sampling fields are `params`)."""
    # the request's own fields (penalties, logit bias, ...); its sampler's are `params`, set below
    own = None if request is None else replace(request, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None)
    body = (server.request(prompt, max_new_tokens, eos_token_id) if own is None or own.is_plain()
            else server.request(prompt, max_new_tokens, eos_token_id, own))
    fields = sampling_fields(server.dialect, params, seed)
    if server.dialect == "sglang":
        body["sampling_params"].update(fields)
        body["return_logprob"] = True  # SGLang's answer carries the ids in its log-probability entries
        body["top_logprobs_num"] = 0
    else:
        body.update(fields)
        body.pop("logprobs", None)  # vLLM, TensorRT-LLM
        if "n_probs" in body:  # llama.cpp
            body["n_probs"] = 0
    return body


class SampledServer:
    """`generate(prompts, max_new_tokens, eos_token_id, seeds=None)` on a live server, sampled with
    `params`; `seeds` (one per request) default to engines/sampling/engine.py's `request_seeds(seed, n)`."""

    black_box = True
    # one `RequestParams` per prompt of the next `generate` (module docstring); None: the sampler's fields alone
    request_params: list[RequestParams] | None = None

    def __init__(self, server: ServerEngine, params: SamplingParams, *, seed: int = 0,
                 seed_requests: bool = True) -> None:
        if server.dialect not in SAMPLED_DIALECTS:
            raise ValueError(f"no sampled requests for the {server.dialect!r} dialect")
        self.server = server
        self.params = params
        self.seed = int(seed)
        self.seed_requests = bool(seed_requests)
        self.name = f"{server.dialect}:{server.url}"
        self.penalty_scope = PENALTY_SCOPE.get(server.dialect, "output")
        self.last_speculation: dict[str, Any] | None = None
        self.metrics_note: str | None = None

    def describe(self) -> dict[str, Any]:
        return {**self.server.describe(), "sampling": self.params.describe(), "seeded_requests": self.seed_requests,
                "speculation": self.last_speculation, "metrics_note": self.metrics_note}

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                 seeds: list[int] | None = None) -> list[list[int]]:
        from specaudit.engines.sampling.engine import request_seeds

        if seeds is None:
            seeds = request_seeds(self.seed, len(prompts))
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        server = self.server
        before, _ = safe_snapshot(server.url, server.dialect, server.timeout)
        url = join_url(server.url, server.path)

        requests = self.request_params
        if requests is not None and len(requests) != len(prompts):
            raise ValueError(f"{len(requests)} request parameter sets for {len(prompts)} prompts")

        def one(item: tuple[list[int], int, RequestParams | None]) -> list[int]:
            prompt, seed, request = item
            body = sampled_request(server, [int(t) for t in prompt], max_new_tokens, eos_token_id,
                                   self.params if request is None else sampling_of(request),
                                   seed if self.seed_requests else None, request)
            answer = post_json(url, body, timeout=server.timeout, retries=server.retries,
                               what=f"{server.server_name} server")
            try:
                completion = server.parse(answer)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise ServerError(f"{server.server_name} server at {server.url}: unexpected answer shape "
                                  f"({type(exc).__name__}: {exc})") from None
            tokens, _, _ = finish_output(completion, max_new_tokens, eos_token_id)
            return tokens

        outputs = map_concurrently(one, list(zip(prompts, seeds, requests or [None] * len(prompts))),
                                   server.batch_size)
        after, failure = safe_snapshot(server.url, server.dialect, server.timeout)
        names = COUNTERS.get(server.dialect)
        self.last_speculation = speculation_between(before, after, server.url,
                                                    iterations=bool(names and names.json_iterations))
        self.metrics_note = failure or (after.note if after is not None else None)
        return outputs


def make_sampled_server(spec: str, params: SamplingParams, *, seed: int, batch_size: int = 8,
                        **options: Any) -> SampledServer:
    """`vllm:URL`, `llamacpp:URL`, `sglang:URL` or `trtllm:URL` as a `SampledServer`. Options:
    `seed_requests` (default true), and the server engine's own (`timeout`, `model`, ...)."""
    from specaudit.engines.adapters import servers

    prefix, _, url = spec.partition(":")
    dialects = {"vllm": servers.VLLMEngine, "llamacpp": servers.LlamaCppEngine, "sglang": servers.SGLangEngine,
                "trtllm": servers.TRTLLMEngine}
    if prefix not in SAMPLED_DIALECTS or not url:
        raise ValueError(f"{spec!r} is not a live server (vllm:URL, llamacpp:URL, sglang:URL, trtllm:URL)")
    seed_requests = options.pop("seed_requests", True)
    server = dialects[prefix](url, batch_size=batch_size, **options)
    return SampledServer(server, params, seed=seed, seed_requests=seed_requests)
