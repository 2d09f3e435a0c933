"""The judge: what a correct engine would have fed the target, and the first input the engine fed otherwise.

Contract: `FeedCheck.judge(prompt, position, index)` reads a `CallLog` and returns a `Verdict` on one divergence;
it changes nothing the call log holds (its state checks and their caches aside). `FeedCheck.replay` computes the
target's logits on exactly the observed inputs behind a slot (`forward.replay_all`), which the diagnosis compares
with the engine's (observe.py).

1. The producer (`_producer`): the slot whose query produced the engine's token at the divergence, the first fed
   holding the row's token before it whose visible content is exactly the row's sequence so far; failing that,
   one that reads extra or misses tokens, fed at the row's index where one was.
2. What a correct engine feeds: each query reads exactly the row's own earlier tokens (no padding, no hole, no
   other row's), each token it reads sits at its index in the row, and the same holds for each slot it reads,
   recursively; on a hybrid, each call starts from the row's own recurrent state (`states.StateChecks`).
3. The first slot (in the order fed) that breaks one of these names the class:

    padding visible                               attention_mask
    a token of the row hidden (pad id: pad_as_content) attention_mask / pad_as_content
    a stale slot visible (a token not in the row)  attention_mask where the engine masks columns of this
                                                   cache, else kv_cache; kv_cache too where the stale slots
                                                   were cached by earlier calls and the query's own position
                                                   is its index in the row (the engine numbers the row by its
                                                   accepted tokens, and its mask never hides a fed token:
                                                   it meant them gone, not masked)
    another row's tokens                           cross_row
    a token fed a position other than its index    position_ids
    a sliding-window query that does not read      attention_mask
    exactly the row's last `window` tokens (the
    window counts columns: holes inside it)
    a call's recurrent state not the row's own     recurrent_state / attention_mask (padding entered it)

4. Not judged: a token the target was never fed after though the row goes on (emitted, not continued from: a
   doubled bonus), and, in an engine that speculates, a token equal to the one before it whose first wrong input
   is in the pass that fed it (a token emitted twice and a token fed one position off look alike there): the
   classes of the wrong inputs seen in that pass are kept (`Verdict.seen_classes`).
5. No violation: the inputs were right (`CLEAN`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specaudit.equivalence.diagnosis.forward import replay_all
from specaudit.equivalence.diagnosis.capture import CallLog, columns_text
from specaudit.equivalence.diagnosis.states import StateChecks, Violation

# what a verdict may be: a violation of a class, inputs seen correct, or nothing judged
CLEAN = "clean"
INPUT_CLASSES = ("position_ids", "attention_mask", "kv_cache", "pad_as_content", "cross_row", "recurrent_state")


@dataclass(frozen=True)
class Verdict:
    """What the observation says about one divergence: `cls` (an input class), `CLEAN` (the inputs behind the
    engine's token were right) or None (nothing judged); `confirmed`: a replay of the observed inputs reproduced
    the engine's logits or chose its token (a violation), or chose the reference's token (clean). Frozen: a
    confirmation makes a new verdict (`dataclasses.replace`)."""

    cls: str | None
    evidence: str
    confirmed: bool = False
    speculated: bool = False  # the engine called the draft model, or fed a row several new tokens in one cached pass
    batched: bool = False  # the producer's call was a call of the batch, not one row decoded alone
    seen: str | None = None  # not judged (a repeated token): the class of the wrong input seen in its pass
    seen_classes: tuple[str, ...] = ()  # and the classes of every wrong input seen behind the token
    target_calls: int = 0  # the target calls the re-run made (0: nothing was seen)
    producer: int | None = None  # the slot whose query chose the engine's token
    engine_token: int | None = None  # the token it chose in the re-run
    state: bool = False  # the first wrong input is a recurrent state a call started from (no replay of it is made)
    # where the first wrong input is another: the first recurrent state seen wrong behind the token (class, evidence)
    state_seen: tuple[str, str] | None = None


@dataclass
class FeedCheck:
    """The verdicts on one call log; see the module."""

    seen: CallLog
    model: Any = field(default=None, repr=False)  # the target, to compute the states a row's own tokens leave
    states: StateChecks | None = field(default=None, init=False)  # on a target with recurrent layers

    def __post_init__(self) -> None:
        if self.seen.recurrent:
            self.states = StateChecks(self.seen, self.model)

    def judge(self, local: int, position: int, index: int, by_logits: bool = False,
              exclude: frozenset[int] = frozenset()) -> Verdict:
        """The verdict on new token `position` of the re-run's prompt `local` (prompt `index` of the run);
        `by_logits`: the engine's logits there will confirm it (a repeated token is then no ambiguity); `exclude`:
        slots not to take as the producer (one whose query's choice the engine did not emit)."""
        verdict = self._judge(local, position, index, by_logits, exclude)
        return replace(verdict, speculated=self.seen.speculated, target_calls=self.seen.calls)

    def _producer(self, local: int, sequence: list[int], m: int, exclude: frozenset[int] = frozenset()
                  ) -> tuple[int, str] | None:
        """The slot whose query chose the token at sequence index m + 1: the first fed holding sequence[m]
        whose visible content is sequence[:m + 1]; failing that the first that reads extra tokens besides
        them (`extra`), or misses some of them while written columns of its row are hidden from it
        (`missing`), the first fed at position m where one was (a rejected proposal of the same token, read
        among stale columns, is rarely fed at the row's own index). Where the row's label is ambiguous (rows of
        identical prompts; a prompt of pad ids alone, which a row of padding also holds), the row then fed the
        next token first, then the row labelled with the prompt."""
        want = sequence[:m + 1]
        twins = self._twins(local)
        ambiguous = len(twins) > 1 or all(t == self.seen.pad_token_id for t in self.seen.prompts[local])
        found: list[tuple[int, str]] = []
        for slot_id, slot in enumerate(self.seen.slots):
            if self.seen.records[slot.record].local not in twins or slot.token != sequence[m] or slot.pad \
                    or slot_id in exclude:
                continue
            content = [self.seen.slots[v].token for v in self.seen.visible(slot_id) if not self.seen.slots[v].pad]
            if content == want:
                if not ambiguous:
                    return slot_id, "exact"
                found.append((slot_id, "exact"))
            elif content and content[-1] == sequence[m] and _subsequence(want, content):
                found.append((slot_id, "extra"))
            elif self._misses_hidden(slot_id, content, want):  # its own token among them, if the mask hides it
                found.append((slot_id, "missing"))

        def follows(slot_id: int) -> bool:  # the row was then fed this row's next token
            return m + 1 < len(sequence) and self._fed_after(slot_id, sequence[m + 1])

        def own(slot_id: int) -> bool:
            return self.seen.records[self.seen.slots[slot_id].record].local == local

        if len(twins) > 1:
            # rows of identical prompts: a row labelled with another of them is this row only if it was then fed
            # this row's next token, or if no row labelled with this prompt was fed this token at all (labels
            # among identical prompts are arbitrary; a twin whose query read right inputs is not evidence here)
            reached = any(self.seen.records[slot.record].local == local and slot.token == sequence[m] and not slot.pad
                          for slot in self.seen.slots)
            found = [(slot_id, kind) for slot_id, kind in found if own(slot_id) or not reached or follows(slot_id)]

        def rank(candidate: tuple[int, str]) -> tuple[bool, bool, int]:
            # the row then fed the next token, the row labelled with the prompt; exact content, then a query
            # at the row's own index
            slot_id, kind = candidate
            return (not ambiguous or not follows(slot_id), not own(slot_id),
                    0 if kind == "exact" else 1 if self.seen.slots[slot_id].position == m else 2)

        return min(found, key=rank, default=None)  # min keeps the first of equal rank

    def _twins(self, local: int) -> frozenset[int]:
        """The prompts identical to prompt `local` (itself included): rows are matched to prompts by content, so
        which of identical prompts a row was labelled with is arbitrary; the row's own output tells them apart."""
        prompt = self.seen.prompts[local]
        return frozenset(j for j, other in enumerate(self.seen.prompts) if other == prompt)

    def _fed_after(self, slot_id: int, token: int) -> bool:
        """Whether some later slot holding `token` reads slot `slot_id` (its row was fed that token next)."""
        return any(slot.token == token and not slot.pad and other > slot_id and slot_id in self.seen.visible(other)
                   for other, slot in enumerate(self.seen.slots))

    def reads_ahead(self, local: int, position: int, slot_id: int) -> bool:
        """Whether the query of `slot_id` reads more copies of prompt `local`'s new token `position` than the row
        holds before that token: it reads what it would be taken to produce."""
        sequence = self.seen.prompts[local] + self.seen.outputs[local]
        m = len(self.seen.prompts[local]) + position
        token = sequence[m]
        read = sum(1 for v in self.seen.visible(slot_id) if not self.seen.slots[v].pad and self.seen.slots[v].token == token)
        return read > sequence[:m].count(token)

    def _misses_hidden(self, slot_id: int, content: list[int], want: list[int]) -> bool:
        """Whether the query of `slot_id` reads the row's tokens `want` but some, and as many written columns of
        its row (its own included) are hidden from it."""
        missing = len(want) - len(content)
        return missing > 0 and _subsequence(content, want) and self.seen.hidden(slot_id) >= missing

    def _continued(self, local: int, sequence: list[int], m: int) -> bool:
        """Whether the target was fed the token at index m + 1 after exactly the row's tokens before it (or
        those and stale columns): a token the engine emitted but never continued from (a bonus doubled, a
        token added after the target's choice) was not chosen by a query of the target."""
        want = sequence[:m + 2]
        twins = self._twins(local)
        for slot_id, slot in enumerate(self.seen.slots):
            if self.seen.records[slot.record].local not in twins or slot.token != sequence[m + 1] or slot.pad:
                continue
            content = [self.seen.slots[v].token for v in self.seen.visible(slot_id) if not self.seen.slots[v].pad]
            if content == want or (content and _subsequence(want, content)) or self._misses_hidden(slot_id, content,
                                                                                                 want):
                return True
        return False

    def _judge(self, local: int, position: int, index: int, by_logits: bool, exclude: frozenset[int]) -> Verdict:
        speculated = self.seen.speculated
        if self.seen.failed:
            return Verdict(None, f"the observation failed: {self.seen.failed}", speculated=speculated)
        if not self.seen.calls:
            return Verdict(None, "the engine never called the target's forward in the re-run (its own attention "
                           "over the weights, or another process): nothing to observe", speculated=speculated)
        prompt = self.seen.prompts[local]
        sequence = prompt + self.seen.outputs[local]
        m = len(prompt) + position - 1
        found = self._producer(local, sequence, m, exclude)
        if found is None:
            return Verdict(None, f"no target call fed prompt {index}'s token {sequence[m]} (index {m} in the row) "
                           "after its own earlier tokens", speculated=speculated)
        producer, how = found
        if m + 2 < len(sequence) and not self._continued(local, sequence, m):
            if self.seen.rows_lost():
                return Verdict(None, f"observed up to a pass after which rows of the batch were no longer followed "
                               "(cache entries moved in a way their keys did not tell): prompt "
                               f"{index}'s new token {position} ({sequence[m + 1]}) was not seen fed after the row's "
                               "tokens before it", speculated=speculated)
            return Verdict(None, f"observed: the target was never fed prompt {index}'s new token {position} "
                           f"({sequence[m + 1]}) after the row's tokens before it, though the row goes on: the "
                           "engine emitted a token it did not continue from (not a choice of the target's "
                           "query)", speculated=speculated)
        violations: list[Violation] = []
        repeated = speculated and not by_logits and m + 1 < len(sequence) and sequence[m + 1] == sequence[m]
        reached: dict[int, int] = {}  # slot -> its index in the row
        work = [(producer, m)]
        while work:
            slot_id, at = work.pop()
            if slot_id in reached:
                continue
            reached[slot_id] = at
            slot = self.seen.slots[slot_id]
            order = (slot.call, slot.column)
            if self.states is not None:
                stated = self.states.violation(slot.record, index, sequence)
                if stated:
                    violations.append(stated)
            visible = self.seen.visible(slot_id)
            fed = f"prompt {index}, {self.seen.where(slot_id)}: token {slot.token} (index {at} in the row)"
            pads = [self.seen.slots[v].column for v in visible if self.seen.slots[v].pad]
            if pads:
                violations.append(Violation(order + (0,), "attention_mask", f"{fed} reads {len(pads)} padding column(s) "
                                   f"({columns_text(pads)})"))
            unwritten = self.seen.unwritten(slot_id)
            content_ids = [v for v in visible if not self.seen.slots[v].pad]
            content = [self.seen.slots[v].token for v in content_ids]
            want = sequence[:at + 1]
            if content != want or unwritten:
                violations.append(Violation(order + (1,), *self._content_violation(slot_id, fed, content_ids, content,
                                                                                   want, unwritten, local)))
                continue
            if self.seen.window:
                windowed = self._window_violation(slot_id, fed, want)
                if windowed:
                    violations.append(Violation(order + (1,), "attention_mask", windowed))
            for rank, v in enumerate(content_ids):
                other = self.seen.slots[v]
                if other.position != rank:
                    violations.append(Violation((other.call, other.column, 2), "position_ids",
                                       f"prompt {index}, {self.seen.where(v)}: token {other.token} fed position "
                                       f"{other.position}; its index in the row is {rank}"
                                       + self._counted(v, other.position - rank)))
                if v != slot_id:
                    work.append((v, rank))
        chosen = sequence[m + 1] if m + 1 < len(sequence) else None
        record = self.seen.records[self.seen.slots[producer].record]
        batched = record.batch > 1 or len(self.seen.prompts) == 1  # a call of the batch, not one row decoded alone
        if not violations:
            return Verdict(CLEAN, f"observed: prompt {index}'s new token {position} was chosen at "
                           f"{self.seen.where(producer)}, whose query read exactly the row's {m + 1} earlier tokens, each "
                           "at its index in the row", speculated=speculated, producer=producer, engine_token=chosen,
                           batched=batched)
        violations.sort(key=lambda v: v[0])
        (call, column, _), cls, evidence = violations[0]
        state = column < 0  # a recurrent state a call started from (`_state_violation` orders it first in its call)
        # stale entries read by a query fed its own index as position (`kv_cache`) are no token fed one position
        # off: a token emitted twice leaves the row's queries short of a token, never reading extra ones
        stale_at_index = cls == "kv_cache" and self.seen.slots[producer].position == m
        if repeated and call >= self.seen.slots[producer].call and not stale_at_index:
            return Verdict(None, f"observed, not judged: prompt {index}'s new token {position} ({sequence[m]}) repeats "
                           "the token before it in an engine that speculates, and the first input out of order is "
                           "in the pass that fed it: a token emitted twice and a token fed one position off look "
                           f"alike there (the replays decide); that input: {evidence}", speculated=speculated,
                           seen=cls, seen_classes=self._classes_seen(producer, sequence[:m + 1], violations))
        if how != "exact":
            evidence += f" (the query that chose new token {position} reads {how} tokens against the row's own)"
        stated = next(((v[1], "observed: " + v[2]) for v in violations if v[0][1] < 0), None)
        return Verdict(cls, "observed: " + evidence, speculated=speculated, producer=producer, engine_token=chosen,
                       batched=batched, state=state, state_seen=None if state else stated)

    def _classes_seen(self, producer: int, want: list[int], violations: list[Violation]) -> tuple[str, ...]:
        """The classes of the wrong inputs behind `producer`: those of `violations`, and `position_ids` where a
        token it reads that is one of the row's (the stale ones set aside) was fed a position other than its index."""
        classes = {v[1] for v in violations}
        ids = [v for v in self.seen.visible(producer) if not self.seen.slots[v].pad]
        content = [self.seen.slots[v].token for v in ids]
        if _subsequence(want, content):
            extra = set(_extra(want, content, ids))
            aligned = [v for v in ids if v not in extra]
            if any(self.seen.slots[v].position != i for i, v in enumerate(aligned)):
                classes.add("position_ids")
        return tuple(sorted(classes))

    def _window_violation(self, slot_id: int, fed: str, want: list[int]) -> str | None:
        """Where the query of `slot_id`, in a sliding-window layer, does not read exactly the row's last `window`
        tokens (`want`: the row's tokens up to its own): what it reads instead."""
        read = [self.seen.slots[v].token for v in self.seen.visible(slot_id, window=True) if not self.seen.slots[v].pad]
        expected = want[max(0, len(want) - self.seen.window):]
        if read == expected:
            return None
        if len(read) < len(expected) and read == expected[len(expected) - len(read):]:
            return (f"{fed} reads {len(read)} of the row's last {len(expected)} tokens in a sliding-window layer "
                    f"(window {self.seen.window}): the window counts columns, and columns of this row it cannot read "
                    "(holes, stale or padding) fill the rest")
        if len(read) > len(expected) and read[len(read) - len(expected):] == expected:
            return (f"{fed} reads {len(read)} of the row's tokens in a sliding-window layer where the window holds "
                    f"{len(expected)}: the window is not applied")
        return (f"{fed} reads {len(read)} token(s) in a sliding-window layer (window {self.seen.window}) that are not the "
                f"row's last {len(expected)}")

    def _counted(self, slot_id: int, offset: int) -> str:
        """Where a position `offset` too high equals a count of the row's columns before the slot (its padding, or
        its padding and its hidden columns: rejected slots left as holes), that count, as evidence."""
        slot = self.seen.slots[slot_id]
        record = self.seen.records[slot.record]
        before = [int(c) for c in record.columns[:slot.column] if c >= 0]
        pads = sum(self.seen.slots[c].pad for c in before)
        holes = self.seen.hidden(slot_id)
        if offset == pads and pads:
            return f" (off by {offset}, the number of padding columns before it)"
        if offset == pads + holes and holes:
            return f" (off by {offset}, the number of padding and hidden columns before it)"
        return ""

    def unfed(self, producer: int) -> int:
        """How many of the entries the query of slot `producer` depends on the engine wrote without feeding a
        token (a stacked cache filled with zeros): no replay can compute them."""
        return sum(1 for s in self._closure(producer) if self.seen.slots[s].token < 0)

    def replay(self, model: Any, producer: int) -> torch.Tensor | None:
        """The logits [V] of `model` at the query of slot `producer`, replayed on exactly the slots it depends on
        (those it reads, recursively) with their observed tokens, positions and visibility; None when the
        model refuses them."""
        return self._replay_closure(model, self._closure(producer), producer)

    def _closure(self, producer: int) -> set[int]:
        """The slots the query of `producer` depends on: those it reads, recursively (itself included)."""
        closure, work = {producer}, [producer]
        while work:
            slot_id = work.pop()
            reads = self.seen.visible(slot_id)
            record = self.seen.slots[slot_id].record
            if self.states is not None and record >= 0:  # recurrent layers read what the call fed before (padding not marked
                # as such too) and the history its state was found to be (rejected tokens kept)
                reads = reads + [s for s in self.seen.untold(record) + self.states.histories.get(record, []) if s < slot_id]
            for v in reads:
                if v not in closure:
                    closure.add(v)
                    work.append(v)
        return closure

    def _replay_closure(self, model: Any, closure: set[int], producer: int) -> torch.Tensor | None:
        order = sorted(closure)  # slot ids run in the order the tokens were fed
        place = {slot_id: i for i, slot_id in enumerate(order)}
        # [L, L]: key j visible to query i
        allowed = torch.zeros(len(order), len(order), dtype=torch.bool, device="cpu")
        window = torch.zeros_like(allowed) if self.seen.window else None  # [L, L] in the sliding-window layers
        for slot_id in order:
            for v in self.seen.visible(slot_id):
                allowed[place[slot_id], place[v]] = True
            for v in self.seen.visible(slot_id, window=True) if window is not None else []:
                window[place[slot_id], place[v]] = True
        positions = [self.seen.slots[s].position for s in order]  # (OPT numbers padding -1: its table starts at -2)
        if any(self.seen.slots[s].token < 0 for s in order):  # an entry the engine wrote without feeding it
            return None
        # a slot that could read nothing (padding under a mask that hides it from itself) is computed as the
        # engine's attention computed it: reading nothing under a boolean or -inf mask, else averaging every key
        empty = [self.seen.records[self.seen.slots[s].record].empty_reads for s in order
                 if not bool(allowed[place[s]].any())]
        hidden = float("-inf") if empty and empty[0] == "nothing" else None
        logits = replay_all(model, [self.seen.slots[s].token for s in order], positions, allowed, window=window,
                            hidden=hidden)
        return None if logits is None else logits[place[producer]]

    def _content_violation(self, slot_id: int, fed: str, content_ids: list[int], content: list[int],
                           want: list[int], unwritten: list[int], local: int) -> tuple[str, str]:
        masks = self.seen.masks_columns(slot_id)
        if unwritten:
            return ("attention_mask" if masks else "kv_cache",
                    f"{fed} reads column(s) {columns_text(unwritten)} that hold no token of the row")
        if _subsequence(want, content):
            extra = _extra(want, content, content_ids)
            stale = ", ".join(f"token {self.seen.slots[v].token} at column {self.seen.slots[v].column}" for v in extra[:3])
            query = self.seen.slots[slot_id]
            cached = all(self.seen.slots[v].call < query.call for v in extra)
            if masks and cached and query.position == len(want) - 1 and not self.seen.masks_fed_columns(slot_id):
                return ("kv_cache", f"{fed} reads {len(extra)} cached column(s) not in the row's sequence ({stale}), "
                        f"written by earlier calls, while its own position {query.position} is its index in the row: "
                        "the engine numbers the row by its accepted tokens alone, and its cache keeps entries the row "
                        "did not accept (its mask hides padding of this cache, never a token it fed)")
            if masks:
                return ("attention_mask", f"{fed} reads {len(extra)} column(s) not in the row's sequence ({stale}) "
                        "that the engine's mask leaves visible (it hides other columns of this cache)")
            return ("kv_cache", f"{fed} reads {len(extra)} cached column(s) not in the row's sequence ({stale}): "
                    "the cache keeps entries the row did not accept")
        if _subsequence(content, want):
            missing = _extra(content, want, list(range(len(want))))
            tokens = [want[i] for i in missing]
            what = f"{len(missing)} of the row's earlier tokens (index {columns_text(missing)})"
            if self.seen.pad_token_id is not None and tokens and all(t == self.seen.pad_token_id for t in tokens):
                return ("pad_as_content", f"{fed} cannot read {what}, each the pad id {self.seen.pad_token_id}: "
                        "content treated as padding")
            return ("attention_mask", f"{fed} cannot read {what}")
        for other, prompt in enumerate(self.seen.prompts):
            if other != local and content and content == (prompt + self.seen.outputs[other])[:len(content)]:
                return ("cross_row", f"{fed} reads the sequence of another prompt of its batch")
        return ("unknown", f"{fed} reads {len(content)} token(s) that are not the row's sequence")


def _subsequence(short: list[int], long: list[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def _extra(short: list[int], long: list[int], ids: list[int]) -> list[int]:
    """The ids of `long`'s items left over when `short` is matched in it greedily from the end: the row's tokens
    taken as their latest copies (a query reads its own token last, and a cache that keeps rejected entries holds
    them before the tokens written after them)."""
    extra, at = [], len(short) - 1
    for i in range(len(long) - 1, -1, -1):
        if at >= 0 and long[i] == short[at]:
            at -= 1
        else:
            extra.append(ids[i])
    return extra[::-1]

