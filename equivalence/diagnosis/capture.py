"""The capture: the target calls the hooks saw an engine make, what each fed it row by row, matched to the run's
prompts.

Contract: a `CallLog` holds what one `generate` call of the engine fed the target (the audited run's own, through
`observe.Watch`, or a hooked re-run of it) and judges nothing; the feed check (`feed_check.py`) reads it. Its `CallHooks` are
the forward hooks on the target (and the draft, whose calls are only counted); they change nothing the engine
computes, and keep each call compactly (`CallSeen`: copies of the ids, positions and 2-D mask, the layer's mask as
booleans, the cache's serial, key fingerprints) for `process` to read once the call is over.

1. Each target call is recorded per batch row (`CallRow`): the tokens fed, the columns of the cache they are
   written to (the cache's length before the call, or the `cache_position` given), the position each token was
   given as the model consumed it, and which columns each query may read, from the mask the first
   full-attention layer received (none received: causal over every column; a sliding-window layer's mask
   covers the last columns, and without one the model's own window over the columns applies). On a hybrid,
   the state of the cache's first recurrent layer as the call found it and as it left it (sampled).
2. Every token fed becomes a `Slot`; a slot reads the slots its query could see (`visible`).
3. Each batch row is matched to its prompt by content once its cache holds the prompt (the prompt as one run of
   its tokens; the columns before it, and columns after it that are the pad id and not the row's next token,
   are padding).
4. Each slot's keys in the first full-attention layer, as its call left them in the cache, follow it when the
   engine moves entries between calls (realigned, reordered or dropped rows, a new cache object): a row whose
   columns no longer hold its slots' keys is mapped again by them (a column whose keys no fed slot left is
   padding never fed), or is no longer followed (`rows_lost`).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from specaudit.equivalence.diagnosis.anatomy import (allowed_reads, attention_module, bind_arguments,
                                                      consumed_positions,
                                                      embedding_owner, empty_reads_of, first_keys,
                                                      layer_types, output_cache, position_module, recurrent_states,
                                                      row_state)
from specaudit.equivalence.rulings.thresholds import HIDDEN_MASK_FRACTION


@dataclass
class Slot:
    token: int
    position: int
    pad: bool
    call: int  # the target call that fed it (counted from 0)
    column: int
    record: int  # index into CallLog.records (the call-row whose query it was)
    query: int  # its query's index among that call-row's new tokens
    key: int | None = None  # its first layer's keys' fingerprint as the call left them in the cache (None: not read)


@dataclass
class CallRow:
    """One batch row of one target call: the slot of each column after the call (-1: none) and which
    columns each of the call's queries could read (bits packed along the columns)."""

    columns: np.ndarray  # [kv] int64 slot ids
    allowed: np.ndarray  # [q, ceil(kv / 8)] uint8, np.packbits of the [q, kv] bool mask
    width: int  # kv
    local: int | None  # the rerun's prompt index of the row (None: not matched)
    row: int  # its batch row in the call
    batch: int  # the call's batch size
    cache_length: int
    stream: Any  # its Stream
    window: np.ndarray | None = None  # [q, ceil(kv / 8)] uint8: what each query of a sliding-window layer could read
    # how a query that may read nothing was computed: "nothing" (a boolean or -inf mask: attention gives 0) or
    # "every" (the lowest finite value: it averages every key)
    empty_reads: str = "nothing"
    # per part, [n] float64: the row's first recurrent layer's state as the call found it, and as it left it
    state: dict[str, np.ndarray] | None = None
    end_state: dict[str, np.ndarray] | None = None
    told: np.ndarray | None = None  # [q] bool: the 2-D mask handed to the model marks the call's token as padding


@dataclass
class Stream:
    """The rows of one cache object, their prompts and the slot in each column."""

    rows: list[int | None]  # the rerun's prompt index of each batch row (None: not matched yet)
    columns: list[list[int]]  # per batch row: slot id per column (-1: none)
    unused: list[int]  # the prompts no row of this stream holds yet
    records: list[list[int]]  # per batch row: its call-rows (indices into CallLog.records)
    lost: list[bool]  # per batch row: its entries were moved or rewritten, so it is no longer followed
    masks_columns: bool | None = None  # the engine hid a written column from a later query (None: not asked yet)
    masks_fed: bool | None = None  # and one holding a fed token that is not padding (None: not asked yet)
    copied: bool = False  # first seen holding entries: its rows are followed by their keys at that call


@dataclass
class CallSeen:
    """What the hooks kept of one target call, compact and detached from anything the engine changes later: its
    arguments as the base model took them, the cache as the call found and left it (its identity, length and key
    fingerprints), and what the position module and the first attention layers were handed."""

    input_ids: Any  # [B, q] (anything else: the call is not recorded)
    cache: int | None  # the cache object's serial in this log (None: the call had none)
    length: int  # the cache's length before the call (-1: it could not say)
    states: dict[str, torch.Tensor] | None  # the first recurrent layer's state as the call found it (hybrids)
    prior_keys: torch.Tensor | None  # [B, length] int64: fingerprints of the first full layer's keys before the call
    cache_position: Any
    given_positions: Any  # the position ids the base model was handed
    given_mask: Any  # the attention mask the base model was handed (a 2-D one marks padding)
    positions: torch.Tensor | None = None  # the position ids as the position module consumed them
    # per layer kind ("mask": the first full-attention layer, "window_mask": the first sliding-window layer): the mask
    # it received ([B|1, 1, q, kv] bool where it was a 4-D tensor; None: none)
    masks: dict[str, Any] = field(default_factory=dict)
    empty_reads: str = "nothing"  # how the first full-attention layer computes a query that may read nothing
    end_states: dict[str, torch.Tensor] | None = None  # the state the call left (hybrids)
    new_keys: torch.Tensor | None = None  # [B, kv] int64: fingerprints of the first full layer's keys after the call


def key_fingerprints(keys: torch.Tensor) -> torch.Tensor:
    """[B, L] int64 from keys [B, H, L, D] in any dtype: each entry's bits mixed by fixed odd multipliers and summed
    with wrap-around, so equal entries give equal fingerprints whatever the tensor's length (integer sums do not
    depend on their order), and different ones collide with chance about 2**-64."""
    keys = keys.detach()
    width = keys.element_size()
    bits = keys.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[width]).to(
        device="cpu", dtype=torch.int64)
    heads, dim = keys.shape[1], keys.shape[3]
    multipliers = _MULTIPLIERS.get((heads, dim))
    if multipliers is None:
        generator = torch.Generator().manual_seed(heads * 100003 + dim)
        multipliers = torch.randint(1, 2**62, (heads, 1, dim), generator=generator, dtype=torch.int64) * 2 + 1
        _MULTIPLIERS[(heads, dim)] = multipliers
    return (bits * multipliers).sum(dim=(1, 3))  # [B, L]


_MULTIPLIERS: dict[tuple[int, int], torch.Tensor] = {}


@dataclass
class CallLog:
    """What one hooked re-run of a batch fed the target, row by row, matched to its prompts; see the module."""

    prompts: list[list[int]]  # the re-run's prompts, in its order
    outputs: list[list[int]] = field(default_factory=list)  # the re-run's outputs
    pad_token_id: int | None = None
    window: int | None = None  # the target's sliding window (tokens), where it has sliding-window layers
    recurrent: bool = False  # the target keeps recurrent states (hybrid layers): each call's are kept per row
    calls: int = 0  # target calls seen
    draft_calls: int = 0
    verified: int = 0  # cached target calls that fed a row more than one new token (a verification of proposals)
    failed: str | None = None
    entered: int = 0  # how many times the hooks were installed (once: around the engine's own generate call)
    captured: list[tuple[CallSeen, str]] = field(default_factory=list)  # the target calls kept, in order
    hook_seconds: float = 0.0  # the time the hooks took inside the engine's call (the observation's cost to the run)
    processed: bool = False
    slots: list[Slot] = field(default_factory=list)
    records: list[CallRow] = field(default_factory=list)
    _streams: dict[int, Stream] = field(default_factory=dict)  # per cache serial
    _caches: dict[int, tuple[Any, int]] = field(default_factory=dict)  # id -> (weak reference, serial), while alive
    _last_serial: int = 0
    _by_key: dict[int, list[int]] = field(default_factory=dict)  # the slots that left each key (first full layer)
    _claims: dict[int, int] = field(default_factory=dict)  # per prompt: how many rows were matched to it
    _by_record: dict[int, list[int]] | None = None  # per call-row: its slots (built once the re-run is over)
    _lock: Any = field(default_factory=threading.Lock)

    # ---- capture -----------------------------------------------------------------------------
    def cache_serial(self, cache: Any) -> int | None:
        """A serial for a cache object, stable while it lives (an id can be reused once it is gone)."""
        if cache is None:
            return None
        with self._lock:
            known = self._caches.get(id(cache))
            if known is not None and known[0]() is cache:
                return known[1]
            self._last_serial += 1
            serial = self._last_serial
            try:
                self._caches[id(cache)] = (weakref.ref(cache), serial)
            except TypeError:
                pass
            return serial

    def capture(self, call: CallSeen, family: str) -> None:
        """One target call kept as the hooks saw it (`CallHooks`); `process` reads them once the run is over."""
        with self._lock:
            self.captured.append((call, family))

    def process(self) -> None:
        """The kept calls read in order into slots and call-rows (once; the run's outputs label the rows)."""
        if self.processed:
            return
        self.processed = True
        for call, family in self.captured:
            try:
                self.record(call, family)
            except Exception as exc:  # an observation that fails says so and judges nothing
                self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if self.failed:
                break

    def record(self, call: CallSeen, family: str) -> None:
        """One target call, as the hooks kept it, added: its slots and call-rows."""
        if self.failed:
            return
        ids = call.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or call.length < 0:
            self.failed = "a target call without input ids or with a cache of unknown length"
            return
        ids = ids.detach().cpu().long()
        batch, q = ids.shape
        length = call.length
        given_mask = call.given_mask
        cache_position = call.cache_position
        columns = (cache_position.detach().cpu().long().flatten().tolist() if isinstance(cache_position, torch.Tensor)
                   and cache_position.numel() == q else list(range(length, length + q)))
        positions = call.positions
        if positions is None:  # no position module seen: as the model family derives them
            positions = call.given_positions
            if isinstance(positions, torch.Tensor):
                positions = positions.detach().cpu().long()
            elif family == "opt" and isinstance(given_mask, torch.Tensor) and given_mask.dim() == 2:
                mask = given_mask.detach().cpu().long()
                positions = (mask.cumsum(1) * mask - 1)[:, -q:]
            else:
                positions = torch.tensor([columns], device="cpu")
        positions = positions.reshape(-1, q).expand(batch, q)
        kv = max(columns) + 1
        query_columns = torch.tensor(columns, device="cpu").view(q, 1)  # [q, 1]
        key_columns = torch.arange(kv, device="cpu").view(1, kv)  # [1, kv]
        layer_mask = call.masks.get("mask")  # as the first full-attention layer received it
        allowed = allowed_reads(layer_mask, batch, q, kv)
        if allowed is None:
            if layer_mask is not None:
                self.failed = f"the attention layer received a mask of another form ({type(layer_mask).__name__})"
                return
            allowed = (key_columns <= query_columns).expand(batch, q, kv)  # none received: causal over every column
        window = None  # [B, q, kv]: what each query of a sliding-window layer could read
        if self.window:
            window = allowed_reads(call.masks.get("window_mask"), batch, q, kv, last=True)
            if window is None:  # none received, or another form: the model's own window over the columns
                window = allowed & (key_columns > query_columns - self.window)
        told = None  # [B, q]: the 2-D mask the model was handed marks the token as padding (recurrent layers zero it)
        if isinstance(given_mask, torch.Tensor) and given_mask.dim() == 2 and given_mask.shape[0] == batch \
                and given_mask.shape[1] >= q:
            told = given_mask[:, -q:].detach().cpu() == 0
        with self._lock:
            if length > 0 and q > 1:
                self.verified += 1
            self._feed(call.cache, ids, positions, allowed, columns, length, cache_position is not None,
                       call.prior_keys, window, call.empty_reads, call.states, call.end_states, told, call.new_keys)
            self.calls += 1

    def _stream(self, cache: int | None, ids: torch.Tensor, length: int) -> Stream:
        """The stream of the cache with serial `cache`: a new one at a cache's first call (or a call with none); a
        cache whose batch changed gets a stream whose rows are not followed."""
        known = self._streams.get(cache) if cache is not None else None
        if known is not None and length > 0:
            if len(known.rows) == ids.shape[0]:
                return known
        stream = Stream(rows=[None] * ids.shape[0], columns=[[] for _ in range(ids.shape[0])],
                         unused=list(range(len(self.prompts))), records=[[] for _ in range(ids.shape[0])],
                         lost=[False] * ids.shape[0])
        if length > 0:  # a cache whose batch changed, or one first seen holding entries (a copy): its rows are
            stream.unused = []  # followed by the keys of their entries, or not at all
            stream.copied = True
        if cache is not None:
            self._streams[cache] = stream
        return stream

    def _match(self, stream: Stream, b: int) -> None:
        """Row `b` of `stream` matched to the longest unused prompt that appears in the tokens of its columns as
        one run, at their end (left padding), their start (right padding) or after the leading pad ids; its
        slots then labelled (padding or not) and its call-rows given the prompt."""
        slot_ids = [s for s in stream.columns[b] if s >= 0]
        tokens = [self.slots[s].token for s in slot_ids]
        last = self.records[stream.records[b][-1]] if stream.records[b] else None
        seen = None
        if last is not None:
            mask = np.unpackbits(last.allowed[-1], count=last.width).astype(bool)  # the row's last query
            seen = [bool(mask[self.slots[s].column]) if self.slots[s].column < last.width else False for s in slot_ids]
        # the longest first; among equal prompts (duplicates in one batch, each row decoded with its own cache) the
        # one fewest rows have taken yet
        for local in sorted(stream.unused, key=lambda j: (-len(self.prompts[j]), self._claims.get(j, 0))):
            start = self._offset(tokens, self.prompts[local], local, seen)
            if start is None:
                continue
            if start != len(tokens) - len(self.prompts[local]) and self._partial(tokens, stream.unused, local):
                return  # the row so far may be part of a longer prompt (a prefill of all but its last token)
            stream.unused.remove(local)
            self._claims[local] = self._claims.get(local, 0) + 1
            stream.rows[b] = local
            for slot_id, pad in zip(slot_ids, self._labels(tokens, local, start)):
                self.slots[slot_id].pad = pad
            for record in stream.records[b] + [self.slots[s].record for s in slot_ids if self.slots[s].record >= 0]:
                if self.records[record].local is None:
                    self.records[record].local = local
                    self._label_earlier_padding(record, slot_ids[start:])
            return

    def _pad_only(self, local: int) -> bool:
        return all(t == self.pad_token_id for t in self.prompts[local])

    def _label_earlier_padding(self, record: int, content: list[int]) -> None:
        """An earlier call-row of a row matched only now (a prefill of all but the prompt's last token, split into
        per-row caches without its padding): the pad ids and fill before the prompt's first token in its columns are
        that call's padding, which the split dropped."""
        columns = [int(c) for c in self.records[record].columns]
        held = set(content)
        first = next((i for i, c in enumerate(columns) if c in held), None)
        for c in columns[:first or 0]:
            if c >= 0 and c not in held and (self.slots[c].token == self.pad_token_id or self.slots[c].token < 0):
                self.slots[c].pad = True

    def _partial(self, row: list[int], unused: list[int], local: int) -> bool:
        """Whether the row's tokens, after some of its leading pad ids, begin a longer unused prompt than the one
        found in it (`local`, found away from the row's end): then the row is matched once more is fed."""
        leading = 0
        while leading < len(row) and row[leading] == self.pad_token_id:
            leading += 1
        for other in unused:
            prompt = self.prompts[other]
            if other == local or len(prompt) <= len(self.prompts[local]):
                continue
            if any(len(row) - s < len(prompt) and prompt[:len(row) - s] == row[s:] for s in range(leading + 1)):
                return True
        return False

    def _offset(self, row: list[int], prompt: list[int], local: int | None = None,
                seen: list[bool] | None = None) -> int | None:
        """Where `prompt` starts in `row`: first where the rest of the row is the output of prompt `local` so far
        (a row first seen mid-generation, as an engine without a cache feeds it); else at the row's end (left
        padding), its start (right padding) or after its leading pad ids. Where the prompt could start at several
        of these (a prompt of pad ids in its padding), the first whose columns the row's last query reads
        (`seen`, per token of the row), as the engine's mask tells its content from its padding."""
        n = len(prompt)
        if not n or n > len(row):
            return None
        starts: list[int] = []
        if local is not None and local < len(self.outputs):
            sequence = prompt + self.outputs[local]
            for start in range(len(row) - n, -1, -1):
                if len(row) - start > len(sequence):
                    break
                if row[start:] == sequence[:len(row) - start]:
                    starts.append(start)
                    break
        leading = 0  # the row's leading pad ids and fill (entries written without a token: a stacked cache's zeros)
        while leading < len(row) and (row[leading] == self.pad_token_id or row[leading] < 0):
            leading += 1
        starts += [start for start in (len(row) - n, 0, leading, max(0, leading - 1))
                   if 0 <= start <= len(row) - n and row[start:start + n] == prompt]
        if seen is not None:  # those the last query reads first, each kind in its order
            starts.sort(key=lambda start: not all(seen[start:start + n]))
        return starts[0] if starts else None

    def _labels(self, row: list[int], local: int, start: int) -> list[bool]:
        """Which tokens of a row's first call are padding: those before its prompt, and after it the pad ids
        where the row's sequence (prompt and output) has another token and only pad ids follow (right padding;
        a pad id among proposals that go on, a draft's choice, is content that was not accepted)."""
        prompt = self.prompts[local]
        sequence = prompt + (self.outputs[local] if local < len(self.outputs) else [])
        pads = [True] * start + [False] * len(prompt)
        at = len(prompt)
        after = row[start + len(prompt):]
        trailing = len(after)  # where the run of pad ids that ends the row begins
        while trailing > 0 and after[trailing - 1] == self.pad_token_id:
            trailing -= 1
        for i, token in enumerate(after):
            if at < len(sequence) and token == sequence[at]:
                pads.append(False)
                at += 1
            else:
                pads.append(i >= trailing)
        return pads

    def _feed(self, cache: int | None, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
              columns: list[int], length: int, explicit_columns: bool, prior_keys: torch.Tensor | None,
              window: torch.Tensor | None = None, empty_reads: str = "nothing",
              states: dict[str, torch.Tensor] | None = None, end_states: dict[str, torch.Tensor] | None = None,
              told: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> None:
        batch, q = ids.shape
        stream = self._stream(cache, ids, length)
        kv = allowed.shape[-1]
        for b in range(batch):
            row_columns = stream.columns[b]
            if not explicit_columns:
                del row_columns[length:]  # a cropped cache
            moved = stream.rows[b] is not None and not self._unchanged(row_columns, prior_keys, b, length)
            # every row of a copy, not only those before the first one followed to a row not matched yet (which
            # makes prompts unused again)
            first_seen = stream.copied and not row_columns
            if (moved or (stream.rows[b] is None and (first_seen or not stream.unused))) and length > 0 \
                    and not stream.lost[b]:
                # entries moved or rewritten between calls (rows realigned, reordered or dropped): the row is
                # followed by the keys its slots left in the cache, or no more
                found = self._remap(prior_keys, b, length, {r for r in stream.rows[:b] if r is not None}, stream.rows[b])
                stream.rows[b] = None if found is None else found[0]
                stream.lost[b] = found is None
                if found is not None:
                    row_columns[:] = found[1]
                elif stream.rows[b] is None:  # a row not matched yet (its prompt not all fed): followed by its slots
                    unmatched = self._unmatched(prior_keys, b, length)
                    if unmatched is not None:
                        row_columns[:] = unmatched
                        stream.lost[b] = False
                        if not stream.unused:  # the prompts no row holds yet (all again where each is held); a
                            # prompt of pad ids alone stays open (a row of padding elsewhere may have claimed it)
                            stream.unused = ([j for j in range(len(self.prompts))
                                              if not self._claims.get(j) or self._pad_only(j)]
                                             or list(range(len(self.prompts))))
            row_columns.extend([-1] * (kv - len(row_columns)))
            tokens = ids[b].tolist()
            for i in range(q):
                row_columns[columns[i]] = len(self.slots)
                self.slots.append(Slot(tokens[i], int(positions[b, i]), False, self.calls, columns[i],
                                        len(self.records), i))
            mask = allowed[b].numpy()  # [q, kv]
            stream.records[b].append(len(self.records))
            self.records.append(CallRow(np.array(row_columns[:kv], dtype=np.int64), np.packbits(mask, axis=-1),
                                         kv, stream.rows[b], b, batch, length, stream,
                                         None if window is None else np.packbits(window[b].numpy(), axis=-1),
                                         empty_reads,
                                         row_state(states, b), row_state(end_states, b),
                                         None if told is None else told[b].numpy()))
            if stream.rows[b] is None and stream.unused and not stream.lost[b]:
                self._match(stream, b)
        if keys is not None:  # each new slot's keys as this call left them, to follow moved entries later
            found = keys.tolist()  # [B, kv]
            for b in range(min(batch, len(found))):
                for i in range(q):
                    if columns[i] < len(found[b]):
                        slot_id = stream.columns[b][columns[i]]
                        self.slots[slot_id].key = found[b][columns[i]]
                        self._by_key.setdefault(self.slots[slot_id].key, []).append(slot_id)

    def _remap(self, prior_keys: torch.Tensor | None, b: int, length: int, taken: set[int] = frozenset(),
               held: int | None = None) -> tuple[int, list[int]] | None:
        """The prompt and the slot of each column of row `b` of a cache whose entries moved, found by their keys:
        the prompt whose fed content left most of the row's columns' keys (at least half of those some content
        left) and its last one's; a padding column maps to padding with its keys, and a column whose keys no slot
        left (an entry the engine wrote itself, such as a new pad) becomes padding never fed.
        None when no prompt's slots hold the row."""
        if prior_keys is None or b >= prior_keys.shape[0]:
            return None
        keys = prior_keys[b, :length].tolist()

        def owners(key: int) -> set[int]:  # the prompts whose fed content (not padding) left this key
            return {local for local in (self.records[self.slots[s].record].local for s in self._by_key.get(key, [])
                                        if not self.slots[s].pad) if local is not None}

        votes: dict[int, int] = {}
        content = 0  # columns whose keys some fed token left (a row not matched yet counts: a prompt's content
        for key in keys:  # holding one equal key, an equal token at an equal position, is no majority of them)
            found = owners(key)
            content += bool(found) or any(not self.slots[s].pad and self.slots[s].token >= 0
                                          and self.records[self.slots[s].record].local is None
                                          for s in self._by_key.get(key, []))
            for local in found:
                votes[local] = votes.get(local, 0) + 1
        # a prompt an earlier row of this cache holds is no other row's (unless another prompt is identical to it, or
        # it is pad ids alone): rows of prompts that share their last tokens, end-aligned, leave equal keys there
        votes = {j: n for j, n in votes.items()
                 if j not in taken or self.prompts.count(self.prompts[j]) > 1 or self._pad_only(j)}
        if not votes:
            return None
        # among prompts whose content left as many of the keys (identical prompts leave identical keys, and so do
        # equal tokens at equal positions): one no earlier row took, the one the row held before (`held`), the one
        # with the fewest fed tokens the row does not hold (a prompt fed further is another row), else the first
        top = max(votes.values())
        tied = [j for j in votes if votes[j] == top]
        beyond = self._content_beyond(set(keys), tied) if len(tied) > 1 else {}
        local = max(votes, key=lambda j: (votes[j], j not in taken, j == held, -beyond.get(j, 0), -j))
        if votes[local] * 2 < content or local not in owners(keys[-1]):
            return None
        columns = []
        for column, key in enumerate(keys):
            slots = self._by_key.get(key, [])
            mine = [s for s in slots if self.records[self.slots[s].record].local == local]
            padding = [s for s in slots if self.slots[s].pad]
            if mine or padding:
                columns.append((mine or padding)[-1])
            else:
                columns.append(len(self.slots))
                self.slots.append(Slot(-1, -1, True, self.calls, column, -1, -1, key))
        return local, columns

    def _content_beyond(self, keys: set[int], prompts: list[int]) -> dict[int, int]:
        """Per prompt of `prompts`: how many of its fed tokens (not padding) left keys outside `keys`."""
        beyond = dict.fromkeys(prompts, 0)
        for slot in self.slots:
            local = self.records[slot.record].local if slot.record >= 0 else None
            if local in beyond and not slot.pad and slot.key is not None and slot.key not in keys:
                beyond[local] += 1
        return beyond

    def _unmatched(self, prior_keys: torch.Tensor | None, b: int, length: int) -> list[int] | None:
        """The slot of each column of row `b` of a cache whose entries moved, where the slots that left its keys
        were fed to a row not matched to its prompt yet (a prefill of all but the prompt's last token, split into
        per-row caches): the latest slot that left each key, a column whose keys no slot left padding never fed.
        None when fed slots left fewer than half of its columns' keys."""
        if prior_keys is None or b >= prior_keys.shape[0] or length == 0:
            return None
        columns, known, zeros = [], 0, 0
        keys = prior_keys[b, :length].tolist()
        candidates = [[s for s in self._by_key.get(key, []) if self.records[self.slots[s].record].local is None]
                      for key in keys]
        votes: dict[int, int] = {}  # per call-row: how many columns its slots' keys explain (rows that share a
        for slots in candidates:  # prefix leave equal keys: the columns are taken from the one row that holds most)
            for record in {self.slots[s].record for s in slots}:
                votes[record] = votes.get(record, 0) + 1
        best = max(votes, key=lambda r: (votes[r], r)) if votes else None
        for column, (key, slots) in enumerate(zip(keys, candidates)):
            if slots:
                known += 1
                own = [s for s in slots if self.slots[s].record == best]
                columns.append((own or slots)[-1])
            else:
                zeros += key == 0  # keys of zeros: a stacked cache's fill
                columns.append(len(self.slots))
                self.slots.append(Slot(-1, -1, True, self.calls, column, -1, -1, key))
        return columns if known * 2 >= length - zeros else None

    def _unchanged(self, row_columns: list[int], prior_keys: torch.Tensor | None, b: int, length: int) -> bool:
        """Whether the cache's first columns of row `b` still hold, as the call finds them, the keys of the slots
        this row wrote there (a cache whose rows the engine realigns, shifts or rewrites between calls fails)."""
        if prior_keys is None:
            return True
        if len(row_columns) < length or b >= prior_keys.shape[0]:
            return False
        found = prior_keys[b, :length].tolist()
        for column in range(length):
            slot_id = row_columns[column]
            if slot_id < 0:
                return False
            key = self.slots[slot_id].key
            if key is not None and key != found[column]:
                return False
        return True

    # ---- reading ---------------------------------------------------------------------------
    def visible(self, slot_id: int, window: bool = False) -> list[int]:
        """The slots the query of `slot_id` could read, in column order (its own included; an entry the engine
        wrote without feeding it reads nothing that was seen); with `window`, in a sliding-window layer."""
        slot = self.slots[slot_id]
        if slot.record < 0:
            return [slot_id]
        record = self.records[slot.record]
        bits = record.window if window and record.window is not None else record.allowed
        mask = np.unpackbits(bits[slot.query], count=record.width).astype(bool)
        ids = record.columns[mask]
        return [int(s) for s in ids]

    def unwritten(self, slot_id: int) -> list[int]:
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        mask = np.unpackbits(record.allowed[slot.query], count=record.width).astype(bool)
        return [int(c) for c in np.nonzero(mask & (record.columns < 0))[0]]

    def masks_columns(self, slot_id: int) -> bool:
        """Whether the engine hid, from some query of this slot's cache, an earlier written column (padding and a
        stacked cache's fill among them): it masks columns."""
        stream = self.records[self.slots[slot_id].record].stream
        if stream.masks_columns is None:
            stream.masks_columns = any(self._hides_content(record) for rows in stream.records for record in rows)
        return stream.masks_columns

    def masks_fed_columns(self, slot_id: int) -> bool:
        """Whether the engine hid, from some query of this slot's cache, an earlier column holding a token it fed
        that is not padding (a hole it meant to mask), not only padding and a stacked cache's fill (a pad id counts
        as padding: a row of pad ids alone is never matched to a prompt, so never labelled)."""
        stream = self.records[self.slots[slot_id].record].stream
        if stream.masks_fed is None:
            stream.masks_fed = any(self._hides_content(record, fed_only=True) for rows in stream.records
                                   for record in rows)
        return stream.masks_fed

    def _hides_content(self, record: int, fed_only: bool = False) -> bool:
        row = self.records[record]
        for slot_id in self.record_slots(record):
            slot = self.slots[slot_id]
            mask = np.unpackbits(row.allowed[slot.query], count=row.width).astype(bool)
            for column in range(min(slot.column, row.width)):
                held = int(row.columns[column])
                if held >= 0 and not mask[column] and not (fed_only and (self.slots[held].pad
                                                                          or self.slots[held].token < 0
                                                                          or self.slots[held].token == self.pad_token_id)):
                    return True
        return False

    def where(self, slot_id: int) -> str:
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        return (f"target call {slot.call} (batch row {record.row} of {record.batch}, cache length "
                f"{record.cache_length}), column {slot.column}")

    def hidden(self, slot_id: int) -> int:
        """How many written columns of the row up to the query of `slot_id` (its own included, padding aside) it
        cannot read."""
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        mask = np.unpackbits(record.allowed[slot.query], count=record.width).astype(bool)[:slot.column + 1]
        written = record.columns[:slot.column + 1]
        return sum(1 for c, seen in zip(written, mask) if c >= 0 and not seen and not self.slots[int(c)].pad)

    def record_slots(self, record: int) -> list[int]:
        """The slots call-row `record` fed, in the order of its tokens."""
        if self._by_record is None:
            self._by_record = {}
            for slot_id, slot in enumerate(self.slots):
                self._by_record.setdefault(slot.record, []).append(slot_id)
        return self._by_record.get(record, [])

    def told(self, slot_id: int) -> bool:
        """Whether the 2-D mask handed to the model marks slot `slot_id`'s token as padding."""
        slot = self.slots[slot_id]
        told = self.records[slot.record].told if slot.record >= 0 else None
        return bool(told is not None and slot.query < len(told) and told[slot.query])

    def untold(self, record: int) -> list[int]:
        """The padding slots call-row `record` fed before its last token of the row that the 2-D mask handed to the
        model does not mark (its recurrent layers zero only those it marks): they enter the recurrent state."""
        slots = self.record_slots(record)
        content = [s for s in slots if not self.slots[s].pad]
        if not content:
            return []
        return [s for s in slots[:slots.index(content[-1])] if self.slots[s].pad and not self.told(s)]

    def rows_lost(self) -> bool:
        """Whether some row of the batch stopped being followed (its cache entries moved in a way their keys did
        not tell)."""
        return any(any(stream.lost) for stream in self._streams.values())

    @property
    def speculated(self) -> bool:
        """The engine called the draft model, or verified several tokens of a row in one cached pass."""
        return self.draft_calls > 0 or self.verified > 0


class CallHooks:
    """The hooks on one model; for the target it builds the slots as each call ends."""

    def __init__(self, call_log: "CallLog", model: Any, role: str) -> None:
        self.call_log, self.model, self.role = call_log, model, role
        self.base = embedding_owner(model)
        self.handles: list[Any] = []
        self.current: CallSeen | None = None
        self.live_cache: Any = None  # the cache of the call in flight
        self.family = getattr(getattr(model, "config", None), "model_type", "")

    def install(self) -> None:
        self.handles.append(self.base.register_forward_pre_hook(self._start, with_kwargs=True))
        if self.role != "target":
            return
        self.handles.append(self.base.register_forward_hook(self._end, with_kwargs=True))
        found = position_module(self.base)
        if found is not None:
            self.handles.append(found[1].register_forward_pre_hook(self._positions_hook(found), with_kwargs=True))
        types = layer_types(self.model)
        attention = attention_module(self.base, types)
        if attention is not None:
            self.handles.append(attention.register_forward_pre_hook(self._attention("mask"), with_kwargs=True))
        window = attention_module(self.base, types, sliding=True) if self.call_log.window else None
        if window is not None:
            self.handles.append(window.register_forward_pre_hook(self._attention("window_mask"), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # ---- the hooks (they run in the engine's thread) -------------------------------------------
    def _start(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            self._keep_start(module, args, kwargs)
        finally:
            self.call_log.hook_seconds += time.perf_counter() - started

    def _keep_start(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.role != "target":
            self.call_log.draft_calls += 1
            return
        bound = bind_arguments(module.forward, args, kwargs)
        cache = bound.get("cache", bound.get("past_key_values"))
        length = 0
        if cache is not None and hasattr(cache, "get_seq_length"):
            try:
                length = int(cache.get_seq_length())
            except Exception:  # a cache that cannot say: its calls are not observed
                length = -1
        prior = first_keys(cache) if cache is not None and length > 0 else None
        states = recurrent_states(cache) if self.call_log.recurrent and cache is not None else None
        ids = bound.get("input_ids")
        self.live_cache = cache
        self.current = CallSeen(ids.detach().to("cpu", copy=True) if isinstance(ids, torch.Tensor) else ids,
                                self.call_log.cache_serial(cache), length, states,
                                None if prior is None else key_fingerprints(prior[:, :, :length]),
                                _kept(bound.get("cache_position")), _kept(bound.get("position_ids")),
                                _kept(bound.get("attention_mask")))

    def _positions_hook(self, found: tuple[str, Any]) -> Callable[..., None]:
        leaf, module = found

        def hook(hooked: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.current is None or self.current.positions is not None:
                return
            started = time.perf_counter()
            try:
                keep(args, kwargs)
            finally:
                self.call_log.hook_seconds += time.perf_counter() - started

        def keep(args: tuple, kwargs: dict[str, Any]) -> None:
            positions = consumed_positions(leaf, module, args, kwargs)
            if positions is not None:
                self.current.positions = positions.detach().to("cpu", dtype=torch.long, copy=True)
        return hook

    def _attention(self, kind: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.current is None or kind in self.current.masks:
                return
            started = time.perf_counter()
            bound = bind_arguments(module.forward, args, kwargs)
            mask = bound.get("attention_mask")
            if kind == "mask":
                self.current.empty_reads = empty_reads_of(mask)
            self.current.masks[kind] = _compact_mask(mask)
            self.call_log.hook_seconds += time.perf_counter() - started
        return hook

    def _end(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        started = time.perf_counter()
        try:
            self._keep_end(output)
        finally:
            self.call_log.hook_seconds += time.perf_counter() - started

    def _keep_end(self, output: Any) -> None:
        call, self.current = self.current, None
        cache, self.live_cache = self.live_cache, None
        if call is None:
            return
        if cache is None:  # the cache the model made for the call: followed when the engine hands it back
            cache = output_cache(output)
            call.cache = self.call_log.cache_serial(cache)
        if self.call_log.recurrent:  # the states the call left
            call.end_states = recurrent_states(cache) if cache is not None else None
        keys = first_keys(cache) if cache is not None else None
        if keys is not None:
            call.new_keys = key_fingerprints(keys)
        self.call_log.capture(call, self.family)


def _kept(value: Any) -> Any:
    """A tensor argument copied to the CPU (the engine may write into it after the call); anything else as given."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _compact_mask(mask: Any) -> Any:
    """A 4-D attention mask as [B|1, 1, q, kv] bool on the CPU (what a query may read); anything else as given."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    mask = mask[:, :1].detach()
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min * HIDDEN_MASK_FRACTION
    return mask.to("cpu", copy=True)


def columns_text(columns: list[int]) -> str:
    shown = ", ".join(str(c) for c in columns[:6])
    return shown + (f", ... ({len(columns)} in all)" if len(columns) > 6 else "")

