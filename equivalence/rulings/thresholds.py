"""Every threshold a ruling or a diagnosis decides by, in one place.

A threshold here is a fact about arithmetic, not a knob: each says what it separates and why that value.
"""

from __future__ import annotations

# Above this, a float64 logit difference is a bug: a correct left-padded batch matches batch size 1 to
# about 2e-16 on the CPU (docs/design.md, measured facts). Lower precisions get no logit verdict from it
# (their kernels differ by design): their controls rule instead (rulings/ruler.py).
FLOAT64_LOGIT_TOLERANCE = 1e-9

# The logit tolerance per dtype the comparison applies; a dtype absent here has none.
LOGIT_TOLERANCE: dict[str, float] = {"float64": FLOAT64_LOGIT_TOLERANCE}


def float64_equal(error: float | None) -> bool:
    """Whether a float64 logit difference is within rounding (a replay reproduces what it replays)."""
    return error is not None and error <= FLOAT64_LOGIT_TOLERANCE
