"""The judge of recurrent states: whether each call of a hybrid started from the row's own state.

Contract: `StateChecks.violation(record, ...)` says whether the recurrent state a call-row of a `CallLog`
started from is the one the row's own tokens before the call leave (the target run on them alone, batch 1), and
whether a call that fed padding before the row's tokens left the state its tokens leave; None where it is, or
where nothing can tell. It judges one call-row once (cached) and reads the target only to compute the states
other histories leave.

No tolerance decides it: the observed state is compared with the states other histories leave (those the run's
dtype can tell apart, `rulings.thresholds.state_resolution`), and the nearest, where it is not the row's own,
says what the engine kept:

1. The state a call found (`_start_check`): every token fed to the row in the order fed (rejected ones and fill
   kept, not rolled back; or those the 2-D mask marks fed as zero inputs, which still move a state), one token
   behind or ahead, another row's own state (`recurrent_state`); the row's padding (`attention_mask`: the model
   was not told it is padding).
2. The state a call that fed padding before the row's tokens left (`_padding_check`): the padding entered it
   or not. Where the state cannot tell (a convolution window keeps its last inputs alone), padding fed before
   the row's tokens that no 2-D mask handed to the model marks enters it (its recurrent layers zero only what
   such a mask marks).
3. The history a state was found to be (slots fed, rejected ones and padding kept) is kept per call-row
   (`histories`): a replay feeds it to the recurrent layers (`feed_check.FeedCheck.replay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from specaudit.equivalence.diagnosis.anatomy import recurrent_states
from specaudit.equivalence.diagnosis.capture import CallLog, columns_text
from specaudit.equivalence.rulings.thresholds import state_resolution


class Violation(NamedTuple):
    """One wrong input seen behind a token: where it was fed (ordered: call, column, rank within the column;
    column -1: the recurrent state the call started from), its class and the evidence."""

    order: tuple[int, int, int]
    cls: str
    evidence: str


@dataclass
class StateChecks:
    """The recurrent-state verdicts on one call log's call-rows; see the module."""

    seen: CallLog
    model: Any = field(default=None, repr=False)  # the target, to compute the states a row's own tokens leave
    _states: dict[tuple[Any, ...], dict[str, np.ndarray]] = field(default_factory=dict)  # per token sequence
    _checks: dict[int, Violation | None] = field(default_factory=dict)  # per call-row: its state's violation
    # per call-row whose state was found to be another history of slots fed (rejected ones kept, padding): those
    # slots, which a replay feeds its recurrent layers (hidden from every query that did not read them)
    histories: dict[int, list[int]] = field(default_factory=dict)

    def own_before(self, record: int, sequence: list[int] | None = None) -> list[int] | None:
        """The row's own tokens before call-row `record`'s first token that is not padding: what that token's query
        reads (its own aside) where that is a start of the row's sequence (`sequence`; default the row's); None
        where it is not (a wrong read, judged as such) or the call fed only padding."""
        first = next((s for s in self.seen.record_slots(record) if not self.seen.slots[s].pad), None)
        local = self.seen.records[record].local
        if first is None or local is None:
            return None
        sequence = sequence or self.seen.prompts[local] + self.seen.outputs[local]
        content = [self.seen.slots[v].token for v in self.seen.visible(first) if not self.seen.slots[v].pad]
        return content[:-1] if content and content == sequence[:len(content)] else None

    def state_of(self, tokens: list[int], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state (per part, [n]) the target's first recurrent layer keeps after `tokens` fed alone (batch 1,
        fresh cache), sampled as the observed ones are; a token written `~token` (negative) is fed under a 0 in a
        2-D mask (the model zeroes its input: it still moves the state); zeros for no tokens; NaN for a part of
        another shape than the observed one's (a cache that took its convolution width from a short first call)."""
        key = (tuple(tokens), tuple((name, part.shape) for name, part in like.items()))
        if key not in self._states:
            if not tokens:
                self._states[key] = {name: np.zeros_like(part) for name, part in like.items()}
            else:
                from transformers import DynamicCache

                from specaudit.engines.ops.hf_call import cached_forward

                model = self.model
                cache = DynamicCache(config=model.config)
                marked = {"attention_mask": torch.tensor([[int(t >= 0) for t in tokens]], device=model.device)} \
                    if any(t < 0 for t in tokens) else {}
                with torch.no_grad():
                    cached_forward(model, cache, input_ids=torch.tensor([[t if t >= 0 else ~t for t in tokens]],
                                                                        device=model.device),
                                   position_ids=torch.arange(len(tokens), device=model.device).view(1, -1), **marked)
                state = recurrent_states(cache) or {}
                self._states[key] = {name: state[name][0].numpy() if name in state and state[name].shape[1:]
                                     == part.shape else np.full_like(part, np.nan) for name, part in like.items()}
        return self._states[key]

    def violation(self, record: int, index: int, sequence: list[int]) -> Violation | None:
        """Whether the recurrent state call-row `record` started from is the state after exactly the row's own
        tokens before the call, and, where the call fed padding before the row's tokens, whether its state after
        the call is the one the row's own tokens leave. Each observed state is compared with the states other
        histories leave (`_nearest`): the nearest names what the engine kept."""
        if self.model is None:
            return None
        if record not in self._checks:
            self._checks[record] = (self._start_check(record, index, sequence)
                                    or self._padding_check(record, index, sequence))
        return self._checks[record]

    def _start_check(self, record: int, index: int, sequence: list[int]
                     ) -> Violation | None:
        """The state the call found: the row's own, or every token fed to the row's cache in the order fed
        (rejected ones kept), the same with its padding, one token behind or ahead, another row's own."""
        call_row = self.seen.records[record]
        own = self.own_before(record, sequence)
        slots = self.seen.record_slots(record)
        if call_row.state is None or own is None or not slots:
            return None
        first = next(s for s in slots if not self.seen.slots[s].pad)
        # every token fed to the row before this call, in the order fed, in whichever cache (before its first call
        # seen: the row's own tokens then)
        call = self.seen.slots[first].call
        earlier = [r for r, other in enumerate(self.seen.records) if other.local == call_row.local and r != record
                   and (slots_of := self.seen.record_slots(r)) and self.seen.slots[slots_of[0]].call < call]
        start = ((self.own_before(earlier[0], sequence) or []) if earlier and self.seen.records[earlier[0]].cache_length
                 else [])
        fed_ids = [s for r in earlier for s in self.seen.record_slots(r)]
        fed = [self.seen.slots[s] for s in fed_ids]
        kept = start + [s.token for s in fed if not s.pad]
        # the slots of each history made of slots fed (a replay can feed them again)
        histories = {tuple(kept): [s for s in fed_ids if not self.seen.slots[s].pad],
                     tuple(start + [s.token for s in fed]): fed_ids} if not start else {}
        candidates: list[tuple[list[int], str, str]] = [(own, "", "the row's own")]
        candidates.append((kept, "recurrent_state", f"the state after every token fed to the row in the order fed "
                           f"({len(kept)}, {len(kept) - len(own)} more than the row's own: the rejected ones kept, or "
                           "fill; not rolled back)"))
        marked = {s for s in fed_ids if self.seen.told(s)}
        if marked:  # tokens the 2-D mask marks as padding (holes, fill) still move a state: fed as zeros
            zeroed = [~self.seen.slots[s].token if s in marked else self.seen.slots[s].token for s in fed_ids]
            candidates.append((start + zeroed,
                               "recurrent_state", f"the state after every token fed to the row in the order fed, the "
                               f"{len(marked)} the 2-D mask marks as padding fed as zero inputs (a masked token still "
                               "moves a recurrent state: the convolution window shifts, an SSM state decays)"))
        if any(s.pad for s in fed):
            candidates.append((start + [s.token for s in fed], "attention_mask",
                               "the state after every token fed to the row, its padding included: the padding "
                               "entered the recurrent state (the model was not told it is padding)"))
        if own:
            candidates.append((own[:-1], "recurrent_state", "the state one token behind the row's"))
        candidates.append((own + [self.seen.slots[first].token], "recurrent_state",
                           f"the state one token ahead (the call's first token, {self.seen.slots[first].token}, already in "
                           "it)"))
        for other, other_row in enumerate(self.seen.records):
            if other_row.local is None or other_row.local == call_row.local or other == record:
                continue
            other_slots = self.seen.record_slots(other)
            if other_slots and self.seen.slots[other_slots[0]].call == call:
                other_own = self.own_before(other, self.seen.prompts[other_row.local] + self.seen.outputs[other_row.local])
                if other_own is not None:
                    candidates.append((other_own, "recurrent_state", f"the state of another row of the batch (batch row "
                                       f"{other_row.row}, the re-run's prompt {other_row.local})"))
        nearest = self._nearest(call_row.state, candidates)
        if nearest is None or not nearest[2]:
            return None
        part, distance, cls, what, own_distance = nearest
        tokens = next(c[0] for c in candidates if c[2] == what)
        if tuple(tokens) in histories:
            self.histories[record] = histories[tuple(tokens)]
        return Violation((self.seen.slots[first].call, -1, 1), cls,
                f"prompt {index}, {self.seen.where(first)}: the call started from a recurrent state (its {part}) that is "
                f"{what} (distance {distance:.3g}), not the state after the row's own {len(own)} tokens before it "
                f"(distance {own_distance:.3g})")

    def _padding_check(self, record: int, index: int, sequence: list[int]
                       ) -> Violation | None:
        """A call that fed padding before the row's tokens (left padding; a whole padded row fed again): padding the
        2-D mask handed to the model does not mark enters the recurrent state (its layers zero only what the mask
        marks); the state it left, compared from the row's own (after the row's tokens it fed, or after those and
        the padding), says so where the state still holds it (a convolution window keeps its last inputs alone)."""
        call_row = self.seen.records[record]
        slots = self.seen.record_slots(record)
        content = [s for s in slots if not self.seen.slots[s].pad]
        if not content or not any(self.seen.slots[s].pad for s in slots[:slots.index(content[-1])]):
            return None
        untold = self.seen.untold(record)
        own = self.own_before(record, sequence)
        nearest = None
        if own is not None and call_row.end_state is not None:
            fed = own + [self.seen.slots[s].token for s in content]
            nearest = self._nearest(call_row.end_state, [
                (fed, "", "the state after the row's own tokens"),
                (own + [self.seen.slots[s].token for s in slots], "attention_mask", "the state after the row's tokens and "
                 "the padding fed before them: the padding entered the recurrent state")])
        where = f"prompt {index}, {self.seen.where(content[0])}: the call fed padding before the row's tokens"
        if nearest is not None:  # the state left tells: the padding entered it, or not
            part, distance, cls, what, own_distance = nearest
            if not cls:
                return None
            self.histories[record] = [s for s in slots[:slots.index(content[-1])] if self.seen.slots[s].pad]
            untold_columns = columns_text([self.seen.slots[s].column for s in untold])
            unmarked = (f", {len(untold)} padding column(s) ({untold_columns}) that "
                        "no 2-D mask handed to the model marks,") if untold else ""
            return Violation((self.seen.slots[content[0]].call, -1, 1), cls,
                    f"{where}{unmarked} and left a recurrent state (its {part}) that is {what} (distance "
                    f"{distance:.3g}), not the state after the row's own {len(own) + len(content)} tokens (distance "
                    f"{own_distance:.3g})")
        if untold:
            self.histories[record] = untold
            return Violation((self.seen.slots[content[0]].call, -1, 1), "attention_mask",
                    f"{where}, {len(untold)} padding column(s) "
                    f"({columns_text([self.seen.slots[s].column for s in untold])}) "
                    "that no 2-D mask handed to the model marks: they entered the recurrent state (its layers zero only "
                    "the padding such a mask marks)")
        return None

    def _nearest(self, observed: dict[str, np.ndarray], candidates: list[tuple[list[int], str, str]]
                 ) -> tuple[str, float, str, str, float] | None:
        """The first part of an observed state whose nearest candidate history (tokens, class, description; the
        row's own first, class "") is not the row's own: (part, its distance, class, description, the own one's
        distance); where every part compared is nearest the row's own, the last such (class ""); None where no
        part could be compared (no other history's state differs from the row's own there)."""
        unique: list[tuple[list[int], str, str]] = []
        for candidate in candidates:
            if tuple(candidate[0]) not in {tuple(c[0]) for c in unique}:
                unique.append(candidate)
        own_state = self.state_of(unique[0][0], observed)
        compared = None
        for part in observed:  # each part apart: an engine may roll back its convolution window and not its SSM state
            # histories whose states the run's dtype cannot tell apart (a convolution window keeps its last few inputs
            # alone; padding the model zeroes leaves none) are one state: only those it tells apart compete
            resolution = state_resolution(torch.finfo(self.model.dtype).eps, float(np.linalg.norm(own_state[part])))
            distances: list[tuple[float, str, str]] = []
            kept: list[np.ndarray] = []  # the states of the histories that compete, the first of each kept
            for tokens, cls, what in unique:
                state = self.state_of(tokens, observed)[part]
                if any(float(np.linalg.norm(state - other)) <= resolution for other in kept):
                    continue  # the same state as an earlier history's (the row's own first)
                kept.append(state)
                distances.append((float(np.linalg.norm(observed[part] - state)), cls, what))
            if len(distances) < 2 or not all(np.isfinite(d) for d, _, _ in distances):
                continue
            distance, cls, what = min(distances, key=lambda d: d[0])
            if cls:
                return part, distance, cls, what, distances[0][0]
            compared = part, distance, cls, what, distance
        return compared

