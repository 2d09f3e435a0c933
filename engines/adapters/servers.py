"""Live inference servers as engines: llama.cpp, vLLM, SGLang, TensorRT-LLM.

Named on the command line as `llamacpp:URL`, `vllm:URL`, `sglang:URL`, `trtllm:URL` (URL: the
server's base address, e.g. `http://127.0.0.1:8080`). Such an engine is a black box: it takes no
models; the audit compares its tokens with the reference decoder of the pair named by `--pair` or
`--target`, which must be the model the server serves (same weights, same vocabulary).

Every request sends the prompt as token ids, greedy (temperature 0, no penalties), at most
`max_new_tokens` new tokens, stopping at `eos_token_id` (sent as a stop token where the API takes
one; with `eos_token_id=None` the server is told to ignore EOS). Each dialect builds its request in
one function (`*_request`) and reads the answer in another (`*_parse`), so a test can check both
field by field. `generate` sends one request per prompt, `batch_size` of them in flight at once
(the server batches what it has in flight), and returns, per prompt, only the new tokens: cut at
the first EOS (kept) and at `max_new_tokens`.

Per-token log-probabilities, where the server gives real ones, are kept in `last_logprobs`: per
prompt, `None` or one dict per output token `{token id: log-probability}` holding the server's top
alternatives (the chosen token included). `last_details` keeps, per prompt, what the server said
about stopping and anything the client had to cut.
"""

from __future__ import annotations

from typing import Any, Sequence

from specaudit.engines.adapters import request_fields as fields
from specaudit.engines.adapters.server_base import (  # noqa: F401 (re-exported for users and tests)
    DEFAULT_TOP_LOGPROBS, Completion, ServerEngine, _top_dict, finish_output,
)
from specaudit.engines.limits import eos_ids
from specaudit.engines.requests import RequestParams


# --- llama.cpp: POST /completion -------------------------------------------------------------------

def llamacpp_request(prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                     top_logprobs: int = DEFAULT_TOP_LOGPROBS, params: RequestParams | None = None) -> dict[str, Any]:
    """llama.cpp `/completion`: ids as `prompt`, greedy, no penalties, no prompt cache reuse (reused
    KV from another request would make the output depend on what ran before). `params` adds the
    request parameters in llama.cpp's names (engines/adapters/request_fields.py)."""
    body = {
        "prompt": list(prompt),
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "return_tokens": True,
        "n_probs": top_logprobs,
        "cache_prompt": False,
        "stream": False,
        "ignore_eos": not eos_ids(eos_token_id),
    }
    if params is not None:
        body.update(fields.llamacpp_fields(params, context=len(prompt) + max_new_tokens))
    return body


def llamacpp_parse(answer: dict[str, Any]) -> Completion:
    """Ids from `tokens`. `completion_probabilities` has one entry per emitted text piece, not per
    token, and under speculation carries no real values (`logprob` 0.0, empty `top_logprobs`): they
    are kept only when there is one entry per token, naming that token, with real alternatives."""
    tokens = [int(t) for t in answer["tokens"]]
    finish = answer.get("stop_type")
    completion = Completion(tokens, finish=finish, stopped_at_eos=finish == "eos",
                            report=fields.read_llamacpp(answer, tokens))
    probs = answer.get("completion_probabilities") or []
    if not probs:
        return completion
    usable = len(probs) == len(tokens) and all(
        int(entry.get("id", -1)) == token and entry.get("top_logprobs") for entry, token in zip(probs, tokens))
    if usable:
        completion.logprobs = []
        for entry in probs:
            top = _top_dict([(alt["id"], alt["logprob"]) for alt in entry["top_logprobs"]])
            top.setdefault(int(entry["id"]), float(entry["logprob"]))
            completion.logprobs.append(top)
    else:
        completion.notes.append(f"log-probabilities not used: {len(probs)} entries for {len(tokens)} tokens, "
                                "or without alternatives (llama.cpp gives none under speculation)")
    return completion


class LlamaCppEngine(ServerEngine):
    """llama.cpp `llama-server` (`llamacpp:URL`), through its native `/completion` endpoint."""

    dialect = "llamacpp"
    server_name = "llama.cpp"
    path = "/completion"

    def request(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                params: RequestParams | None = None) -> dict[str, Any]:
        return llamacpp_request(prompt, max_new_tokens, eos_token_id, self.top_logprobs, params)

    def parse(self, answer: Any) -> Completion:
        return llamacpp_parse(answer)


# --- vLLM and TensorRT-LLM: POST /v1/completions (OpenAI-compatible) ---------------------------------

def _openai_stop_fields(eos_token_id: int | Sequence[int] | None) -> dict[str, Any]:
    ids = list(eos_ids(eos_token_id))  # every id of the set stops the request
    return {"stop_token_ids": ids} if ids else {"ignore_eos": True}


def vllm_request(prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                 top_logprobs: int = DEFAULT_TOP_LOGPROBS, model: str | None = None,
                 params: RequestParams | None = None) -> dict[str, Any]:
    """vLLM `/v1/completions`: the ids as `prompt`, greedy, output ids returned (`return_token_ids`)
    and log-probability entries named `token_id:ID` (`return_tokens_as_token_ids`)."""
    body: dict[str, Any] = {
        "prompt": list(prompt),
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "stream": False,
        "logprobs": top_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        **_openai_stop_fields(eos_token_id),
    }
    if model is not None:
        body["model"] = model
    if params is not None:
        body.update(fields.openai_fields(params, list(eos_ids(eos_token_id)), "vllm"))
    return body


def _id_of_token_string(token: str) -> int:
    # `return_tokens_as_token_ids` spells a token as "token_id:123"
    if not token.startswith("token_id:"):
        raise ValueError(f"log-probability entry {token!r} is not spelled token_id:ID")
    return int(token[len("token_id:"):])


def vllm_parse(answer: dict[str, Any]) -> Completion:
    """Ids from `choices[0].token_ids`; log-probabilities from `choices[0].logprobs` when every
    entry is named by id. Stopped on EOS: `finish_reason` "stop" with `stop_reason` None (the EOS
    token) or the stop token id."""
    choice = answer["choices"][0]
    tokens = [int(t) for t in choice["token_ids"]]
    finish = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    completion = Completion(tokens, finish=finish,
                            stopped_at_eos=finish == "stop" and (stop_reason is None or isinstance(stop_reason, int)),
                            stop_token=stop_reason if isinstance(stop_reason, int) else None,
                            report=fields.read_openai(choice, answer))
    logprobs = choice.get("logprobs") or {}
    tops, chosen = logprobs.get("top_logprobs") or [], logprobs.get("token_logprobs") or []
    if tops and len(tops) == len(tokens) and len(chosen) == len(tokens):
        try:
            completion.logprobs = []
            for token, own, top in zip(tokens, chosen, tops):
                entry = _top_dict([(_id_of_token_string(name), value) for name, value in (top or {}).items()])
                if own is not None:
                    entry.setdefault(token, float(own))
                completion.logprobs.append(entry)
        except ValueError as exc:
            completion.logprobs = None
            completion.notes.append(f"log-probabilities not used: {exc}")
    return completion


class VLLMEngine(ServerEngine):
    """vLLM's OpenAI-compatible server (`vllm:URL`), through `/v1/completions`."""

    dialect = "vllm"
    server_name = "vLLM"
    path = "/v1/completions"

    def __init__(self, url: str, *, structured_fields: str = "structured_outputs", **options: Any) -> None:
        super().__init__(url, **options)
        if structured_fields not in ("structured_outputs", "guided"):
            raise ValueError(f"structured_fields={structured_fields!r}: use structured_outputs (vLLM 0.10.2 on) or "
                             "guided (guided_json, guided_regex, ...: older vLLM)")
        self.structured_fields = structured_fields  # how a constraint is sent (engines/constraints/fields.py)

    def request(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                params: RequestParams | None = None) -> dict[str, Any]:
        body = vllm_request(prompt, max_new_tokens, eos_token_id, self.top_logprobs, self.model, params)
        if params is not None and params.constraint is not None and self.structured_fields == "guided":
            from specaudit.engines.constraints.fields import vllm_fields

            body.pop("structured_outputs", None)
            body.update(vllm_fields(params.constraint, style="guided"))
        return body

    def parse(self, answer: Any) -> Completion:
        return vllm_parse(answer)

    def logprobs_at(self, prefix: list[int], token: int, eos_token_id: int | Sequence[int] | None,
                    top: int = 20) -> dict[int, float] | None:
        """`prompt_logprobs`: the prefix and `token` sent as a prompt; the last prompt position's entry holds
        `token`'s log-probability at the prefix (exact, whatever its rank) and the top `top` beside it."""
        from specaudit.engines.adapters._http import ServerError

        try:
            return self.prompt_logprobs(list(prefix) + [int(token)], eos_token_id, top)[-1]
        except (ServerError, KeyError, IndexError, TypeError, ValueError):
            return None

    def prompt_logprobs(self, sequence: list[int], eos_token_id: int | Sequence[int] | None,
                        top: int = 20) -> list[dict[int, float] | None]:
        """Teacher forcing of a whole sequence: per position i, {token id: log-probability} of the token after
        `sequence[:i]` (the top `top` and `sequence[i]` itself; None at position 0), from `prompt_logprobs`."""
        from specaudit.engines.adapters._http import join_url, post_json

        body = vllm_request(list(sequence), 1, eos_token_id, 1, self.model)
        body["prompt_logprobs"] = top
        answer = post_json(join_url(self.url, self.path), body, timeout=self.timeout, retries=self.retries,
                           what=f"{self.server_name} server", observe=self._observe)
        entries = answer["choices"][0].get("prompt_logprobs") or []
        return [None if not entry else {int(k): float(v["logprob"]) for k, v in entry.items()} for entry in entries]


def trtllm_request(prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                   top_logprobs: int = DEFAULT_TOP_LOGPROBS, model: str | None = None,
                   params: RequestParams | None = None) -> dict[str, Any]:
    """TensorRT-LLM `trtllm-serve` `/v1/completions`. Its request model forbids unknown fields and
    requires `model`; it returns output ids only with `detokenize` false (then `text` is empty). Its
    top log-probabilities are keyed by decoded text, so only the chosen tokens' are asked for."""
    body = {
        "model": model or "model",
        "prompt": list(prompt),
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "stream": False,
        "detokenize": False,
        **({"logprobs": 1} if top_logprobs else {}),
        **_openai_stop_fields(eos_token_id),
    }
    if params is not None:
        extra = fields.openai_fields(params, list(eos_ids(eos_token_id)), "trtllm")
        extra.pop("logprobs", None)  # alternatives come keyed by text: only the chosen token's is read
        body.update(extra)
    return body


def trtllm_parse(answer: dict[str, Any]) -> Completion:
    """Ids from `choices[0].token_ids`. Top alternatives come keyed by text, not id, so no
    per-token alternatives are kept (a margin needs two named tokens)."""
    choice = answer["choices"][0]
    tokens = [int(t) for t in choice["token_ids"]]
    finish = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    report = fields.read_openai(choice, answer)
    report["text"] = None  # `detokenize` false: no text to check
    completion = Completion(tokens, finish=finish,
                            stopped_at_eos=finish == "stop" and (stop_reason is None or isinstance(stop_reason, int)),
                            stop_token=stop_reason if isinstance(stop_reason, int) else None,
                            report=report)
    if choice.get("logprobs"):
        completion.notes.append("log-probabilities not used: TensorRT-LLM names alternatives by text, not id")
    return completion


class TRTLLMEngine(ServerEngine):
    """TensorRT-LLM's `trtllm-serve` (`trtllm:URL`), through `/v1/completions`. Engine option
    `model=NAME` sets the served model's name (the request requires one)."""

    dialect = "trtllm"
    server_name = "TensorRT-LLM"
    path = "/v1/completions"

    def request(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                params: RequestParams | None = None) -> dict[str, Any]:
        return trtllm_request(prompt, max_new_tokens, eos_token_id, self.top_logprobs, self.model, params)

    def parse(self, answer: Any) -> Completion:
        return trtllm_parse(answer)


# --- SGLang: POST /generate ----------------------------------------------------------------------

def sglang_request(prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                   top_logprobs: int = DEFAULT_TOP_LOGPROBS, params: RequestParams | None = None) -> dict[str, Any]:
    """SGLang's native `/generate`: ids as `input_ids`, greedy sampling parameters, log-
    probabilities of the output only (`logprob_start_len` -1) with `top_logprobs_num` alternatives."""
    sampling: dict[str, Any] = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "skip_special_tokens": False,
    }
    if eos_ids(eos_token_id):
        sampling["stop_token_ids"] = list(eos_ids(eos_token_id))
    else:
        sampling["ignore_eos"] = True
    body: dict[str, Any] = {
        "input_ids": list(prompt),
        "sampling_params": sampling,
        "stream": False,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": top_logprobs,
    }
    if params is not None:
        extra_sampling, extra_top = fields.sglang_fields(params, list(eos_ids(eos_token_id)))
        sampling.update(extra_sampling)
        body.update(extra_top)
    return body


def sglang_parse(answer: Any) -> Completion:
    """Ids from `meta_info.output_token_logprobs` ([logprob, id, text] per token); alternatives from
    `meta_info.output_top_logprobs` (per token, a list of [logprob, id, text]). Stopped on EOS:
    `finish_reason.type` "stop" with `matched` an id."""
    if isinstance(answer, list):  # a batch answer: one request, one element
        answer = answer[0]
    meta = answer["meta_info"]
    per_token = meta["output_token_logprobs"]
    tokens = [int(entry[1]) for entry in per_token]
    finish_reason = meta.get("finish_reason") or {}
    finish = finish_reason.get("type") if isinstance(finish_reason, dict) else str(finish_reason)
    matched = finish_reason.get("matched") if isinstance(finish_reason, dict) else None
    completion = Completion(tokens, finish=finish,
                            stopped_at_eos=finish == "stop" and (matched is None or isinstance(matched, int)),
                            stop_token=matched if isinstance(matched, int) else None,
                            report=fields.read_sglang(answer))
    tops = meta.get("output_top_logprobs") or []
    if tops and len(tops) == len(tokens):
        completion.logprobs = []
        for (own, token, *_), top in zip(per_token, tops):
            entry = _top_dict([(alt[1], alt[0]) for alt in (top or []) if alt[0] is not None])
            if own is not None:
                entry.setdefault(int(token), float(own))
            completion.logprobs.append(entry)
    return completion


class SGLangEngine(ServerEngine):
    """SGLang's server (`sglang:URL`), through its native `/generate` endpoint."""

    dialect = "sglang"
    server_name = "SGLang"
    path = "/generate"

    def request(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                params: RequestParams | None = None) -> dict[str, Any]:
        return sglang_request(prompt, max_new_tokens, eos_token_id, self.top_logprobs, params)

    def parse(self, answer: Any) -> Completion:
        return sglang_parse(answer)
