"""The diagnosis's experiments on the engine itself: re-runs, and how their outputs are judged.

`Experiments` is the part of `Diagnoser` (core.py) that re-runs the audited engine through the run's
context (`run.rerun(indices, pad_token_id)`, equivalence/run_context.py) within its budgets (re-runs
per run, pad-id re-runs, a time budget, none at all in a quick diagnosis) and judges what comes back.
In float64 a re-run is equivalent only when exact; below float64 it differs from the run by rounding
alone, so its first divergence is ruled as the audit rules the run's (`equivalence/rulings/ruler.py`).
"""

from __future__ import annotations

import time

from specaudit.engines.limits import eos_ids
from specaudit.equivalence.diagnosis.facts import RunFacts


class Experiments:
    """Re-runs and their judgement; the fields live on `Diagnoser`."""

    facts: RunFacts
    references: list[list[int]]
    reruns_left: int
    pad_reruns_left: int
    rerun_seconds: float
    _alone: dict[int, list[int] | str]

    def _run(self, indices: list[int], pad_token_id: int | None = None) -> list[list[int]] | str:
        if self.facts.mode == "quick":
            return "quick diagnosis: no re-runs (--diagnosis full runs them)"
        if self.facts.run is None:
            return "no re-run available for this engine"
        if self.facts.deadline is not None and time.monotonic() >= self.facts.deadline:
            return "the diagnosis time budget is spent"
        if pad_token_id is not None and not self.facts.run.takes_pad_option:
            return "the engine takes no pad option"
        if pad_token_id is not None:
            if self.pad_reruns_left <= 0:
                return "the pad-id re-run budget of this run is spent"
            self.pad_reruns_left -= 1
        elif self.reruns_left <= 0:
            return "the re-run budget of this run is spent"
        else:
            self.reruns_left -= 1
        started = time.perf_counter()
        try:
            return [[int(t) for t in out] for out in self.facts.run.rerun(indices, pad_token_id)]
        except Exception as exc:  # an experiment that fails tells that, not more
            return f"the re-run failed: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            self.rerun_seconds += time.perf_counter() - started

    def equivalent(self, index: int, output: list[int], reference: list[int] | None = None) -> bool:
        """A re-run's output for prompt `index` against `reference` (default: the prompt's): exact,
        or, below float64, its first divergence ruled numerical as the audit rules the run's."""
        reference = self.references[index] if reference is None else reference
        if self.facts.ruler is None or list(output) == list(reference):
            return list(output) == list(reference)
        return self.facts.ruler.equivalent(self.facts.prompts[index], reference, output)

    def _verdict(self, index: int, output: list[int]) -> str:
        if list(output) == list(self.references[index]):
            return "exact"
        return "equivalent (its divergence ruled numerical)" if self.equivalent(index, output) else "still diverges"

    def precision_noise(self, index: int) -> float:
        """The largest logit error of the audit-dtype reference against the float64 target along its own
        output on this prompt (0 in float64): how closely a replay can reproduce an engine's logits. Measured
        along the output those logits were computed for (`logit_paths`), not a reference continued past a flip."""
        logits = self.facts.reference_logits[index] if index < len(self.facts.reference_logits) else None
        path = self.facts.logit_paths[index] if index < len(self.facts.logit_paths) else self.references[index]
        if self.facts.ruler is None or logits is None or not path:
            return 0.0
        return self.facts.ruler.precision_noise(self.facts.prompts[index], path, logits)

    def alone(self, index: int) -> list[int] | str:
        if index not in self._alone:
            result = self._run([index])
            self._alone[index] = result[0] if isinstance(result, list) else result
        return self._alone[index]

    def other_pad_id(self, indices: list[int]) -> int | None:
        used = {t for i in indices for t in self.facts.prompts[i] + self.references[i] + self.facts.outputs[i]}
        used |= {t for t in (self.facts.pad_token_id, *eos_ids(self.facts.eos_token_id)) if t is not None}
        # an id both models have (a padded vocabulary's extra ids cannot be fed to the smaller one)
        sizes = [getattr(getattr(model, "config", None), "vocab_size", None)
                 for model in (self.facts.target, self.facts.draft)]
        vocab = int(min((size for size in sizes if isinstance(size, int)), default=0))
        for candidate in range(vocab - 1, -1, -1):
            if candidate not in used:
                return candidate
        return None

