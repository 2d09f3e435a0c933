"""Audit target: Hugging Face assisted generation, `generate(assistant_model=...)`, greedy.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

This is the ecosystem's default speculative decoder (Leviathan et al.'s draft-then-verify, greedy
acceptance, as implemented by `transformers`). Every 5.x release refuses a batch here, so prompts
run one at a time and `batch_size` is ignored. The draft proposes a constant `draft_tokens` per
step: the draft's `generation_config` gets `num_assistant_tokens=draft_tokens`, the "constant"
schedule and no confidence threshold for the duration of the call.

`last_trace` has one step per target forward pass, recovered from the pass's logits (accepted
count = emitted - 1, exact unless the pass was cut at EOS or `max_new_tokens`); with
`record_logits`, `last_trace.logits[p]` holds the logits the model computed, in its own dtype (what
the audit compares), and `last_generate_logits[p]` the float32 casts of them that `generate` chose
each token from (a token flipped by that cast still shows in the token comparison).

`HFPromptLookup` (`hf-prompt-lookup`) is the same loop with transformers' prompt-lookup candidates
(`generate(prompt_lookup_num_tokens=draft_tokens)`, n-grams of up to `max_matching_ngram_size` 2 copied
from the context) instead of a draft model.

Request parameters (engines/requests/): the class declares `request_params`, so the audit sets one
`RequestParams` per prompt before `generate`. Each is sent as the `generate` option transformers defines
the same way as the reference (vLLM's definitions), and nothing else:

| RequestParams      | `generate` option                                                                        |
|--------------------|------------------------------------------------------------------------------------------|
| stop               | `stop_strings` with the target's own tokenizer (`StopStringCriteria`)                    |
| stop_token_ids     | added to the `eos_token_id` list (the row ends with that id)                             |
| min_tokens         | `min_new_tokens` (`MinNewTokensLengthLogitsProcessor` bans every EOS id, stop ids included) |
| max_tokens         | `max_new_tokens`                                                                         |
| repetition_penalty | `repetition_penalty` (`RepetitionPenaltyLogitsProcessor`: prompt and output, vLLM's rule) |
| logit_bias         | `sequence_bias` {(id,): bias} (applied before the penalty, as the reference does)        |
| bad_words          | `bad_words_ids`, one-token words only                                                    |
| min_p, top_k       | nothing: greedy decoding never applies them and neither changes a greedy choice          |
| logprobs           | nothing: `generate` reports no log-probabilities here                                    |

Refused (`last_refused`, `ParameterRefused` as a live server's refusal: reported, the prompt not judged):
`presence_penalty` and `frequency_penalty` (transformers has neither); `bad_words` of several tokens
(transformers matches a banned sequence's prefix against prompt and output, vLLM against the output
alone); `stop` without a transformers tokenizer of the target, together with `min_tokens` (vLLM holds
stop strings back until `min_tokens`, `min_new_tokens` does not), or when the prompt's text ends with
the start of a stop string (`StopStringCriteria` matches across the prompt, vLLM in the output alone);
and any parameter `generate` itself rejects with a ValueError that names it (with `assistant_model`,
every 5.x release up to 5.24 rejects `stop_strings`: the assistant's own `generate` gets no tokenizer,
transformers issue #48039).

With request parameters the audit rules on the tokens alone (no logits are compared), and `generate`
applies the processors to float32 casts of the logits: a float64 near-tie closer than float32 can
resolve would read as a token divergence (`--engine-dtype float32` declares that band).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.ops import layout
from specaudit.engines.adapters._hf import LogitsTap, as_float, cut_at_eos, hf_eos, patched_generation_config
from specaudit.engines.adapters._hf import resolve_pad_id
from specaudit.engines.adapters.request_fields import ParameterRefused
from specaudit.engines.limits import eos_ids
from specaudit.engines.requests import RequestParams
from specaudit.engines.trace import StepRecord, Trace


class HFAssisted:
    """`target.generate(assistant_model=draft)` one prompt at a time."""

    name = "hf-assisted"
    needs_draft = True
    # one RequestParams per prompt, set by the audit before `generate` (engines/registry.takes_request_params)
    request_params: list[RequestParams] | RequestParams | None = None

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        *,
        batch_size: int = 1,
        draft_tokens: int = 4,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        **_: object,
    ) -> None:
        if draft is None and self.needs_draft:
            raise ValueError(f"{self.name} needs a draft model")
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be at least 1")
        if "recurrent" in layout.attention_layer_kinds(target):
            raise layout.UnsupportedModel(
                f"{self.name}: {layout.architecture_name(target)} keeps recurrent state, and transformers' assisted "
                "generation refuses stateful models (audit eqspec, exspec or inplace on it instead)")
        self.target = target
        self.draft = draft
        self.batch_size = batch_size  # assisted generation refuses batches: prompts run one at a time
        self.k = draft_tokens
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None
        self.last_generate_logits: list[torch.Tensor | None] = []
        self.request_params = None
        self.last_refused: list[tuple[int, ParameterRefused]] = []  # (prompt index, refusal) of the last generate
        self.last_speculation: dict[str, Any] | None = None  # the counts of the last generate (`_speculation`)
        self.last_logprobs: list[None] = []  # `generate` reports none here
        self._tokenizer: Any = None

    def candidate_options(self) -> dict[str, Any]:
        """The `generate` options that choose the candidates: the draft model."""
        return {"assistant_model": self.draft}

    def params_for(self, index: int) -> RequestParams | None:
        """The request parameters of prompt `index` (None: a plain greedy request)."""
        params = self.request_params
        if isinstance(params, list):
            params = params[index] if index < len(params) else None
        return None if params is None or params.is_plain() else params

    def tokenizer(self) -> Any:
        """The target's transformers tokenizer, loaded from its folder (None when it has none)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = getattr(self.target, "name_or_path", "") or ""
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if path else False
            except (OSError, ValueError):
                self._tokenizer = False
        return self._tokenizer or None

    def request_options(self, prompt: list[int], params: RequestParams | None, max_new_tokens: int,
                        eos_token_id: int | list[int] | None) -> dict[str, Any]:
        """`generate` options for one request (module table); `ParameterRefused` for what transformers
        does not define the reference's way."""
        options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "min_new_tokens": 0, "eos_token_id": eos_token_id}
        if params is None:
            return options
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(params, name) != 0.0:
                raise ParameterRefused(name, "transformers' generate has no such penalty")
        stops = list(eos_ids(eos_token_id)) + [t for t in params.stop_token_ids if t not in eos_ids(eos_token_id)]
        options["eos_token_id"] = hf_eos(stops)
        if params.max_tokens is not None:
            options["max_new_tokens"] = params.max_tokens
        options["min_new_tokens"] = params.min_tokens
        if params.repetition_penalty != 1.0:
            options["repetition_penalty"] = params.repetition_penalty
        if params.logit_bias:
            options["sequence_bias"] = {(token,): bias for token, bias in params.logit_bias}
        if params.bad_words:
            if any(len(word) > 1 for word in params.bad_words):
                raise ParameterRefused("bad_words", "transformers matches a banned sequence's prefix against the "
                                                    "prompt and the output, the reference (vLLM) against the output alone")
            options["bad_words_ids"] = [list(word) for word in params.bad_words]
        if params.stop:
            options.update(self._stop_options(prompt, params))
        return options

    def _stop_options(self, prompt: list[int], params: RequestParams) -> dict[str, Any]:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise ParameterRefused("stop", "transformers' stop_strings need a transformers tokenizer of the target, "
                                           "and the target's folder has none")
        if params.min_tokens > 0:
            raise ParameterRefused("stop", "min_new_tokens does not hold stop strings back as vLLM's min_tokens does")
        text = tokenizer.decode(list(prompt), skip_special_tokens=False)
        for stop in params.stop:
            if any(text.endswith(stop[:cut]) for cut in range(1, len(stop))):
                raise ParameterRefused("stop", f"the prompt's text ends with the start of {stop!r}: transformers' "
                                               "StopStringCriteria matches across the prompt, the reference in the output alone")
        return {"stop_strings": list(params.stop), "tokenizer": tokenizer}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        eos_token_id = hf_eos(eos_token_id)  # a set of ids as the list transformers stops at
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        trace = Trace(num_prompts=len(prompts), draft_tokens=self.k)
        outputs: list[list[int]] = [[] for _ in prompts]
        self.last_generate_logits = [None] * len(prompts)
        self.last_refused, self.last_logprobs, self.last_speculation = [], [None] * len(prompts), None
        if max_new_tokens <= 0:
            self.last_trace = trace
            return outputs
        draft_options = dict(
            num_assistant_tokens=self.k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
        )
        with patched_generation_config(self.draft, **draft_options) if self.draft is not None else _nothing(), \
                patched_generation_config(self.target, eos_token_id=eos_token_id, pad_token_id=self.pad_id):
            for index, prompt in enumerate(prompts):
                try:
                    options = self.request_options(prompt, self.params_for(index), max_new_tokens, eos_token_id)
                    outputs[index] = self._run_prompt(index, prompt, options, trace)
                except ParameterRefused as exc:  # reported as such, never a divergence
                    self.last_refused.append((index, exc))
                except ValueError as exc:
                    refused = _rejected_parameter(str(exc), self.params_for(index))
                    if refused is None:
                        raise
                    self.last_refused.append((index, ParameterRefused(refused, f"transformers' generate raised: {exc}")))
        self.last_trace = trace
        self.last_speculation = _speculation(trace)
        return outputs

    def _run_prompt(self, index: int, prompt: list[int], options: dict[str, Any], trace: Trace) -> list[int]:
        device = self.target.device
        input_ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, n]
        tap = LogitsTap(self.target)
        with tap:
            out = self.target.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                pad_token_id=self.pad_id,
                **self.candidate_options(),
                **options,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, len(prompt):].tolist()
        kept = cut_at_eos(new, options["eos_token_id"], options["max_new_tokens"])
        chosen = torch.cat(out.logits, dim=0)[:kept]  # [n, V] float32, one row per emitted token
        computed, per_pass, drafted = _align_passes(tap.calls, chosen, len(prompt), self.k)
        for count, proposed in zip(per_pass, drafted):
            trace.record(StepRecord(
                step=len(trace.steps), kind="assisted", rows=[index], pad_lengths=[0],
                accepted_counts=[max(count - 1, 0)], emitted_counts=[count], drafted_counts=[proposed],
            ))
        if self.record_logits:
            trace.logits[index] = computed
            self.last_generate_logits[index] = as_float(chosen)
        return new[:kept]


class HFPromptLookup(HFAssisted):
    """`target.generate(prompt_lookup_num_tokens=draft_tokens)` one prompt at a time: candidates copied from
    the context where its last n-gram occurred before (no draft model)."""

    name = "hf-prompt-lookup"
    needs_draft = False

    def candidate_options(self) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": self.k}


def _speculation(trace: Trace) -> dict[str, Any]:
    """The run's speculation counts from its trace, in the audit's record (equivalence/speculation.py): the
    candidates each verification pass scored and the ones it accepted."""
    drafted = sum(step.drafted(trace.draft_tokens) for step in trace.steps)
    accepted = sum(sum(step.accepted_counts) for step in trace.steps)
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "preemptions": None,
            "source": f"the engine's trace: the candidates each of its {len(trace.steps)} verification passes scored"}


# what `generate` names in the ValueError it raises for a parameter it rejects -> the RequestParams field
REJECTED = {"stop_strings": "stop", "stop strings": "stop", "sequence_bias": "logit_bias",
            "bad_words_ids": "bad_words", "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_tokens"}


def _rejected_parameter(message: str, params: RequestParams | None) -> str | None:
    """The field of `params` a `generate` ValueError names, when it was sent (None otherwise: a real error)."""
    if params is None:
        return None
    sent = set(params.sent())
    for phrase, field in REJECTED.items():
        if phrase in message and field in sent:
            return field
    return None


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _align_passes(calls: list[torch.Tensor], chosen: torch.Tensor, prompt_length: int,
                  k: int) -> tuple[torch.Tensor | None, list[int], list[int]]:
    """Match the target's forward passes to the emitted tokens.

    Each verification pass returns logits for [last token, candidates] (`logits_to_keep`); the
    tokens it emits are a run of those rows (accepted candidates, then the bonus token), and
    each emitted row, cast to float32, is exactly the row `generate` returned. Returns the emitted
    rows in the model's dtype [n, V] (None if the passes cannot be matched), the number of tokens each
    pass emitted and the number of candidates it scored (its rows less one; the first pass's rows cover
    the prompt too where `logits_to_keep` is unsupported).
    """
    rows: list[torch.Tensor] = []
    per_pass: list[int] = []
    drafted: list[int] = []
    t = 0
    for number, logits in enumerate(calls):  # [1, q, V]; q covers the prompt too where `logits_to_keep` is unsupported
        count = 0
        for row in logits[0]:
            if t < chosen.shape[0] and torch.equal(row.to(torch.float32), chosen[t]):
                rows.append(row)
                t += 1
                count += 1
            elif count:
                break  # the rows after the bonus token follow a rejected candidate
        if count:
            per_pass.append(count)
            scored = logits.shape[1]
            drafted.append(scored - prompt_length if number == 0 and scored - 1 > k else scored - 1)
    if t != chosen.shape[0]:
        return None, [], []
    return as_float(torch.stack(rows)) if rows else None, per_pass, drafted
