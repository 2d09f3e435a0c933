"""Diagnosis by observation: what an in-process engine fed the target, against what a correct engine feeds.

An in-process engine runs on the models the audit hands it, so its inputs can be seen. `observe_batch` re-runs
the engine once on a divergent batch (through the run's context: a fresh engine, guarded) with forward pre-hooks
on the module of the target that takes the input ids (its base model, or the decoder the language model calls
directly, as OPT's does) and on the draft's (its calls are counted), on the module that consumes the position
ids (a learned position table, `wpe` or `embed_positions`, or the rotary embedding) and on the first
full-attention layer (and the first sliding-window layer, where the model has them), and records for every
target call, per batch row: the tokens fed, the columns of the cache they are written to (the cache's length
before the call, or the `cache_position` given), the position each token was given as the model consumed it,
and which columns each query may read, from the mask as the attention layer received it (none received: causal
over every column; a sliding-window layer's mask covers the last columns, and without one the model's own
window over the columns applies). The engine's code is untouched.

Each batch row is matched to its prompt by content once its cache holds the prompt (the prompt as one run of
its tokens; the columns before it, and columns after it that are the pad id and not the row's next token,
are padding). Every token fed becomes a slot; a slot reads the slots its query could see. Each slot's
keys in the first full-attention layer, as its call left them in the cache, follow it when the engine moves
entries between calls (realigned, reordered or dropped rows, a new cache object): a row whose columns no
longer hold its slots' keys is mapped again by them (a column whose keys no fed slot left is padding never
fed), or is no longer followed.

`Observation.judge(prompt, position)` compares the slots that produced the engine's token at the divergence
(the first slot fed holding the row's token before it whose visible content is exactly the row's sequence
so far; failing that, one that reads extra or misses tokens, fed at the row's index where one was) with what
a correct engine feeds: each query reads exactly the row's own earlier tokens (no padding, no hole, no other
row's), each token it reads sits at its index in the row, and the same holds for each slot it reads,
recursively. The first slot (in the order fed) that breaks one of these names the class:

    padding visible                               attention_mask
    a token of the row hidden (pad id: pad_as_content) attention_mask / pad_as_content
    a stale slot visible (a token not in the row)  attention_mask where the engine masks columns of this
                                                   cache, else kv_cache
    another row's tokens                           cross_row
    a token fed a position other than its index    position_ids
    a sliding-window query that does not read      attention_mask
    exactly the row's last `window` tokens (the
    window counts columns: holes inside it)

A replay of the target (float64 where the audit has it) on exactly the observed slots, positions and
visibility (`forward.replay_all`) that reproduces the engine's logits (where it records them; the diagnosis
then judges the first new token whose logits are off) or chooses its token confirms it. Not judged: a token
the target was never fed after though the row goes on (emitted, not continued from: a doubled bonus), and, in
an engine that speculates, a token equal to the one before it whose first wrong input is in the pass that fed
it (a token emitted twice and a token fed one position off look alike there, and a replay often chooses the
repeated token either way; the engine's logits, where recorded, tell them apart): the classes of the wrong
inputs seen in that pass are kept, and a replay that names another input class gives way to `unknown`.
Inputs observed correct (the replay of them chooses the reference's token) rule out the input classes: the
divergence comes after the logits (acceptance, stops).

Hybrids (short convolutions, gated delta-net, Mamba-2 beside attention): each call also records, per row, the
state of the cache's first recurrent layer as the call found it and as it left it (sampled; its convolution
window and SSM state apart). A call's state must be the one the row's own tokens before the call leave (the
target run on them alone, batch 1), and a call that fed padding before the row's tokens must leave the state its
tokens leave. No tolerance decides it: the observed state is compared with the states other histories leave
(those the run's dtype can tell apart), and the nearest, where it is not the row's own, says what the engine
kept: every token fed to the row in the order fed (rejected ones and fill kept, not rolled back; or those the
2-D mask marks fed as zero inputs, which still move a state), one token behind or ahead, another row's own state
(`recurrent_state`); the row's padding (`attention_mask`: the model was
not told it is padding). Where the state cannot tell (a convolution window keeps its last inputs alone), padding
fed before the row's tokens that no 2-D mask handed to the model marks enters it (its recurrent layers zero only
what such a mask marks). A replay that feeds the recurrent layers that history (the slots, hidden from queries
that did not read them) and reproduces the engine confirms it; failing that, a re-run of the batch with the
target's attention layers silenced that still diverges from greedy decoding of the silenced target
(`layers.diverges_silenced`). Caches of
another kind (sliding windows alone) are not observed; an engine that never calls the target's forward (its own
attention over the weights) shows nothing, and the replays decide.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from specaudit.equivalence.rulings.thresholds import HIDDEN_MASK_FRACTION, state_resolution
from specaudit.equivalence.run_context import RunContext

# what a verdict may be: a violation of a class, inputs seen correct, or nothing judged
CLEAN = "clean"
INPUT_CLASSES = ("position_ids", "attention_mask", "kv_cache", "pad_as_content", "cross_row", "recurrent_state")
POSITION_MODULE_NAMES = ("wpe", "embed_positions")
STATE_SAMPLE = 4096  # elements of a row's recurrent state kept per call (evenly spaced): enough to tell histories apart


@dataclass
class Verdict:
    """What the observation says about one divergence: `cls` (an input class), `CLEAN` (the inputs behind the
    engine's token were right) or None (nothing judged); `confirmed`: a replay of the observed inputs reproduced
    the engine's logits or chose its token (a violation), or chose the reference's token (clean)."""

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
class _Slot:
    token: int
    position: int
    pad: bool
    call: int  # the target call that fed it (counted from 0)
    column: int
    record: int  # index into Observation.records (the call-row whose query it was)
    query: int  # its query's index among that call-row's new tokens
    key: bytes | None = None  # its first layer's keys as the call left them in the cache (None: not read)


@dataclass
class _CallRow:
    """One batch row of one target call: the slot of each column after the call (-1: none) and which
    columns each of the call's queries could read (bits packed along the columns)."""

    columns: np.ndarray  # [kv] int64 slot ids
    allowed: np.ndarray  # [q, ceil(kv / 8)] uint8, np.packbits of the [q, kv] bool mask
    width: int  # kv
    local: int | None  # the rerun's prompt index of the row (None: not matched)
    row: int  # its batch row in the call
    batch: int  # the call's batch size
    cache_length: int
    stream: Any  # its _Stream
    window: np.ndarray | None = None  # [q, ceil(kv / 8)] uint8: what each query of a sliding-window layer could read
    # how a query that may read nothing was computed: "nothing" (a boolean or -inf mask: attention gives 0) or
    # "every" (the lowest finite value: it averages every key)
    empty_reads: str = "nothing"
    # per part, [n] float64: the row's first recurrent layer's state as the call found it, and as it left it
    state: dict[str, np.ndarray] | None = None
    end_state: dict[str, np.ndarray] | None = None
    told: np.ndarray | None = None  # [q] bool: the 2-D mask handed to the model marks the call's token as padding


@dataclass
class _Stream:
    """The rows of one cache object, their prompts and the slot in each column."""

    rows: list[int | None]  # the rerun's prompt index of each batch row (None: not matched yet)
    columns: list[list[int]]  # per batch row: slot id per column (-1: none)
    unused: list[int]  # the prompts no row of this stream holds yet
    records: list[list[int]]  # per batch row: its call-rows (indices into Observation.records)
    lost: list[bool]  # per batch row: its entries were moved or rewritten, so it is no longer followed
    masks_columns: bool = False  # the engine hid some written column of this cache from a later query


def _recurrent(layer: Any) -> bool:
    """A cache layer that keeps a recurrent state (a convolution window, an SSM state)."""
    return hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states")


def _first_keys(cache: Any) -> torch.Tensor | None:
    """The keys [B, H, columns, D] of the cache's first layer that keeps every column (not a sliding window's,
    which drops the old ones, nor a recurrent layer's); None: no such layer holds them as a tensor."""
    for layer in getattr(cache, "layers", None) or []:
        if getattr(layer, "sliding_window", None) is not None or (_recurrent(layer) and not hasattr(layer, "keys")):
            continue
        keys = getattr(layer, "keys", None)
        return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None
    return None


STATE_PARTS = ("convolution window", "SSM state")


def _recurrent_states(cache: Any) -> dict[str, torch.Tensor] | None:
    """Per part of the cache's first recurrent layer's state (`STATE_PARTS`: its convolution windows, the last
    `kernel` columns of each, and its SSM states), [B, n] float64 on the CPU, `STATE_SAMPLE` evenly spaced
    elements at most (the parts apart: an engine may roll one back and not the other); None where the cache keeps
    none yet."""
    for layer in getattr(cache, "layers", None) or []:
        if not _recurrent(layer):
            continue
        kernels = getattr(layer, "conv_kernel_size", None) or {}
        convs = []
        for key, conv in sorted((getattr(layer, "conv_states", None) or {}).items()):
            if isinstance(conv, torch.Tensor):
                kernel = kernels.get(key) if isinstance(kernels, dict) else None
                convs.append(conv[..., -kernel:] if kernel else conv)
        ssm = [state for _, state in sorted((getattr(layer, "recurrent_states", None) or {}).items())
               if isinstance(state, torch.Tensor)]
        states = {}
        for name, parts in zip(STATE_PARTS, (convs, ssm)):
            if parts:
                rows = torch.cat([p.detach().reshape(p.shape[0], -1).to("cpu", torch.float64) for p in parts], dim=1)
                if rows.shape[1] > STATE_SAMPLE:
                    rows = rows[:, torch.linspace(0, rows.shape[1] - 1, STATE_SAMPLE, device="cpu").long()]
                states[name] = rows
        return states or None
    return None


def _output_cache(output: Any) -> Any:
    """The cache a model's output hands back (`cache` from transformers 5.24, `past_key_values` before)."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


def _row_state(states: dict[str, torch.Tensor] | None, row: int) -> dict[str, np.ndarray] | None:
    if states is None or any(row >= rows.shape[0] for rows in states.values()):
        return None
    return {name: rows[row].numpy() for name, rows in states.items()}


def _layer_types(model: Any) -> list[str] | None:
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None) or getattr(getattr(config, "text_config", None), "layer_types", None)
    return list(types) if types else None


def sliding_window(model: Any) -> int | None:
    """The window (in tokens, the query's own included) of the model's sliding-window layers; None: it has none."""
    types = _layer_types(model)
    if not types or "sliding_attention" not in types:
        return None
    config = model.config
    window = getattr(config, "sliding_window", None) or getattr(getattr(config, "text_config", None),
                                                                 "sliding_window", None)
    return int(window) if window else None


def _key_of(keys: torch.Tensor, row: int, column: int) -> bytes:
    """The bytes of one entry's keys [H, D], in any dtype (numpy has no bfloat16: read as raw bytes)."""
    return keys[row, :, column, :].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _bind(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name, those caught by a `**kwargs` parameter among them."""
    try:
        signature = inspect.signature(function)
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound = {**bound.pop(name), **bound}
    return bound


def _embedding_owner(model: Any) -> Any:
    """The module that takes the input ids: the parent of the token embedding (a base model, or its decoder
    where the language model calls that directly, as OPT does)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for _, module in model.named_modules():
        if embeddings is not None and any(child is embeddings for child in module.children()):
            return module
    return getattr(model, "base_model", None) or model


def _position_module(model: Any) -> tuple[str, Any] | None:
    """The module that consumes the position ids: a learned position table or the rotary embedding."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in POSITION_MODULE_NAMES or ("Rotary" in type(module).__name__ and "local" not in leaf):
            return leaf, module
    return None


def _attention_module(model: Any, types: list[str] | None, sliding: bool = False) -> Any:
    """The first full-attention layer (the mask it receives is what every such layer receives), or with `sliding`
    the first sliding-window layer; `types`: the model's layer types (None: every layer attends in full)."""
    for _, module in model.named_modules():
        name = type(module).__name__
        if not name.endswith("Attention") or "Rotary" in name:
            continue
        index = getattr(module, "layer_idx", None)
        kind = types[index] if types and isinstance(index, int) and index < len(types) else "full_attention"
        if (kind == "sliding_attention") == sliding:
            return module
    return None


def _empty_reads(mask: Any) -> str:
    """How the attention layer computed a query its mask hides everything from (`_CallRow.empty_reads`)."""
    if isinstance(mask, torch.Tensor) and mask.dtype.is_floating_point and not bool(torch.isinf(mask).any()):
        return "every"
    return "nothing"


def _allowed(mask: Any, batch: int, q: int, kv: int, last: bool = False) -> torch.Tensor | None:
    """[B, q, kv] bool from a mask as an attention layer receives it ([B|1, 1|H, q, kv] bool or additive);
    None when it is not a tensor of that shape. `last`: a sliding-window layer's mask, which may cover only the
    last columns (those its cache still holds, and the call's own)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    mask = mask[:, 0].detach().cpu()
    if mask.shape[-2] != q:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min * HIDDEN_MASK_FRACTION
    width = mask.shape[-1]
    if width >= kv:
        return mask.expand(batch, q, width)[..., :kv]
    if not last:
        return None
    out = torch.zeros(batch, q, kv, dtype=torch.bool, device="cpu")
    out[..., kv - width:] = mask.expand(batch, q, width)
    return out


class _Recorder:
    """The hooks on one model; for the target it builds the slots as each call ends."""

    def __init__(self, observation: "Observation", model: Any, role: str) -> None:
        self.observation, self.model, self.role = observation, model, role
        self.base = _embedding_owner(model)
        self.handles: list[Any] = []
        self.current: dict[str, Any] | None = None
        self.family = getattr(getattr(model, "config", None), "model_type", "")

    def install(self) -> None:
        self.handles.append(self.base.register_forward_pre_hook(self._start, with_kwargs=True))
        if self.role != "target":
            return
        self.handles.append(self.base.register_forward_hook(self._end, with_kwargs=True))
        found = _position_module(self.base)
        if found is not None:
            self.handles.append(found[1].register_forward_pre_hook(self._positions_hook(found), with_kwargs=True))
        types = _layer_types(self.model)
        attention = _attention_module(self.base, types)
        if attention is not None:
            self.handles.append(attention.register_forward_pre_hook(self._attention("mask"), with_kwargs=True))
        window = _attention_module(self.base, types, sliding=True) if self.observation.window else None
        if window is not None:
            self.handles.append(window.register_forward_pre_hook(self._attention("window_mask"), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # ---- the hooks (they run in the engine's thread) -------------------------------------------
    def _start(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.role != "target":
            self.observation.draft_calls += 1
            return
        bound = _bind(module.forward, args, kwargs)
        cache = bound.get("cache", bound.get("past_key_values"))
        length = 0
        if cache is not None and hasattr(cache, "get_seq_length"):
            try:
                length = int(cache.get_seq_length())
            except Exception:  # a cache that cannot say: its calls are not observed
                length = -1
        prior = _first_keys(cache) if cache is not None and length > 0 else None
        states = _recurrent_states(cache) if self.observation.recurrent and cache is not None else None
        self.current = {"input_ids": bound.get("input_ids"), "cache": cache, "length": length, "states": states,
                        "prior_keys": None if prior is None else prior[:, :, :length].detach().clone(),
                        "cache_position": bound.get("cache_position"), "given_positions": bound.get("position_ids"),
                        "given_mask": bound.get("attention_mask"), "positions": None, "mask": None, "window_mask": None}

    def _positions_hook(self, found: tuple[str, Any]) -> Callable[..., None]:
        leaf, module = found

        def hook(hooked: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.current is None or self.current["positions"] is not None:
                return
            bound = _bind(module.forward, args, kwargs)
            positions = bound.get("position_ids")
            if positions is None and leaf == "embed_positions":  # OPT: from the mask it is handed
                mask = bound.get("attention_mask")
                cut = int(bound.get("cache_length", bound.get("past_key_values_length", 0)) or 0)
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    positions = ((mask.long().cumsum(1) * mask.long()) - 1)[:, cut:]
            if positions is None and leaf == "wpe":  # an Embedding: its input is the position ids
                positions = bound.get("input")
            if isinstance(positions, torch.Tensor):
                self.current["positions"] = positions.detach().cpu().long()
        return hook

    def _attention(self, slot: str) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.current is None or slot + "_seen" in self.current:
                return
            bound = _bind(module.forward, args, kwargs)
            self.current[slot], self.current[slot + "_seen"] = bound.get("attention_mask"), True
        return hook

    def _end(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        call, self.current = self.current, None
        if call is None:
            return
        if self.observation.recurrent:  # the states the call left (its cache, or the one the model made for it)
            cache = call["cache"] if call["cache"] is not None else _output_cache(output)
            call["end_states"] = _recurrent_states(cache) if cache is not None else None
        try:
            self.observation._record(call, self.family)
        except Exception as exc:  # an observation that fails says so and judges nothing
            self.observation.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]


@dataclass
class Observation:
    """What one hooked re-run of a batch fed the target; see the module."""

    prompts: list[list[int]]  # the re-run's prompts, in its order
    outputs: list[list[int]] = field(default_factory=list)  # the re-run's outputs
    pad_token_id: int | None = None
    window: int | None = None  # the target's sliding window (tokens), where it has sliding-window layers
    recurrent: bool = False  # the target keeps recurrent states (hybrid layers): each call's are kept per row
    model: Any = field(default=None, repr=False)  # the target, to compute the states a row's own tokens leave
    calls: int = 0  # target calls seen
    draft_calls: int = 0
    verified: int = 0  # cached target calls that fed a row more than one new token (a verification of proposals)
    failed: str | None = None
    entered: int = 0  # how many times the hooks were installed (once: around the engine's own generate call)
    slots: list[_Slot] = field(default_factory=list)
    records: list[_CallRow] = field(default_factory=list)
    _streams: dict[int, tuple[Any, _Stream]] = field(default_factory=dict)
    _by_key: dict[bytes, list[int]] = field(default_factory=dict)  # the slots that left each key (first full layer)
    _claims: dict[int, int] = field(default_factory=dict)  # per prompt: how many rows were matched to it
    _by_record: dict[int, list[int]] | None = None  # per call-row: its slots (built once the re-run is over)
    _states: dict[tuple[Any, ...], dict[str, np.ndarray]] = field(default_factory=dict)  # per token sequence
    _state_checks: dict[int, Any] = field(default_factory=dict)  # per call-row: its state's violation (or None)
    # per call-row whose state was found to be another history of slots fed (rejected ones kept, padding): those
    # slots, which a replay feeds its recurrent layers (hidden from every query that did not read them)
    _state_slots: dict[int, list[int]] = field(default_factory=dict)
    _lock: Any = field(default_factory=threading.Lock)

    # ---- recording ---------------------------------------------------------------------------
    def _record(self, call: dict[str, Any], family: str) -> None:
        if self.failed:
            return
        ids = call["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or call["length"] < 0:
            self.failed = "a target call without input ids or with a cache of unknown length"
            return
        ids = ids.detach().cpu().long()
        batch, q = ids.shape
        length = call["length"]
        given_mask = call["given_mask"]
        cache_position = call["cache_position"]
        columns = (cache_position.detach().cpu().long().flatten().tolist() if isinstance(cache_position, torch.Tensor)
                   and cache_position.numel() == q else list(range(length, length + q)))
        positions = call["positions"]
        if positions is None:  # no position module seen: as the model family derives them
            positions = call["given_positions"]
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
        allowed = _allowed(call["mask"], batch, q, kv)
        if allowed is None:
            if call["mask"] is not None:
                self.failed = f"the attention layer received a mask of another form ({type(call['mask']).__name__})"
                return
            allowed = (key_columns <= query_columns).expand(batch, q, kv)  # none received: causal over every column
        window = None  # [B, q, kv]: what each query of a sliding-window layer could read
        if self.window:
            window = _allowed(call["window_mask"], batch, q, kv, last=True)
            if window is None:  # none received, or another form: the model's own window over the columns
                window = allowed & (key_columns > query_columns - self.window)
        told = None  # [B, q]: the 2-D mask the model was handed marks the token as padding (recurrent layers zero it)
        if isinstance(given_mask, torch.Tensor) and given_mask.dim() == 2 and given_mask.shape[0] == batch \
                and given_mask.shape[1] >= q:
            told = given_mask[:, -q:].detach().cpu() == 0
        with self._lock:
            if length > 0 and q > 1:
                self.verified += 1
            self._feed(call["cache"], ids, positions, allowed, columns, length, cache_position is not None,
                       call["prior_keys"], window, _empty_reads(call["mask"]), call.get("states"),
                       call.get("end_states"), told)
            self.calls += 1

    def _stream(self, cache: Any, ids: torch.Tensor, length: int) -> _Stream:
        """The stream of `cache`: a new one at a cache's first call (or a call with none); a cache whose batch
        changed gets a stream whose rows are not followed."""
        key = id(cache) if cache is not None else None
        known = self._streams.get(key) if key is not None else None
        if known is not None and known[0]() is cache and length > 0:
            if len(known[1].rows) == ids.shape[0]:
                return known[1]
        stream = _Stream(rows=[None] * ids.shape[0], columns=[[] for _ in range(ids.shape[0])],
                         unused=list(range(len(self.prompts))), records=[[] for _ in range(ids.shape[0])],
                         lost=[False] * ids.shape[0])
        if length > 0:  # a cache whose batch changed, or one first seen holding entries (a copy): its rows are
            stream.unused = []  # followed by the keys of their entries, or not at all
        if key is not None:
            try:
                self._streams[key] = (weakref.ref(cache), stream)
            except TypeError:
                pass
        return stream

    def _match(self, stream: _Stream, b: int) -> None:
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
            for record in stream.records[b]:
                self.records[record].local = local
            return

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
        leading = 0
        while leading < len(row) and row[leading] == self.pad_token_id:
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

    def _feed(self, cache: Any, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
              columns: list[int], length: int, explicit_columns: bool, prior_keys: torch.Tensor | None,
              window: torch.Tensor | None = None, empty_reads: str = "nothing",
              states: dict[str, torch.Tensor] | None = None, end_states: dict[str, torch.Tensor] | None = None,
              told: torch.Tensor | None = None) -> None:
        batch, q = ids.shape
        stream = self._stream(cache, ids, length)
        kv = allowed.shape[-1]
        for b in range(batch):
            row_columns = stream.columns[b]
            if not explicit_columns:
                del row_columns[length:]  # a cropped cache
            moved = stream.rows[b] is not None and not self._unchanged(row_columns, prior_keys, b, length)
            if (moved or (stream.rows[b] is None and not stream.unused)) and length > 0 and not stream.lost[b]:
                # entries moved or rewritten between calls (rows realigned, reordered or dropped): the row is
                # followed by the keys its slots left in the cache, or no more
                found = self._remap(prior_keys, b, length, {r for r in stream.rows[:b] if r is not None})
                stream.rows[b] = None if found is None else found[0]
                stream.lost[b] = found is None
                if found is not None:
                    row_columns[:] = found[1]
            row_columns.extend([-1] * (kv - len(row_columns)))
            tokens = ids[b].tolist()
            for i in range(q):
                row_columns[columns[i]] = len(self.slots)
                self.slots.append(_Slot(tokens[i], int(positions[b, i]), False, self.calls, columns[i],
                                        len(self.records), i))
            mask = allowed[b].numpy()  # [q, kv]
            written = np.array(row_columns[:kv]) >= 0
            for i in range(q):  # a written column before the query, hidden from it: the engine masks columns
                if not stream.masks_columns and (~mask[i, :columns[i]] & written[:columns[i]]).any():
                    stream.masks_columns = True
            stream.records[b].append(len(self.records))
            self.records.append(_CallRow(np.array(row_columns[:kv], dtype=np.int64), np.packbits(mask, axis=-1),
                                         kv, stream.rows[b], b, batch, length, stream,
                                         None if window is None else np.packbits(window[b].numpy(), axis=-1),
                                         empty_reads,
                                         _row_state(states, b), _row_state(end_states, b),
                                         None if told is None else told[b].numpy()))
            if stream.rows[b] is None and stream.unused and not stream.lost[b]:
                self._match(stream, b)
        keys = _first_keys(cache)
        if keys is not None:  # each new slot's keys as this call left them, to follow moved entries later
            for b in range(batch):
                for i in range(q):
                    if columns[i] < keys.shape[2]:
                        slot_id = stream.columns[b][columns[i]]
                        self.slots[slot_id].key = _key_of(keys, b, columns[i])
                        self._by_key.setdefault(self.slots[slot_id].key, []).append(slot_id)

    def _remap(self, prior_keys: torch.Tensor | None, b: int, length: int, taken: set[int] = frozenset()
               ) -> tuple[int, list[int]] | None:
        """The prompt and the slot of each column of row `b` of a cache whose entries moved, found by their keys:
        the prompt whose fed content left most of the row's columns' keys (at least half of those some content
        left) and its last one's; a padding column maps to padding with its keys, and a column whose keys no slot
        left (an entry the engine wrote itself, such as a new pad) becomes padding never fed.
        None when no prompt's slots hold the row."""
        if prior_keys is None or b >= prior_keys.shape[0]:
            return None
        keys = [_key_of(prior_keys, b, column) for column in range(length)]

        def owners(key: bytes) -> set[int]:  # the prompts whose fed content (not padding) left this key
            return {local for local in (self.records[self.slots[s].record].local for s in self._by_key.get(key, [])
                                        if not self.slots[s].pad) if local is not None}

        votes: dict[int, int] = {}
        content = 0  # columns whose keys some prompt's content left
        for key in keys:
            found = owners(key)
            content += bool(found)
            for local in found:
                votes[local] = votes.get(local, 0) + 1
        if not votes:
            return None
        # among prompts whose content left as many of the keys (duplicate prompts), one no earlier row took
        local = max(votes, key=lambda j: (votes[j], j not in taken, -j))
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
                self.slots.append(_Slot(-1, -1, True, self.calls, column, -1, -1, key))
        return local, columns

    def _unchanged(self, row_columns: list[int], prior_keys: torch.Tensor | None, b: int, length: int) -> bool:
        """Whether the cache's first columns of row `b` still hold, as the call finds them, the keys of the slots
        this row wrote there (a cache whose rows the engine realigns, shifts or rewrites between calls fails)."""
        if prior_keys is None:
            return True
        if len(row_columns) < length or b >= prior_keys.shape[0]:
            return False
        for column in range(length):
            slot_id = row_columns[column]
            if slot_id < 0:
                return False
            key = self.slots[slot_id].key
            if key is not None and key != _key_of(prior_keys, b, column):
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

    def _unwritten(self, slot_id: int) -> list[int]:
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        mask = np.unpackbits(record.allowed[slot.query], count=record.width).astype(bool)
        return [int(c) for c in np.nonzero(mask & (record.columns < 0))[0]]

    def _masks_columns(self, slot_id: int) -> bool:
        return bool(self.records[self.slots[slot_id].record].stream.masks_columns)

    def where(self, slot_id: int) -> str:
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        return (f"target call {slot.call} (batch row {record.row} of {record.batch}, cache length "
                f"{record.cache_length}), column {slot.column}")

    # ---- judging ---------------------------------------------------------------------------
    def _producer(self, local: int, sequence: list[int], m: int, exclude: frozenset[int] = frozenset()
                  ) -> tuple[int, str] | None:
        """The slot whose query chose the token at sequence index m + 1: the first fed holding sequence[m]
        whose visible content is sequence[:m + 1]; failing that the first that reads extra tokens besides
        them (`extra`), or misses some of them while written columns of its row are hidden from it
        (`missing`), the first fed at position m where one was (a rejected proposal of the same token, read
        among stale columns, is rarely fed at the row's own index)."""
        want = sequence[:m + 1]
        near: list[tuple[int, str]] = []
        for slot_id, slot in enumerate(self.slots):
            if self.records[slot.record].local != local or slot.token != sequence[m] or slot.pad or slot_id in exclude:
                continue
            content = [self.slots[v].token for v in self.visible(slot_id) if not self.slots[v].pad]
            if content == want:
                return slot_id, "exact"
            if content and content[-1] == sequence[m] and _subsequence(want, content):
                near.append((slot_id, "extra"))
            elif self._misses_hidden(slot_id, content, want):  # its own token among them, if the mask hides it
                near.append((slot_id, "missing"))
        at_index = [found for found in near if self.slots[found[0]].position == m]
        return (at_index or near or [None])[0]

    def reads_ahead(self, local: int, position: int, slot_id: int) -> bool:
        """Whether the query of `slot_id` reads more copies of prompt `local`'s new token `position` than the row
        holds before that token: it reads what it would be taken to produce."""
        sequence = self.prompts[local] + self.outputs[local]
        m = len(self.prompts[local]) + position
        token = sequence[m]
        read = sum(1 for v in self.visible(slot_id) if not self.slots[v].pad and self.slots[v].token == token)
        return read > sequence[:m].count(token)

    def _misses_hidden(self, slot_id: int, content: list[int], want: list[int]) -> bool:
        """Whether the query of `slot_id` reads the row's tokens `want` but some, and as many written columns of
        its row (its own included) are hidden from it."""
        missing = len(want) - len(content)
        return missing > 0 and _subsequence(content, want) and self._hidden(slot_id) >= missing

    def _hidden(self, slot_id: int) -> int:
        """How many written columns of the row up to the query of `slot_id` (its own included, padding aside) it
        cannot read."""
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        mask = np.unpackbits(record.allowed[slot.query], count=record.width).astype(bool)[:slot.column + 1]
        written = record.columns[:slot.column + 1]
        return sum(1 for c, seen in zip(written, mask) if c >= 0 and not seen and not self.slots[int(c)].pad)

    def _continued(self, local: int, sequence: list[int], m: int) -> bool:
        """Whether the target was fed the token at index m + 1 after exactly the row's tokens before it (or
        those and stale columns): a token the engine emitted but never continued from (a bonus doubled, a
        token added after the target's choice) was not chosen by a query of the target."""
        want = sequence[:m + 2]
        for slot_id, slot in enumerate(self.slots):
            if self.records[slot.record].local != local or slot.token != sequence[m + 1] or slot.pad:
                continue
            content = [self.slots[v].token for v in self.visible(slot_id) if not self.slots[v].pad]
            if content == want or (content and _subsequence(want, content)) or self._misses_hidden(slot_id, content,
                                                                                                 want):
                return True
        return False

    def judge(self, local: int, position: int, index: int, by_logits: bool = False,
              exclude: frozenset[int] = frozenset()) -> Verdict:
        """The verdict on new token `position` of the re-run's prompt `local` (prompt `index` of the run);
        `by_logits`: the engine's logits there will confirm it (a repeated token is then no ambiguity); `exclude`:
        slots not to take as the producer (one whose query's choice the engine did not emit)."""
        speculated = self.speculated
        verdict = self._judge(local, position, index, by_logits, exclude)
        verdict.speculated, verdict.target_calls = speculated, self.calls
        return verdict

    @property
    def speculated(self) -> bool:
        """The engine called the draft model, or verified several tokens of a row in one cached pass."""
        return self.draft_calls > 0 or self.verified > 0

    def _judge(self, local: int, position: int, index: int, by_logits: bool, exclude: frozenset[int]) -> Verdict:
        speculated = self.speculated
        if self.failed:
            return Verdict(None, f"the observation failed: {self.failed}", speculated=speculated)
        if not self.calls:
            return Verdict(None, "the engine never called the target's forward in the re-run (its own attention "
                           "over the weights, or another process): nothing to observe", speculated=speculated)
        prompt = self.prompts[local]
        sequence = prompt + self.outputs[local]
        m = len(prompt) + position - 1
        found = self._producer(local, sequence, m, exclude)
        if found is None:
            return Verdict(None, f"no target call fed prompt {index}'s token {sequence[m]} (index {m} in the row) "
                           "after its own earlier tokens", speculated=speculated)
        producer, how = found
        if m + 2 < len(sequence) and not self._continued(local, sequence, m):
            if any(any(stream.lost) for _, stream in self._streams.values()):
                return Verdict(None, f"observed up to a pass after which rows of the batch were no longer followed "
                               "(cache entries moved in a way their keys did not tell): prompt "
                               f"{index}'s new token {position} ({sequence[m + 1]}) was not seen fed after the row's "
                               "tokens before it", speculated=speculated)
            return Verdict(None, f"observed: the target was never fed prompt {index}'s new token {position} "
                           f"({sequence[m + 1]}) after the row's tokens before it, though the row goes on: the "
                           "engine emitted a token it did not continue from (not a choice of the target's "
                           "query)", speculated=speculated)
        violations: list[tuple[tuple[int, int, int], str, str]] = []  # ((call, column, rank), class, evidence)
        repeated = speculated and not by_logits and m + 1 < len(sequence) and sequence[m + 1] == sequence[m]
        seen: dict[int, int] = {}
        work = [(producer, m)]
        while work:
            slot_id, at = work.pop()
            if slot_id in seen:
                continue
            seen[slot_id] = at
            slot = self.slots[slot_id]
            order = (slot.call, slot.column)
            if self.recurrent:
                stated = self._state_violation(slot.record, index, sequence)
                if stated:
                    violations.append(stated)
            visible = self.visible(slot_id)
            fed = f"prompt {index}, {self.where(slot_id)}: token {slot.token} (index {at} in the row)"
            pads = [self.slots[v].column for v in visible if self.slots[v].pad]
            if pads:
                violations.append((order + (0,), "attention_mask", f"{fed} reads {len(pads)} padding column(s) "
                                   f"({_columns(pads)})"))
            unwritten = self._unwritten(slot_id)
            content_ids = [v for v in visible if not self.slots[v].pad]
            content = [self.slots[v].token for v in content_ids]
            want = sequence[:at + 1]
            if content != want or unwritten:
                violations.append((order + (1,),) + self._content_violation(slot_id, fed, content_ids, content, want,
                                                                            unwritten, local))
                continue
            if self.window:
                windowed = self._window_violation(slot_id, fed, want)
                if windowed:
                    violations.append((order + (1,), "attention_mask", windowed))
            for rank, v in enumerate(content_ids):
                other = self.slots[v]
                if other.position != rank:
                    violations.append(((other.call, other.column, 2), "position_ids",
                                       f"prompt {index}, {self.where(v)}: token {other.token} fed position "
                                       f"{other.position}; its index in the row is {rank}"
                                       + self._counted(v, other.position - rank)))
                if v != slot_id:
                    work.append((v, rank))
        chosen = sequence[m + 1] if m + 1 < len(sequence) else None
        record = self.records[self.slots[producer].record]
        batched = record.batch > 1 or len(self.prompts) == 1  # a call of the batch, not one row decoded alone
        if not violations:
            return Verdict(CLEAN, f"observed: prompt {index}'s new token {position} was chosen at "
                           f"{self.where(producer)}, whose query read exactly the row's {m + 1} earlier tokens, each "
                           "at its index in the row", speculated=speculated, producer=producer, engine_token=chosen,
                           batched=batched)
        violations.sort(key=lambda v: v[0])
        (call, column, _), cls, evidence = violations[0]
        state = column < 0  # a recurrent state a call started from (`_state_violation` orders it first in its call)
        if repeated and call >= self.slots[producer].call:
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

    # ---- recurrent states ---------------------------------------------------------------------
    def _record_slots(self, record: int) -> list[int]:
        """The slots call-row `record` fed, in the order of its tokens."""
        if self._by_record is None:
            self._by_record = {}
            for slot_id, slot in enumerate(self.slots):
                self._by_record.setdefault(slot.record, []).append(slot_id)
        return self._by_record.get(record, [])

    def _own_before(self, record: int, sequence: list[int] | None = None) -> list[int] | None:
        """The row's own tokens before call-row `record`'s first token that is not padding: what that token's query
        reads (its own aside) where that is a start of the row's sequence (`sequence`; default the row's); None
        where it is not (a wrong read, judged as such) or the call fed only padding."""
        first = next((s for s in self._record_slots(record) if not self.slots[s].pad), None)
        local = self.records[record].local
        if first is None or local is None:
            return None
        sequence = sequence or self.prompts[local] + self.outputs[local]
        content = [self.slots[v].token for v in self.visible(first) if not self.slots[v].pad]
        return content[:-1] if content and content == sequence[:len(content)] else None

    def _state_of(self, tokens: list[int], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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
                state = _recurrent_states(cache) or {}
                self._states[key] = {name: state[name][0].numpy() if name in state and state[name].shape[1:]
                                     == part.shape else np.full_like(part, np.nan) for name, part in like.items()}
        return self._states[key]

    def _state_violation(self, record: int, index: int, sequence: list[int]
                         ) -> tuple[tuple[int, int, int], str, str] | None:
        """Whether the recurrent state call-row `record` started from is the state after exactly the row's own
        tokens before the call, and, where the call fed padding before the row's tokens, whether its state after
        the call is the one the row's own tokens leave. Each observed state is compared with the states other
        histories leave (`_nearest`): the nearest names what the engine kept."""
        if self.model is None:
            return None
        if record not in self._state_checks:
            self._state_checks[record] = (self._start_check(record, index, sequence)
                                          or self._padding_check(record, index, sequence))
        return self._state_checks[record]

    def _start_check(self, record: int, index: int, sequence: list[int]
                     ) -> tuple[tuple[int, int, int], str, str] | None:
        """The state the call found: the row's own, or every token fed to the row's cache in the order fed
        (rejected ones kept), the same with its padding, one token behind or ahead, another row's own."""
        call_row = self.records[record]
        own = self._own_before(record, sequence)
        slots = self._record_slots(record)
        if call_row.state is None or own is None or not slots:
            return None
        first = next(s for s in slots if not self.slots[s].pad)
        # every token fed to the row before this call, in the order fed, in whichever cache (before its first call
        # seen: the row's own tokens then)
        call = self.slots[first].call
        earlier = [r for r, other in enumerate(self.records) if other.local == call_row.local and r != record
                   and (slots_of := self._record_slots(r)) and self.slots[slots_of[0]].call < call]
        start = (self._own_before(earlier[0], sequence) or []) if earlier and self.records[earlier[0]].cache_length else []
        fed_ids = [s for r in earlier for s in self._record_slots(r)]
        fed = [self.slots[s] for s in fed_ids]
        kept = start + [s.token for s in fed if not s.pad]
        # the slots of each history made of slots fed (a replay can feed them again)
        histories = {tuple(kept): [s for s in fed_ids if not self.slots[s].pad],
                     tuple(start + [s.token for s in fed]): fed_ids} if not start else {}
        candidates: list[tuple[list[int], str, str]] = [(own, "", "the row's own")]
        candidates.append((kept, "recurrent_state", f"the state after every token fed to the row in the order fed "
                           f"({len(kept)}, {len(kept) - len(own)} more than the row's own: the rejected ones kept, or "
                           "fill; not rolled back)"))
        marked = {s for s in fed_ids if self._told(s)}
        if marked:  # tokens the 2-D mask marks as padding (holes, fill) still move a state: fed as zeros
            candidates.append((start + [~self.slots[s].token if s in marked else self.slots[s].token for s in fed_ids],
                               "recurrent_state", f"the state after every token fed to the row in the order fed, the "
                               f"{len(marked)} the 2-D mask marks as padding fed as zero inputs (a masked token still "
                               "moves a recurrent state: the convolution window shifts, an SSM state decays)"))
        if any(s.pad for s in fed):
            candidates.append((start + [s.token for s in fed], "attention_mask",
                               "the state after every token fed to the row, its padding included: the padding "
                               "entered the recurrent state (the model was not told it is padding)"))
        if own:
            candidates.append((own[:-1], "recurrent_state", "the state one token behind the row's"))
        candidates.append((own + [self.slots[first].token], "recurrent_state",
                           f"the state one token ahead (the call's first token, {self.slots[first].token}, already in "
                           "it)"))
        for other, other_row in enumerate(self.records):
            if other_row.local is None or other_row.local == call_row.local or other == record:
                continue
            other_slots = self._record_slots(other)
            if other_slots and self.slots[other_slots[0]].call == call:
                other_own = self._own_before(other, self.prompts[other_row.local] + self.outputs[other_row.local])
                if other_own is not None:
                    candidates.append((other_own, "recurrent_state", f"the state of another row of the batch (batch row "
                                       f"{other_row.row}, the re-run's prompt {other_row.local})"))
        nearest = self._nearest(call_row.state, candidates)
        if nearest is None or not nearest[2]:
            return None
        part, distance, cls, what, own_distance = nearest
        tokens = next(c[0] for c in candidates if c[2] == what)
        if tuple(tokens) in histories:
            self._state_slots[record] = histories[tuple(tokens)]
        return ((self.slots[first].call, -1, 1), cls,
                f"prompt {index}, {self.where(first)}: the call started from a recurrent state (its {part}) that is "
                f"{what} (distance {distance:.3g}), not the state after the row's own {len(own)} tokens before it "
                f"(distance {own_distance:.3g})")

    def _told(self, slot_id: int) -> bool:
        """Whether the 2-D mask handed to the model marks slot `slot_id`'s token as padding."""
        slot = self.slots[slot_id]
        told = self.records[slot.record].told if slot.record >= 0 else None
        return bool(told is not None and slot.query < len(told) and told[slot.query])

    def _untold(self, record: int) -> list[int]:
        """The padding slots call-row `record` fed before its last token of the row that the 2-D mask handed to the
        model does not mark (its recurrent layers zero only those it marks): they enter the recurrent state."""
        slots = self._record_slots(record)
        content = [s for s in slots if not self.slots[s].pad]
        if not content:
            return []
        return [s for s in slots[:slots.index(content[-1])] if self.slots[s].pad and not self._told(s)]

    def _padding_check(self, record: int, index: int, sequence: list[int]
                       ) -> tuple[tuple[int, int, int], str, str] | None:
        """A call that fed padding before the row's tokens (left padding; a whole padded row fed again): padding the
        2-D mask handed to the model does not mark enters the recurrent state (its layers zero only what the mask
        marks); the state it left, compared from the row's own (after the row's tokens it fed, or after those and
        the padding), says so where the state still holds it (a convolution window keeps its last inputs alone)."""
        call_row = self.records[record]
        slots = self._record_slots(record)
        content = [s for s in slots if not self.slots[s].pad]
        if not content or not any(self.slots[s].pad for s in slots[:slots.index(content[-1])]):
            return None
        untold = self._untold(record)
        own = self._own_before(record, sequence)
        nearest = None
        if own is not None and call_row.end_state is not None:
            fed = own + [self.slots[s].token for s in content]
            nearest = self._nearest(call_row.end_state, [
                (fed, "", "the state after the row's own tokens"),
                (own + [self.slots[s].token for s in slots], "attention_mask", "the state after the row's tokens and "
                 "the padding fed before them: the padding entered the recurrent state")])
        where = f"prompt {index}, {self.where(content[0])}: the call fed padding before the row's tokens"
        if nearest is not None:  # the state left tells: the padding entered it, or not
            part, distance, cls, what, own_distance = nearest
            if not cls:
                return None
            self._state_slots[record] = [s for s in slots[:slots.index(content[-1])] if self.slots[s].pad]
            unmarked = (f", {len(untold)} padding column(s) ({_columns([self.slots[s].column for s in untold])}) that "
                        "no 2-D mask handed to the model marks,") if untold else ""
            return ((self.slots[content[0]].call, -1, 1), cls,
                    f"{where}{unmarked} and left a recurrent state (its {part}) that is {what} (distance "
                    f"{distance:.3g}), not the state after the row's own {len(own) + len(content)} tokens (distance "
                    f"{own_distance:.3g})")
        if untold:
            self._state_slots[record] = untold
            return ((self.slots[content[0]].call, -1, 1), "attention_mask",
                    f"{where}, {len(untold)} padding column(s) ({_columns([self.slots[s].column for s in untold])}) "
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
        own_state = self._state_of(unique[0][0], observed)
        compared = None
        for part in observed:  # each part apart: an engine may roll back its convolution window and not its SSM state
            # histories whose states the run's dtype cannot tell apart (a convolution window keeps its last few inputs
            # alone; padding the model zeroes leaves none) are one state: only those it tells apart compete
            resolution = state_resolution(torch.finfo(self.model.dtype).eps, float(np.linalg.norm(own_state[part])))
            distances: list[tuple[float, str, str]] = []
            kept: list[np.ndarray] = []  # the states of the histories that compete, the first of each kept
            for tokens, cls, what in unique:
                state = self._state_of(tokens, observed)[part]
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

    def _classes_seen(self, producer: int, want: list[int], violations: list[tuple[Any, str, str]]) -> tuple[str, ...]:
        """The classes of the wrong inputs behind `producer`: those of `violations`, and `position_ids` where a
        token it reads that is one of the row's (the stale ones set aside) was fed a position other than its index."""
        classes = {v[1] for v in violations}
        ids = [v for v in self.visible(producer) if not self.slots[v].pad]
        content = [self.slots[v].token for v in ids]
        if _subsequence(want, content):
            extra = set(_extra(want, content, ids))
            aligned = [v for v in ids if v not in extra]
            if any(self.slots[v].position != i for i, v in enumerate(aligned)):
                classes.add("position_ids")
        return tuple(sorted(classes))

    def _window_violation(self, slot_id: int, fed: str, want: list[int]) -> str | None:
        """Where the query of `slot_id`, in a sliding-window layer, does not read exactly the row's last `window`
        tokens (`want`: the row's tokens up to its own): what it reads instead."""
        read = [self.slots[v].token for v in self.visible(slot_id, window=True) if not self.slots[v].pad]
        expected = want[max(0, len(want) - self.window):]
        if read == expected:
            return None
        if len(read) < len(expected) and read == expected[len(expected) - len(read):]:
            return (f"{fed} reads {len(read)} of the row's last {len(expected)} tokens in a sliding-window layer "
                    f"(window {self.window}): the window counts columns, and columns of this row it cannot read "
                    "(holes, stale or padding) fill the rest")
        if len(read) > len(expected) and read[len(read) - len(expected):] == expected:
            return (f"{fed} reads {len(read)} of the row's tokens in a sliding-window layer where the window holds "
                    f"{len(expected)}: the window is not applied")
        return (f"{fed} reads {len(read)} token(s) in a sliding-window layer (window {self.window}) that are not the "
                f"row's last {len(expected)}")

    def _counted(self, slot_id: int, offset: int) -> str:
        """Where a position `offset` too high equals a count of the row's columns before the slot (its padding, or
        its padding and its hidden columns: rejected slots left as holes), that count, as evidence."""
        slot = self.slots[slot_id]
        record = self.records[slot.record]
        before = [int(c) for c in record.columns[:slot.column] if c >= 0]
        pads = sum(self.slots[c].pad for c in before)
        holes = self._hidden(slot_id)
        if offset == pads and pads:
            return f" (off by {offset}, the number of padding columns before it)"
        if offset == pads + holes and holes:
            return f" (off by {offset}, the number of padding and hidden columns before it)"
        return ""

    def replay(self, model: Any, producer: int) -> torch.Tensor | None:
        """The logits [V] of `model` at the query of slot `producer`, replayed on exactly the slots it depends on
        (those it reads, recursively) with their observed tokens, positions and visibility; None when the
        model refuses them."""
        from specaudit.equivalence.diagnosis.forward import replay_all

        closure, work = {producer}, [producer]
        while work:
            slot_id = work.pop()
            reads = self.visible(slot_id)
            record = self.slots[slot_id].record
            if self.recurrent and record >= 0:  # recurrent layers read what the call fed before (padding not marked
                # as such too) and the history its state was found to be (rejected tokens kept)
                reads = reads + [s for s in self._untold(record) + self._state_slots.get(record, []) if s < slot_id]
            for v in reads:
                if v not in closure:
                    closure.add(v)
                    work.append(v)
        order = sorted(closure)  # slot ids run in the order the tokens were fed
        place = {slot_id: i for i, slot_id in enumerate(order)}
        # [L, L]: key j visible to query i
        allowed = torch.zeros(len(order), len(order), dtype=torch.bool, device="cpu")
        window = torch.zeros_like(allowed) if self.window else None  # [L, L] in the sliding-window layers
        for slot_id in order:
            for v in self.visible(slot_id):
                allowed[place[slot_id], place[v]] = True
            for v in self.visible(slot_id, window=True) if window is not None else []:
                window[place[slot_id], place[v]] = True
        positions = [self.slots[s].position for s in order]  # (OPT numbers padding -1: its table starts at -2)
        if any(self.slots[s].token < 0 for s in order):  # an entry the engine wrote without feeding it
            return None
        # a slot that could read nothing (padding under a mask that hides it from itself) is computed as the
        # engine's attention computed it: reading nothing under a boolean or -inf mask, else averaging every key
        empty = [self.records[self.slots[s].record].empty_reads for s in order if not bool(allowed[place[s]].any())]
        hidden = float("-inf") if empty and empty[0] == "nothing" else None
        logits = replay_all(model, [self.slots[s].token for s in order], positions, allowed, window=window,
                            hidden=hidden)
        return None if logits is None else logits[place[producer]]

    def _content_violation(self, slot_id: int, fed: str, content_ids: list[int], content: list[int],
                           want: list[int], unwritten: list[int], local: int) -> tuple[str, str]:
        masks = self._masks_columns(slot_id)
        if unwritten:
            return ("attention_mask" if masks else "kv_cache",
                    f"{fed} reads column(s) {_columns(unwritten)} that hold no token of the row")
        if _subsequence(want, content):
            extra = _extra(want, content, content_ids)
            stale = ", ".join(f"token {self.slots[v].token} at column {self.slots[v].column}" for v in extra[:3])
            if masks:
                return ("attention_mask", f"{fed} reads {len(extra)} column(s) not in the row's sequence ({stale}) "
                        "that the engine's mask leaves visible (it hides other columns of this cache)")
            return ("kv_cache", f"{fed} reads {len(extra)} cached column(s) not in the row's sequence ({stale}): "
                    "the cache keeps entries the row did not accept")
        if _subsequence(content, want):
            missing = _extra(content, want, list(range(len(want))))
            tokens = [want[i] for i in missing]
            what = f"{len(missing)} of the row's earlier tokens (index {_columns(missing)})"
            if self.pad_token_id is not None and tokens and all(t == self.pad_token_id for t in tokens):
                return ("pad_as_content", f"{fed} cannot read {what}, each the pad id {self.pad_token_id}: "
                        "content treated as padding")
            return ("attention_mask", f"{fed} cannot read {what}")
        for other, prompt in enumerate(self.prompts):
            if other != local and content and content == (prompt + self.outputs[other])[:len(content)]:
                return ("cross_row", f"{fed} reads the sequence of another prompt of its batch")
        return ("unknown", f"{fed} reads {len(content)} token(s) that are not the row's sequence")


def _subsequence(short: list[int], long: list[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def _extra(short: list[int], long: list[int], ids: list[int]) -> list[int]:
    """The ids of `long`'s items left over when `short` is matched in it greedily."""
    extra, at = [], 0
    for i, token in enumerate(long):
        if at < len(short) and token == short[at]:
            at += 1
        else:
            extra.append(ids[i])
    return extra


def _columns(columns: list[int]) -> str:
    shown = ", ".join(str(c) for c in columns[:6])
    return shown + (f", ... ({len(columns)} in all)" if len(columns) > 6 else "")


def _has_recurrent_layers(model: Any) -> bool:
    try:
        from transformers import DynamicCache

        return any(_recurrent(layer) for layer in DynamicCache(config=model.config).layers)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def observable(model: Any) -> str | None:
    """Why the inputs of `model` cannot be judged by observation (None: they can): each layer of its cache must be
    an attention cache, full or a sliding window, or a recurrent state (its state read at each call), with at
    least one full attention layer (its keys follow the slots)."""
    if model is None:
        return "no target model in the process"
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=model.config).layers
    except (ImportError, AttributeError, TypeError, ValueError):
        return "the target's cache could not be built from its config"
    full = [layer for layer in layers if type(layer) is DynamicLayer
            or (_recurrent(layer) and isinstance(layer, DynamicLayer) and getattr(layer, "sliding_window", None) is None)]
    windowed = [layer for layer in layers if type(layer) is not DynamicLayer and isinstance(layer, DynamicLayer)
                and getattr(layer, "sliding_window", None) is not None]
    recurrent = [layer for layer in layers if _recurrent(layer) and not isinstance(layer, DynamicLayer)]
    if not full or len(full) + len(windowed) + len(recurrent) != len(layers):
        return ("the target's cache is not an attention cache per layer (or a recurrent state) with a full "
                "attention layer among them (sliding windows alone, or layers of another kind)")
    if windowed and sliding_window(model) is None:
        return "the target's sliding-window layers do not say their window"
    return None


def observe_batch(run: RunContext, batch: list[int], outputs: list[list[int]], pad_token_id: int | None) -> Observation | str:
    """One hooked re-run of the prompts at `batch` through the run's context (a fresh engine on the run's
    pair, guarded as its re-runs are): what the engine fed the target and whether it called the draft. The
    run's `outputs` of those prompts label the rows (a re-run that returns others is reported, and its rows
    are judged along its own outputs). A string says why nothing was observed."""
    target, draft = run.pair.target, run.pair.draft
    refused = observable(target)
    if refused:
        return refused
    if not run.confines_reruns:
        return ("the re-runs come from a callable that takes no `around`: the hooks could not be held to the "
                "engine's own generate call (a caller's reference decoding would be observed with it)")
    observation = Observation([list(run.prompts[i]) for i in batch], [list(o) for o in outputs], pad_token_id,
                              window=sliding_window(target), recurrent=_has_recurrent_layers(target), model=target)
    recorders = [_Recorder(observation, target, "target")]
    if draft is not None and draft is not target:
        recorders.append(_Recorder(observation, draft, "draft"))

    @contextlib.contextmanager
    def hooked() -> Any:  # entered around the engine's own generate call alone (RunContext.rerun)
        observation.entered += 1
        try:
            for recorder in recorders:
                recorder.install()
            yield
        finally:
            for recorder in recorders:
                recorder.remove()

    try:
        rerun = run.rerun(list(batch), None, around=hooked)
    except Exception as exc:  # an observation that fails tells that, not more
        return f"the hooked re-run failed: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        for recorder in recorders:
            recorder.remove()
    if observation.entered != 1:
        return f"the engine's generate was entered {observation.entered} times in the re-run: nothing is judged"
    rerun = [[int(t) for t in out] for out in rerun]
    if rerun != observation.outputs:
        changed = [batch[k] for k, (a, b) in enumerate(zip(rerun, observation.outputs)) if a != b]
        return (f"the hooked re-run gave other tokens than the run for prompt(s) {changed}: an engine that is not "
                "deterministic is not judged by observation")
    return observation
