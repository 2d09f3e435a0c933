"""The dtype noise every ruling starts from: how far two correct computations of one logit may differ.

noise = NOISE_FACTOR x unit roundoff of the dtype x max(1, |top logit|).
"""

from __future__ import annotations

from specaudit.equivalence.rulings.thresholds import NOISE_FACTOR

# unit roundoff of each dtype
EPS: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float64": 2.0**-53}


def dtype_noise(dtype: str, top_logit: float) -> float:
    return NOISE_FACTOR * EPS[dtype] * max(1.0, abs(top_logit))
