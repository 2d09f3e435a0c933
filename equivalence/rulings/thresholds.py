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

# The diagnosis's recurrent-state comparison (diagnosis/states.py): two histories whose states lie closer than
# this many machine epsilons of the run's dtype, relative to the norm of the row's own state, are one state and
# do not compete as explanations. A state is the sum of a few rounded updates per token: histories that differ
# only where the dtype cannot hold the difference (a convolution window that keeps its last inputs alone, padding
# the model zeroes) land within a few epsilons of each other, while a token more or less moves it by far more.
STATE_RESOLUTION_EPS = 16
# the norm below which a state counts as zero (the resolution must stay positive for an all-zero state)
STATE_NORM_FLOOR = 1e-30

# An additive attention mask hides a column where its value lies below this fraction of the dtype's lowest value:
# models write the lowest value itself (or -inf) there and 0 elsewhere; half leaves room for a mask built as a sum.
HIDDEN_MASK_FRACTION = 0.5


def state_resolution(eps: float, own_norm: float) -> float:
    """The distance under which two recurrent states are one state for a run of machine epsilon `eps`, whose
    row's own state has norm `own_norm` (`STATE_RESOLUTION_EPS`)."""
    return STATE_RESOLUTION_EPS * eps * max(own_norm, STATE_NORM_FLOOR)

# The diagnosis's logit replays (diagnosis/replay.py): a hypothesis explains the engine's logits when its replay
# is at most this share of the plain replay's distance from them. In float64 a right hypothesis reproduces them
# to rounding (about 1e-13), orders of magnitude closer than the plain replay of a run whose inputs were wrong;
# 100 times asks for two of those orders.
EXPLAIN_RATIO = 0.01
# Below float64 no replay comes closer than the precision's own error: there a hypothesis explains within that
# error, and must still come at least 4 times closer than the plain replay (an error of the size of the noise
# that the plain replay nearly matches explains nothing).
NOISY_EXPLAIN_RATIO = 0.25

# The pad-id replay along the engine's own output (diagnosis/causes.py): with the pad-id tokens masked it must
# choose at least this share of the engine's tokens over the window compared (and more than the plain replay):
# the masked replay must follow the engine's output on most of the window, not agree by chance on a few tokens.
MASKED_REPLAY_AGREEMENT = 0.75

# An output that is another prompt's reference names `output_order` (the engine answered for the wrong prompt:
# rulings/outputs.other_references_matched, the served `output-match` and the diagnosis's check) only where at
# least this many of its tokens lie at or past where it leaves its own reference. One token is a single flipped
# choice, and a wrong first token often is some other prompt's first token (a common word, or every reference at
# max_new_tokens 1): that match is chance, not a row answered for another prompt; two tokens in a row are not.
OTHER_REFERENCE_TOKENS = 2
