"""The hooks that record, from a real transformers target, the per-call records the provenance check reads
(`provenance.CallRecord`), during an engine's own `generate`.

Contract: `ProvenanceHooks` changes nothing the engine computes; it keeps, per target call, copies of what it
needs (ids, positions, the mask the last attention layer received, fingerprints of that layer's cache, each
query's argmax and gap) and times itself (`ProvenanceLog.hook_seconds`). Where the hooks go is anatomy.py's
knowledge: the module that takes the input ids, the one that consumes the position ids, and here the LAST
full-attention layer (its forward hook reads the mask it received and, after it ran, its cache layer's keys and
values) and the output head (argmax and gap per query).

`Hooked` wraps an engine so that only its first `generate` call is recorded (the audited run itself, not a
re-run the audit may make).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from specaudit.equivalence.diagnosis.anatomy import (allowed_reads, attention_module, bind_arguments,
                                                      consumed_positions, embedding_owner, first_recurrent_layer,
                                                      has_recurrent_layers, layer_types, position_module,
                                                      sliding_window, state_parts)
from specaudit.equivalence.diagnosis.provenance import ZERO, CallRecord, ProvenanceLog, RowFeed

VALUE_MIX = 0x5851F42D4C957F2D  # odd: keys' and values' fingerprints mixed so that neither alone decides
_MULTIPLIERS: dict[tuple[int, int], torch.Tensor] = {}  # per (heads, dim): the fixed odd multipliers


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


def entry_fingerprints(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, L] int64 from keys and values [B, H, L, D] in any dtype: each entry's bits mixed (keys and values apart),
    so an entry copied or moved keeps its fingerprint at any column of any cache."""
    return key_fingerprints(keys) * VALUE_MIX + key_fingerprints(values)


def state_fingerprints(cache: Any, batch: int) -> list[tuple[int | None, ...]]:
    """Per row, the fingerprint of each part of the cache's first recurrent layer's state (its convolution windows,
    the last `kernel` columns of each; its SSM states), the bits of every element mixed, `ZERO` where the part is
    all zeros, None where the layer holds no such part (yet, or ever: a model without an SSM state)."""
    layer = first_recurrent_layer(cache)
    if layer is not None:
        convs, ssm = state_parts(layer)
        rows: list[list[int | None]] = [[] for _ in range(batch)]
        for tensors in (convs, ssm):
            tensors = [t for t in tensors if t.shape[0] == batch]
            prints = torch.zeros(batch, dtype=torch.int64)
            nonzero = torch.zeros(batch, dtype=torch.bool)
            for k, tensor in enumerate(tensors):
                flat = tensor.detach().reshape(batch, 1, 1, -1)
                prints = prints + key_fingerprints(flat)[:, 0] * (2 * k + 1)
                nonzero |= (flat.reshape(batch, -1) != 0).any(dim=1).cpu()
            for b in range(batch):
                rows[b].append(None if not tensors else int(prints[b]) if bool(nonzero[b]) else ZERO)
        return [tuple(row) for row in rows]
    return [(None, None)] * batch  # no recurrent layer made yet


class _Pending:
    """One target call in flight: what its hooks have kept so far."""

    def __init__(self, ids: torch.Tensor, cache: Any, length: int, cache_position: Any) -> None:
        self.ids, self.cache, self.length, self.cache_position = ids, cache, length, cache_position
        self.positions: torch.Tensor | None = None
        self.visible: torch.Tensor | None = None  # [B, q, kv] bool
        self.window_mask: Any = None  # the mask the last sliding-window layer received
        self.prints: torch.Tensor | None = None  # [B, kv] int64
        self.choices: torch.Tensor | None = None  # [B, q'] argmax of the last q' queries
        self.gaps: torch.Tensor | None = None
        self.states_in: list[tuple[int | None, ...]] | None = None  # hybrids: the state each row was found in
        self.zeroed: torch.Tensor | None = None  # [B, q] bool: fed tokens a 2-D mask marks as padding


class ProvenanceHooks:
    """Forward hooks on one target; a context manager around the engine's `generate`."""

    def __init__(self, target: Any, pad_token_id: int | None, draft: Any = None) -> None:
        self.model = target
        self.draft = draft if draft is not None and draft is not target else None  # its calls are counted
        self.log = ProvenanceLog(pad_token_id=pad_token_id)
        self.base = embedding_owner(target)
        self.attention = attention_module(self.base, layer_types(self.base), last=True)
        self.head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        if self.attention is None or self.head is None:
            raise ValueError("the target has no attention layer or output head the provenance hooks know: "
                             "hook a transformers decoder-only model")
        self.handles: list[Any] = []
        self.pending: _Pending | None = None
        self.failed: str | None = None  # why nothing the hooks kept can be read (a hook raised)
        self.recurrent = has_recurrent_layers(target)
        self.log.window = sliding_window(target)
        self.sliding = (attention_module(self.base, layer_types(self.base), sliding=True, last=True)
                        if self.log.window else None)

    def __enter__(self) -> "ProvenanceHooks":
        self.handles = [self.base.register_forward_pre_hook(self._timed(self._start), with_kwargs=True),
                        self.attention.register_forward_hook(self._timed(self._attention), with_kwargs=True),
                        self.head.register_forward_hook(self._timed(self._head))]
        if self.draft is not None and hasattr(self.draft, "register_forward_pre_hook"):
            self.handles.append(self.draft.register_forward_pre_hook(self._timed(self._draft_call)))
        if self.sliding is not None:
            self.handles.append(self.sliding.register_forward_pre_hook(self._timed(self._window), with_kwargs=True))
        found = position_module(self.base)
        if found is not None:
            self.handles.append(found[1].register_forward_pre_hook(self._timed(self._positions(found)),
                                                                    with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self._timed(self._finish)()

    def _draft_call(self, *_: Any) -> None:
        self.log.draft_calls += 1

    def _timed(self, hook: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            if self.failed:
                return
            started = time.perf_counter()
            try:
                hook(*args)
            except Exception as exc:  # a model the hooks do not know: nothing recorded, the engine's call untouched
                self.failed = f"the provenance hooks failed: {type(exc).__name__}: {exc}".splitlines()[0]
                self.pending = None
            finally:
                self.log.hook_seconds += time.perf_counter() - started
        return timed

    # ---- the hooks -------------------------------------------------------------------------------
    def _start(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        self._finish()  # the call before, where its output head was not run through the model
        bound = bind_arguments(module.forward, args, kwargs)
        ids = bound.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        cache = bound.get("cache", bound.get("past_key_values"))
        length = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        position = bound.get("cache_position")
        self.pending = _Pending(ids.detach().to("cpu", torch.long, copy=True), cache, length,
                                position.detach().to("cpu", torch.long, copy=True)
                                if isinstance(position, torch.Tensor) else None)
        given = bound.get("position_ids")
        if isinstance(given, torch.Tensor):
            self.pending.positions = given.detach().to("cpu", torch.long, copy=True)
        if self.recurrent:
            batch, q = ids.shape
            self.pending.states_in = state_fingerprints(cache, batch)
            mask = bound.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch:
                columns = torch.tensor(self._columns(self.pending)).clamp(max=mask.shape[1] - 1)
                self.pending.zeroed = (mask.detach().to("cpu")[:, columns] == 0)
            else:
                self.pending.zeroed = torch.zeros(batch, q, dtype=torch.bool)

    def _positions(self, found: tuple[str, Any]) -> Callable[..., None]:
        leaf, module = found

        def hook(hooked: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            if self.pending is None:
                return
            positions = consumed_positions(leaf, module, args, kwargs)
            if positions is not None:
                self.pending.positions = positions.detach().to("cpu", torch.long, copy=True)
        return hook

    def _window(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if self.pending is not None:
            self.pending.window_mask = bind_arguments(module.forward, args, kwargs).get("attention_mask")

    def _attention(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        call = self.pending
        if call is None:
            return
        bound = bind_arguments(module.forward, args, kwargs)
        cache = next((bound[name] for name in ("cache", "past_key_values", "past_key_value")
                      if bound.get(name) is not None), call.cache)
        if call.cache is None:
            call.cache = cache  # made by the model in this call: read its state when the call ends
        layers = getattr(cache, "layers", None)
        if not layers:
            return
        index = getattr(module, "layer_idx", None)
        layer = layers[index if isinstance(index, int) and index < len(layers) else -1]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            return
        batch, q = call.ids.shape
        kv = keys.shape[2]
        call.prints = entry_fingerprints(keys, values)  # [B, kv]
        call.visible = allowed_reads(bound.get("attention_mask"), batch, q, kv)
        if call.visible is None:  # none received: causal over every column
            own = torch.tensor(self._columns(call), device="cpu").view(q, 1)
            call.visible = (torch.arange(kv, device="cpu").view(1, kv) <= own).expand(batch, q, kv)

    def _head(self, module: Any, args: tuple, output: Any) -> None:
        call = self.pending
        if call is None or not isinstance(output, torch.Tensor) or output.dim() != 3:
            return
        top = output.detach().topk(2, dim=-1)
        call.choices = output.detach().argmax(dim=-1).to("cpu")  # as engines choose: the first of tied maxima
        call.gaps = (top.values[..., 0] - top.values[..., 1]).to("cpu", torch.float64)
        self._finish()

    # ---- the record ------------------------------------------------------------------------------
    @staticmethod
    def _columns(call: _Pending) -> list[int]:
        q = call.ids.shape[1]
        if call.cache_position is not None and call.cache_position.numel() == q:
            return call.cache_position.flatten().tolist()
        return list(range(call.length, call.length + q))

    def _finish(self) -> None:
        call, self.pending = self.pending, None
        if call is None or call.prints is None:
            return
        batch, q = call.ids.shape
        columns = tuple(self._columns(call))
        positions = call.positions if call.positions is not None else torch.tensor([columns])
        if positions.dim() == 3:  # [3, B, q] multimodal rotary positions: text tokens carry one position thrice
            positions = positions[0]
        positions = positions.reshape(-1, q).expand(batch, q)
        seen = call.choices.shape[1] if call.choices is not None else 0  # the head may compute the last queries only
        states_out = state_fingerprints(call.cache, batch) if call.states_in is not None else None
        window = None  # [B, q, kv]: what each query of the last sliding-window layer could read
        if self.log.window:
            kv = call.visible.shape[-1]
            window = allowed_reads(call.window_mask, batch, q, kv, last=True)
            if window is None:  # none received, or another form: the model's own window over the columns
                own = torch.tensor(columns).view(q, 1)
                window = call.visible & (torch.arange(kv).view(1, kv) > own - self.log.window)
        rows = []
        for b in range(batch):
            choices = [-1] * (q - seen) + (call.choices[b].tolist() if seen else [])
            gaps = [float("nan")] * (q - seen) + (call.gaps[b].tolist() if seen else [])
            states = ((call.states_in[b], states_out[b], tuple(bool(z) for z in call.zeroed[b].tolist()))
                      if states_out is not None else (None, None, None))
            rows.append(RowFeed(tuple(call.ids[b].tolist()), tuple(positions[b].tolist()), columns,
                                tuple(call.prints[b].tolist()), np.asarray(call.visible[b], dtype=bool),
                                tuple(choices), tuple(gaps), *states,
                                None if window is None else np.asarray(window[b], dtype=bool)))
        self.log.add(CallRecord(len(self.log.calls), tuple(rows)))


class Hooked:
    """An engine whose first `generate` call is recorded by `ProvenanceHooks` (later calls run unhooked); every
    other attribute is the engine's."""

    def __init__(self, engine: Any, target: Any, pad_token_id: int | None) -> None:
        self.engine = engine
        self.hooks = ProvenanceHooks(target, pad_token_id)
        self.generate_seconds = 0.0  # the hooked call's own time, the hooks' included
        self.outputs: list[list[int]] | None = None  # what the hooked call returned

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self.hooks.log.calls or self.generate_seconds:
            return self.engine.generate(*args, **kwargs)
        started = time.perf_counter()
        with self.hooks:
            result = self.engine.generate(*args, **kwargs)
        self.generate_seconds = time.perf_counter() - started
        self.outputs = [[int(t) for t in row] for row in result]
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
