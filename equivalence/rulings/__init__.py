"""The ruling of a divergence, in one place: is it a bug (`structural`) or the precision's doing (`numerical`)?

Every ruling the audit makes comes from this package, for every dtype and every kind of engine, and
each records what decided it in one field, `decided_by`:

- `ruler.Ruler`: one token divergence of any engine, in-process or black-box. float64 without a band:
  every mismatch is a bug (`float64`; `length` where one output ends); below float64, or with a
  black-box engine's band: the float64 replay within the band measured on the run (`float64-replay`),
  a same-dtype replay (`same-dtype-replay`), else structural. The diagnosis judges its re-runs with
  `Ruler.equivalent`, the same logic.
- `band`: the noise band of a black-box engine (declared, measured from its log-probabilities or
  assumed), the evidence it adds beside a ruling, and `rule_on_band` where the reference's logits are
  processed by request parameters (`noise-band`).
- `plain`: a plain run of the same rows (the built-in `batched` engine for in-process engines,
  `--plain-engine` for servers) overrules a structural ruling it makes identically (`plain-control`);
  under a constraint, to a token the reference's grammar forbids, it is a `reference_mismatch` (the reference is not the
  server's processing), never the engine's bug.
- `draft.DraftPrecision`: below float64, whether a draft proposal that differs from the float64 draft's
  choice lies within the draft's precision (the draft-fidelity check, the diagnosis's kept draft tokens).
- `record.divergence`: the divergence record of `audit.json` around a ruling (`logits` where tokens
  agree but logits do not): the step, the batch, the margin, the context.
- `outputs`: what an output's tokens say before any logit is read (where it leaves the reference, the token
  there, whether another output departs alike, whether it is another prompt's reference), for every ruling and
  the diagnosis's checks.
- `noise`: the dtype noise all of them start from; `thresholds`: every threshold they decide by, with its reason.
"""

from __future__ import annotations

from specaudit.equivalence.rulings.band import NoiseBand, band_evidence, noise_band, rule_on_band
from specaudit.equivalence.rulings.draft import DraftPrecision, departure_floor
from specaudit.equivalence.rulings.noise import EPS, dtype_noise
from specaudit.equivalence.rulings.outputs import first_divergence
from specaudit.equivalence.rulings.plain import (REFERENCE_MISMATCH, rule as plain_rule,
                                                 rule_processed as plain_rule_processed,
                                                 rule_violation as plain_rule_violation, summary as plain_summary)
from specaudit.equivalence.rulings.record import divergence, step_context
from specaudit.equivalence.rulings.ruler import Ruler

__all__ = ["EPS", "REFERENCE_MISMATCH", "plain_rule_processed", "plain_rule_violation", "DraftPrecision", "NoiseBand", "Ruler", "departure_floor", "band_evidence", "divergence", "dtype_noise", "first_divergence",
           "noise_band", "plain_rule", "plain_summary", "rule_on_band", "step_context"]
