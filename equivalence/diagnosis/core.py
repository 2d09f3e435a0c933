"""Name the bug: a diagnosis for every structural divergence.

Each structural divergence gets a `records.Diagnosis` (`diagnosis`): its class and evidence. The class says what
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
    prompt_truncated the prompt cut to a limit (its first or last N tokens) before decoding
    unknown          none of the above is shown by the evidence

The diagnosis ranks causes before symptoms and facts before coincidences, and stops at the first decisive
result. For an in-process engine whose audited run was watched, the provenance of what the producing query
read comes first (diagnosis/provenance/; a run not watched is observed by one hooked re-run of its call, after
the checks that need no re-run, `_ranked_checks`): a column its row never fed, padding or fill visible, a row token hidden, a token
at another position, a recurrent state or window not the row's own name the class by fact. Then the output
against other prompts' references; a reference replay on the prompt cut to a common limit
(`prompt_truncated`); the pad id in the row (or equal to EOS beside a row that stopped early), decided by a
re-run with another pad id or, when the engine takes no pad option, by a replay with the pad-id tokens masked
and where the divergence starts (`diagnosis/causes.py`); the EOS and the trace's own record; then logit replays
with shifted positions or a widened mask (`diagnosis/replay.py`), made only where the provenance saw nothing
(servers, recordings, an engine whose target cannot be hooked), judged on tokens alone only where nothing can
run again (a recording); then a repeated token and the length symptom; last, the controlled re-runs: alone,
beside a neighbour of the same padding and beside another of the same length, with another pad id. The
heuristic that the engine's token is the draft's own choice ranks before those re-runs in a watched run and
after them in one not watched (a coincidence of tokens after the experiments). `evidence` says
what was tried and what it showed, and `named_by` which evidence decided. An input class that the provenance
contradicts (every query with the row's exact context chose the reference's token) becomes `unknown` with
what was seen, and so does `acceptance_rule` for an engine that did not speculate; a provenance that saw
nothing leaves the class to the replays. Divergences of one run that one mechanism explains say so
(`note_shared_mechanisms`).

The ranking is `Diagnoser._ranked_checks`, a tuple of checks in that order: each reads the divergence (`Case`),
notes what it tried and returns a cause or None, and the first cause decides (`_decide`); the provenance's
reading is kept for the reconciliation (`observe.Observing._reconcile`). What a run's diagnosis reads comes in
one frozen record, `facts.RunFacts`, built where the audit diagnoses the run.

Re-runs go through the run's context (`equivalence/run_context.py`): `run.rerun(indices, pad_token_id)`
builds a fresh engine and runs it on the prompts at `indices` (repeats allowed); without one, the
experiments that need it are reported as not run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from collections.abc import Sequence
from typing import Any, Callable

import torch

from specaudit.engines.limits import eos_ids
from specaudit.equivalence.diagnosis import causes, checks
from specaudit.equivalence.diagnosis.causes import Cause, note_shared_mechanisms  # noqa: F401 (re-exported)
from specaudit.equivalence.diagnosis.checks import Finding
from specaudit.equivalence.diagnosis.experiments import Experiments
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.diagnosis.observe import DRAFT_CHOICE, OBSERVED_MECHANISMS, Observing
from specaudit.equivalence.diagnosis.replay import RowContext, explain
from specaudit.equivalence.diagnosis.provenance import (CHOSE_RIGHT, EMITTED_TWICE, EXTRA_ENTRY, FILL_VISIBLE, PADDING_IN_STATE,
                                                        PADDING_VISIBLE, PAD_HIDDEN, TOKEN_HIDDEN, WRONG_POSITION,
                                                        WRONG_STATE, WRONG_WINDOW, Provenance, ProvenanceLog,
                                                        provenance_diagnosis)
from specaudit.equivalence.records import ABSENT, Diagnosis, Divergence
from specaudit.equivalence.rulings.thresholds import FLOAT64_LOGIT_TOLERANCE, PAD_RERUN_BUDGET, RERUN_BUDGET

PROVENANCE = "the provenance of the columns each query read"
# what the provenance check decides first: a column the producing query read that its row's sequence does not
# hold there (padding, fill no target call wrote, an extra entry), a row token it could not read, a token at
# another position, one target choice emitted twice (`provenance.emitted_twice`). A token no readable column holds (a missing entry), a foreign entry and the classes after
# the logits are left to the checks below: the outputs against every reference, the pad-id and stop experiments,
# the trace
DECISIVE_FACTS = (PADDING_VISIBLE, FILL_VISIBLE, TOKEN_HIDDEN, PAD_HIDDEN, EXTRA_ENTRY, WRONG_POSITION, WRONG_STATE,
                  PADDING_IN_STATE, WRONG_WINDOW, EMITTED_TWICE)

CLASSES: tuple[str, ...] = ("position_ids", "attention_mask", "kv_cache", "draft_cache", "acceptance_rule",
                            "stop_eos", "stop_length", "pad_as_content", "output_order", "cross_row", "recurrent_state",
                            "prompt_truncated",
                            "unknown")

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
    "prompt_truncated": "Decode the whole prompt: never cut it to a length limit; refuse a prompt longer than the "
                        "model allows with a clear error instead.",
    "unknown": "Read the evidence and the divergence context; the diagnosis could not name the mechanism.",
}



WOULD_DECIDE = ("the engine's target logits at the divergence (a trace with record_logits), replayed under the "
                "position and mask hypotheses; or re-runs of the row beside other neighbours of the same length")


def diagnosis(cls: str, evidence: str, tried: Sequence[str] | None = None, named_by: str | None = None,
              mechanism: str | None = None, would_decide: str | None = None) -> Diagnosis:
    """A named class carries `named_by` (the experiment that decided it) and `tried` (every check,
    replay and re-run made, with what it showed: the alternatives ruled out); `unknown` carries
    `would_decide`, the experiment that would name it."""
    assert cls in CLASSES, cls
    return Diagnosis(cls=cls, evidence=evidence, tried=tuple(tried or ()), named_by=named_by or ABSENT,
                     mechanism=mechanism or ABSENT,
                     would_decide=(would_decide or WOULD_DECIDE) if cls == "unknown" else ABSENT)


@dataclass(frozen=True)
class Case:
    """One divergence as the ranked checks read it: prompt `index`'s new token `position`, the row's prompt,
    reference and output, and the engine's logits of its tokens [n, V] (None: not recorded)."""

    index: int
    position: int
    prompt: list[int]
    reference: list[int]
    output: list[int]
    logits: torch.Tensor | None
    first_corrupted: Callable[[], int] = field(repr=False)

    @cached_property
    def q(self) -> int:
        """The first new token whose recorded logits are off (`position` without them): computed once, by the
        first check that reads it (a replay along the row)."""
        return self.first_corrupted()


Check = Callable[[Case, list[str]], Cause | None]  # a ranked check: the divergence, what was tried -> its cause


def _cause(found: Finding | Cause, named_by: str) -> Cause:
    """A check's finding as a cause, with what decided it."""
    if isinstance(found, Cause):
        return found
    return Cause(found.cls, found.evidence, named_by, "")


@dataclass
class Diagnoser(Experiments, Observing):
    """One run's diagnosis: what it reads (`facts`), its re-run budgets and the experiments it made."""

    facts: RunFacts
    # the references the divergences are diagnosed against: the audit's, where the audit swaps in, for a divergence
    # judged past a numerical flip, the reference it was judged by (audit.diagnose)
    references: list[list[int]] = field(init=False)
    replay_draft: Any = field(init=False)  # the draft in float64 (below float64; made from the draft when not given)
    reruns_left: int = RERUN_BUDGET
    pad_reruns_left: int = PAD_RERUN_BUDGET
    observe_seconds: float = 0.0  # the hooked re-runs' time
    rerun_seconds: float = 0.0
    _alone: dict[int, list[int] | str] = field(default_factory=dict)
    _explained_by: list[str] = field(default_factory=list)  # replay hypotheses that explained, most recent first
    # per batch: the other pad id and the batch's re-run with it (or why none ran)
    _pad_read: dict[tuple[int, ...], tuple[int | None, Any]] = field(default_factory=dict)
    _draft_precision: Any = None  # draft_fidelity.DraftPrecision, made on the first draft check below float64
    # the provenance records of the watched call or of one hooked re-run (or why none), once read (observe.py)
    _run_observation: Any = None
    _observed: Any = None  # provenance.Reading of the divergence being diagnosed, for `_reconcile`
    _provenance_check: Any = None  # provenance.Provenance over the watched call, shared by the run's divergences

    def __post_init__(self) -> None:
        self.references = list(self.facts.references)
        self.replay_draft = self.facts.replay_draft

    # ---- the diagnosis -----------------------------------------------------------------------
    def diagnose(self, divergence: Divergence) -> Diagnosis:
        if divergence.detected_by == "draft":
            return diagnosis("draft_cache", "the engine proposed a token that the draft model, run alone on the "
                             "same prefix, does not choose: the draft cache is out of step (outputs stay exact; "
                             "acceptance drops)", ["draft fidelity check"], "the draft fidelity check")
        tried: list[str] = []
        try:
            self._observed = None
            found = self._decide(divergence.prompt_index, int(divergence.position), tried)  # type: ignore[arg-type]
            found = self._reconcile(found, tried)
        except Exception as exc:  # a diagnosis must never lose the divergence it describes
            tried.append(f"diagnosis failed: {type(exc).__name__}: {exc}".splitlines()[0])
            found = None
        if found is None:
            return diagnosis("unknown", "no check or experiment named the mechanism; see what was tried", tried)
        if found.cls == "unknown":  # an experiment narrowed it down without naming it
            return diagnosis("unknown", found.evidence, tried, would_decide=found.named_by or None)
        if str(found.named_by).startswith(PROVENANCE):  # seen, not guessed: decided as seen
            return diagnosis(found.cls, found.evidence, tried, found.named_by, found.mechanism or None)
        return diagnosis(found.cls, found.evidence + f" (decided by {found.named_by})", tried, found.named_by,
                         found.mechanism or None)

    def _logits(self, index: int) -> torch.Tensor | None:
        return self.facts.engine_logits[index] if index < len(self.facts.engine_logits) else None

    def _case(self, index: int, position: int) -> Case:
        logits = self._logits(index)
        return Case(index, position, self.facts.prompts[index], self.references[index], self.facts.outputs[index], logits,
                    lambda: self._first_corrupted(index, position))

    def _ranked_checks(self) -> tuple[Check, ...]:
        """Causes before symptoms, experiments before coincidences: the order is the ranking. Each check reads
        the divergence (and notes what it tried) and returns its verdict, a cause or None; the first cause
        decides. Where the run's own call was watched, its provenance ranks first: the output against other
        prompts' references is a coincidence of tokens, and the pad-id re-run runs a batch of consecutive prompts
        the engine may never have formed, while a violation seen in the run is the cause (a row whose pad-id
        tokens were hidden is `pad_as_content` there too). Unwatched, the provenance needs a hooked re-run of the
        whole call, so the checks that need none come first."""
        if self.facts.watch is not None:
            return (self._provenance, self._output_order, self._answered_elsewhere, self._truncation,
                    self._pad_cause, self._stop_eos, self._trace_and_logits, self._overlong, self._reproducing_replay,
                    self._doubled_token, self._draft_choice, self._after_the_logits, self._length,
                    self._batch_experiments)
        # unwatched, the draft's own choice is a coincidence of tokens: it ranks after the controlled re-runs
        return (self._output_order, self._answered_elsewhere, self._truncation, self._pad_cause, self._stop_eos,
                self._trace_and_logits, self._overlong, self._provenance, self._reproducing_replay,
                self._doubled_token, self._after_the_logits, self._length, self._batch_experiments,
                self._draft_choice)

    def _decide(self, index: int, position: int, tried: list[str]) -> Cause | None:
        case = self._case(index, position)
        for check in self._ranked_checks():
            cause = check(case, tried)
            if cause is not None:
                return cause
        return None

    # ---- the ranked checks, in their order ---------------------------------------------------------
    def _output_order(self, case: Case, tried: list[str]) -> Cause | None:
        tried.append("output against the other prompts' references")
        found = checks.output_order(case.index, self.references, self.facts.outputs)
        if found:
            return Cause(found.cls, found.evidence, "the outputs against every prompt's reference",
                         "outputs answered for other prompts")
        return None

    def _truncation(self, case: Case, tried: list[str]) -> Cause | None:
        if len(case.prompt) <= min(causes.TRUNCATION_LIMITS):
            return None
        return causes.truncation(self.facts.target, case.prompt, case.output, case.position, self.facts.max_new_tokens,
                                 self.facts.eos_token_id, tried, case.logits)

    def _stop_eos(self, case: Case, tried: list[str]) -> Cause | None:
        tried.append("lengths against EOS")
        found = checks.stop_eos(case.index, case.prompt, case.reference, case.output, case.position, self.facts.eos_token_id,
                                self.facts.trace, self.facts.outputs, self._batch_rows(case.index))
        return _cause(found, "the output's length against its EOS") if found else None

    def _choice(self, index: int) -> checks.Choice | None:
        """How a correct decoder chooses from raw logits at each new token of prompt `index` (request parameters
        processed: `RunFacts.processed`); None: the argmax."""
        if self.facts.processed is None:
            return None
        return lambda position, logits: self.facts.choice(index, position, logits)

    def _trace_and_logits(self, case: Case, tried: list[str]) -> Cause | None:
        tried.append("the trace's proposals and counts against the target's choices")
        found = (checks.acceptance_from_trace(case.index, case.reference, case.output, case.position,
                                              self.facts.max_new_tokens, self.facts.eos_token_id, self.facts.trace)
                 or checks.own_logits_not_chosen(case.output, case.position, case.logits, self._choice(case.index)))
        return _cause(found, "the engine's own trace and logits") if found else None

    def _overlong(self, case: Case, tried: list[str]) -> Cause | None:
        if len(case.output) <= self.facts.max_new_tokens:
            return None
        found = checks.length_stop(case.reference, case.output, case.position, self.facts.max_new_tokens,
                                   self.facts.eos_token_id, self._continuation(case.index, len(case.output)))
        return _cause(found, "the output's length against max_new_tokens") if found else None

    def _provenance(self, case: Case, tried: list[str]) -> Cause | None:
        """The provenance check on the watched call, else on one hooked re-run of it (diagnosis/provenance/): the
        first violation behind the query that chose the engine's token names the input class by fact. Where
        queries that read the row's exact context chose the reference's token (the bug is after the logits), a
        query with the row's exact context chose the engine's token, the fact is one the checks below tell apart
        better (a missing or foreign entry), or nothing was seen, it decides nothing: the checks below (the
        outputs against the references, the pad-id and stop experiments, the trace) go on, and what it read is
        kept to check their class (`_reconcile`)."""
        log = self._observation()
        if not isinstance(log, ProvenanceLog):
            tried.append(f"provenance of what each query read: not seen ({log})")
            return None
        started = time.perf_counter()
        try:
            return self._provenance_cause(log, case, tried)
        finally:
            self.observe_seconds += time.perf_counter() - started  # reading what the hooks kept

    def _provenance_cause(self, log: ProvenanceLog, case: Case, tried: list[str]) -> Cause | None:
        if self._provenance_check is None:
            self._provenance_check = Provenance(log, [list(p) + list(o) for p, o in
                                                      zip(self.facts.prompts, self.facts.outputs)])
        output = case.output
        divergence = {"prompt_index": case.index, "position": case.position,
                      "engine_token": output[case.position] if case.position < len(output) else None}
        reading = provenance_diagnosis(log, self.facts.prompts, self.facts.outputs, self.references, divergence,
                                       eos_token_id=self.facts.eos_token_id, max_new_tokens=self.facts.max_new_tokens,
                                       provenance=self._provenance_check)
        tried.append(f"provenance of what each query read: {reading.cls}: {reading.evidence}")
        self._observed = reading
        if reading.fact not in DECISIVE_FACTS:
            return None  # the inputs seen right, or a fact the checks below tell apart better (module docstring)
        return Cause(reading.cls, reading.evidence, PROVENANCE, OBSERVED_MECHANISMS[reading.cls])

    def _reproducing_replay(self, case: Case, tried: list[str]) -> Cause | None:
        if self._observed is not None and self._observed.fact == CHOSE_RIGHT:
            tried.append("replays of hypotheses on the target's inputs: not made (queries that read the row's exact "
                         "context chose the reference's token)")
            return None
        index, q, logits = case.index, case.q, case.logits
        if logits is None and (isinstance(self._run_observation, ProvenanceLog) or self.facts.run is not None):
            # a replay judged on tokens alone can agree by chance: where the run was seen, what it read decides;
            # where the engine can run again, the controlled re-runs below do (alone, beside a neighbour, the pad id)
            seen = "the provenance saw the run's inputs" if isinstance(self._run_observation, ProvenanceLog) else \
                "the engine can run again: controlled re-runs decide"
            tried.append(f"replays of hypotheses on tokens: not made ({seen})")
            return None
        hypothesis, replays = explain(self.facts.replay_target or self.facts.target, case.prompt, case.output, q,
                                      self.facts.trace, index, self.facts.pad_token_id,
                                      logits[q] if logits is not None and q < logits.shape[0] else None,
                                      None, prefer=tuple(self._explained_by), row=self._row_context(index),
                                      noise=self.precision_noise(index))
        tried += [f"replay at new token {q}: {line}" for line in replays] or [f"replay at new token {q}: nothing to replay"]
        if hypothesis is None:
            return None
        if hypothesis.name in self._explained_by:
            self._explained_by.remove(hypothesis.name)
        self._explained_by.insert(0, hypothesis.name)
        shown = next((line for line in replays if line.startswith(hypothesis.name + ": ")), replays[-1])
        return Cause(hypothesis.cls, f"a replay of the target with {hypothesis.name} reproduces the engine at "
                     f"new token {q} ({shown.split(': ', 1)[1]})", "a reproducing replay", hypothesis.mechanism)

    def _doubled_token(self, case: Case, tried: list[str]) -> Cause | None:
        """A heuristic: a repeated token can be a coincidence, so it ranks after the replays."""
        tried.append("the output with a repeated token dropped against the reference")
        found = checks.doubled_token(case.reference, case.output, case.position)
        return _cause(found, "the output with its repeated token dropped (no replay reproduced it)") if found else None

    def _draft_choice(self, case: Case, tried: list[str]) -> Cause | None:
        tried.append("the engine's token against the draft model's own choice")
        found = checks.draft_token_kept(case.prompt, case.reference, case.output, case.position, self.facts.draft,
                                        case.logits, self._draft_chose, self._choice(case.index))
        return _cause(found, DRAFT_CHOICE) if found else None

    def _after_the_logits(self, case: Case, tried: list[str]) -> Cause | None:
        """Where the provenance saw the target choose right and no check above named
        what came after the logits, the class it read from the run's own facts (`provenance.after_the_logits`)."""
        reading = self._observed
        if reading is None or reading.fact != CHOSE_RIGHT or reading.cls == "unknown":
            return None
        return Cause(reading.cls, reading.evidence, PROVENANCE, "")

    def _length(self, case: Case, tried: list[str]) -> Cause | None:
        found = checks.length_stop(case.reference, case.output, case.position, self.facts.max_new_tokens,
                                   self.facts.eos_token_id, None)
        return _cause(found, "the output's length (no cause explains it)") if found else None

    def _batch_experiments(self, case: Case, tried: list[str]) -> Cause | None:
        found = self._in_batch(case.index, case.position, case.q, tried)
        return _cause(found, "re-runs alone and in its batch") if found else None

    def _draft_chose(self, prefix: list[int], choice: int, token: int) -> bool:
        """Below float64: a draft that chooses `choice` on `prefix` in the audit dtype may have chosen `token`
        in the engine's own rounding, ruled as the draft-fidelity check rules a proposal
        (`draft_fidelity.DraftPrecision`, its floor measured along this prefix)."""
        if self.facts.ruler is None or self.facts.draft is None:
            return False  # float64: the draft's choice is exact
        if self._draft_precision is None:
            from specaudit.engines.models.zoo import float64_copy
            from specaudit.equivalence.rulings import DraftPrecision

            if self.replay_draft is None:
                self.replay_draft = float64_copy(self.facts.draft)
            self._draft_precision = DraftPrecision(self.facts.ruler.dtype, self.facts.draft, self.replay_draft)
        return self._draft_precision.admits(prefix, choice, token)

    def _batch_rows(self, index: int) -> list[int]:
        """The rows of prompt `index`'s batch: consecutive batches of the run's batch size."""
        if not self.facts.batch_size:
            return [index]
        start = index - index % self.facts.batch_size
        return list(range(start, min(start + self.facts.batch_size, len(self.facts.prompts))))

    def _row_context(self, index: int) -> RowContext:
        padding = None
        if self.facts.batch_size:
            rows = self._batch_rows(index)
            padding = max(len(self.facts.prompts[j]) for j in rows) - len(self.facts.prompts[index])
        return RowContext(padding, self.facts.draft, self.facts.draft_tokens)

    def _continuation(self, index: int, length: int) -> list[int] | None:
        if self.facts.target is None:
            return None
        from specaudit.engines.reference import greedy_decode

        return greedy_decode(self.facts.target, list(self.facts.prompts[index]), length, None)[0]

    def _first_corrupted(self, index: int, position: int) -> int:
        """The first new token whose recorded logits leave the float64 tolerance of the plain replay
        along the engine's own output (at most `position`); `position` without logits."""
        logits = self._logits(index)
        if logits is None or self.facts.target is None or logits.dtype != torch.float64:
            return position
        from specaudit.equivalence.compare import replay_logits

        upto = min(position + 1, logits.shape[0], len(self.facts.outputs[index]))
        if upto == 0:
            return position
        plain = replay_logits(self.facts.target, self.facts.prompts[index], self.facts.outputs[index][:upto])
        errors = (logits[:upto].to(torch.float64) - plain.to(torch.float64)).abs().amax(dim=-1)
        beyond = (errors > FLOAT64_LOGIT_TOLERANCE).nonzero().flatten()
        return int(beyond[0]) if beyond.numel() else position

    def _answered_elsewhere(self, case: Case, tried: list[str]) -> Cause | None:
        """When other outputs of the run are exactly other prompts' references, re-run this prompt
        alone: its own output there, returned in the run for another prompt, is an order bug."""
        index = case.index
        crossed = [j for j, out in enumerate(self.facts.outputs)
                   if out and out != self.references[j] and out in self.references]
        if not crossed:
            return None
        alone = self.alone(index)
        if not isinstance(alone, list) or not alone or alone == self.facts.outputs[index]:
            return None
        places = [j for j, out in enumerate(self.facts.outputs)
                  if j != index and out == alone and self.facts.prompts[j] != self.facts.prompts[index]]
        tried.append(f"re-run alone beside the run's outputs: {'returned for prompt ' + str(places[0]) if places else 'not in the run'}")
        if not places:
            return None
        return Cause("output_order", f"alone, prompt {index} gives the output that the run returned for prompt "
                     f"{places[0]}, and {len(crossed)} output(s) of the run are exactly other prompts' references: "
                     "the engine returns its outputs in another order than the prompts",
                     "a re-run alone beside the run's outputs", "outputs answered for other prompts")

    def _pad_cause(self, case: Case, tried: list[str]) -> Cause | None:
        """A pad id in the row (or a pad id equal to EOS beside a row that stopped early): the
        re-run with another pad id decides; without it, the other evidence does."""
        index, position = case.index, case.position
        pad, eos = self.facts.pad_token_id, self.facts.eos_token_id
        evidence = causes.pad_evidence(index, self.facts.prompts, self.references, self.facts.outputs, position, pad, eos)
        if evidence is None or not evidence.any:
            return None
        prompt, reference, output = self.facts.prompts[index], self.references[index], self.facts.outputs[index]
        stopped_early = len(output) < len(reference) and (not output or output[-1] not in eos_ids(eos))
        if not (evidence.in_prompt or evidence.in_output) and not stopped_early:
            return None  # pad = EOS matters to rows that stop early
        mechanism = "pad-id tokens treated as padding"
        tried.append(f"the pad id {pad} in the row: {evidence.where() or 'none'}; pad id = EOS: {evidence.pad_is_eos}")
        # the row's own batch again (consecutive batches), only the pad id changed: a controlled experiment
        batch = self._batch_rows(index)
        other, result = self._pad_rerun(batch)
        if isinstance(result, list):
            exact = self.equivalent(index, result[batch.index(index)])
            where = "alone" if len(batch) == 1 else f"in its batch (prompts {batch[0]} to {batch[-1]})"
            tried.append(f"re-run {where} with pad id {other} instead of {pad}: "
                         f"{self._verdict(index, result[batch.index(index)])}")
            if not exact:
                return None  # the experiment says the pad id is not the cause
            what = (f"the pad id {pad} sits in the row as content ({evidence.where()})" if evidence.where() else
                    f"the pad id {pad} is the EOS id and the row stopped after {len(output)} token(s) with no EOS of "
                    "its own")
            return Cause("pad_as_content", f"{what}; re-run {where} with pad id {other}, the same prompt is exact: the "
                         "engine treats a token equal to the pad id as padding (or padding as content)",
                         "a re-run with another pad id", mechanism)
        tried.append(f"re-run with another pad id: not run ({result})")
        cause = causes.slice_shift(prompt, reference, output, pad, evidence) or causes.masked_replay(
            self.facts.target, prompt, reference, output, pad, self.facts.max_new_tokens, eos, evidence, tried, position)
        if cause:
            return cause
        if prompt and all(t == pad for t in prompt) and position == 0:
            alone = self.alone(index)  # alone, no padding: a wrong first token there is the pad id's doing
            if isinstance(alone, str) or (alone[:1] != reference[:1] and not self.equivalent(index, alone)):
                seen = ("not run (" + alone + ")") if isinstance(alone, str) else "its first new token still differs"
                tried.append(f"re-run alone (batch of 1, no padding): {seen}")
                return Cause("pad_as_content", f"the whole prompt is the pad id {pad} and the engine differs from the "
                             f"first new token on, alone too{'' if not isinstance(alone, str) else ' (not run)'}"
                             f"{evidence.others_text()}: it read the row's only content as padding",
                             "the divergence starts where the pad ids sit (no re-run with another pad id could be "
                             "made)", mechanism)
            tried.append("re-run alone (batch of 1, no padding): its first new token is right")
        if evidence.pad_is_eos and stopped_early and not any(t in eos_ids(eos) for t in prompt):
            alone = self.alone(index)
            if isinstance(alone, list) and self.equivalent(index, alone[:len(reference)]):  # (tokens after EOS: another bug)
                return Cause("pad_as_content", f"the pad id {pad} is the EOS id; the row stopped after {len(output)} "
                             "token(s) with no EOS of its own, and alone (a batch of 1, no padding) it is exact: its "
                             "left padding was read as an EOS", "a re-run alone, without padding",
                             "padding equal to EOS read as a finished row")
            tried.append(f"re-run alone: {'not run (' + alone + ')' if isinstance(alone, str) else 'still diverges'}")
            if isinstance(alone, str):
                return Cause("pad_as_content", f"the pad id {pad} is the EOS id; the row stopped after {len(output)} "
                             "token(s) with no EOS of its own and its prompt holds no EOS: the only EOS ids in its "
                             "rows are padding", "the pad id equals EOS beside a row that stopped early (no re-run "
                             "could be made)", "padding equal to EOS read as a finished row")
        if evidence.in_prompt and position == 0 and evidence.others and evidence.others[0] == evidence.others[1]:
            return Cause("pad_as_content", f"the pad id {pad} sits in the prompt ({evidence.where()}), the divergence "
                         f"starts at the first new token{evidence.others_text()}: the pad ids are what sets this row "
                         "apart", "the divergence starts where the pad ids sit and every row without them is exact",
                         mechanism)
        return None

    def _in_batch(self, index: int, position: int, q: int, tried: list[str]) -> Finding | Cause | None:
        alone = self.alone(index)
        if isinstance(alone, str):
            tried.append(f"re-run alone: not run ({alone})")
            return self._single_row(index, q, tried, alone_known=False)
        exact = self.equivalent(index, alone)
        tried.append(f"re-run alone (batch of 1): {self._verdict(index, alone)}")
        if not exact:
            return self._single_row(index, q, tried, alone_known=True)
        group = checks.group_of_unequal_rows(index, position, self.facts.trace)
        if group:
            return group
        own = self._own_padding(index, position, tried)
        if own is not None:
            return own
        twin = self._run([index, index])
        if isinstance(twin, list):
            twin_exact = all(self.equivalent(index, out) for out in twin)
            tried.append(f"re-run beside a copy of itself (batch of 2 identical rows): "
                         f"{'equivalent' if twin_exact else 'diverges'}")
        detail = ""
        finished = checks.finished_beside(index, position, self.facts.trace)
        if finished is not None:
            detail = f"; prompt {finished[1]} of its batch finished at step {finished[0]}, before the divergence"
        uneven = checks.uneven_acceptance(index, position, self.facts.trace)
        if uneven is not None:
            detail += (f"; at step {uneven[0]} it accepted more draft tokens than other rows of its batch "
                       f"(rows {uneven[1]} accepted {uneven[2]})")
        return Finding("cross_row", "alone the prompt is exact and in its batch it diverges, and neither shifted "
                       f"positions nor visible padding explain its logits: its output depends on the other rows{detail}")

    def _own_padding(self, index: int, position: int, tried: list[str]) -> Cause | None:
        """Alone exact, in its batch not: is it the row's own left padding or its neighbours? Re-run the row
        beside the longest prompt of its batch (the same left padding as in the run), then beside another
        prompt of that same length (only the neighbour changed). `cross_row` only when changing only the
        neighbour changes the row's tokens; the row's own padding when it does not."""
        rows = self._batch_rows(index)
        mine = len(self.facts.prompts[index])
        longest = max(rows, key=lambda j: (len(self.facts.prompts[j]), j == index))
        width = len(self.facts.prompts[longest])
        if longest == index or width <= mine:
            tried.append("re-run with the row's own left padding: none to test (the row is the longest of its batch, "
                         "its prefill has no padding)")
            return None
        pad = width - mine
        beside = self._run([index, longest])
        if isinstance(beside, str):
            tried.append(f"re-run with the same left padding ({pad}) beside prompt {longest}: not run ({beside})")
            return None
        padded = beside[0]
        tried.append(f"re-run beside prompt {longest} alone (the same left padding, {pad}, as in its batch): "
                     f"{self._verdict(index, padded)}"
                     + (", the run's own output" if padded == self.facts.outputs[index] else ""))
        if self.equivalent(index, padded):
            return Cause("cross_row", f"alone the prompt is exact; beside prompt {longest} alone, with the same left "
                         f"padding ({pad}) as in its batch, it is exact too; in its batch it diverges: the other rows "
                         "of its batch (not its own padding) change its tokens", "re-runs with the same padding beside "
                         "other neighbours", "other rows' content read by this row")
        prompts = self.facts.prompts
        others = [j for j in range(len(prompts))
                  if j not in (index, longest) and len(prompts[j]) == width and prompts[j] != prompts[longest]]
        if not others:
            tried.append(f"re-run beside another prompt of length {width}: none in the run")
            return self._own_padding_read(index, pad, f"alone the prompt is exact; beside prompt {longest} alone, with "
                                          f"the same left padding ({pad}) as in its batch, it still diverges: its own "
                                          "left padding changes its tokens", tried)
        swapped = self._run([index, others[0]])
        if isinstance(swapped, str):
            tried.append(f"re-run beside prompt {others[0]} (the same length): not run ({swapped})")
            return None
        upto = position + 1  # the row's tokens up to and with the divergence
        same = swapped[0][:upto] == padded[:upto]
        tried.append(f"re-run beside prompt {others[0]} instead (the same length, the same padding; only the "
                     f"neighbour changed): {'the same' if same else 'other'} tokens up to new token {position}")
        if not same:
            return Cause("cross_row", f"with the same left padding ({pad}), beside prompt {longest} and beside prompt "
                         f"{others[0]} (the same length) the row gives different tokens: its neighbour's content "
                         "changes its output", "a re-run that changes only the neighbour",
                         "other rows' content read by this row")
        return self._own_padding_read(index, pad, f"alone the prompt is exact; with the same left padding ({pad}) it "
                                      f"diverges beside prompt {longest} and gives the same tokens beside prompt "
                                      f"{others[0]} (only the neighbour changed): its own left padding, not its "
                                      "neighbours, changes its tokens", tried)

    def _own_padding_read(self, index: int, pad: int, shown: str, tried: list[str]) -> Cause:
        """The row's own left padding changes its tokens: counted in its positions, or attended. Another pad id
        tells them apart (attended padding is read, so its tokens change; padding only counted is never read);
        without that re-run the two stay named together."""
        batch = self._batch_rows(index)
        other, result = self._pad_rerun(batch)
        if isinstance(result, str):
            tried.append(f"re-run with another pad id: not run ({result})")
            return Cause("unknown", f"{shown}: it depends on its padding, `attention_mask` or `position_ids` "
                         "(positions counted over it, or the padding attended), and no re-run with another pad id "
                         "could tell which", "a re-run of its batch with another pad id", "")
        read = result[batch.index(index)] != self.facts.outputs[index]
        tried.append(f"re-run of its batch with pad id {other} instead of {self.facts.pad_token_id}: the row's tokens "
                     f"{'change' if read else 'stay the same'}")
        if read:
            return Cause("attention_mask", f"{shown}; with pad id {other} its tokens change: its queries read the "
                         f"padding", "re-runs with the same padding, then with another pad id",
                         "the row's padding visible to its queries")
        return Cause("position_ids", f"{shown}; with pad id {other} its tokens stay the same: the padding is not "
                     "read, only counted in its positions", "re-runs with the same padding, then with another pad id",
                     "position ids counted over the row's padding")

    def _pad_rerun(self, batch: list[int]) -> tuple[int | None, Any]:
        """The batch's re-run with another pad id, made once per batch: (the pad id, the outputs or why none)."""
        key = tuple(batch)
        if key not in self._pad_read:
            other = self.other_pad_id(batch)
            self._pad_read[key] = (other, self._run(batch, other) if other is not None else
                                   "no unused token id for another pad id")
        return self._pad_read[key]

    def _single_row(self, index: int, q: int, tried: list[str], alone_known: bool) -> Finding | None:
        rejected = checks.rejection_before(index, q, self.facts.trace)
        if rejected is None:
            tried.append("no rejection before the divergence in the trace")
            return None
        where = "alone (batch of 1) the prompt still diverges" if alone_known else "the row diverges"
        return Finding("kv_cache", f"{where}; its logits are right until the step after step {rejected}, which "
                       "rejected draft tokens, and no position or mask hypothesis explains them: the target cache "
                       "kept or lost entries at the rejection")
