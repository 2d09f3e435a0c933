"""Hypothesis strategies for speculative sampling: one step's table of logits and the sampling
parameters, drawn with zeros (logit -inf) and ties and shrunk toward the small case (vocabulary 2,
k = 1, temperature 1, no cuts). Public, for checking a sampler exactly:

    from hypothesis import given
    from specaudit.testing.sampling_strategies import sampling_cases
    from specaudit.equivalence.sampling.exact import step_departure

    @given(case=sampling_cases())
    def test_my_sampler(case):
        assert step_departure(my_rule, case.target_logits, case.draft_logits, case.params).total_variation < 1e-6
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from specaudit.engines.sampling.process import SamplingParams

# logits from a small set, so that ties are common; -inf is a token the model never gives
LOGIT_VALUES = (0.0, 1.0, -1.0, 2.0, 0.5, -2.5, 3.0, float("-inf"))
TEMPERATURES = (1.0, 0.0, 0.5, 0.7, 1.5)
TOP_PS = (1.0, 0.9, 0.5, 0.75)


@dataclass
class SamplingCase:
    target_logits: torch.Tensor  # [k+1, V]
    draft_logits: torch.Tensor  # [k+1, V]: the last row is the draft after its last token (unused by a correct sampler)
    params: SamplingParams

    @property
    def k(self) -> int:
        return self.target_logits.shape[0] - 1


@st.composite
def logit_rows(draw: st.DrawFn, *, rows: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 logits, each row with at least one finite value."""
    table = []
    for _ in range(rows):
        row = draw(st.lists(st.sampled_from(LOGIT_VALUES), min_size=vocab, max_size=vocab))
        if all(v == float("-inf") for v in row):
            row[draw(st.integers(0, vocab - 1))] = 0.0
        table.append(row)
    return torch.tensor(table, dtype=torch.float64)


@st.composite
def sampling_params(draw: st.DrawFn, *, vocab: int, greedy: bool = True) -> SamplingParams:
    temperatures = TEMPERATURES if greedy else tuple(t for t in TEMPERATURES if t > 0)
    return SamplingParams(temperature=draw(st.sampled_from(temperatures)), top_k=draw(st.integers(0, vocab)),
                          top_p=draw(st.sampled_from(TOP_PS)))


@st.composite
def sampling_cases(draw: st.DrawFn, *, max_vocab: int = 5, max_k: int = 3, max_paths: int = 27,
                   greedy: bool = True) -> SamplingCase:
    """One step's table. `max_paths` bounds V**k, the draft's paths the exact check enumerates."""
    k = draw(st.integers(1, max_k))
    largest = max(2, min(max_vocab, int(round(max_paths ** (1 / k)))))
    vocab = draw(st.integers(2, largest))
    target = draw(logit_rows(rows=k + 1, vocab=vocab))
    # the draft: its own values, or the target's row nudged (close drafts, as in practice)
    draft = draw(logit_rows(rows=k + 1, vocab=vocab))
    if draw(st.booleans()):
        draft = torch.where(torch.isinf(target), target, target + draft.clamp(-1, 1) * 0.25)
    return SamplingCase(target, draft, draw(sampling_params(vocab=vocab, greedy=greedy)))
