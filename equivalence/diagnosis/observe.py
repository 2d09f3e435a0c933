"""Diagnosis by observation: what an in-process engine fed the target, against what a correct engine feeds.

An in-process engine runs on the models the audit hands it, so its inputs can be seen. The audit holds a `Watch`
(forward hooks on the target and its draft) around the engine's own `generate` call in the audited run: the
batches, order, padding and schedule are the engine's own, read from its calls, never assumed from
`--batch-size`. The hooks keep each call compactly (`capture.CallSeen`) and time themselves
(`CallLog.hook_seconds`, the observation's cost to the run); `Watch.feed_check` reads what they kept into a `FeedCheck`
only when a divergence needs it. A run that was not watched (a run made elsewhere) is observed by `observe_run`,
the run's call made again once with the hooks (every prompt, in the run's order, in one `generate`, through the
run's context); a re-run that gives other tokens than the run is not the run: it decides nothing, and says so.
The engine's code is untouched. The layers, each a module:

1. `anatomy.py`: where the hooks go in a transformers model (the module that takes the input ids, the one that
   consumes the position ids, the first full-attention and sliding-window layers) and how a hook reads a cache,
   a mask and a config; `observable` says which targets can be observed.
2. `capture.py` (the capture): per target call and batch row, the tokens fed, their cache columns and
   positions, which columns each query could read, and on hybrids the recurrent state each call found and left;
   every token fed a slot, each row matched to its prompt and followed by its keys when the engine moves entries.
3. `feed_check.py` and `states.py` (the feed check): what a correct engine would have fed each query behind the engine's
   token at the divergence, and the first input fed otherwise, which names the class; on hybrids, whether each
   call started from the row's own recurrent state.

A replay of the target (float64 where the audit has it) on exactly the observed slots, positions and
visibility (`FeedCheck.replay`, `forward.replay_all`) that reproduces the engine's logits (where it records them;
the diagnosis then judges the first new token whose logits are off) or chooses its token confirms a violation
(`Observing`, below). Inputs observed correct (the replay of them chooses the reference's token) rule out the input
classes: the divergence comes after the logits (acceptance, stops). A recurrent state seen wrong is confirmed by
a replay that feeds the recurrent layers the history it was found to be (the slots, hidden from queries that did
not read them), failing that by a re-run of the batch with the target's attention layers silenced that still
diverges from greedy decoding of the silenced target (`layers.diverges_silenced`). Caches of another kind
(sliding windows alone) are not observed; an engine that never calls the target's forward (its own attention
over the weights) shows nothing, and the replays decide.

`Observing` is the part of `Diagnoser` (core.py) that makes and reads the observation:

1. `_observe`: the watched run (else one hooked re-run of the run's call), shared by every divergence of the run,
   judged at the divergence. Where the inputs were observed they decide the input classes: the logit replays of
   hypotheses and the re-run experiments are for engines whose inputs cannot be seen (core.py).
2. A violation is confirmed by a replay of the observed inputs that reproduces the engine's logits (within the
   float64 tolerance or the dtype's measured noise) or, without them, chooses its token (below float64, or puts it
   within the dtype's own noise of its top); a clean verdict by one
   that chooses the reference's token. A replay that chooses another token looks for another query fed the same
   token (`_other_producer`).
3. A recurrent state seen wrong: its replay, else a re-run with the attention layers silenced (`_observed_state`).
4. `_reconcile`: a class the later checks name is checked against the verdict kept; only a positive
   contradiction overrules it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from specaudit.equivalence import speculation
from specaudit.equivalence.diagnosis.anatomy import has_recurrent_layers, observable, sliding_window
from specaudit.equivalence.diagnosis.causes import Cause
from specaudit.equivalence.diagnosis.checks import Finding
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.diagnosis.feed_check import CLEAN, INPUT_CLASSES, FeedCheck, Verdict
from specaudit.equivalence.diagnosis.layers import diverges_silenced
from specaudit.equivalence.diagnosis.capture import CallHooks, CallLog
from specaudit.equivalence.diagnosis.provenance import ProvenanceLog
from specaudit.equivalence.diagnosis.provenance.hooks import ProvenanceHooks
from specaudit.equivalence.rulings.thresholds import FLOAT64_LOGIT_TOLERANCE
from specaudit.equivalence.run_context import RunContext

# the bug behind each class the observation names
OBSERVED_MECHANISMS: dict[str, str] = {
    "position_ids": "position ids other than each token's index in its row (observed)",
    "attention_mask": "queries reading padding or holes, or missing the row's tokens (observed)",
    "kv_cache": "cache entries the row did not accept, read (observed)",
    "pad_as_content": "pad-id tokens of the row hidden as padding (observed)",
    "cross_row": "another row's tokens read (observed)",
    "recurrent_state": "a recurrent state not the row's own after its accepted tokens (observed)",
}
OBSERVED_STATE = "the recurrent state a call started from, observed"


class Watch:
    """The hooks on the target (and its draft) held around one `generate` call of the engine: entered around the
    audited run's own call (`audit.run_engine`), it records what the engine fed the target in the batches, order
    and padding the engine chose, compactly (`capture.CallSeen`); `feed_check` reads it once the run is over."""

    def __init__(self, prompts: list[list[int]], target: Any, draft: Any, pad_token_id: int | None) -> None:
        self.target = target
        self.call_log = CallLog([list(p) for p in prompts], [], pad_token_id, window=sliding_window(target),
                                   recurrent=has_recurrent_layers(target))
        self.hooks = [CallHooks(self.call_log, target, "target")]
        if draft is not None and draft is not target:
            self.hooks.append(CallHooks(self.call_log, draft, "draft"))
        self.spoiled: str | None = None  # why what was recorded is not the run (the call raised, ...)
        # what each query read, by the writers of the columns (diagnosis/provenance/); None: the target has no
        # attention layer and output head the hooks know
        self.provenance: ProvenanceHooks | None = None
        try:
            self.provenance = ProvenanceHooks(target, pad_token_id)
        except ValueError:
            self.provenance = None

    def __enter__(self) -> "Watch":
        self.call_log.entered += 1
        for hooks in self.hooks:
            hooks.install()
        if self.provenance is not None and self.call_log.entered == 1:
            self.provenance.__enter__()
        return self

    def __exit__(self, kind: Any, exc: Any, traceback: Any) -> None:
        for hooks in self.hooks:
            hooks.remove()
        if self.provenance is not None and self.provenance.handles:
            self.provenance.__exit__(kind, exc, traceback)
        if exc is not None and self.spoiled is None:
            self.spoiled = f"the engine's call raised {type(exc).__name__}"

    @property
    def hook_seconds(self) -> float:
        """The hooks' own time inside the watched call (the feed capture's and the provenance's)."""
        return self.call_log.hook_seconds + (self.provenance.log.hook_seconds if self.provenance is not None else 0.0)

    def provenance_log(self) -> ProvenanceLog | None:
        """The provenance records of the watched call (None: not recorded, or not the run)."""
        if (self.provenance is None or self.spoiled or self.provenance.failed or self.call_log.entered != 1
                or not self.provenance.log.calls):
            return None
        return self.provenance.log

    def feed_check(self, outputs: list[list[int]]) -> FeedCheck | str:
        """A `FeedCheck` over what the call fed the target, its rows labelled by `outputs` (the call's own), or a
        sentence saying why nothing was observed."""
        if self.spoiled:
            return self.spoiled
        if self.call_log.entered != 1:
            return f"the engine's generate was entered {self.call_log.entered} times: nothing is judged"
        self.call_log.outputs = [[int(t) for t in out] for out in outputs]
        self.call_log.process()
        return FeedCheck(self.call_log, self.target)


def watch_for(prompts: list[list[int]], target: Any, draft: Any, pad_token_id: int | None) -> Watch | None:
    """The hooks for an audited run of an in-process engine on `target` (None where it cannot be observed)."""
    if observable(target):
        return None
    return Watch(prompts, target, draft, pad_token_id)


def observe_run(run: RunContext, outputs: list[list[int]], pad_token_id: int | None) -> FeedCheck | str:
    """The run's call made again with hooks, where the run itself was not watched: every prompt of the run, in
    its order, in one `generate` through the run's context (a fresh engine on the run's pair, guarded as its
    re-runs are). The run's `outputs` label the rows; a re-run that returns other tokens is not the run and is not
    judged. A string says why nothing was observed."""
    target, draft = run.pair.target, run.pair.draft
    refused = observable(target)
    if refused:
        return refused
    if not run.confines_reruns:
        return ("the re-runs come from a callable that takes no `around`: the hooks could not be held to the "
                "engine's own generate call (a caller's reference decoding would be observed with it)")
    watch = Watch(run.prompts, target, draft, pad_token_id)
    try:
        rerun = run.rerun(list(range(len(run.prompts))), None, around=lambda: watch)
    except Exception as exc:  # an observation that fails tells that, not more
        return f"the hooked re-run failed: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        for hooks in watch.hooks:
            hooks.remove()
    rerun = [[int(t) for t in out] for out in rerun]
    if rerun != [[int(t) for t in out] for out in outputs]:
        changed = [k for k, (a, b) in enumerate(zip(rerun, outputs)) if a != [int(t) for t in b]]
        return (f"the hooked re-run of the run's call (every prompt, in the run's order) gave other tokens than the "
                f"run for prompt(s) {changed}: a re-run that is not the run decides nothing")
    return watch.feed_check(outputs)



@dataclass(frozen=True)
class Observed:
    """What the observation concluded on one divergence: the verdict kept to reconcile the later checks' class with
    (None: nothing observed), and the cause it decides (None: it decides nothing)."""

    verdict: Verdict | None
    cause: Cause | None = None


def _observed_mechanism(verdict: Verdict) -> str:
    """The bug behind an observed class: padding read is the mechanism the mask replays name; the others are
    named by what was observed (an offset that equals a count of columns can be a coincidence)."""
    if verdict.cls == "attention_mask" and "padding column(s) (" in verdict.evidence:
        return "the row's padding visible to its queries"
    return OBSERVED_MECHANISMS[verdict.cls]


def _chooses(replayed: torch.Tensor, token: int | None, noise: float) -> bool:
    """Whether a replay's logits [V] choose `token`: its top, or below the float64 audit (`noise` > 0: the audit
    dtype's own logit error on the prompt, `Experiments.precision_noise`) within that noise of the top, where the
    engine's rounding may have put it first. The replay runs in float64 while the engine computed in its dtype."""
    if token is None or not 0 <= token < replayed.shape[-1]:
        return False
    if int(replayed.argmax()) == token:
        return True
    return noise > 0 and _gap(replayed, token) <= noise


def _gap(replayed: torch.Tensor, token: int) -> float:
    """How far below the top of a replay's logits [V] `token` lies."""
    replayed = replayed.to(torch.float64)
    return float(replayed.max() - replayed[token])


def _within(replayed: torch.Tensor, token: int | None, noise: float) -> str:
    return (f" (the engine's token {token} lies {_gap(replayed, token):.3g} below it, within the dtype's noise "
            f"{noise:.3g})")


def _logit_error(replayed: torch.Tensor, engine_row: torch.Tensor) -> float:
    """The largest difference between a replay's logits and the engine's own, in float64."""
    return float((replayed.to(torch.float64).cpu() - engine_row.to(torch.float64).cpu()).abs().max())


class Observing:
    """The observation's part of the diagnosis; the fields live on `Diagnoser` (core.py)."""

    facts: RunFacts
    observe_seconds: float
    _run_observation: FeedCheck | str | None  # the hooked re-run of the run's call, once made
    _observed: Verdict | None

    # and what `Diagnoser` and `Experiments` answer: the rows of a prompt's batch, the engine's logits of a prompt,
    # the dtype's own logit error on a prompt
    _batch_rows: Callable[[int], list[int]]
    _logits: Callable[[int], torch.Tensor | None]
    precision_noise: Callable[[int], float]

    def _observation(self) -> FeedCheck | str:
        """What the run's own call fed the target (`Watch`, recorded during the run), else the hooked re-run of
        the run's call, made once (or why none was made)."""
        if self._run_observation is None:
            started = time.perf_counter()
            try:
                if self.facts.watch is not None:
                    self._run_observation = self.facts.watch.feed_check(self.facts.outputs)
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

    def _observe(self, index: int, position: int, tried: list[str]) -> Observed:
        """Make the run's call again once with hooks (shared by the run's divergences) and judge what the
        engine fed the target: a violation that a replay of the observed inputs confirms decides; the verdict
        is kept to check the class the guessing replays and re-runs name."""
        if not self.facts.observe_inputs or (self.facts.run is None and self.facts.watch is None):
            return Observed(None)
        batch = self._batch_rows(index)
        observation = self._observation()
        if isinstance(observation, str):
            tried.append(f"observation of the engine's inputs: not made ({observation})")
            return Observed(None)
        logits = self._logits(index)
        engine_row = logits[position] if logits is not None and position < logits.shape[0] else None
        verdict = observation.judge(index, position, index, by_logits=engine_row is not None)
        if verdict.state and verdict.cls in INPUT_CLASSES:
            return self._observed_state(observation, verdict, index, batch, tried, engine_row)
        if verdict.producer is not None and verdict.cls is not None and verdict.cls != CLEAN and engine_row is not None:
            verdict = self._confirmed_by_logits(observation, verdict, index, position, engine_row, tried)
        elif verdict.producer is not None and verdict.cls is not None:
            verdict = self._confirmed_by_token(observation, verdict, index, position, index, tried)
        else:
            tried.append(verdict.evidence)
        if verdict.state_seen and not (verdict.confirmed and verdict.cls in INPUT_CLASSES):
            # a replay cannot set a recurrent state: where one seen wrong behind the token may explain it, its re-run
            cls, evidence = verdict.state_seen
            stated = replace(verdict, cls=cls, evidence=evidence, state=True, state_seen=None, confirmed=False)
            observed = self._observed_state(observation, stated, index, batch, tried, engine_row)
            return observed if observed.cause is not None else Observed(verdict)
        unfed = (observation.unfed(verdict.producer)
                 if not verdict.confirmed and verdict.cls in INPUT_CLASSES and verdict.producer is not None else 0)
        if unfed:  # entries no token was fed for cannot be replayed: what was observed decides
            return Observed(verdict, Cause(verdict.cls, f"{verdict.evidence}; no replay can be made: the query depends "
                                           f"on {unfed} cache entr{'y' if unfed == 1 else 'ies'} the engine wrote "
                                           f"without feeding a token", "the observed inputs",
                                           _observed_mechanism(verdict)))
        if verdict.confirmed and verdict.cls in INPUT_CLASSES:
            what = "reproduces the engine's logits" if engine_row is not None else "chooses the engine's token"
            return Observed(verdict, Cause(verdict.cls, f"{verdict.evidence}; a replay of the target with exactly the "
                                           f"observed inputs {what}", "a reproducing replay",
                                           _observed_mechanism(verdict)))
        return Observed(verdict)

    def _confirmed_by_logits(self, observation: FeedCheck, verdict: Verdict, index: int, position: int,
                             engine_row: torch.Tensor, tried: list[str]) -> Verdict:
        """A violation, against the engine's own logits at the first corrupted token: the replay of its observed
        inputs must reproduce them."""
        replayed = observation.replay(self.facts.replay_target or self.facts.target, verdict.producer)
        error = None if replayed is None else _logit_error(replayed, engine_row)
        noise = self.precision_noise(index)
        reproduced = error is not None and error <= max(FLOAT64_LOGIT_TOLERANCE, noise)
        shown = "not made" if error is None else (f"{'reproduces' if reproduced else 'does not reproduce'} "
                                                   f"the engine's logits at new token {position} (error {error:.3g})")
        # logits reproduced that do not choose the engine's token: the inputs were wrong, yet the token came after
        # the logits (a rule that emits another token than the target's choice), so they do not explain it
        # the engine's token is chosen from these logits as the prompt's request parameters process them
        chosen_from = self.facts.chosen_from(index, position, replayed) if replayed is not None else None
        confirmed = reproduced and _chooses(chosen_from, verdict.engine_token, noise)
        if reproduced and not confirmed:
            shown += (f", which choose token {int(chosen_from.argmax())}, not the engine's {verdict.engine_token}: the "
                      "engine's token came after its logits")
        tried.append(f"{verdict.evidence}; a replay of the target with the observed inputs {shown}")
        return replace(verdict, confirmed=confirmed)

    def _confirmed_by_token(self, observation: FeedCheck, verdict: Verdict, local: int, position: int, index: int,
                            tried: list[str]) -> Verdict:
        """Without the engine's logits: a violation whose replay chooses the engine's token (below float64, or puts it
        within the dtype's own noise of its top: `_chooses`), inputs seen right whose
        replay chooses another (right inputs cannot give a wrong token: one that chooses the engine's leaves the
        verdict empty); else another query fed the same token may have chosen it (`_other_producer`)."""
        replayed = observation.replay(self.facts.replay_target or self.facts.target, verdict.producer)
        if replayed is not None:  # chosen from as the prompt's request parameters process them
            replayed = self.facts.chosen_from(index, position, replayed)
        chosen = None if replayed is None else int(replayed.argmax())
        noise = self.precision_noise(index)
        if verdict.cls == CLEAN:
            confirmed = chosen is not None and chosen != verdict.engine_token
            if chosen == verdict.engine_token:  # right inputs cannot give a wrong token: something unseen
                verdict = replace(verdict, cls=None, evidence=verdict.evidence + "; yet a replay of them chooses the "
                                  "engine's token: the engine reads something the hooks did not see")
        else:
            confirmed = replayed is not None and _chooses(replayed, verdict.engine_token, noise)
        verdict = replace(verdict, confirmed=confirmed)
        shown = "not made" if chosen is None else f"chooses token {chosen}" + (
            " (the engine's)" if chosen == verdict.engine_token else
            _within(replayed, verdict.engine_token, noise) if confirmed and verdict.cls != CLEAN else " (not the engine's)")
        tried.append(f"{verdict.evidence}; a replay of the target with the observed inputs {shown}")
        if verdict.cls != CLEAN and verdict.confirmed:
            return verdict
        return self._other_producer(observation, verdict, local, position, index, tried)

    def _observed_state(self, observation: FeedCheck, verdict: Verdict, index: int, batch: list[int], tried: list[str],
                        engine_row: torch.Tensor | None) -> Observed:
        """A call seen starting from a recurrent state that is not the row's own, or feeding it padding the model was
        not told of (states.py). A replay that feeds the recurrent layers the history the state was found to be (the
        slots fed, rejected ones and padding kept, hidden from the queries that did not read them) and reproduces
        the engine's logits or token confirms it; failing that, a re-run of the batch with the target's attention
        layers silenced that still diverges from greedy decoding of the silenced target (the state alone is wrong)."""
        mechanism = (OBSERVED_MECHANISMS["recurrent_state"] if verdict.cls == "recurrent_state" else
                     "padding the model was not told of (no 2-D mask marks it) fed into the recurrent state (observed)")
        replayed = None
        if verdict.producer is not None:
            replayed = observation.replay(self.facts.replay_target or self.facts.target, verdict.producer)
        if replayed is not None:
            if engine_row is not None:
                error = _logit_error(replayed, engine_row)
                confirmed = error <= max(FLOAT64_LOGIT_TOLERANCE, self.precision_noise(index))
                shown = (f"{'reproduces' if confirmed else 'does not reproduce'} the engine's logits "
                         f"(error {error:.3g})")
            else:
                confirmed = int(replayed.argmax()) == verdict.engine_token
                shown = f"chooses token {int(replayed.argmax())}" + (" (the engine's)" if confirmed else
                                                                     " (not the engine's)")
            verdict = replace(verdict, confirmed=confirmed)
            tried.append(f"{verdict.evidence}; a replay of the target feeding its recurrent layers that history {shown}")
            if confirmed:
                return Observed(verdict, Cause(verdict.cls, f"{verdict.evidence}; a replay of the target feeding its "
                                               f"recurrent layers that history {shown}",
                                               f"{OBSERVED_STATE}, then a reproducing replay", mechanism))
        try:
            outcome = diverges_silenced(self, index, batch, "attention")
        except Exception as exc:  # an experiment that fails tells that, not more
            outcome = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        said = ("was not run (" + outcome + ")" if isinstance(outcome, str) else "still diverges" if outcome
                else "is exact")
        verdict = replace(verdict, confirmed=outcome is True)
        tried.append(f"{verdict.evidence}; re-run of its batch with the attention layers silenced, against greedy "
                     f"decoding of the same target: it {said}")
        if not verdict.confirmed:
            return Observed(verdict)
        return Observed(verdict, Cause(verdict.cls, f"{verdict.evidence}; re-run of its batch with the attention "
                                       "layers silenced, the row still diverges from greedy decoding of the same "
                                       "silenced target",
                                       f"{OBSERVED_STATE}, then a re-run with the attention layers silenced", mechanism))

    def _other_producer(self, observation: FeedCheck, first: Verdict, local: int, position: int, index: int,
                        tried: list[str], attempts: int = 6) -> Verdict:
        """The query taken to choose the engine's token did not (its inputs replayed choose another): a token fed
        more than once (a proposal rejected, then fed again; a step's choice the engine set aside, as a rule that
        drops its bonus does) leaves other queries that may have. The first other one, in the order fed, whose
        wrong input a replay confirms (it chooses the engine's token) names the class, unless it reads the token
        it would produce; else the first verdict stands."""
        excluded = {first.producer}
        for _ in range(attempts):
            other = observation.judge(local, position, index, exclude=frozenset(excluded))
            if other.producer is None:
                break
            excluded.add(other.producer)
            if other.cls not in INPUT_CLASSES or observation.reads_ahead(local, position, other.producer):
                continue
            replayed = observation.replay(self.facts.replay_target or self.facts.target, other.producer)
            if replayed is not None:  # chosen from as the prompt's request parameters process them
                replayed = self.facts.chosen_from(index, position, replayed)
            noise = self.precision_noise(index)
            if replayed is None or not _chooses(replayed, other.engine_token, noise):
                continue
            other = replace(other, confirmed=True, evidence=other.evidence + " (a query fed the same token elsewhere "
                            "chose another token, which the engine did not emit)")
            shown = (" (the engine's)" if int(replayed.argmax()) == other.engine_token
                     else _within(replayed, other.engine_token, noise))
            tried.append(f"{other.evidence}; a replay of the target with the observed inputs chooses token "
                         f"{int(replayed.argmax())}{shown}")
            return other
        return first

    def _reconcile(self, found: Cause | Finding | None, tried: list[str]) -> Cause | Finding | None:
        """A class from the guessing replays, heuristics or re-runs checked against what was observed. Only a
        positive contradiction overrules it: the inputs of a call of the row's batch (not a row decoded alone)
        seen right and a replay of them choosing the reference's token, or a violation of another class seen
        there; `acceptance_rule` needs an engine that speculated (called its draft model, verified several
        tokens of a row in one pass, or drafted in its trace), and is not taken from the draft-choice coincidence
        where the engine was seen feeding a wrong input (a violation no replay confirmed, or one in the pass that
        fed a repeated token left unjudged); an input class is not taken where the inputs behind a repeated token
        left unjudged were seen wrong in other classes alone. An observation that judged nothing leaves the
        class as the checks named it (the replays of hypotheses are not made where the inputs were observed)."""
        verdict, self._observed = self._observed, None
        observation = self._run_observation
        if (found is not None and found.cls == "acceptance_rule" and isinstance(observation, FeedCheck)
                and observation.seen.calls and not (observation.seen.speculated or self._drafted())):
            return Cause("unknown", f"acceptance_rule was suggested ({found.evidence}), but the engine was not seen "
                         f"speculating (no draft model call, no target call verifying several new tokens of a row, "
                         f"no draft token in its trace)", "the engine's trace of its proposals and counts", "")
        if verdict is None or (found is not None and found.cls == "unknown"):
            return found
        cls = found.cls if found is not None else None
        if verdict.cls == CLEAN and verdict.confirmed and verdict.batched and (cls is None or cls in INPUT_CLASSES):
            named = f" ({cls} was suggested: the observation contradicts it)" if cls else ""
            return Cause("unknown", f"{verdict.evidence}, and a replay of them chooses the reference's token: the "
                         f"target's inputs were right, the engine's token came after its logits{named}",
                         "the engine's step after the target's logits (acceptance, stops, its own trace)", "")
        if (verdict.cls in INPUT_CLASSES and verdict.batched and cls != verdict.cls
                and (cls is None or cls in INPUT_CLASSES)):
            named = f"; {cls} was suggested, which the observation does not show" if cls else ""
            return Cause("unknown", f"{verdict.evidence}; no replay of the observed inputs reproduced the engine's "
                         f"token{named}", "a replay of the observed inputs that reproduces the engine's token", "")
        if verdict.seen and cls in INPUT_CLASSES and cls not in verdict.seen_classes:
            return Cause("unknown", f"{cls} was suggested ({found.evidence}), but the inputs behind the engine's token "
                         f"were seen wrong otherwise, with no wrong input of that class ({verdict.evidence})",
                         "a replay of the observed inputs that reproduces the engine's token", "")
        wrong = verdict.seen or (verdict.cls if verdict.cls in INPUT_CLASSES else None)
        if (cls == "acceptance_rule" and wrong
                and isinstance(found, Cause) and found.named_by.startswith("the engine's token is the draft's own choice")):
            return Cause("unknown", f"acceptance_rule was suggested by a coincidence ({found.evidence}), but the "
                         f"engine's inputs were seen wrong ({verdict.evidence})",
                         "a replay that reproduces the engine's token", "")
        if cls == "acceptance_rule" and verdict.target_calls and not (verdict.speculated or self._drafted()):
            return Cause("unknown", f"acceptance_rule was suggested ({found.evidence}), but the engine did not "
                         f"speculate in the re-run (no draft model call, no pass verifying several tokens of a "
                         f"row, no draft token in its trace); {verdict.evidence}",
                         "the engine's trace of its proposals and counts", "")
        return found

    def _drafted(self) -> bool:
        """The engine's trace records draft tokens (a drafter that is not a model: scripted, n-gram)."""
        counted = speculation.from_trace(self.facts.trace)
        return bool(counted and counted.get("drafted_tokens"))
