"""Diagnosis by observation: what an in-process engine's target calls read, recorded where the engine runs.

An in-process engine runs on the models the audit hands it, so what its target reads can be seen. The audit holds
a `Watch` (the provenance hooks, provenance/hooks.py) around the engine's own `generate` call in the audited run:
the batches, order, padding and schedule are the engine's own, read from its calls, never assumed from
`--batch-size`. The hooks keep per target call and batch row what the provenance check reads (provenance/) and
time themselves (`Watch.hook_seconds`, the observation's cost to the run). A run that was not watched (an
isolated run, a run made elsewhere) is observed by `observe_run`: the run's call made again once with the hooks
(every prompt, in the run's order, in one `generate`, through the run's context); a re-run that gives other tokens
than the run is not the run: it decides nothing, and says so. The engine's code is untouched.

`Observing` is the part of `Diagnoser` (core.py) that reads the observation:

1. `_observation`: the watched call's records, else one hooked re-run's, shared by every divergence of the run.
2. `_reconcile`: a class the later checks name is checked against what was seen; only a positive contradiction
   overrules it: every query that read the row's exact context chose the reference's token (an input class is
   then refuted), or the engine never verified proposals, or a target query chose the engine's token
   (`acceptance_rule` is then refuted).
"""

from __future__ import annotations

import time
from typing import Any

from specaudit.equivalence import speculation
from specaudit.equivalence.diagnosis.anatomy import observable
from specaudit.equivalence.diagnosis.causes import Cause
from specaudit.equivalence.diagnosis.checks import Finding
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.diagnosis.provenance import CHOSE_RIGHT, CLASS_OF, ProvenanceLog, Reading
from specaudit.equivalence.diagnosis.provenance.hooks import ProvenanceHooks
from specaudit.equivalence.run_context import RunContext

# the classes of what a target call read: the provenance names them by fact, and a target query that read the
# row's exact context and chose right refutes them
INPUT_CLASSES = ("position_ids", "attention_mask", "kv_cache", "pad_as_content", "cross_row", "recurrent_state")
# the input classes only the target's inputs can cause: a query that read the row's exact context and chose right
# refutes them (a real token taken for padding, or a result written to another row, can come after the logits)
REFUTED_BY_RIGHT_CHOICE = ("position_ids", "attention_mask", "kv_cache", "recurrent_state")
# the named_by of the coincidence check: the engine's token is the draft's own choice
DRAFT_CHOICE = "the engine's token is the draft's own choice (no replay reproduced it)"
# the bug behind each class the provenance names
OBSERVED_MECHANISMS: dict[str, str] = {
    "position_ids": "position ids other than each token's index in its row (observed)",
    "attention_mask": "queries reading padding or holes, or missing the row's tokens (observed)",
    "kv_cache": "cache entries the row did not accept, read (observed)",
    "pad_as_content": "pad-id tokens of the row hidden as padding (observed)",
    "cross_row": "another row's tokens read (observed)",
    "recurrent_state": "a recurrent state not the row's own after its accepted tokens (observed)",
    "acceptance_rule": "one target choice emitted twice (observed)",
}


class Watch:
    """The provenance hooks on the target held around one `generate` call of the engine: entered around the
    audited run's own call (`audit.run_engine`), it records what each target call read in the batches, order and
    padding the engine chose; `log` hands the records over once the run is over."""

    def __init__(self, target: Any, pad_token_id: int | None, draft: Any = None) -> None:
        self.hooks = ProvenanceHooks(target, pad_token_id, draft)  # ValueError: a target the hooks do not know
        self.entered = 0
        self.spoiled: str | None = None  # why what was recorded is not the run (the call raised, ...)

    def __enter__(self) -> "Watch":
        self.entered += 1
        if self.entered == 1:
            self.hooks.__enter__()
        return self

    def __exit__(self, kind: Any, exc: Any, traceback: Any) -> None:
        if self.hooks.handles:
            self.hooks.__exit__(kind, exc, traceback)
        if exc is not None and self.spoiled is None:
            self.spoiled = f"the engine's call raised {type(exc).__name__}"

    @property
    def hook_seconds(self) -> float:
        """The hooks' own time inside the watched call."""
        return self.hooks.log.hook_seconds

    def log(self) -> ProvenanceLog | str:
        """The records of the watched call, or a sentence saying why there are none to read."""
        if self.spoiled:
            return self.spoiled
        if self.entered != 1:
            return f"the engine's generate was entered {self.entered} times: nothing is judged"
        if self.hooks.failed:
            return self.hooks.failed
        if not self.hooks.log.calls:
            return "the engine never called the target's forward: its own attention over the weights is not seen"
        return self.hooks.log


def watch_for(target: Any, pad_token_id: int | None, draft: Any = None) -> Watch | None:
    """The hooks for an audited run of an in-process engine on `target`, counting the calls of its `draft` (None
    where the target cannot be observed)."""
    if observable(target):
        return None
    try:
        return Watch(target, pad_token_id, draft)
    except ValueError:
        return None


def observe_run(run: RunContext, outputs: list[list[int]], pad_token_id: int | None) -> ProvenanceLog | str:
    """The run's call made again with the hooks, where the run itself was not watched: every prompt of the run, in
    its order, in one `generate` through the run's context (a fresh engine on the run's pair, guarded as its
    re-runs are). A re-run that returns other tokens than the run's `outputs` is not the run and is not judged.
    A string says why nothing was observed."""
    refused = observable(run.pair.target)
    if refused:
        return refused
    if not run.confines_reruns:
        return ("the re-runs come from a callable that takes no `around`: the hooks could not be held to the "
                "engine's own generate call (a caller's reference decoding would be observed with it)")
    watch = watch_for(run.pair.target, pad_token_id, getattr(run.pair, "draft", None))
    if watch is None:
        return "the target has no attention layer and output head the hooks know"
    try:
        rerun = run.rerun(list(range(len(run.prompts))), None, around=lambda: watch)
    except Exception as exc:  # an observation that fails tells that, not more
        return f"the hooked re-run failed: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        if watch.hooks.handles:
            watch.hooks.__exit__(None, None, None)
    rerun = [[int(t) for t in out] for out in rerun]
    wanted = [[int(t) for t in out] for out in outputs]
    if rerun != wanted:
        changed = [k for k, (a, b) in enumerate(zip(rerun, wanted)) if a != b]
        return (f"the hooked re-run of the run's call (every prompt, in the run's order) gave other tokens than the "
                f"run for prompt(s) {changed}: a re-run that is not the run decides nothing")
    return watch.log()


class Observing:
    """The observation's part of the diagnosis; the fields live on `Diagnoser` (core.py)."""

    facts: RunFacts
    observe_seconds: float
    _run_observation: ProvenanceLog | str | None  # the watched call's records or the hooked re-run's, once read
    _observed: Reading | None  # the provenance's reading of the divergence being diagnosed

    def _observation(self) -> ProvenanceLog | str:
        """What the run's own call read (`Watch`, recorded during the run), else the hooked re-run of the run's
        call, made once (or why none was made)."""
        if self._run_observation is None:
            started = time.perf_counter()
            try:
                if self.facts.watch is not None:
                    self._run_observation = self.facts.watch.log()
                elif not self.facts.observe_inputs:
                    self._run_observation = "a black-box engine: its target calls cannot be hooked"
                elif self.facts.mode == "quick":
                    self._run_observation = "quick diagnosis: no hooked re-run (--diagnosis full runs it)"
                elif self.facts.run is None:
                    self._run_observation = "the engine cannot be run again, and its run was not watched"
                elif self.facts.deadline is not None and time.monotonic() >= self.facts.deadline:
                    self._run_observation = "the diagnosis time budget is spent"
                else:
                    self._run_observation = observe_run(self.facts.run, self.facts.outputs, self.facts.pad_token_id)
            finally:
                self.observe_seconds += time.perf_counter() - started
        return self._run_observation

    def _reconcile(self, found: Cause | Finding | None, tried: list[str]) -> Cause | Finding | None:
        """A class the later checks named, against what was seen. Only a positive contradiction overrules it:
        `acceptance_rule` for an engine that never verified proposals (no draft model call, no target call fed a
        row several new tokens onto its cache, no draft token in its trace), or named only by the coincidence that
        the draft chose the engine's token where a target query chose it from wrong inputs; an input class where every query that read the row's exact
        context chose the reference's token (the target's inputs were right: the token came after the logits)."""
        reading, self._observed = self._observed, None
        log = self._run_observation
        if found is None or found.cls == "unknown" or not isinstance(log, ProvenanceLog):
            return found
        if found.cls == "acceptance_rule" and not (log.speculated or self._drafted()):
            return Cause("unknown", f"acceptance_rule was suggested ({found.evidence}), but the engine was not seen "
                         "speculating (no draft model call, no target call verifying several new tokens of a row, no "
                         "draft token in its trace)", "the engine's trace of its proposals and counts", "")
        if (found.cls == "acceptance_rule" and getattr(found, "named_by", "") == DRAFT_CHOICE and reading is not None
                and reading.fact in CLASS_OF):  # a coincidence of tokens against a wrong input seen
            return Cause("unknown", f"acceptance_rule was suggested ({found.evidence}), but a target query chose the "
                         f"engine's token from wrong inputs ({reading.evidence})",
                         "a re-run with that input right", "")
        if (reading is not None and reading.fact == CHOSE_RIGHT and found.cls in REFUTED_BY_RIGHT_CHOICE
                and found.cls != reading.cls):
            return Cause("unknown", f"{reading.evidence}; {found.cls} was suggested ({found.evidence}), which the "
                         "observation contradicts: the target's inputs were right, the engine's token came after its "
                         "logits", "the engine's step after the target's logits (acceptance, stops, its own trace)", "")
        return found

    def _drafted(self) -> bool:
        """The engine's trace records draft tokens (a drafter that is not a model: scripted, n-gram)."""
        counted = speculation.from_trace(self.facts.trace)
        return bool(counted and counted.get("drafted_tokens"))
