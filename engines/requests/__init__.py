"""Request parameters under greedy decoding, and their exact logits processors.

`RequestParams` is what one request asks beside its prompt: stop strings and stop token ids, a
minimum and a maximum length, repetition / presence / frequency penalties, a logit bias, banned
token sequences, `min_p` and `top_k`, and how many top log-probabilities to report. Under greedy
decoding every one of them is deterministic, so the reference computes the tokens a correct server
must return (engines/requests/reference.py).

Each processor is a pure function over one row of float64 logits `[V]`, returning a new row. The
definitions are vLLM's (vllm/v1/sample/sampler.py and its ops), applied in vLLM's order by
`process`:

1. `apply_bad_words`: a banned sequence whose prefix equals the tail of the OUTPUT bans its last token;
2. `apply_min_tokens`: the stop token ids (EOS and `stop_token_ids`) banned while fewer than
   `min_tokens` tokens were generated;
3. `apply_logit_bias`: `logit[id] += bias`;
4. `apply_repetition_penalty`: every token seen in the prompt or the output: a positive logit divided
   by the penalty, a negative one multiplied by it;
5. `apply_frequency_presence`: `logit[t] -= frequency * count(t) + presence * (count(t) > 0)`, counts
   over the OUTPUT only (vLLM) or over prompt and output (llama.cpp, whose penalty window we set to the
   whole context: `repeat_last_n` the request's prompt and new tokens);

then greedy takes the argmax. `min_p` and `top_k` (`apply_min_p`, `apply_top_k`) only ever remove
tokens below the top one, so they never change a greedy choice; they change the distribution a
server reports when it reports log-probabilities after its sampling chain (llama.cpp's
`post_sampling_probs`). Which distribution a server reports is `LogprobDefinition`: vLLM's default
(`logprobs_mode` raw_logprobs) and llama.cpp's default (`post_sampling_probs` false) report the raw
model's log-softmax, before any processor.

Structured outputs (`constraint`, engines/constraints/): the grammar's mask comes first, before every
processor above (vLLM applies its grammar bitmask to the logits before its sampler): `process` takes the
tokens the grammar admits at this position (`allowed` [V]) and sets every other logit to `-inf`. The
grammar state that decides `allowed` is the caller's (engines/constraints/matcher.py).

Sampling (`temperature`, `top_p`, `seed`, with `top_k`): a request with temperature > 0 is sampled on the
built-in engines (engines/sampling/step.py): its tokens are drawn from the processed row (the processors
above, then temperature, top-k and top-p: `engines/sampling/process.py`) with its own seeded stream.
Temperature 0 (the default) is greedy decoding. A sampled request's `min_p` and `top_k` are its sampler's
cuts, after the temperature as vLLM applies them (`engines/sampling/process.py`), not the `post_sampling`
row's; `engines/requests/sampled.py` gives the whole chain of one sampled request.

llama.cpp names: `repeat_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `n_probs`,
`stop`, `n_predict`; it has no `min_tokens` or `bad_words` (see engines/adapters/servers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import torch

from specaudit.engines.constraints import Constraint

PENALTY_SCOPES = ("output", "context")  # presence/frequency counted over the output (vLLM) or prompt + output (llama.cpp)
LOGPROB_DEFINITIONS = ("raw", "processed", "post_sampling")


@dataclass(frozen=True)
class RequestParams:
    """One request's parameters (defaults: a plain greedy request). `logit_bias` is kept as sorted
    `(id, bias)` pairs (a dict given to the constructor is converted); `bad_words` as token id
    sequences, `bad_words_text` the same words as text for servers that take text (vLLM)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    max_tokens: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    bad_words_text: tuple[str, ...] = ()
    min_p: float = 0.0
    top_k: int = 0  # 0 (or -1): off
    logprobs: int | None = None  # how many top log-probabilities to ask for (None: the client's default)
    # sampling (engines/sampling/): temperature 0 is greedy decoding; top_p 1 is off; a seed makes a
    # sampled request reproducible (None: a fresh seed per call)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # structured outputs (engines/constraints/): what the output text must be (None: unconstrained)
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        set_(self, "stop", tuple(str(s) for s in self.stop))
        set_(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        set_(self, "logit_bias", tuple(sorted((int(i), float(b)) for i, b in bias)))
        set_(self, "bad_words", tuple(tuple(int(t) for t in word) for word in self.bad_words))
        set_(self, "bad_words_text", tuple(str(w) for w in self.bad_words_text))
        if isinstance(self.constraint, Mapping):
            set_(self, "constraint", Constraint.from_dict(self.constraint))
        if any(s == "" for s in self.stop):
            raise ValueError("stop: an empty stop string would stop before any text")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if any(len(word) == 0 for word in self.bad_words):
            raise ValueError("bad_words: an empty token sequence bans nothing")
        if any(abs(b) > 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias: each bias must lie in [-100, 100] (OpenAI's range; vLLM clamps to it)")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be at least 0, got {self.logprobs}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be at least 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1: off), got {self.top_p}")
        if self.constraint is not None and self.min_tokens > 0:
            # a sentence complete before min_tokens admits only the stop ids, which min_tokens bans: no token left
            raise ValueError("min_tokens with a constraint is not supported: a complete sentence before min_tokens "
                             "would leave no token to choose")

    @property
    def sampled(self) -> bool:
        """Whether the request samples (temperature > 0); else it is decoded greedily."""
        return self.temperature > 0

    def sent(self) -> list[str]:
        """The names of the fields that differ from a plain greedy request (what a server must honour)."""
        plain = RequestParams()
        return [f.name for f in fields(self) if f.name != "logprobs" and getattr(self, f.name) != getattr(plain, f.name)]

    def is_plain(self) -> bool:
        return not self.sent()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, only the fields that are set (the inverse of `from_dict`)."""
        out: dict[str, Any] = {}
        for name in self.sent() + (["logprobs"] if self.logprobs is not None else []):
            value = getattr(self, name)
            if name == "logit_bias":
                value = {str(i): b for i, b in value}
            elif name == "constraint":
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestParams":
        """From a JSON object (a prompts file's `params`); an unknown field raises ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown request parameter(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
        values = dict(data)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        if "logit_bias" in values:
            bias = values["logit_bias"]
            values["logit_bias"] = bias.items() if isinstance(bias, Mapping) else [tuple(p) for p in bias]
        return cls(**values)

    def merged(self, other: "RequestParams") -> "RequestParams":
        """These parameters with every field `other` sets (non-default) taken from `other`."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in other.sent() + (["logprobs"] if other.logprobs is not None else []):
            values[name] = getattr(other, name)
        return RequestParams(**values)



# --- the processors: one row of logits [V] in, a new row out ------------------------------------------

def apply_bad_words(logits: torch.Tensor, bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> torch.Tensor:
    """vLLM `apply_bad_words`: for each banned sequence `w`, when its first len(w)-1 tokens equal the
    last len(w)-1 tokens of the OUTPUT (the prompt is not looked at; a one-token word always matches),
    `logit[w[-1]] = -inf`. A word longer than the output + 1 is skipped."""
    out = logits.clone()
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:prefix]):
            if 0 <= word[-1] < out.shape[-1]:
                out[word[-1]] = -math.inf
    return out


def apply_min_tokens(logits: torch.Tensor, output_length: int, min_tokens: int, stop_ids: Iterable[int]) -> torch.Tensor:
    """vLLM `MinTokensLogitsProcessor`: while `output_length < min_tokens`, every stop token id (the
    EOS ids and `stop_token_ids`) gets `-inf`; from then on nothing changes."""
    out = logits.clone()
    if output_length < min_tokens:
        for token in stop_ids:
            if 0 <= token < out.shape[-1]:
                out[token] = -math.inf
    return out


def apply_logit_bias(logits: torch.Tensor, logit_bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> torch.Tensor:
    """vLLM `LogitBiasLogitsProcessor` (and llama.cpp's logit_bias sampler): `logit[id] += bias`."""
    out = logits.clone()
    for token, bias in (logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias):
        if 0 <= token < out.shape[-1]:
            out[token] = out[token] + bias
    return out


def apply_repetition_penalty(logits: torch.Tensor, seen: Iterable[int], penalty: float) -> torch.Tensor:
    """vLLM `apply_penalties` (CTRL's repetition penalty; llama.cpp's `repeat_penalty`): for every token
    seen in the prompt or the output, `logit / penalty` where `logit > 0`, else `logit * penalty`."""
    out = logits.clone()
    if penalty == 1.0:
        return out
    ids = sorted({t for t in seen if 0 <= t < out.shape[-1]})
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=out.device)
        values = out[index]
        out[index] = torch.where(values > 0, values / penalty, values * penalty)
    return out


def apply_frequency_presence(logits: torch.Tensor, counted: Sequence[int], frequency: float,
                             presence: float) -> torch.Tensor:
    """vLLM `apply_penalties` (OpenAI's definition): `logit[t] -= frequency * count(t) + presence *
    (count(t) > 0)`, `count` over `counted` (vLLM: the output tokens; llama.cpp: prompt and output)."""
    out = logits.clone()
    if frequency == 0.0 and presence == 0.0:
        return out
    counts = torch.bincount(torch.tensor([t for t in counted if 0 <= t < out.shape[-1]], dtype=torch.long),
                            minlength=out.shape[-1]).to(out.device, out.dtype)  # [V]
    return out - frequency * counts - presence * (counts > 0).to(out.dtype)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM `MinPLogitsProcessor`: tokens whose probability is below `min_p` times the top token's get
    `-inf`. The top token is never removed, so a greedy choice never changes."""
    out = logits.clone()
    if min_p <= 0.0:
        return out
    probs = torch.softmax(out, dim=-1)
    out[probs < min_p * probs.max()] = -math.inf
    return out


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits, `-inf` for the rest (`top_k` 0 or -1: off). Ties at the k-th
    value are all kept (vLLM's `apply_top_k_top_p` masks `logits < kth value`)."""
    out = logits.clone()
    if top_k <= 0 or top_k >= out.shape[-1]:
        return out
    kth = torch.topk(out, top_k).values[-1]
    out[out < kth] = -math.inf
    return out


@dataclass
class Processed:
    """One step's logits [V] after the processors: `greedy` (what greedy decoding takes the argmax of)
    and `post_sampling` (then `min_p` and `top_k`, what a post-sampling report normalises)."""

    greedy: torch.Tensor
    post_sampling: torch.Tensor
    applied: list[str] = field(default_factory=list)  # the processors that changed something, in order


def process(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], params: RequestParams,
            stop_ids: Iterable[int], penalty_scope: str = "output", skip: str | None = None,
            allowed: torch.Tensor | None = None) -> Processed:
    """All processors in vLLM's order (module docstring) on one row of raw logits `[V]` (float64).
    `penalty_scope` "output" (vLLM, SGLang) or "context" (llama.cpp) says what presence and frequency
    count; `skip` names one processor to leave out (the audit's "which processor was not applied" replay);
    `allowed` [V] the tokens a constraint's grammar admits here (None: unconstrained), masked first."""
    if penalty_scope not in PENALTY_SCOPES:
        raise ValueError(f"penalty_scope must be one of {PENALTY_SCOPES}, got {penalty_scope!r}")
    row = logits.to(torch.float64)
    applied: list[str] = []
    if allowed is not None and skip != "constraint":
        new = row.masked_fill(~allowed.to(row.device), -math.inf)
        if not torch.equal(new, row):
            applied.append("constraint")
        row = new
    steps = [
        ("bad_words", lambda r: apply_bad_words(r, params.bad_words, output)),
        ("min_tokens", lambda r: apply_min_tokens(r, len(output), params.min_tokens, stop_ids)),
        ("logit_bias", lambda r: apply_logit_bias(r, params.logit_bias)),
        ("repetition_penalty", lambda r: apply_repetition_penalty(r, list(prompt) + list(output),
                                                                  params.repetition_penalty)),
        ("frequency_presence", lambda r: apply_frequency_presence(
            r, list(output) if penalty_scope == "output" else list(prompt) + list(output),
            params.frequency_penalty, params.presence_penalty)),
    ]
    for name, step in steps:
        if name == skip:
            continue
        new = step(row)
        if not torch.equal(new, row):
            applied.append(name)
        row = new
    post = apply_top_k(apply_min_p(row, params.min_p), params.top_k)
    return Processed(row, post, applied)


PROCESSOR_NAMES = ("bad_words", "min_tokens", "logit_bias", "repetition_penalty", "frequency_presence")


def log_softmax(row: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of one row `[V]` (`-inf` entries stay `-inf`)."""
    return torch.log_softmax(row.to(torch.float64), dim=-1)


def bad_words_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `SamplingParams.update_from_tokenizer` for `bad_words`: each word encoded without special
    tokens as written (left-stripped) and, where it encodes to as many tokens with a different first
    token, also after a space (a word inside the text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain: tuple[int, ...] | None = None
        for prefix in ("", " "):
            text = prefix + word.lstrip()
            try:
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:  # the built-in byte tokenizer takes no keyword (it adds no specials)
                ids = tuple(tokenizer.encode(text))
            if not ids:
                continue
            if prefix == "":
                plain = ids
                out.append(ids)
            elif plain is not None and ids[0] != plain[0] and len(ids) == len(plain):
                out.append(ids)
    return tuple(out)


def with_bad_words_resolved(params: RequestParams, tokenizer: Any) -> RequestParams:
    """`params` with `bad_words` (ids) filled from `bad_words_text` by `bad_words_ids` when only text was given."""
    if not params.bad_words_text or params.bad_words or tokenizer is None:
        return params
    values = {f.name: getattr(params, f.name) for f in fields(params)}
    values["bad_words"] = bad_words_ids(params.bad_words_text, tokenizer)
    return RequestParams(**values)
