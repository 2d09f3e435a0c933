"""Engines for the EOS-set tests (tests/test_eos_sets.py), each made from an engine that takes one EOS id.

`StopsAtEosSet`: correct for a set of EOS ids: it decodes with no EOS and ends each row at its first id
of the set (greedy decoding does not look ahead, so the cut is exact). `IgnoresLaterEos`: the bug the
issue measured: it stops only at the first id of the set and runs past the others.
"""

from __future__ import annotations

from typing import Any, Sequence

from specaudit.engines.limits import eos_ids


class _Wrapper:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last_trace = None

    @property
    def record_logits(self) -> bool:
        return bool(getattr(self.inner, "record_logits", False))

    @record_logits.setter
    def record_logits(self, value: bool) -> None:
        self.inner.record_logits = value


class StopsAtEosSet(_Wrapper):
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        ends = eos_ids(eos_token_id)
        outputs = self.inner.generate(prompts, max_new_tokens, None)
        trace = getattr(self.inner, "last_trace", None)
        kept = []
        for row, tokens in enumerate(outputs):
            n = next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))
            kept.append([int(t) for t in tokens[:n]])
            if trace is not None and row < len(trace.logits) and trace.logits[row] is not None:
                trace.logits[row] = trace.logits[row][:n]  # [n, V]: the logits of the tokens kept
                trace.emitted_at[row] = trace.emitted_at[row][:n]
        if trace is not None:  # its proposals past a cut row no longer line up with that row's output
            trace.proposals_from_draft_model = False
        self.last_trace = trace
        return kept


class IgnoresLaterEos(_Wrapper):
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        ends = eos_ids(eos_token_id)
        outputs = self.inner.generate(prompts, max_new_tokens, ends[0] if ends else None)
        self.last_trace = getattr(self.inner, "last_trace", None)
        return outputs
