"""Name the bug: a diagnosis for every structural divergence.

Each structural divergence gets `diagnosis = {"class": ..., "evidence": ...}`. The class says what
the user must fix, from one vocabulary (`CLASSES`, each with its fix in one sentence in `FIXES`):

    position_ids     a token numbered by anything but its index in its own row's sequence
    attention_mask   a query that sees the row's padding, or misses its real tokens
    kv_cache         the target cache holds wrong, extra or missing entries of the row
    draft_cache      the draft cache out of step (proposals only: outputs stay exact)
    acceptance_rule  a token the target did not choose is kept; a bonus token dropped or doubled
    stop_eos         tokens after EOS, or a stop at an EOS that is not the row's own
    stop_length      more or fewer tokens than max_new_tokens allows
    pad_as_content   a real token equal to the pad id treated as padding (prompt or output)
    output_order     outputs answered for the wrong prompts
    cross_row        a row's output depends on the other rows of its batch
    recurrent_state  a recurrent layer's state (gated delta-net, convolution, Mamba) not the row's own after
                     its accepted tokens: not rolled back, advanced by rejected tokens, reset, or another row's
    unknown          none of the above is shown by the evidence

The diagnosis works as an engineer would, cheapest first, and stops at the first decisive result:
the output against other prompts' references; the lengths against EOS and `max_new_tokens`; the
trace's proposals and counts against the target's choices (and the draft model's); then, on the
divergent prompt only, experiments: a re-run with another pad id (when a pad-id token sits in the
row), logit replays with shifted positions or a widened mask (`diagnose_replay`), and re-runs of
the prompt alone and beside a copy of itself. `evidence` says what was tried and what it showed.

Re-runs go through `Diagnoser.rerun(indices, pad_token_id)`, which builds a fresh engine and runs it
on the prompts at `indices` (repeats allowed); without one, the experiments that need it are
reported as not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specaudit.equivalence.diagnosis import checks
from specaudit.equivalence.diagnosis.checks import Finding
from specaudit.equivalence.diagnosis.replay import explain

CLASSES: tuple[str, ...] = ("position_ids", "attention_mask", "kv_cache", "draft_cache", "acceptance_rule",
                            "stop_eos", "stop_length", "pad_as_content", "output_order", "cross_row", "recurrent_state", "unknown")

FIXES: dict[str, str] = {
    "position_ids": "Derive each row's position ids from its own real length (no padding, no rejected slots, no offset).",
    "attention_mask": "Mask each row's padding for every query, and let it see exactly its own real earlier tokens.",
    "kv_cache": "After each step keep exactly the row's accepted tokens in the target cache: trim rejected slots, "
                "cut each row at its own columns.",
    "draft_cache": "Realign the draft cache with the target's after each step (trim rejections, fill the k-th draft "
                   "token).",
    "acceptance_rule": "Accept the longest draft prefix equal to the target's greedy choices, then exactly one "
                       "bonus token from the target.",
    "stop_eos": "End each row at its own first generated EOS: keep that EOS, emit nothing after it, ignore EOS ids "
                "in prompts and in other rows.",
    "stop_length": "Stop each row at exactly max_new_tokens, cutting a step that would overshoot.",
    "pad_as_content": "Tell padding from content by each row's length, never by token value: a pad-id token in a "
                      "prompt or output is content.",
    "output_order": "Return outputs in the order of the prompts (map results back by request id after any sort "
                    "or pool).",
    "cross_row": "Never let a row read another row's state: select, trim and write back caches per row by its "
                 "own index and its own accepted count.",
    "recurrent_state": "Roll each row's recurrent state (convolution window, SSM state) back to the state after its "
                       "last accepted token after every verification, per row, and never feed it padding.",
    "unknown": "Read the evidence and the divergence context; the diagnosis could not name the mechanism.",
}

RERUN_BUDGET = 24  # engine re-runs per audited run; the rest of the divergences get evidence only


def diagnosis(cls: str, evidence: str, tried: list[str] | None = None) -> dict[str, Any]:
    assert cls in CLASSES, cls
    return {"class": cls, "evidence": evidence, "tried": list(tried or [])}


@dataclass
class Diagnoser:
    """Everything a diagnosis of one run may look at, and its re-run budget."""

    prompts: list[list[int]]
    references: list[list[int]]
    outputs: list[list[int]]
    max_new_tokens: int
    eos_token_id: int | None
    pad_token_id: int | None
    trace: Any = None
    engine_logits: list[torch.Tensor | None] = field(default_factory=list)
    target: Any = None  # the target in the audit dtype, for replays
    draft: Any = None
    rerun: Callable[[list[int], int | None], list[list[int]]] | None = None
    reruns_left: int = RERUN_BUDGET
    _alone: dict[int, list[int] | str] = field(default_factory=dict)

    # ---- experiments -------------------------------------------------------------------------
    def _run(self, indices: list[int], pad_token_id: int | None = None) -> list[list[int]] | str:
        if self.rerun is None:
            return "no re-run available for this engine"
        if self.reruns_left <= 0:
            return "the re-run budget of this run is spent"
        self.reruns_left -= 1
        try:
            return [[int(t) for t in out] for out in self.rerun(indices, pad_token_id)]
        except Exception as exc:  # an experiment that fails tells that, not more
            return f"the re-run failed: {type(exc).__name__}: {exc}".splitlines()[0]

    def alone(self, index: int) -> list[int] | str:
        if index not in self._alone:
            result = self._run([index])
            self._alone[index] = result[0] if isinstance(result, list) else result
        return self._alone[index]

    def other_pad_id(self, indices: list[int]) -> int | None:
        used = {t for i in indices for t in self.prompts[i] + self.references[i] + self.outputs[i]}
        used |= {t for t in (self.pad_token_id, self.eos_token_id) if t is not None}
        # an id both models have (a padded vocabulary's extra ids cannot be fed to the smaller one)
        sizes = [getattr(getattr(model, "config", None), "vocab_size", None) for model in (self.target, self.draft)]
        vocab = int(min((size for size in sizes if isinstance(size, int)), default=0))
        for candidate in range(vocab - 1, -1, -1):
            if candidate not in used:
                return candidate
        return None

    # ---- the diagnosis -----------------------------------------------------------------------
    def diagnose(self, divergence: dict[str, Any]) -> dict[str, Any]:
        if divergence.get("detected_by") == "draft":
            return diagnosis("draft_cache", "the engine proposed a token that the draft model, run alone on the "
                             "same prefix, does not choose: the draft cache is out of step (outputs stay exact; "
                             "acceptance drops)", ["draft fidelity check"])
        tried: list[str] = []
        try:
            found = self._decide(int(divergence["prompt_index"]), int(divergence["position"]), tried)
        except Exception as exc:  # a diagnosis must never lose the divergence it describes
            tried.append(f"diagnosis failed: {type(exc).__name__}: {exc}".splitlines()[0])
            found = None
        if found is None:
            return diagnosis("unknown", "no check or experiment named the mechanism; see what was tried", tried)
        return diagnosis(*_in_recurrent_state(self.target, found), tried)

    def _logits(self, index: int) -> torch.Tensor | None:
        return self.engine_logits[index] if index < len(self.engine_logits) else None

    def _decide(self, index: int, position: int, tried: list[str]) -> Finding | None:
        prompt, reference, output = self.prompts[index], self.references[index], self.outputs[index]
        eos, logits = self.eos_token_id, self._logits(index)

        tried.append("output against the other prompts' references")
        found = checks.output_order(index, self.references, self.outputs)
        if found:
            return found
        tried.append("lengths against EOS and max_new_tokens")
        found = checks.stop_eos(index, prompt, reference, output, position, eos, self.trace, self.outputs)
        if found:
            return found
        tried.append("the engine's token against the draft model's own choice")
        found = checks.draft_token_kept(prompt, reference, output, position, self.draft, logits)
        if found:
            return found
        tried.append("the trace's proposals and counts against the target's choices")
        found = (checks.acceptance_from_trace(index, reference, output, position, self.max_new_tokens, eos, self.trace)
                 or checks.doubled_token(reference, output, position)
                 or checks.own_logits_not_chosen(output, position, logits))
        if found:
            return found
        found = checks.length_stop(reference, output, position, self.max_new_tokens, eos,
                                   self._continuation(index, len(output)) if len(output) > self.max_new_tokens else None)
        if found:
            return found

        found = self._pad_experiment(index, position, tried)
        if found:
            return found

        q = self._first_corrupted(index, position)
        hypothesis, replays = explain(self.target, prompt, output, q, self.trace, index, self.pad_token_id,
                                      logits[q] if logits is not None and q < logits.shape[0] else None, None)
        tried += [f"replay at new token {q}: {line}" for line in replays] or [f"replay at new token {q}: nothing to replay"]
        if hypothesis is not None:
            return Finding(hypothesis.cls, f"a replay of the target with {hypothesis.name} reproduces the engine at "
                           f"new token {q} ({replays[-1].split(': ', 1)[1]})")
        return self._batch_experiments(index, position, q, tried)

    def _continuation(self, index: int, length: int) -> list[int] | None:
        if self.target is None:
            return None
        from specaudit.engines.reference import greedy_decode

        return greedy_decode(self.target, list(self.prompts[index]), length, None)[0]

    def _first_corrupted(self, index: int, position: int) -> int:
        """The first new token whose recorded logits leave the float64 tolerance of the plain replay
        along the engine's own output (at most `position`); `position` without logits."""
        logits = self._logits(index)
        if logits is None or self.target is None or logits.dtype != torch.float64:
            return position
        from specaudit.equivalence.compare import replay_logits

        upto = min(position + 1, logits.shape[0], len(self.outputs[index]))
        if upto == 0:
            return position
        plain = replay_logits(self.target, self.prompts[index], self.outputs[index][:upto])
        errors = (logits[:upto].to(torch.float64) - plain.to(torch.float64)).abs().amax(dim=-1)
        beyond = (errors > 1e-9).nonzero().flatten()
        return int(beyond[0]) if beyond.numel() else position

    def _pad_experiment(self, index: int, position: int, tried: list[str]) -> Finding | None:
        pad = self.pad_token_id
        if pad is None:
            return None
        content = self.prompts[index] + self.outputs[index][:position]
        where = [i for i, t in enumerate(content) if t == pad]
        if not where:
            return None
        other = self.other_pad_id([index])
        if other is None:
            return None
        result = self._run([index], other)
        if isinstance(result, str):
            tried.append(f"re-run with pad id {other}: not run ({result})")
            return None
        exact = result[0] == self.references[index]
        tried.append(f"re-run alone with pad id {other} instead of {pad}: {'exact' if exact else 'still diverges'}")
        if not exact:
            return None
        n = len(self.prompts[index])
        places = ", ".join(f"prompt position {i}" if i < n else f"new token {i - n}" for i in where[:3])
        return Finding("pad_as_content", f"the pad id {pad} sits in the row as content ({places}); re-run with pad id "
                       f"{other}, the same prompt is exact: the engine treats a real token equal to the pad id as padding")

    def _batch_experiments(self, index: int, position: int, q: int, tried: list[str]) -> Finding | None:
        alone = self.alone(index)
        if isinstance(alone, str):
            tried.append(f"re-run alone: not run ({alone})")
            return self._single_row(index, q, tried, alone_known=False)
        exact = alone == self.references[index]
        tried.append(f"re-run alone (batch of 1): {'exact' if exact else 'still diverges'}")
        if not exact:
            return self._single_row(index, q, tried, alone_known=True)
        group = checks.group_of_unequal_rows(index, position, self.trace)
        if group:
            return group
        twin = self._run([index, index])
        if isinstance(twin, list):
            twin_exact = all(out == self.references[index] for out in twin)
            tried.append(f"re-run beside a copy of itself (batch of 2 identical rows): "
                         f"{'exact' if twin_exact else 'diverges'}")
        detail = ""
        finished = checks.finished_beside(index, position, self.trace)
        if finished is not None:
            detail = f"; prompt {finished[1]} of its batch finished at step {finished[0]}, before the divergence"
        uneven = checks.uneven_acceptance(index, position, self.trace)
        if uneven is not None:
            detail += (f"; at step {uneven[0]} it accepted more draft tokens than other rows of its batch "
                       f"(rows {uneven[1]} accepted {uneven[2]})")
        return Finding("cross_row", "alone the prompt is exact and in its batch it diverges, and neither shifted "
                       f"positions nor visible padding explain its logits: its output depends on the other rows{detail}")

    def _single_row(self, index: int, q: int, tried: list[str], alone_known: bool) -> Finding | None:
        rejected = checks.rejection_before(index, q, self.trace)
        if rejected is None:
            tried.append("no rejection before the divergence in the trace")
            return None
        where = "alone (batch of 1) the prompt still diverges" if alone_known else "the row diverges"
        return Finding("kv_cache", f"{where}; its logits are right until the step after step {rejected}, which "
                       "rejected draft tokens, and no position or mask hypothesis explains them: the target cache "
                       "kept or lost entries at the rejection")


def _in_recurrent_state(target: Any, found: Finding) -> tuple[str, str]:
    """A row's own cache wrong, or its output depending on its batch, in a model with recurrent
    layers: the state those layers keep per row (`engines/recurrent.py`) is the cache that went
    wrong, since a state cannot be trimmed like KV columns (the class names that fix)."""
    if found.cls not in ("kv_cache", "cross_row") or target is None:
        return found.cls, found.evidence
    from specaudit.engines.layout import attention_layer_kinds

    recurrent = attention_layer_kinds(target).count("recurrent")
    if not recurrent:
        return found.cls, found.evidence
    return "recurrent_state", (f"{found.evidence}; the target keeps recurrent state in {recurrent} layers, which a "
                               "rejection or another row changes exactly this way: the state was not the row's own "
                               "after its accepted tokens")
