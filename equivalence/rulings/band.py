"""The noise band of black-box engines (recordings, live servers), which may run in another precision.

A server's numbers are not the reference's: llama.cpp, for one, keeps an f16 KV cache and uses
flash attention by default, and then flips near-ties. A black-box divergence is therefore ruled
against a noise band, in logit units (differences of log-probabilities are differences of logits).
`Ruler` (ruler.py) rules a black-box divergence with the band as its noise; where the reference's
logits are processed by request parameters (penalties, bias: `blackbox/requests_run.py`) and no
float64 replay applies, `rule_on_band` rules on the band alone:

- `numerical` when, at the split, the reference's top-2 margin AND the gap between the reference's
  top logit and its logit for the engine's token both lie within the band: the engine chose a token
  the reference itself nearly tied with;
- `structural` otherwise, and always when one output ended where the other went on (a stop
  decision is not a near-tie).

The band, in order of precedence (the run record says which was used and how it was obtained):

1. declared: `--logit-tolerance X` (an absolute band of X);
2. declared: `--engine-dtype DTYPE` (that dtype's noise at the split: 16 x unit roundoff x
   max(1, |top logit|), as for the built-in engines below float64);
3. measured: from the engine's own log-probabilities where it gives them, on the positions where
   engine and reference agree: for each token the engine names beside its chosen one, how far the
   engine's log-probability gap between the two differs from the reference's logit gap. The band is
   the largest such difference seen;
4. assumed: the audit dtype's own noise (the engine is taken to compute like the reference; in
   float64 this makes every token mismatch structural).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specaudit.equivalence.rulings.noise import EPS, dtype_noise
from specaudit.equivalence.compare import matched_prefix, top2

Logprobs = list[dict[int, float]]  # per output token: {token id: log-probability}


@dataclass
class NoiseBand:
    """The band a black-box divergence is ruled against."""

    source: str  # "declared-tolerance", "declared-dtype", "measured", "audit-dtype"
    how: str  # one sentence: where the band comes from
    tolerance: float | None = None  # a fixed band (declared tolerance, or measured)
    dtype: str | None = None  # a band that scales with the top logit (declared or audit dtype)
    measurement: dict[str, Any] | None = None  # what the engine's log-probabilities showed, when given
    extra: dict[str, Any] = field(default_factory=dict)

    def at(self, top_logit: float) -> float:
        """The band's width at a position whose top logit is `top_logit`."""
        if self.tolerance is not None:
            return self.tolerance
        return dtype_noise(self.dtype or "float64", top_logit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(engine_logprobs: list[Logprobs | None], outputs: list[list[int]],
            reference_outputs: list[list[int]], reference_logits: list[torch.Tensor | None]) -> dict[str, Any] | None:
    """How far the engine's log-probability gaps stray from the reference's logit gaps, on the
    positions where both chose the same token (see the module docstring); None when the engine
    named no second token anywhere."""
    worst, where, pairs, positions, prompts = 0.0, None, 0, 0, 0
    for index, per_token in enumerate(engine_logprobs):
        logits = reference_logits[index] if index < len(reference_logits) else None
        if per_token is None or logits is None:
            continue
        agree = min(matched_prefix(reference_outputs[index], outputs[index]), len(per_token), logits.shape[0])
        used = False
        for position in range(agree):
            entry, chosen = per_token[position], outputs[index][position]
            if chosen not in entry:
                continue
            row = logits[position].to(torch.float64)
            for token, logprob in entry.items():
                if token == chosen or not 0 <= token < row.shape[0]:
                    continue
                engine_gap = entry[chosen] - logprob
                reference_gap = float(row[chosen] - row[token])
                deviation = abs(engine_gap - reference_gap)
                pairs += 1
                used = True
                if deviation > worst or where is None:
                    worst, where = deviation, {"prompt_index": index, "position": position, "token": token}
            positions += 1 if used else 0
        prompts += 1 if used else 0
    if pairs == 0:
        return None
    return {"max_gap_deviation": worst, "at": where, "token_pairs": pairs, "positions": positions,
            "prompts": prompts}


def noise_band(audit_dtype: str, engine_dtype: str | None = None, logit_tolerance: float | None = None,
               engine_logprobs: list[Logprobs | None] | None = None, outputs: list[list[int]] | None = None,
               reference_outputs: list[list[int]] | None = None,
               reference_logits: list[torch.Tensor | None] | None = None) -> NoiseBand:
    """The band for one black-box run (precedence in the module docstring). The measurement is made
    whenever the engine gave log-probabilities, and reported even when a declared band wins."""
    measurement = None
    if engine_logprobs and outputs is not None and reference_outputs is not None and reference_logits is not None:
        measurement = measure(engine_logprobs, outputs, reference_outputs, reference_logits)
    if logit_tolerance is not None:
        return NoiseBand("declared-tolerance", f"declared with --logit-tolerance {logit_tolerance:g}",
                         tolerance=float(logit_tolerance), measurement=measurement)
    if engine_dtype is not None:
        if engine_dtype not in EPS:
            raise ValueError(f"unknown engine dtype {engine_dtype!r}: use one of {', '.join(EPS)}")
        return NoiseBand("declared-dtype", f"declared with --engine-dtype {engine_dtype}: 16 x unit roundoff "
                         f"({EPS[engine_dtype]:.3g}) x max(1, |top logit|) at the split",
                         dtype=engine_dtype, measurement=measurement)
    if measurement is not None:
        return NoiseBand("measured", (f"measured from the engine's own log-probabilities: the largest "
                                      f"difference between its and the reference's gap to the chosen token, over "
                                      f"{measurement['token_pairs']} token pairs at {measurement['positions']} "
                                      f"agreeing positions of {measurement['prompts']} prompt(s)"),
                         tolerance=measurement["max_gap_deviation"], measurement=measurement)
    return NoiseBand("audit-dtype", f"assumed: no band declared and no engine log-probabilities, so the audit "
                     f"dtype's own noise ({audit_dtype}: 16 x unit roundoff x max(1, |top logit|))",
                     dtype=audit_dtype)


def band_evidence(band: NoiseBand, ruling: dict[str, Any], engine_token: int | None, reference_token: int | None,
                  engine_entry: dict[int, float] | None = None) -> dict[str, Any]:
    """A black-box engine's band beside a ruling of `Ruler` (ruler.py; its evidence dict):
    where the band came from, its width at the split, the float64 margin and the engine token's gap,
    and the engine's own log-probabilities there when it gave them."""
    extra: dict[str, Any] = {"noise_band_source": band.source, "noise_band": ruling.get("measured_band"),
                             "reference_margin": ruling.get("replay_float64_margin"),
                             "engine_token_gap": (ruling.get("replay_float64_gaps") or {}).get("engine"),
                             "reference_top2": ruling.get("replay_float64_top2")}
    if engine_entry:
        extra["engine_logprobs"] = {str(k): v for k, v in sorted(engine_entry.items(), key=lambda kv: -kv[1])}
        if reference_token in engine_entry and engine_token in engine_entry:
            extra["engine_margin"] = engine_entry[engine_token] - engine_entry[reference_token]
    return extra


def rule_on_band(band: NoiseBand, logits_at_split: torch.Tensor | None, reference_token: int | None,
                 engine_token: int | None) -> tuple[str, dict[str, Any]]:
    """The kind of one black-box token divergence on the band alone, and its evidence (`decided_by`
    "noise-band", or "length"). `logits_at_split` is the reference's processed logits [V] on the
    common prefix."""
    evidence: dict[str, Any] = {"noise_band_source": band.source, "noise_band": None,
                                "reference_margin": None, "engine_token_gap": None, "decided_by": "noise-band"}
    if engine_token is None or reference_token is None:
        evidence["decided_by"] = "length"
        evidence["reason"] = "length mismatch (one output stops where the other goes on): not a near-tie"
        return "structural", evidence
    if logits_at_split is None:
        evidence["reason"] = "no reference logits at the split"
        return "structural", evidence
    row = logits_at_split.to(torch.float64)
    pairs, margin = top2(row)
    top = pairs[0][1]
    gap = top - float(row[engine_token])
    width = band.at(top)
    evidence.update({"noise_band": width, "reference_margin": margin, "engine_token_gap": gap,
                     "reference_top2": pairs})
    if margin > width:
        evidence["reason"] = f"reference margin {margin:.3g} exceeds the noise band {width:.3g} ({band.source})"
        return "structural", evidence
    if gap > width:
        evidence["reason"] = (f"the engine's token lies {gap:.3g} below the reference's top logit, beyond the "
                              f"noise band {width:.3g} ({band.source})")
        return "structural", evidence
    evidence["reason"] = (f"near-tie: reference margin {margin:.3g}, engine's token {gap:.3g} below the top, "
                          f"both within the noise band {width:.3g} ({band.source})")
    return "numerical", evidence
