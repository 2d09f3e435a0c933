"""A drawn example's arrival, sent: the engine's one `generate` per wave (equivalence/search/model.py `waves`).

`ArrivalEngine` wraps the audited engine so that the greedy judge (equivalence/audit.py `audit_engine`) sees one
engine answering every request of the example, in the example's order, while the requests reach the engine wave
by wave: the requests of one wave in one call (a server keeps them all in flight at once: its client's
`batch_size` is set to the wave's size), the next wave after that call returned. What the engine says beside its
tokens (completions, refusals, failures, log-probabilities) is put back at each request's index. A trace (an
in-process engine's steps) is kept only when the example is one wave: its rows are then the example's requests.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from specaudit.engines.contract import capability

# what `ArrivalEngine` keeps itself; every other attribute is the wrapped engine's
_OWN = ("_engine", "waves", "request_params", "request_tokenizer", "last_completions", "last_refused",
        "last_failures", "last_logprobs", "last_trace", "last_details", "last_speculation", "last_acceptance",
        "last_step_offsets", "last_outputs", "answer_seconds")


class ArrivalEngine:
    def __init__(self, engine: Any, waves: Sequence[Sequence[int]]) -> None:
        object.__setattr__(self, "_engine", engine)
        self.waves = [list(w) for w in waves]
        self.request_params: Any = None
        self.request_tokenizer: Any = None
        self.last_completions: list[Any] | None = None
        self.last_refused: list[tuple[int, BaseException]] = []
        self.last_failures: list[tuple[int, BaseException]] = []
        self.last_logprobs: list[Any] | None = None
        self.last_trace: Any = None
        self.last_details: list[Any] | None = None
        self.last_speculation: Any = None
        self.last_acceptance: Any = None
        self.last_step_offsets: Any = None
        self.last_outputs: list[list[int]] = []  # the last call's answers, per request
        self.answer_seconds = 0.0  # inside the engine's own `generate`: what answering the mix alone takes

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_engine"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], eos_token_id: Any) -> list[list[int]]:
        engine, count = self._engine, len(prompts)
        params = self.request_params
        per_prompt = params if isinstance(params, list) else [params] * count
        outputs: list[list[int]] = [[] for _ in range(count)]
        completions: list[Any] = [None] * count
        logprobs: list[Any] = [None] * count
        details: list[Any] = [None] * count
        refused: list[tuple[int, BaseException]] = []
        failures: list[tuple[int, BaseException]] = []
        speculation: list[Any] = []
        if self.request_tokenizer is not None and hasattr(engine, "request_tokenizer"):
            engine.request_tokenizer = self.request_tokenizer
        for wave in self.waves:
            if params is not None:
                engine.request_params = [per_prompt[i] for i in wave]
            if capability(engine, "url") is not None and hasattr(engine, "batch_size"):
                engine.batch_size = max(1, len(wave))  # the wave in flight at once
            limits = [max_new_tokens[i] for i in wave] if isinstance(max_new_tokens, list) else max_new_tokens
            started = time.perf_counter()
            answered = engine.generate([list(prompts[i]) for i in wave], limits, eos_token_id)
            self.answer_seconds += time.perf_counter() - started
            for row, index in enumerate(wave):
                outputs[index] = list(answered[row])
            for name, into in (("last_completions", completions), ("last_logprobs", logprobs),
                               ("last_details", details)):
                got = capability(engine, name) or []
                for row, index in enumerate(wave):
                    if row < len(got):
                        into[index] = got[row]
            refused += [(wave[int(row)], exc) for row, exc in capability(engine, "last_refused") or []]
            failures += [(wave[int(row)], exc) for row, exc in capability(engine, "last_failures") or []]
            speculation.append(capability(engine, "last_speculation"))
        self.last_completions = completions
        self.last_logprobs = logprobs if any(lp is not None for lp in logprobs) else None
        self.last_details = details
        self.last_refused, self.last_failures = refused, failures
        one = len(self.waves) == 1
        self.last_trace = capability(engine, "last_trace") if one else None
        self.last_acceptance = capability(engine, "last_acceptance") if one else None
        self.last_step_offsets = capability(engine, "last_step_offsets") if one else None
        self.last_speculation = speculation[0] if one else None  # counters over several calls are not summed
        self.last_outputs = outputs
        return outputs
