"""The float64 oracle computes in float64: no layer of a built-in pair rounds through float32 on the way.

transformers normalises every RMS norm in float32 and takes expert routers' softmax in float32 whatever the
model's dtype (`engines/models/float64_recurrent.py` switches them). Left alone, two float64 inputs that
differ by rounding alone (a row alone against the same row in a batch) once in a while land on different
float32 values, and a correct engine's logits then differ from the reference's by about 1e-7.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specaudit.engines.drafters import ScriptedDrafter
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.models.zoo import builtin_pair_names
from specaudit.engines.reference import greedy_decode
from specaudit.testing.models import pair, prompts

# what a pass may still compute below float64: rotary angles and position counters, functions of the
# position alone (the same value in every batch)
POSITION_ONLY = {"aten._to_copy.default", "aten.mul.Tensor", "aten.cat.default", "aten.cos.default",
                 "aten.sin.default", "aten.ones.default", "aten.cumsum.default", "aten.sub.Tensor"}


class BelowFloat64(TorchDispatchMode):
    """Counts the ops whose floating outputs are narrower than float64."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64:
                self.ops[str(func)] += 1
        return out


@pytest.mark.parametrize("name", builtin_pair_names())
def test_every_pass_of_a_float64_pair_stays_in_float64(name: str) -> None:
    p = pair(name)
    for model in (p.target, p.draft):
        counted = BelowFloat64()
        with torch.no_grad(), counted:
            model(input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]))
        assert set(counted.ops) <= POSITION_ONLY, (name, dict(counted.ops))


def test_a_row_beside_a_short_one_keeps_the_reference_logits() -> None:
    """The case that showed it: tiny-lfm2, a 14-token prompt beside a 1-token one at batch size 2, every
    draft rejected, 21 new tokens; its last logits were 1e-7 off with the norms in float32."""
    p = pair("tiny-lfm2")
    cases = [[97], list(prompts()[6])]
    expected = [greedy_decode(p.target, case, 21, None, record_logits=True) for case in cases]
    drafter = ScriptedDrafter([tokens for tokens, _ in expected], lambda row, step: 0, p.target.config.vocab_size)
    engine = EQSpec(p.target, p.draft, batch_size=2, draft_tokens=1, drafter=drafter, record_logits=True)
    assert engine.generate(cases, 21, None) == [tokens for tokens, _ in expected]
    for got, (_, logits) in zip(engine.last_trace.logits, expected):
        assert float((got - logits).abs().max()) < 1e-9
