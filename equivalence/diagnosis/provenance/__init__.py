"""Diagnosis by provenance (first in a watched run's diagnosis, `core.Diagnoser._provenance`): which slot wrote
every cache column each query read, and one check of what it read.

Contract: pure. It reads per-call records (`CallRecord`, made by `provenance.hooks.ProvenanceHooks` from a real
model, or by hand in a test) and the requests' sequences (prompt, then the engine's output); it needs no model, no
row labels and no prompt labels, and changes nothing it is handed.

1. The records. Per target call and batch row (`RowFeed`): the tokens fed, the positions they were fed at, the
   cache column each was written to, a fingerprint of every column of the row's cache as the call left it (the
   last attention layer's keys and values, their bits mixed: an entry copied or moved keeps its fingerprint), for
   each query the columns it may read, and per query its argmax and the gap to the second.
2. The provenance map (`ProvenanceLog.writers`): every fingerprint a call wrote -> its writer slots (call, row,
   index among that row's fed tokens). Equal fingerprints are identical computations, so any of them serves. A
   column whose fingerprint no call wrote was written by the engine itself (fill, a stale tail): no writer.
3. The one check (`Provenance.check`): a query fed at index j of a request's sequence S must read, in column
   order, slots holding S[0], S[1], ..., S[j] (itself last), each fed at its own index as position, and each
   read slot must pass the same check at its index (memoized). A producing query of the emitted token at index
   n reads S[:n]: the sequence so far, the same call's accepted proposals among it.
4. The producer of an emitted token is a query whose argmax is that token and whose fed token is the one before
   it (`Provenance.producers`), not a guess; of several, the one that read the longest correct prefix. A query
   that read the row's exact context speaks for the row only where no other request shares that context, or
   where its row then went on with the engine's token: a request sharing the prefix computes the same context
   in its own row.
5. The first violation names the class, by fact (`CLASS_OF`, the same table as code):

    fact at the first violation                               class
    a column the row never fed is read (an extra, stale or    kv_cache
      duplicated entry; a foreign entry)
    ... where its writer served another request               cross_row
    a padding or fill column is read (a pad-id slot that is   attention_mask
      not the row's token there; a column no call wrote)
    a token of the row is hidden (the column holding it is    attention_mask
      not visible to the query)
    ... where the hidden token is the pad id                   pad_as_content
    the right token at the wrong position                     position_ids
    a sliding-window layer's query does not read the row's    attention_mask
      last `window` tokens (holes counted, no window)
    the recurrent state read is not the row's sequence up     recurrent_state
      to the query (not rolled back, reset, another row's)
    ... the difference is padding before every token of the   attention_mask
      row that no 2-D mask marks
    every query with the row's exact context chose the        acceptance_rule / stop_eos / stop_length /
      reference's token (the bug is after the logits)          output_order / pad_as_content, from the
                                                              run's facts (`after_the_logits`)
    the token repeats the one before it, which queries with   acceptance_rule
      the exact context chose there, and no query was fed the
      first copy at its index (one choice emitted twice:
      `emitted_twice`)

   A violation says where: call, batch row, column, token, the position fed and the index expected.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

# the facts of section 5, each to its class (the module's table, as code)
EXTRA_ENTRY, FOREIGN_ENTRY, PADDING_VISIBLE, FILL_VISIBLE = "extra entry", "foreign entry", "padding visible", "fill visible"
TOKEN_HIDDEN, PAD_HIDDEN, WRONG_POSITION, MISSING_ENTRY = "token hidden", "pad-id token hidden", "wrong position", "missing entry"
WRONG_STATE, PADDING_IN_STATE = "wrong state", "padding in the state"
WRONG_WINDOW = "wrong window"
STATE_PARTS = ("convolution window", "SSM state")  # the parts of a recurrent state, fingerprinted apart
ZERO = 0  # the fingerprint of a state part that is all zeros: the state of an empty history
CLASS_OF: dict[str, str] = {
    EXTRA_ENTRY: "kv_cache",  # a column the row never fed: extra, stale or duplicated
    MISSING_ENTRY: "kv_cache",  # a token of the row the cache does not hold at all
    FOREIGN_ENTRY: "cross_row",  # a column the row never fed, written serving another request
    PADDING_VISIBLE: "attention_mask",
    FILL_VISIBLE: "attention_mask",  # a column no call wrote (the engine's own fill)
    TOKEN_HIDDEN: "attention_mask",
    PAD_HIDDEN: "pad_as_content",
    WRONG_POSITION: "position_ids",
    WRONG_STATE: "recurrent_state",  # the state a query's recurrent layer read is not its row's sequence's
    PADDING_IN_STATE: "attention_mask",  # padding the model was not told of entered the state
    WRONG_WINDOW: "attention_mask",  # a sliding-window layer's query does not read the row's last `window` tokens
}
AFTER_THE_LOGITS = ("acceptance_rule", "stop_eos", "stop_length", "output_order", "pad_as_content")
CHOSE_RIGHT = "chose right"  # every query with the row's exact context chose the reference's token
EMITTED_TWICE = "emitted twice"  # the choice for the index before emitted again, its first copy never fed


@dataclass(frozen=True, eq=False)
class RowFeed:
    """One batch row of one target call, as the hooks saw it."""

    tokens: tuple[int, ...]  # [q] the ids fed
    positions: tuple[int, ...]  # [q] the position each was fed at (as the model consumed it)
    columns: tuple[int, ...]  # [q] the cache column each was written to
    prints: tuple[int, ...]  # [kv] the fingerprint of every column of the row's cache after the call
    visible: np.ndarray  # [q, kv] bool: which columns each query may read (the mask the attention layer received)
    choices: tuple[int, ...]  # [q] each query's argmax (-1: the output head did not compute it)
    gaps: tuple[float, ...]  # [q] the argmax's logit minus the second's (nan: not computed)
    # hybrids: the fingerprint of each part of the first recurrent layer's state (STATE_PARTS; None: the layer holds
    # no such part) as the call found it and as it left it, and which fed tokens a 2-D mask marks as padding
    # (the recurrent layers zero those inputs); None: no recurrent layer
    states_in: tuple[int | None, ...] | None = None
    states_out: tuple[int | None, ...] | None = None
    zeroed: tuple[bool, ...] | None = None  # [q]
    # sliding windows: [q, kv] bool, which columns each query of the last sliding-window layer may read (None: none)
    window: np.ndarray | None = None

    @property
    def written(self) -> tuple[int, ...]:
        """[q] the fingerprint of each column the call wrote."""
        return tuple(self.prints[c] for c in self.columns)

    def reads(self, query: int) -> list[int]:
        """The columns query `query` may read, in column order."""
        return [int(c) for c in np.nonzero(self.visible[query])[0]]

    def hidden(self, query: int) -> list[int]:
        """The columns up to the query's own (its own included) that it may not read."""
        own = self.columns[query]
        return [int(c) for c in np.nonzero(~self.visible[query][:own + 1])[0]]


@dataclass(frozen=True, eq=False)
class CallRecord:
    call: int  # the target call, counted from 0
    rows: tuple[RowFeed, ...]
    cache: int | None = None  # the serial of the cache object the call used (for the evidence only)


class Slot(NamedTuple):
    call: int
    row: int
    index: int  # among that row's fed tokens in the call


@dataclass(frozen=True)
class Violation:
    """The first input a query read that a correct engine does not feed it."""

    fact: str  # a key of CLASS_OF
    slot: Slot  # the query that read it (or whose own position is wrong)
    column: int  # the column concerned (read, or hidden)
    token: int  # the token that column holds (-1: no call wrote it)
    position: int  # the position it was fed at (-1: no call wrote it)
    index: int  # the index in the row's sequence the query expected there
    depth: int  # how many of the sequence's tokens were read right before it (ranks producers)
    writer: Slot | None = None
    note: str = ""

    @property
    def cls(self) -> str:
        return CLASS_OF[self.fact]

    def evidence(self) -> str:
        where = f"target call {self.slot.call}, batch row {self.slot.row}, query {self.slot.index}"
        if self.fact == WRONG_WINDOW:
            return f"{where}: {self.note}: {self.fact}"
        if self.column < 0:  # the recurrent state the query read
            return f"{where}: the recurrent state it read is not its row's: {self.fact} ({self.note})"
        written = (f"written by target call {self.writer.call} (batch row {self.writer.row})"
                   if self.writer is not None else "written by no target call")
        return (f"target call {self.slot.call}, batch row {self.slot.row}, query {self.slot.index}: column "
                f"{self.column} holds token {self.token} fed at position {self.position}, {written}; the row's "
                f"index {self.index} was expected there: {self.fact}" + (f" ({self.note})" if self.note else ""))


@dataclass
class ProvenanceLog:
    """The per-call records of one `generate` call of an engine, and the provenance map built from them."""

    calls: list[CallRecord] = field(default_factory=list)
    pad_token_id: int | None = None
    window: int | None = None  # the sliding window (tokens, the query's own included) of the target's windowed layers
    hook_seconds: float = 0.0  # the hooks' own time inside the engine's call
    draft_calls: int = 0  # the draft model's forward calls inside the engine's call
    _writers: dict[int, list[Slot]] | None = field(default=None, repr=False)
    _tokens: dict[int, frozenset[int]] | None = field(default=None, repr=False)
    _after: dict[int, frozenset[int]] | None = field(default=None, repr=False)
    # per (call, row, part): the history the state the call found holds, (token, zeroed) per input in the order
    # fed (None: a state no call left and not zero: written by the engine itself)
    _histories: dict[tuple[int, int, int], tuple[tuple[int, bool], ...] | None] | None = field(default=None, repr=False)

    def add(self, record: CallRecord) -> None:
        self.calls.append(record)
        self._writers = self._tokens = self._after = self._histories = None

    def state_history(self, slot: Slot, part: int) -> tuple[tuple[int, bool], ...] | None:
        """The inputs the query's recurrent state holds, its own token last: the history of the state its call
        found (the state another call left carries that call's; zero carries none), then the tokens its row was
        fed in the call up to it. None: no recurrent state, or one no call left (the engine wrote it)."""
        if self._histories is None:
            self._histories, left = {}, {}
            for record in self.calls:
                for row, feed in enumerate(record.rows):
                    if feed.states_in is None or feed.states_out is None:
                        continue
                    fed = tuple(zip(feed.tokens, feed.zeroed or (False,) * len(feed.tokens)))
                    for kept, (found, after) in enumerate(zip(feed.states_in, feed.states_out)):
                        if after is None:  # a part the model does not keep
                            continue
                        # a part made by this call (none before it) started from zero
                        history = () if found in (None, ZERO) else left.get((kept, found))
                        self._histories[(record.call, row, kept)] = history
                        if history is not None and after != ZERO:
                            left.setdefault((kept, after), history + fed)
        feed = self.feed(slot)
        if feed.states_in is None or part >= len(feed.states_in):
            return None
        history = self._histories.get((slot.call, slot.row, part))
        if history is None:
            return None
        zeroed = feed.zeroed or (False,) * len(feed.tokens)
        return history + tuple(zip(feed.tokens[:slot.index + 1], zeroed[:slot.index + 1]))

    def feed(self, slot: Slot) -> RowFeed:
        return self.calls[slot.call].rows[slot.row]

    def token(self, slot: Slot) -> int:
        return self.feed(slot).tokens[slot.index]

    def position(self, slot: Slot) -> int:
        return self.feed(slot).positions[slot.index]

    @property
    def writers(self) -> dict[int, list[Slot]]:
        """Every fingerprint a call wrote -> the slots that wrote it, in the order fed."""
        if self._writers is None:
            self._writers = {}
            for record in self.calls:
                for row, feed in enumerate(record.rows):
                    for index, fingerprint in enumerate(feed.written):
                        self._writers.setdefault(fingerprint, []).append(Slot(record.call, row, index))
        return self._writers

    def tokens_of(self, fingerprint: int) -> frozenset[int]:
        """The tokens the slots that wrote `fingerprint` were fed (one, unless unequal tokens left equal entries)."""
        if self._tokens is None:  # emptied by `add` with the writers
            self._tokens = {}
        found = self._tokens.get(fingerprint)
        if found is None:
            found = self._tokens[fingerprint] = frozenset(self.token(w) for w in self.writers.get(fingerprint, []))
        return found

    def fed_after(self, token: int, position: int) -> frozenset[int]:
        """The tokens fed to queries whose last column read before their own holds `token` fed at `position` (the
        entry itself, or the same token re-fed there): what a row went on with after it."""
        if self._after is None:
            writers, after, seen = self.writers, {}, {}
            for record in self.calls:
                for feed in record.rows:
                    for index, fed in enumerate(feed.tokens):
                        own = feed.columns[index]
                        before = [c for c in feed.reads(index) if c < own]
                        if not before:
                            continue
                        fingerprint = feed.prints[before[-1]]
                        if fingerprint not in seen:
                            seen[fingerprint] = {(self.token(w), self.position(w)) for w in writers.get(fingerprint, [])}
                        for key in seen[fingerprint]:
                            after.setdefault(key, set()).add(fed)
            self._after = {key: frozenset(tokens) for key, tokens in after.items()}
        return self._after.get((token, position), frozenset())

    def slots(self) -> list[Slot]:
        return [Slot(r.call, row, i) for r in self.calls for row, feed in enumerate(r.rows)
                for i in range(len(feed.tokens))]

    @property
    def speculated(self) -> bool:
        """The engine ran its draft model, or some call fed a row several new tokens onto a cache that held entries
        (a verification of proposals)."""
        return self.draft_calls > 0 or any(len(feed.tokens) > 1 and min(feed.columns) > 0 for r in self.calls for feed in r.rows)


class Provenance:
    """The one check over a `ProvenanceLog`, against the requests' sequences (prompt, then output)."""

    def __init__(self, log: ProvenanceLog, sequences: Sequence[Sequence[int]]) -> None:
        self.log = log
        self.sequences = [tuple(int(t) for t in s) for s in sequences]
        self._memo: dict[tuple[Slot, int, int], Violation | None] = {}

    def check(self, slot: Slot, request: int, n: int) -> Violation | None:
        """The first violation behind `slot` as the query at index n - 1 of request `request`'s sequence (None:
        it read exactly the sequence's first n tokens, each at its index, each passing the same check)."""
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * n + 1000))  # one frame per index of the sequence at most
        try:
            return self._check(slot, request, n)
        finally:
            sys.setrecursionlimit(limit)

    def _check(self, slot: Slot, request: int, n: int) -> Violation | None:
        key = (slot, request, n)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = found = self._first_violation(slot, request, n)
        return found

    def _first_violation(self, slot: Slot, request: int, n: int) -> Violation | None:
        log, expected = self.log, self.sequences[request][:n]
        feed = log.feed(slot)
        own = feed.columns[slot.index]
        hidden = feed.hidden(slot.index)
        j, seen = 0, set()  # j: the next index of the sequence to be read
        for column in feed.reads(slot.index):
            fingerprint = feed.prints[column]
            writers = log.writers.get(fingerprint, [])
            if column == own and j < n - 1:  # its own column comes before the sequence so far is read
                return self._missing(slot, request, j, hidden, column)
            if not writers:
                written = sum(1 for c in feed.reads(slot.index) if feed.prints[c] in log.writers)
                if written < n:  # fewer entries than the sequence's tokens: the fill sits where the row's are
                    return Violation(MISSING_ENTRY, slot, column, expected[j] if j < n else -1, -1, j, j,
                                     note="fill no target call wrote where the row's entries should be")
                return Violation(FILL_VISIBLE, slot, column, -1, -1, j, j)
            if fingerprint in seen:  # one entry at two columns
                return self._extra(slot, request, column, writers[0], j, "the same entry at two columns")
            if j < n:
                want = expected[j]
                holding = [w for w in writers if log.token(w) == want]
                if holding:
                    writer = slot if column == own and slot in holding else min(
                        holding, key=lambda w: (log.position(w) != j, w))
                    position = log.position(writer)
                    if position != j:
                        # where the sequence holds the same token at the index fed, the entry may be that index's
                        # (a copy, or entries between lost): so it may be where its writer read another count than
                        # j tokens in order, or where every index between holds the token too (a run of one token
                        # tells no count from a position). A later index's entry is a second copy; an earlier one
                        # is index j's at a wrong position where the rest of the read holds the sequence's next
                        # tokens up to the query's own (`_shifted_read`), else entries between were lost
                        whole = self.sequences[request]
                        if 0 <= position < len(whole) and whole[position] == want and (
                                one_token_run(whole, position, j)
                                or self.read_of(writer, request, min(len(whole), max(position, j) + 1)) != j + 1):
                            if position < j:  # index `position` again
                                return self._extra(slot, request, column, writer, j, f"a second copy of index {position}")
                            if not self._shifted_read(slot, request, n, column, j):
                                return Violation(MISSING_ENTRY, slot, column, want, position, j, j, writer,
                                                 f"the entry of index {position}, which holds the same token")
                        return Violation(WRONG_POSITION, slot, column, want, position, j, j, writer)
                    if writer != slot:
                        below = self._check(writer, request, j + 1)
                        if below is not None and below.slot == writer and not self._reads_itself(writer):
                            # its writer could not read its own entry: padding computed from nothing, not the
                            # row's token (a pad id at the position of the row's first token looks alike)
                            return Violation(PADDING_VISIBLE if log.token(writer) == log.pad_token_id else FILL_VISIBLE,
                                             slot, column, log.token(writer), log.position(writer), j, j, writer,
                                             "its writer could not read its own entry")
                        if below is not None:
                            return below
                    seen.add(fingerprint)
                    j += 1
                    continue
                before = [h for h in hidden if h < column and self._holds(feed, h, want)]
                if before:  # the row's token sits in a column the query may not read
                    stale = self._stale_read(slot, request, j)
                    if stale is not None:  # and an entry its sequence never holds read: the window moved over it
                        return stale
                    return self._hidden(slot, before[0], want, j)
            writer = writers[0]
            return self._extra(slot, request, column, writer, j, "")
        if j < n:
            return self._missing(slot, request, j, hidden, own)
        return self._window_violation(slot, request, n) or self._state_violation(slot, request, n)

    def _shifted_read(self, slot: Slot, request: int, n: int, column: int, j: int) -> bool:
        """Whether, with `column` read as index j of the sequence, the query's later reads hold indices j + 1 .. n - 2 in
        order (other entries among them aside) and its own column is index n - 1: every entry of the row is there,
        numbered from a wrong position on. Where they run out first, entries were lost instead."""
        feed, sequence = self.log.feed(slot), self.sequences[request]
        own = feed.columns[slot.index]
        if column == own:
            return j == n - 1
        j += 1
        for read in feed.reads(slot.index):
            if read == own:
                return j == n - 1
            if read > column and j < n - 1 and sequence[j] in self.log.tokens_of(feed.prints[read]):
                j += 1
        return False

    def _window_violation(self, slot: Slot, request: int, n: int) -> Violation | None:
        """The same check in the last sliding-window layer: the query reads, in column order, the sequence's last
        `window` tokens up to its own (its full-attention reads passed, so every column it reads was written)."""
        log, feed = self.log, self.log.feed(slot)
        if feed.window is None or not log.window:
            return None
        sequence = self.sequences[request]
        expected = sequence[max(0, n - log.window):n]
        read, padding = [], 0
        for column in np.nonzero(feed.window[slot.index])[0]:
            writers = log.writers.get(feed.prints[column], [])
            if not writers:  # fill
                padding += 1
                continue
            token, position = log.token(writers[0]), log.position(writers[0])
            if token == log.pad_token_id and not (0 <= position < len(sequence) and sequence[position] == token):
                padding += 1  # a pad-id entry where the row holds no pad id
                continue
            read.append(token)
        read_tuple = tuple(read)
        if read_tuple == expected and not padding:
            return None
        w = log.window
        if padding:
            note = f"it reads {padding} padding column(s) in a sliding-window layer (window {w})"
        elif len(read) < len(expected) and read_tuple == expected[len(expected) - len(read):]:
            note = (f"it reads {len(read)} of the row's last {len(expected)} tokens in a sliding-window layer (window "
                    f"{w}): the window counts columns, and columns of this row it cannot read fill the rest")
        elif len(read) > len(expected) and read_tuple[len(read) - len(expected):] == expected:
            note = (f"it reads {len(read)} of the row's tokens in a sliding-window layer where the window holds "
                    f"{len(expected)}: the window is not applied")
        else:
            note = (f"it reads {len(read)} token(s) in a sliding-window layer (window {w}) that are not the row's "
                    f"last {len(expected)}")
        return Violation(WRONG_WINDOW, slot, -1, -1, -1, n - len(expected), n - len(expected), note=note)

    def _state_violation(self, slot: Slot, request: int, n: int) -> Violation | None:
        """The same check on the recurrent state the query read (each part apart): its inputs, padding the model
        was told of before any token aside (zero inputs to a zero state), must be the sequence's first n tokens."""
        expected = self.sequences[request][:n]
        for part, name in enumerate(STATE_PARTS):
            history = self.log.state_history(slot, part)
            if history is None:
                continue
            start = 0
            while start < len(history) and history[start][1]:
                start += 1
            history = history[start:]
            tokens = tuple(t for t, _ in history)
            if tokens == expected and not any(z for _, z in history):
                continue
            pad, lead = self.log.pad_token_id, 0
            while lead < len(tokens) and tokens[lead] == pad and tokens[lead:] != expected:
                lead += 1
            if lead and tokens[lead:] == expected and not any(z for _, z in history):
                # padding before every token of the row: the model was not told it is padding (a 2-D mask
                # zeroes it); padding after them is an input the state should not have taken (below)
                return Violation(PADDING_IN_STATE, slot, -1, pad, -1, 0, 0,
                                 note=f"its {name} took in padding the model was not told of (no 2-D mask marks it)")
            first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                         min(len(tokens), len(expected)))
            return Violation(WRONG_STATE, slot, -1, tokens[first] if first < len(tokens) else -1, -1, first, first,
                             note=f"its {name}: {self._state_text(history, expected, request, slot.index + 1)}")
        return None

    def _state_text(self, history: tuple[tuple[int, bool], ...], expected: tuple[int, ...], request: int,
                    fed: int) -> str:
        """What the state holds against the sequence, in words (`fed`: how many of its inputs the call itself fed)."""
        tokens = [t for t, _ in history]
        found = tuple(tokens[:len(tokens) - fed])  # the state the call found
        for other, sequence in enumerate(self.sequences):
            if found and other != request and found == sequence[:len(found)] and found != expected[:len(found)]:
                return f"the call found request {other}'s state"
        if any(z for _, z in history) and [t for t, z in history if not z] == list(expected):
            return ("inputs the 2-D mask marks as padding, fed between the row's tokens, moved it (zero inputs still "
                    "move a state)")
        pad = self.log.pad_token_id
        if pad is not None and pad not in expected and [t for t in tokens if t != pad] == list(expected):
            return "pad ids fed after the row's tokens moved it (the state kept through a ragged pass's padding)"
        if len(tokens) > len(expected) and _subsequence(list(expected), tokens):
            return (f"the state after {len(tokens)} inputs where the row's sequence has {len(expected)}: every token "
                    "fed kept, the rejected ones kept (not rolled back)")
        if len(tokens) < len(expected) and tuple(tokens) == expected[len(expected) - len(tokens):]:
            return f"the state of the row's last {len(tokens)} tokens alone: reset"
        return f"the state after {len(tokens)} inputs that are not the row's first {len(expected)} tokens"

    def _stale_read(self, slot: Slot, request: int, j: int) -> Violation | None:
        """The first column the query reads before its own whose entry its sequence holds at no index (not
        padding, not fill, not the row's token at the position it was fed at), as an extra or foreign entry."""
        log, feed, whole = self.log, self.log.feed(slot), self.sequences[request]
        own = feed.columns[slot.index]
        for column in feed.reads(slot.index):
            if column == own:
                break
            writers = log.writers.get(feed.prints[column], [])
            if not writers:
                continue
            if any(0 <= log.position(w) < len(whole) and whole[log.position(w)] == log.token(w) for w in writers):
                continue  # the row's token at its own index
            found = self._extra(slot, request, column, writers[0], j, "")
            if found.fact in (EXTRA_ENTRY, FOREIGN_ENTRY):
                return found
        return None

    def _reads_itself(self, slot: Slot) -> bool:
        """Whether the query may read its own column (every token fed as content does)."""
        feed = self.log.feed(slot)
        return bool(feed.visible[slot.index][feed.columns[slot.index]])

    # ---- the facts ---------------------------------------------------------------------------------
    def _holds(self, feed: RowFeed, column: int, token: int) -> bool:
        return token in self.log.tokens_of(feed.prints[column])

    def _hidden(self, slot: Slot, column: int, token: int, j: int) -> Violation:
        fact = PAD_HIDDEN if token == self.log.pad_token_id else TOKEN_HIDDEN
        feed = self.log.feed(slot)
        writer = next(w for w in self.log.writers[feed.prints[column]] if self.log.token(w) == token)
        return Violation(fact, slot, column, token, self.log.position(writer), j, j, writer)

    def _missing(self, slot: Slot, request: int, j: int, hidden: list[int], column: int) -> Violation:
        want = self.sequences[request][j]
        feed = self.log.feed(slot)
        held = [h for h in hidden if self._holds(feed, h, want)]
        if held:
            return self._hidden(slot, held[0], want, j)
        return Violation(MISSING_ENTRY, slot, column, want, -1, j, j, note="no column the query may read holds it")

    def _extra(self, slot: Slot, request: int, column: int, writer: Slot, j: int, note: str) -> Violation:
        """A read column that is not the row's token at index j: padding, another request's entry, or an entry
        the row never fed."""
        log = self.log
        token, position = log.token(writer), log.position(writer)
        sequence = self.sequences[request]
        copy = not note and 0 <= position < j and sequence[position] == token and self._reads_itself(writer)
        if token == log.pad_token_id and (j >= len(sequence) or sequence[j] != token) and not copy:
            # a pad-id entry where the row's token is not the pad id: padding, however many columns hold it (a
            # copy of the row's own pad-id token, computed reading itself as content is, is an extra entry)
            return Violation(PADDING_VISIBLE, slot, column, token, position, j, j, writer)
        other = None if note else self._served(writer, request)
        if other is not None:
            return Violation(FOREIGN_ENTRY, slot, column, token, position, j, j, writer,
                             f"its writer read request {other}'s sequence")
        if not note and 0 <= position < j and self.sequences[request][position] == token:
            note = f"a second copy of index {position}"
        return Violation(EXTRA_ENTRY, slot, column, token, position, j, j, writer, note or "an entry the row never fed")

    def _served(self, writer: Slot, request: int) -> int | None:
        """Another request whose sequence the writer's query read exactly, each at its index (None: none)."""
        log = self.log
        position = log.position(writer)
        for other, sequence in enumerate(self.sequences):
            if other == request or position >= len(sequence) or sequence[position] != log.token(writer):
                continue
            # the same context before the writer's token: it read nothing of another request's (a rejected
            # proposal the row fed that the other request's sequence holds next is the row's own extra entry); at
            # position 0 it read nothing at all, and the token alone says which request it served
            context = position if position > 0 else 1
            if self.sequences[request][:context] == sequence[:context]:
                continue
            if self._check(writer, other, position + 1) is None:
                return other
        return None

    # ---- producers -----------------------------------------------------------------------------------
    def producers(self, request: int, n: int, token: int) -> list[tuple[Slot, Violation | None]]:
        """The queries that chose `token` as the one after the first n tokens of request `request`'s sequence
        (their fed token is its token n - 1; not one that read the sequence past it, a later query fed the same
        token, nor one fed at another index where the sequence holds the same token that did not read the first
        n tokens in order, or where every index between holds it too: that index's query), with
        the first violation behind each; the most correct first: no
        violation, then the most of the sequence its row holds, then the most read (in order, whatever else was
        read among it), then one whose row went on with the token, then one fed at the token's own index, then the
        fewest other columns read (a query of another request whose context
        holds the sequence's few tokens among many reads them too), then the longest prefix read right."""
        last = self.sequences[request][n - 1]
        sequence = self.sequences[request]

        def elsewhere(slot: Slot) -> bool:
            """Fed at another index of the sequence that holds its token there, reading less than the first n
            tokens in order, or in a run of that one token (no count told from a position): that index's query
            (one that read them all, outside such a run, is this index's at a wrong position)."""
            position = self.log.position(slot)
            return (position != n - 1 and 0 <= position < len(sequence) and sequence[position] == last
                    and (self.read_of(slot, request, n) < n or one_token_run(sequence, position, n - 1)))

        chose = [slot for slot in self.log.slots()
                 if self.log.token(slot) == last and self.log.feed(slot).choices[slot.index] == token
                 and not self._reads_past(slot, request, n) and not elsewhere(slot)]
        found = [(slot, self.check(slot, request, n)) for slot in chose]
        def rank(item: tuple[Slot, Violation | None]) -> tuple:
            slot, violation = item
            held = self.held_of(slot, request, n)
            read = self.read_of(slot, request, n)
            extra = len(self.log.feed(slot).reads(slot.index)) - read  # columns read beside the sequence's
            moved = self.log.position(slot) != n - 1  # fed elsewhere than the token's index in the sequence
            # a row that went on with the query's choice (the token fed next after the same token and position)
            went_on = token in self.log.fed_after(self.log.token(slot), self.log.position(slot))
            return (violation is not None, -held, -read, not went_on, moved, extra,
                    -(violation.depth if violation else n), slot)

        return sorted(found, key=rank)

    def held_of(self, slot: Slot, request: int, n: int | None = None) -> int:
        """How many of the first n tokens of the sequence (all of it: None) the query's row holds up to the query's
        own column, visible to it or not, counted as a multiset (an entry out of place or overwritten costs one):
        a query of the request's own row at index n - 1 holds all n; a query of another request's row, fewer
        (unless the two share the prefix: the same computation)."""
        sequence = self.sequences[request] if n is None else self.sequences[request][:n]
        feed = self.log.feed(slot)
        wanted = Counter(sequence)
        held = 0
        for column in range(min(feed.columns[slot.index] + 1, len(feed.prints))):
            for token in self.log.tokens_of(feed.prints[column]):
                if wanted[token] > 0:
                    wanted[token] -= 1
                    held += 1
                    break
        return held

    def _reads_past(self, slot: Slot, request: int, n: int) -> bool:
        """The query reads, before its own column and in order, the sequence's first n + 1 tokens: a later query of
        the row fed the same token again, not the one at index n - 1."""
        sequence = self.sequences[request][:n + 1]
        if len(sequence) <= n:
            return False
        feed, j = self.log.feed(slot), 0
        own = feed.columns[slot.index]
        for column in feed.reads(slot.index):
            if column == own:
                break
            if j < len(sequence) and sequence[j] in self.log.tokens_of(feed.prints[column]):
                j += 1
        return j > n

    def read_of(self, slot: Slot, request: int, n: int) -> int:
        """How many of the sequence's first n tokens the query read, in order (a subsequence of what it read)."""
        expected, feed, j = self.sequences[request][:n], self.log.feed(slot), 0
        for column in feed.reads(slot.index):
            writers = self.log.writers.get(feed.prints[column], [])
            if j < n and writers and self.log.token(writers[0]) == expected[j]:
                j += 1
        return j

    def shared(self, request: int, n: int) -> bool:
        """Whether another request's sequence starts with the same first n tokens (its row computes them too)."""
        head = self.sequences[request][:n]
        return any(other != request and tuple(sequence[:n]) == head for other, sequence in enumerate(self.sequences))

    def correct_queries(self, request: int, n: int) -> list[Slot]:
        """The queries that read exactly the first n tokens of request `request`'s sequence."""
        last = self.sequences[request][n - 1]
        return [slot for slot in self.log.slots()
                if self.log.token(slot) == last and self.check(slot, request, n) is None]


def one_token_run(sequence: Sequence[int], i: int, j: int) -> bool:
    """Indices i..j of the sequence (either order) all hold one token: there no count is told from a position."""
    low, high = min(i, j), max(i, j)
    return len(set(sequence[low:high + 1])) == 1


def eos_set(eos_token_id: Any) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(e) for e in eos_token_id)


def after_the_logits(request: int, position: int, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                     references: Sequence[Sequence[int]], speculated: bool, eos_token_id: Any = None,
                     max_new_tokens: int | None = None, pad_token_id: int | None = None) -> tuple[str, str]:
    """The class of a divergence whose target queries chose right, from the run's own facts: the output is another
    prompt's reference (`output_order`); it ends, the reference's prefix, where the reference's next token is the
    pad id (`pad_as_content`: a real token taken for padding); it goes on past an EOS or stops short of the reference (`stop_eos` where
    an EOS is involved, else `stop_length`); otherwise a token the target did not choose was emitted
    (`acceptance_rule`, for an engine seen verifying proposals; `unknown` for one that was not)."""
    output, reference = list(outputs[request]), list(references[request])
    eos = eos_set(eos_token_id)
    if (pad_token_id is not None and len(output) <= position < len(reference) and reference[position] == pad_token_id
            and output == reference[:len(output)]):
        return "pad_as_content", (f"the output of prompt {request} ends where the reference's next token is the pad "
                                  f"id {pad_token_id}: a real token taken for padding")
    for other, expected in enumerate(references):
        if other != request and expected != reference and output and output == list(expected)[:len(output)] \
                and tuple(prompts[other]) != tuple(prompts[request]):
            return "output_order", f"the output of prompt {request} is prompt {other}'s reference"
    if any(t in eos for t in output[:-1]):
        return "stop_eos", f"the output of prompt {request} goes on after an EOS"
    limit = max_new_tokens if max_new_tokens is not None else len(reference)
    if position >= len(output) or position >= len(reference) or len(output) > limit:
        if (output and output[-1] in eos) or (position < len(reference) and reference[position] in eos):
            return "stop_eos", (f"the output of prompt {request} has {len(output)} tokens where the reference has "
                                f"{len(reference)}, at an EOS")
        return "stop_length", (f"the output of prompt {request} has {len(output)} tokens where the reference has "
                               f"{len(reference)} (max_new_tokens {limit})")
    if speculated:
        return "acceptance_rule", (f"token {position} of prompt {request} ({output[position]}) is not what the target "
                                   f"chose after the row's exact context ({reference[position]})")
    return "unknown", "the target chose right and the engine did not speculate: what emitted the token is not seen"


class Reading(NamedTuple):
    """What the provenance says of one divergence: its class, the evidence, and the fact that decided it (a key of
    `CLASS_OF` for a violation, `CHOSE_RIGHT` for a class after the logits; None: nothing seen decides)."""

    cls: str
    evidence: str
    fact: str | None = None


def emitted_twice(provenance: Provenance, request: int, m: int, prompt_length: int) -> str:
    """Whether token m of the request's sequence is the choice for index m - 1 emitted again: it repeats the token
    before it, queries that read the exact first m - 1 tokens chose that token there (a context no other request
    shares), and no query was fed that first copy at its index after the row's first m - 1 tokens: the engine
    never computed the sequence it emitted. The evidence, or ''."""
    log, sequence = provenance.log, provenance.sequences[request]
    if not log.speculated or not prompt_length < m < len(sequence) or sequence[m - 1] != sequence[m]:
        return ""
    if provenance.shared(request, m - 1):
        return ""  # a query with that context may be another request's row: its choice is not this row's
    before = provenance.correct_queries(request, m - 1) if m >= 2 else []
    if not before or {log.feed(s).choices[s.index] for s in before} != {sequence[m]}:
        return ""
    if any(log.token(s) == sequence[m] and log.position(s) == m - 1 and provenance.read_of(s, request, m) == m
           for s in log.slots()):
        return ""  # the first copy was fed at its index after the row's tokens (whatever else was read among them)
    return (f"new token {m - prompt_length} ({sequence[m]}) repeats the one before it, which {len(before)} queries "
            "that read the row's exact context chose there, and no query was fed that first copy in the row's "
            "context: one target choice emitted twice (a doubled bonus token)")


def provenance_diagnosis(log: ProvenanceLog, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                         references: Sequence[Sequence[int]], divergence: dict[str, Any], *,
                         eos_token_id: Any = None, max_new_tokens: int | None = None,
                         provenance: Provenance | None = None) -> Reading:
    """The `Reading` of one structural divergence (`prompt_index`, `position`, `engine_token`): the first
    violation behind the query that chose the engine's token, else, where queries read the row's exact context
    and chose the reference's token, the class after the logits. `provenance`: one shared across the run's
    divergences (its memo), built over `prompts` and `outputs` when not given."""
    request, position = int(divergence["prompt_index"]), int(divergence["position"])
    token = divergence.get("engine_token")
    if provenance is None:
        provenance = Provenance(log, [list(p) + list(o) for p, o in zip(prompts, outputs)])
    n = len(prompts[request]) + position  # the emitted token's index in the sequence
    if not log.calls:
        return Reading("unknown", "no target call was recorded")
    correct = provenance.correct_queries(request, n) if n >= 1 else []
    shared = provenance.shared(request, n)
    if token is not None and shared:
        # another request shares the first n tokens: a query of its row computes the same context, and its choice
        # says nothing of this row's, unless this row went on with the engine's token after it
        correct = [s for s in correct if int(token) in log.fed_after(log.token(s), log.position(s))]
    reference = list(references[request])
    wanted = reference[position] if position < len(reference) else None
    chose = {log.feed(s).choices[s.index] for s in correct} - {-1}  # -1: the head did not compute it
    if token is not None and n >= 1:
        ranked = provenance.producers(request, n, int(token))
        held = provenance.held_of(ranked[0][0], request, n) if ranked else 0
        # a query fed the row's exact context at the token's own index, no later than the producer's call, that
        # chose the reference's token: the target chose right where the row asked it (a later call's query
        # computes the context again, after the token was emitted: an engine that re-feeds whole sequences)
        chose_right = bool(ranked) and wanted is not None and chose == {wanted} and any(
            s.call <= ranked[0][0].call and log.position(s) == n - 1 and log.feed(s).choices[s.index] == wanted
            for s in correct)
        if ranked and ranked[0][1] is not None and (held < n - 1 or chose_right and held < n):
            # the best query that chose the engine's token holds little of the row's sequence (a query of another
            # context), or, where a query fed the row's exact context at the token's index chose the reference's
            # token, does not hold the whole sequence: a coincidence of tokens
            ranked = []
        if not ranked or ranked[0][1] is not None and ranked[0][1].fact == MISSING_ENTRY:
            # no producer, or one that misses an entry: where the row's sequence was first never computed (no query
            # fed its token m - 1 in its exact context), a second copy of one choice there explains both
            start = len(prompts[request]) + 1
            m = next((m for m in range(start, n + 1) if not provenance.correct_queries(request, m)), None)
            twice = emitted_twice(provenance, request, m, len(prompts[request])) if m is not None else ""
            if twice:
                after = f"; the divergence at new token {position} comes after it" if m < n else ""
                return Reading("acceptance_rule", f"prompt {request}: {twice}{after}", EMITTED_TWICE)
        if ranked and ranked[0][1] is None:
            return Reading("unknown", f"a query that read the row's exact context chose the engine's token {token} "
                           f"(target call {ranked[0][0].call}, batch row {ranked[0][0].row})")
        if ranked:
            violation = ranked[0][1]
            return Reading(violation.cls, violation.evidence(), violation.fact)
    if correct and (wanted is None or chose == {wanted}):
        cls, why = after_the_logits(request, position, prompts, outputs, references, log.speculated, eos_token_id,
                                    max_new_tokens, log.pad_token_id)
        if shared:  # the right choice may be another request's row: it shows nothing of this row's inputs
            return Reading(cls, f"{len(correct)} queries read the row's exact context, which another request "
                           f"shares, and chose the reference's token: {why}")
        return Reading(cls, f"{len(correct)} queries read the row's exact context and chose the reference's token: "
                       f"{why}", CHOSE_RIGHT)
    if token is None:
        return Reading("unknown", "the output stops here and no query read the row's exact context")
    return Reading("unknown", f"no query chose token {token} after the row's first {n} tokens, and none read them "
                   "exactly")


def _subsequence(short: list[int], long: list[int]) -> bool:
    """`short` is `long` with some items left out."""
    items = iter(long)
    return all(any(x == y for y in items) for x in short)
