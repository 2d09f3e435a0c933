"""The ruling of one token divergence: the precision's doing (`numerical`) or a bug (`structural`)?

In float64 (an in-process engine, or a black-box one without a band) every token mismatch is a bug:
`decided_by` "float64", or "length" where one output ends. Below it, two correct computations of the same logits
differ by rounding, and how much is a property of the model, the kernels and the device, not of
the dtype alone: a tiny Llama in bfloat16 moves the gap between two tokens by 0.5 on an H100, where
16 unit roundoffs of its top logit are 0.25. So the ruling measures precision on the run itself
and lets a divergence be `numerical` only when a control shows precision can make it. For the
first divergent position p of a prompt, the reference's token r and the engine's token e:

1. `length`: one output ends where the other goes on: a stop decision, never a near-tie (structural).
2. `float64-replay`: the float64 target on the common prefix (prompt + the agreed tokens) puts both
   r and e within the measured band of its top logit: numerical. The band is the larger of the
   dtype's noise there (16 x unit roundoff x max(1, |top logit|), or a black-box engine's declared
   or measured band) and the reference's own largest departure from the float64 choice along its
   whole output on this prompt: how far a correct decoder in this precision strayed, measured with
   the same float64 pass (the reference is itself a computation in the audit dtype; where it was the
   one that flipped, its departure at p is in that floor).
3. `same-dtype-replay`: a plain replay of the target in the audit dtype on the same prefix (batch of
   one, no cache: a correct computation with other kernel shapes than the reference's and the
   engine's) puts e within the dtype's noise of its top: a correct computation in that precision
   chooses the engine's token, or nearly.
4. Otherwise `structural`, decided by the float64 replay, with every control's numbers as evidence.

A plain, non-speculative run of the same rows in the same batch shapes (plain.py: the built-in
`batched` engine for in-process engines, `--plain-engine` for servers) overrules a structural ruling
when it makes the same divergence (`plain-control`). Each divergence records `decided_by`, and the
diagnosis judges its own re-runs with `Ruler.equivalent`, the same logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specaudit.equivalence.compare import replay_logits, top2
from specaudit.equivalence.rulings.band import NoiseBand
from specaudit.equivalence.rulings.noise import dtype_noise
from specaudit.equivalence.rulings.outputs import first_divergence, token_at

Band = Callable[[float], float]  # top logit -> the band's width there (or a NoiseBand, band.py)


@dataclass
class Ruler:
    """Rules token divergences of one run below float64, measuring precision on the way.

    `target` computes in the audit dtype, `replay_target` in float64 (the same model when the audit
    runs in float64); `band` gives the declared or dtype band at a top logit (a `NoiseBand`, or a
    function of the top logit). In float64 without a band every mismatch is structural."""

    dtype: str
    target: Any
    replay_target: Any
    band: Band | None = None
    seconds: float = 0.0  # time spent in the float64 and same-dtype replays (the report's `controls`)
    _paths: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def width(self, top_logit: float) -> float:
        if self.band is None:
            return dtype_noise(self.dtype, top_logit)
        return self.band.at(top_logit) if isinstance(self.band, NoiseBand) else self.band(top_logit)

    @property
    def exact_only(self) -> bool:
        """float64 and no band: every token mismatch is a bug."""
        return self.dtype == "float64" and self.band is None

    def _reference_path(self, prompt: list[int], reference: list[int]) -> torch.Tensor:
        """float64 logits [n, V] choosing each token of `reference` after `prompt` (one pass, cached)."""
        key = (len(prompt), *prompt, -1, *reference)
        if key not in self._paths:
            self._paths[key] = replay_logits(self.replay_target, prompt, list(reference) + [0]).to(torch.float64).cpu()
        return self._paths[key]

    def precision_noise(self, prompt: list[int], path: list[int], logits: torch.Tensor) -> float:
        """The largest error of `logits` [n, V] (the audit dtype's, choosing each token of `path` after
        `prompt`) against the float64 target's along the same path (0 in float64): how closely a replay
        in the audit dtype can reproduce an engine's logits."""
        rows = min(logits.shape[0], len(path))  # [rows, V] each
        exact = self._reference_path(prompt, path)[:rows]
        return float((logits[:rows].to(torch.float64).cpu() - exact).abs().max())

    def floor(self, prompt: list[int], reference: list[int]) -> float:
        """The reference's largest departure from the float64 choice along its own output: the
        float64 gap below the top of each token it chose, at most over its whole output."""
        if not reference:
            return 0.0
        path = self._reference_path(prompt, reference)[: len(reference)]  # [n, V]
        chosen = path.gather(1, torch.tensor(reference, dtype=torch.long).unsqueeze(1)).squeeze(1)  # [n]
        return float((path.max(dim=1).values - chosen).max())

    def rule(self, prompt: list[int], reference: list[int], output: list[int], position: int,
             same_dtype: torch.Tensor | None = None, floor: float | None = None) -> tuple[str, dict[str, Any]]:
        """The kind of the divergence at `position` and its evidence (with `decided_by`).
        `same_dtype`: the audit-dtype target's logits [V] on the common prefix, when already computed;
        `floor`: a departure measured otherwise (default: the reference's along its own output)."""
        import time

        started = time.perf_counter()
        try:
            return self._rule(prompt, reference, output, position, same_dtype, floor)
        finally:
            self.seconds += time.perf_counter() - started

    def _rule(self, prompt: list[int], reference: list[int], output: list[int], position: int,
              same_dtype: torch.Tensor | None, floor: float | None) -> tuple[str, dict[str, Any]]:
        reference_token, engine_token = token_at(reference, position), token_at(output, position)
        evidence: dict[str, Any] = {"replay_float64_top2": None, "replay_float64_margin": None, "dtype_noise": None}
        if reference_token is None or engine_token is None:
            evidence.update(decided_by="length", reason="length mismatch (one output stops where the other goes on): "
                            "a stop decision, not a near-tie")
            return "structural", evidence
        if self.exact_only:  # the float64 target's top two on the common prefix, as evidence
            exact = replay_logits(self.replay_target, prompt, list(reference[:position]) + [0])[-1]
            evidence["replay_float64_top2"], evidence["replay_float64_margin"] = top2(exact)
            evidence.update(decided_by="float64", reason="float64: every token mismatch is a bug")
            return "structural", evidence
        exact = self._reference_path(prompt, reference)[position]  # [V] float64 on the common prefix
        evidence["replay_float64_top2"], evidence["replay_float64_margin"] = top2(exact)
        top = float(exact.max())
        gaps = {"reference": top - float(exact[reference_token]), "engine": top - float(exact[engine_token])}
        noise = self.width(top)
        floor = self.floor(prompt, reference) if floor is None else floor
        band = max(noise, floor)
        evidence.update(dtype_noise=noise, replay_float64_gaps=gaps, reference_departure=floor, measured_band=band)
        if max(gaps.values()) <= band:
            widened = (f"; the band is the reference's own largest departure from float64 on this prompt, {floor:.3g}"
                       if floor > noise else "")
            evidence.update(decided_by="float64-replay", reason=(
                f"near-tie: in the float64 replay both tokens lie within {max(gaps.values()):.3g} of the top, inside "
                f"the measured band {band:.3g} ({self.dtype} noise {noise:.3g}{widened})"))
            return "numerical", evidence
        if same_dtype is None:
            same_dtype = replay_logits(self.target, prompt, list(reference[:position]) + [0])[-1]
        plain = same_dtype.to(torch.float64).cpu()
        plain_top = float(plain.max())
        plain_gaps = {"reference": plain_top - float(plain[reference_token]),
                      "engine": plain_top - float(plain[engine_token])}
        plain_noise = self.width(plain_top)
        evidence.update(replay_same_dtype_gaps=plain_gaps, replay_same_dtype_noise=plain_noise)
        if plain_gaps["engine"] <= plain_noise:
            evidence.update(decided_by="same-dtype-replay", reason=(
                f"a plain replay in {self.dtype} on the same prefix puts the engine's token "
                f"{plain_gaps['engine']:.3g} below its top, inside {self.dtype} noise {plain_noise:.3g} (in float64 it "
                f"lies {gaps['engine']:.3g} below the top): a correct {self.dtype} computation chooses it, or nearly"))
            return "numerical", evidence
        who = max(gaps, key=gaps.get)
        evidence.update(decided_by="float64-replay", reason=(
            f"in the float64 replay the {who} token lies {gaps[who]:.3g} below the top, beyond the measured band "
            f"{band:.3g} ({self.dtype} noise {noise:.3g}, the reference's own largest departure {floor:.3g}); a plain "
            f"{self.dtype} replay puts it {plain_gaps[who]:.3g} below its top, beyond {plain_noise:.3g}: no precision "
            "control explains it"))
        return "structural", evidence

    def equivalent(self, prompt: list[int], reference: list[int], output: list[int]) -> bool:
        """`output` is exact, or its first divergence from `reference` is ruled numerical: how the
        diagnosis judges a re-run below float64 (a re-run differs from the run by rounding alone)."""
        output = [int(t) for t in output]
        if output == list(reference):
            return True
        if self.exact_only:
            return False
        position = first_divergence(reference, output)
        return self.rule(prompt, reference, output, position)[0] == "numerical"

