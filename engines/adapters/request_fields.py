"""Request parameters in each server's own names, and what each server says beside its tokens.

Sending (`*_fields(params, eos_token_id)` -> the JSON fields to add to the dialect's request body):

| RequestParams       | vLLM / TensorRT-LLM (`/v1/completions`) | SGLang (`/generate` sampling_params) | llama.cpp (`/completion`)       |
|---------------------|-----------------------------------------|--------------------------------------|---------------------------------|
| stop                | `stop`                                  | `stop`                               | `stop`                          |
| stop_token_ids      | `stop_token_ids` (with the EOS ids)     | `stop_token_ids` (with the EOS ids)  | none: refused by the client     |
| min_tokens          | `min_tokens`                            | `min_new_tokens`                     | none: refused by the client     |
| max_tokens          | `max_tokens`                            | `max_new_tokens`                     | `n_predict`                     |
| repetition_penalty  | `repetition_penalty`                    | `repetition_penalty`                 | `repeat_penalty`, `repeat_last_n` the whole context |
| presence_penalty    | `presence_penalty`                      | `presence_penalty`                   | `presence_penalty`              |
| frequency_penalty   | `frequency_penalty`                     | `frequency_penalty`                  | `frequency_penalty`             |
| logit_bias          | `logit_bias` {"id": bias}               | `logit_bias` {"id": bias}            | `logit_bias` [[id, bias], ...]  |
| bad_words           | vLLM `bad_words` (text; ids alone: refused by the client); TensorRT-LLM: refused | refused | refused |
| min_p, top_k        | `min_p`, `top_k`                        | `min_p`, `top_k`                     | `min_p`, `top_k`                |
| logprobs            | `logprobs`                              | `top_logprobs_num`                   | `n_probs`                       |
| seed                | `seed` (greedy: it must change nothing) | `sampling_seed`                      | `seed`                          |
| constraint          | `structured_outputs`; TensorRT-LLM `response_format` | `json_schema` / `regex` / `ebnf` | `grammar` (engines/constraints/fields.py) |

A parameter the dialect cannot express raises `ParameterRefused` before anything is sent; a server
that answers HTTP 400 naming a field it was sent is `ParameterRefused` too (engines/adapters/server_base.py):
both are reported as "refused parameter X", never as a divergence.

Reading (`read_*`): the server's `text`, its finish reason normalised to "stop" / "length" with the
stop reason (the stop string, the stop token id, or None for EOS), its usage counts and the log-
probability it reports for each returned token (`chosen_logprobs`, kept even when it names no
alternatives: a server that reports 0.0 for every token is caught by comparing them).
"""

from __future__ import annotations

import re
from typing import Any

from specaudit.engines.constraints import fields as constraint_fields
from specaudit.engines.requests import RequestParams


class ParameterRefused(ValueError):
    """A request parameter the server (or its dialect) does not take: reported, not a divergence."""

    def __init__(self, parameter: str, why: str) -> None:
        super().__init__(f"refused parameter {parameter}: {why}")
        self.parameter = parameter
        self.why = why


# which server field name carries which RequestParams field, per dialect (for reading an HTTP 400)
SERVER_NAMES: dict[str, dict[str, str]] = {
    "vllm": {"stop": "stop", "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens",
             "max_tokens": "max_tokens", "repetition_penalty": "repetition_penalty",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "logit_bias": "logit_bias", "bad_words": "bad_words", "min_p": "min_p", "top_k": "top_k",
             "logprobs": "logprobs", "seed": "seed"},
    "sglang": {"stop": "stop", "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens",
               "max_tokens": "max_new_tokens", "repetition_penalty": "repetition_penalty",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
               "logit_bias": "logit_bias", "min_p": "min_p", "top_k": "top_k", "logprobs": "top_logprobs_num",
               "seed": "sampling_seed"},
    "llamacpp": {"stop": "stop", "max_tokens": "n_predict", "repetition_penalty": "repeat_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "logit_bias": "logit_bias", "min_p": "min_p", "top_k": "top_k", "logprobs": "n_probs",
                 "seed": "seed"},
}
SERVER_NAMES["vllm"]["bad_words_text"] = "bad_words"  # the words as text: what an HTTP 400 about them names
SERVER_NAMES["trtllm"] = {k: v for k, v in SERVER_NAMES["vllm"].items() if k not in ("bad_words", "bad_words_text")}
for _dialect, _field in (("vllm", "structured_outputs"), ("sglang", "json_schema"), ("llamacpp", "grammar"),
                         ("trtllm", "response_format")):
    SERVER_NAMES[_dialect]["constraint"] = _field

# presence/frequency counted over the output (vLLM, SGLang, TensorRT-LLM) or the whole context (llama.cpp,
# whose window `repeat_last_n` is set to the request's whole context): engines/requests.py `process`'s penalty_scope
PENALTY_SCOPE = {"vllm": "output", "sglang": "output", "trtllm": "output", "llamacpp": "context"}
# the distribution each server's log-probabilities come from by default (vLLM `logprobs_mode` raw_logprobs,
# llama.cpp `post_sampling_probs` false, SGLang's output logprobs of the model's logits)
LOGPROB_DEFINITION = {"vllm": "raw", "sglang": "raw", "trtllm": "raw", "llamacpp": "raw"}


def refuse_unsupported(dialect: str, params: RequestParams) -> None:
    """`ParameterRefused` for the first parameter `dialect` cannot carry (see the module table)."""
    names = SERVER_NAMES[dialect]
    for field in params.sent():
        if field == "bad_words_text":
            continue
        if field == "constraint":
            assert params.constraint is not None
            why = constraint_fields.dialect_refusal(dialect, params.constraint)
            if why is not None:
                raise ParameterRefused("constraint", why)
            continue
        if field == "bad_words" and dialect == "vllm":
            if not params.bad_words_text:
                raise ParameterRefused("bad_words", "vLLM takes banned words as text only; give them as text "
                                                    "(the audit resolves text to the ids the reference bans)")
            continue
        if field not in names:
            raise ParameterRefused(field, f"the {dialect} dialect has no such request field")


def openai_fields(params: RequestParams, eos_ids: list[int], dialect: str = "vllm") -> dict[str, Any]:
    """vLLM / TensorRT-LLM `/v1/completions` fields for `params` (the EOS ids stay in `stop_token_ids`)."""
    refuse_unsupported(dialect, params)
    body: dict[str, Any] = {}
    if params.stop:
        body["stop"] = list(params.stop)
        body["include_stop_str_in_output"] = False
    if params.stop_token_ids:
        body["stop_token_ids"] = list(dict.fromkeys(list(eos_ids) + list(params.stop_token_ids)))
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        body[name] = getattr(params, name)
    if params.logit_bias:
        body["logit_bias"] = {str(i): b for i, b in params.logit_bias}
    if params.bad_words_text:
        body["bad_words"] = list(params.bad_words_text)
    if params.min_p:
        body["min_p"] = params.min_p
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
    if params.seed is not None:  # greedy: a seed must change nothing
        body["seed"] = params.seed
    if params.constraint is not None:
        body.update(constraint_fields.vllm_fields(params.constraint) if dialect == "vllm"
                    else constraint_fields.trtllm_fields(params.constraint))
    return body


def sglang_fields(params: RequestParams, eos_ids: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang: (fields for `sampling_params`, fields for the request's top level)."""
    refuse_unsupported("sglang", params)
    sampling: dict[str, Any] = {}
    top: dict[str, Any] = {}
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(dict.fromkeys(list(eos_ids) + list(params.stop_token_ids)))
    if params.min_tokens:
        sampling["min_new_tokens"] = params.min_tokens
    if params.max_tokens is not None:
        sampling["max_new_tokens"] = params.max_tokens
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        sampling[name] = getattr(params, name)
    if params.logit_bias:
        sampling["logit_bias"] = {str(i): b for i, b in params.logit_bias}
    if params.min_p:
        sampling["min_p"] = params.min_p
    if params.top_k > 0:
        sampling["top_k"] = params.top_k
    if params.logprobs is not None:
        top["top_logprobs_num"] = params.logprobs
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    if params.constraint is not None:
        sampling.update(constraint_fields.sglang_fields(params.constraint))
    return sampling, top


def llamacpp_fields(params: RequestParams, context: int | None = None) -> dict[str, Any]:
    """llama.cpp `/completion` fields; penalties over the whole context: `repeat_last_n` the request's `context`
    (its prompt and new tokens), or -1 (the slot's context) without one. Released builds since b11549 refuse -1
    (HTTP 400, "Value must be between 0 <= value"), so the audit's requests always give the count."""
    refuse_unsupported("llamacpp", params)
    body: dict[str, Any] = {}
    if params.stop:
        body["stop"] = list(params.stop)
    if params.max_tokens is not None:
        body["n_predict"] = params.max_tokens
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        body["repeat_last_n"] = -1 if context is None else max(1, int(context))
    body["repeat_penalty"] = params.repetition_penalty
    body["presence_penalty"] = params.presence_penalty
    body["frequency_penalty"] = params.frequency_penalty
    if params.logit_bias:
        body["logit_bias"] = [[i, b] for i, b in params.logit_bias]
    if params.min_p:
        body["min_p"] = params.min_p
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.logprobs is not None:
        body["n_probs"] = params.logprobs
    if params.seed is not None:
        body["seed"] = params.seed
    if params.constraint is not None:
        body.update(constraint_fields.llamacpp_fields(params.constraint))
    return body


def refused_in_answer(dialect: str, params: RequestParams, message: str) -> str | None:
    """The RequestParams field an HTTP 400 answer names (by the server's name for it), or None."""
    text = message.lower()
    names = SERVER_NAMES.get(dialect, {})
    sent = [f for f in params.sent() + (["logprobs"] if params.logprobs is not None else []) if names.get(f)]
    for field in sorted(sent, key=lambda f: -len(names[f])):  # "stop_token_ids" before "stop"
        if re.search(rf"(?<![a-z_]){re.escape(names[field].lower())}(?![a-z_])", text):
            return field
    return None


# --- reading -------------------------------------------------------------------------------------

def _usage(prompt: Any, completion: Any) -> dict[str, int] | None:
    if prompt is None and completion is None:
        return None
    usage = {}
    if prompt is not None:
        usage["prompt_tokens"] = int(prompt)
    if completion is not None:
        usage["completion_tokens"] = int(completion)
    return usage


def read_openai(choice: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """vLLM / TensorRT-LLM: text, normalised finish, usage and the chosen tokens' log-probabilities."""
    usage = answer.get("usage") or {}
    chosen = (choice.get("logprobs") or {}).get("token_logprobs")
    return {"text": choice.get("text"), "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason"),
            "usage": _usage(usage.get("prompt_tokens"), usage.get("completion_tokens")),
            "chosen_logprobs": [None if v is None else float(v) for v in chosen] if chosen else None}


def llamacpp_chosen_logprobs(probs: list[dict[str, Any]], tokens: list[int]) -> list[float | None] | None:
    """Each returned token's reported log-probability, None for a token without an entry; None when the
    entries cannot be placed. llama.cpp writes one entry per complete UTF-8 character, not per token: a
    token that ends inside a character (a byte that starts a multi-byte one) gets no entry, the entry
    of the token that completes it names that token and carries the bytes of both, and a character
    still incomplete at the end gets none. So each entry is placed on the next token with its `id`,
    past at most len(bytes) - 1 tokens without an entry (each of them holds at least one of its bytes)."""
    if not probs:
        return None
    chosen: list[float | None] = [None] * len(tokens)
    cursor = 0
    for entry in probs:
        token = int(entry.get("id", -1))
        covered = max(1, len(entry.get("bytes") or [token]))
        window = tokens[cursor:cursor + covered]
        if token not in window:
            return None
        position = cursor + window.index(token)
        chosen[position] = float(entry["logprob"]) if "logprob" in entry else None
        cursor = position + 1
    return chosen


def read_llamacpp(answer: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
    """llama.cpp: `content`, `stop_type` ("eos", "word" with `stopping_word`, "limit"), `tokens_evaluated`
    / `tokens_predicted`, and the chosen tokens' log-probabilities placed by `llamacpp_chosen_logprobs`."""
    stop_type = answer.get("stop_type")
    finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(stop_type, stop_type)
    stop_reason = answer.get("stopping_word") if stop_type == "word" else None
    chosen = llamacpp_chosen_logprobs(answer.get("completion_probabilities") or [], tokens)
    return {"text": answer.get("content"), "finish_reason": finish, "stop_reason": stop_reason,
            "usage": _usage(answer.get("tokens_evaluated"), answer.get("tokens_predicted")),
            "chosen_logprobs": chosen}


def read_sglang(answer: dict[str, Any]) -> dict[str, Any]:
    """SGLang: `text`, `meta_info.finish_reason` {type, matched}, prompt / completion token counts and
    the chosen tokens' log-probabilities from `output_token_logprobs`."""
    meta = answer.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    finish = reason.get("type") if isinstance(reason, dict) else reason
    matched = reason.get("matched") if isinstance(reason, dict) else None
    per_token = meta.get("output_token_logprobs") or []
    chosen = [None if e[0] is None else float(e[0]) for e in per_token] if per_token else None
    return {"text": answer.get("text"), "finish_reason": finish, "stop_reason": matched,
            "usage": _usage(meta.get("prompt_tokens"), meta.get("completion_tokens")),
            "chosen_logprobs": chosen}
