"""Engines for the diagnosis by observation (`tests/test_observed_diagnosis.py`), each with a correct twin.

Each factory takes `(target, draft, *, batch_size, draft_tokens, pad_token_id)` and returns an object with
`generate(prompts, max_new_tokens, eos_token_id)`, run on the target's device (a default-device context, as a
user's engine may set one). The cache keyword is looked up as a user's engine would
(`cache` from transformers 5.24, `past_key_values` before).

- `loop_padded_positions` / `loop`: greedy decoding of a left-padded batch with one cache and a 2-D mask
  [B, columns]; the bug numbers every column of the padded width (positions count the padding);
- `holes_all_slots` / `holes`: speculative decoding whose rejected proposals stay in both caches as columns
  hidden by zeros in the 2-D mask; the bug numbers every column (padding and holes counted);
- `recompute_sees_padding` / `recompute`: greedy decoding without a cache, the whole padded batch fed every
  step under a 4-D additive mask; the bug hides only the future, so queries read the left padding;
- `generate_all_ones` / `generate`: `model.generate` on left-padded chunks of the batch; the bug hands it an
  all-ones mask (the padding is content to the model);
- `rows_not_cropped` / `rows`: speculative decoding one row at a time with its own caches, right positions; the
  bug never crops the target cache at a rejection, so later queries read the rejected proposals (`kv_cache`);
- `pad_id_masked` (twin `loop`): the padded loop, right positions, whose mask hides every pad id, a prompt's own
  tokens equal to the pad id among them (`pad_as_content`);
- `padding_shown_late` (twin `loop`): the padded loop, right positions, whose mask shows the padding from the third
  new token on: the padding was computed reading nothing (its own mask row empty), then read (`attention_mask`);
- `state_not_rolled_back` / `state_rolled_back`: speculative decoding one row at a time on targets with recurrent
  layers; a recurrent state cannot be cropped, so the twin copies the target's cache before each verify pass and
  feeds the copy the pending token and the accepted proposals; the bug crops the attention layers alone, and the
  recurrent state keeps the rejected proposals (`recurrent_state`);
- `state_cropped` (twin `state_rolled_back`): the same, rolled back by the cache's own `crop` after
  `activate_past_recording`, which rolls back the attention layers and the convolution windows but not an SSM state
  (gated delta-net, Mamba-2): exact on tiny-lfm2, `recurrent_state` on the others.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def _cache_kwarg(model: Any, cache: Any) -> dict[str, Any]:
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return {name: cache}


def _crop(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count drops entries from the end


def _finish(tokens: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The row's tokens up to max_new_tokens, cut after its first EOS."""
    tokens = tokens[:max_new_tokens]
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tokens


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, W] and keep [B, W] (1: a real token) of the prompts padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    keep = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, keep


class Batched:
    """Runs `_batch` on consecutive chunks of `batch_size` prompts."""

    def __init__(self, target: Any, draft: Any, batch_size: int, k: int, pad: int, buggy: bool,
                 bug: str | None = None) -> None:
        self.target, self.draft, self.batch_size, self.k, self.pad, self.buggy = target, draft, batch_size, k, pad, buggy
        self.bug = bug  # another bug than the class's own (`buggy`): "pad_mask" (Loop)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        out: list[list[int]] = []
        with torch.device(self.target.device):  # every tensor the engine makes, where its models are
            for start in range(0, len(prompts), self.batch_size):
                out += self._batch(prompts[start:start + self.batch_size], max_new_tokens, eos_token_id)
        return out

    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        raise NotImplementedError


class Loop(Batched):
    """One token a step for every row; 2-D mask; positions from the mask, or (bug) the column index."""

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        model = self.target
        ids, keep = _left_pad(prompts, self.pad)
        # the mask handed to the model: the padding hidden, or (bug "pad_mask") every pad id hidden, a prompt's
        # own tokens equal to the pad id among them; the positions still count each row's real tokens
        mask = keep * (ids != self.pad).long() if self.bug == "pad_mask" else keep
        cache = DynamicCache(config=model.config)
        rows: list[list[int]] = [[] for _ in prompts]
        step = ids
        while True:
            q, width = step.shape[1], keep.shape[1]
            if self.buggy:
                positions = torch.arange(width - q, width).expand(len(prompts), q)
            else:
                positions = (keep.cumsum(-1) - 1).clamp(min=0)[:, -q:]
            logits = model(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True,
                           **_cache_kwarg(model, cache)).logits[:, -1]  # [B, V]
            chosen = logits.argmax(-1)  # [B]
            for b, token in enumerate(chosen.tolist()):
                rows[b].append(int(token))
            if all(len(r) >= max_new_tokens or (eos is not None and eos in r) for r in rows):
                break
            step = chosen.unsqueeze(1)
            if self.bug == "pad_late" and len(rows[0]) > 1:  # from the third new token on, the padding is shown
                mask = torch.ones_like(mask)
            keep = torch.cat([keep, torch.ones(len(prompts), 1, dtype=keep.dtype)], dim=1)
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        return [_finish(r, max_new_tokens, eos) for r in rows]


class Holes(Batched):
    """Speculative decoding, k proposals a step. Both caches get the same columns: each step writes the
    row's pending token and its k proposals; the rejected ones stay as holes (0 in the 2-D mask)."""

    def _forward(self, model: Any, cache: DynamicCache, step: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits [B, q, V] of `step` [B, q]; `keep` [B, columns] covers the cache and the q new columns."""
        q, width = step.shape[1], keep.shape[1]
        if self.buggy:
            positions = torch.arange(width - q, width).expand(step.shape[0], q)
        else:
            positions = (keep.cumsum(-1) - 1).clamp(min=0)[:, -q:]
        return model(input_ids=step, attention_mask=keep, position_ids=positions, use_cache=True,
                     **_cache_kwarg(model, cache)).logits

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        b, k = len(prompts), max(1, self.k)
        ids, keep = _left_pad(prompts, self.pad)
        target_cache, draft_cache = DynamicCache(config=self.target.config), DynamicCache(config=self.draft.config)
        # prefill all but the last prompt column; that column is each row's first pending token
        pending = ids[:, -1:]  # [B, 1]
        if ids.shape[1] > 1:
            self._forward(self.target, target_cache, ids[:, :-1], keep[:, :-1])
            self._forward(self.draft, draft_cache, ids[:, :-1], keep[:, :-1])
        keep = keep[:, :-1]
        rows: list[list[int]] = [[] for _ in prompts]
        ones = torch.ones(b, 1, dtype=keep.dtype)
        while not all(len(r) >= max_new_tokens or (eos is not None and eos in r) for r in rows):
            # the draft proposes k tokens, one pass each, after the pending token, on a copy of its cache (a
            # sliding-window layer cannot be cropped back once its window is full)
            saved = copy.deepcopy(draft_cache)
            proposals, fed, draft_keep = [], pending, keep
            for _ in range(k):
                draft_keep = torch.cat([draft_keep, ones], dim=1)
                fed = self._forward(self.draft, draft_cache, fed, draft_keep)[:, -1].argmax(-1, keepdim=True)
                proposals.append(fed)
            drafted = torch.cat(proposals, dim=1)  # [B, k]
            step = torch.cat([pending, drafted], dim=1)  # [B, k + 1]
            logits = self._forward(self.target, target_cache, step, torch.cat([keep] + [ones] * (k + 1), dim=1))
            choices = logits.argmax(-1)  # [B, k + 1]: the target's token after each fed one
            new_keep = torch.zeros(b, k + 1, dtype=keep.dtype)
            next_pending = torch.zeros(b, 1, dtype=pending.dtype)
            for row in range(b):
                accepted = 0
                while accepted < k and int(drafted[row, accepted]) == int(choices[row, accepted]):
                    accepted += 1
                rows[row] += [int(t) for t in drafted[row, :accepted]] + [int(choices[row, accepted])]
                new_keep[row, :accepted + 1] = 1  # the pending token and the accepted proposals
                next_pending[row, 0] = choices[row, accepted]
            keep = torch.cat([keep, new_keep], dim=1)
            pending = next_pending
            # the draft's cache: the same k + 1 columns as the target's, under the step's final mask
            draft_cache = saved
            self._forward(self.draft, draft_cache, step, keep)
        return [_finish(r, max_new_tokens, eos) for r in rows]


class RowSpec(Batched):
    """Speculative decoding one row at a time, each with its own caches (no padding, no mask: causal over the
    cache), positions counted by the row's accepted tokens; the bug (`buggy`) never crops the target cache, so the
    rejected proposals' entries stay in it, visible to every later query."""

    def _call(self, model: Any, cache: DynamicCache, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [q, V] of `tokens` at positions start.. after `cache`."""
        positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
        return model(input_ids=torch.tensor([tokens]), position_ids=positions, use_cache=True,
                     **_cache_kwarg(model, cache)).logits[0]

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        return [self._row(list(p), max_new_tokens, eos) for p in prompts]

    def _row(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
        k = max(1, self.k)
        target_cache, draft_cache = DynamicCache(config=self.target.config), DynamicCache(config=self.draft.config)
        if len(prompt) > 1:  # every prompt token but the last, the row's first pending token
            self._call(self.target, target_cache, prompt[:-1], 0)
            self._call(self.draft, draft_cache, prompt[:-1], 0)
        length, pending, out = len(prompt) - 1, prompt[-1], []  # length: the row's tokens both caches hold
        while len(out) < max_new_tokens and not (eos is not None and eos in out):
            _crop(draft_cache, length)
            if draft_cache.get_seq_length() < length:  # all k proposals were accepted: the last one is not cached
                self._call(self.draft, draft_cache, (prompt + out)[draft_cache.get_seq_length():length],
                           draft_cache.get_seq_length())
            proposals, fed = [], pending
            for i in range(k):
                fed = int(self._call(self.draft, draft_cache, [fed], length + i)[-1].argmax())
                proposals.append(fed)
            if not self.buggy:
                _crop(target_cache, length)
            choices = self._call(self.target, target_cache, [pending] + proposals, length).argmax(-1).tolist()
            accepted = 0
            while accepted < k and proposals[accepted] == choices[accepted]:
                accepted += 1
            out += proposals[:accepted] + [int(choices[accepted])]
            pending, length = int(choices[accepted]), length + accepted + 1
        return _finish(out, max_new_tokens, eos)


class StateSpec(RowSpec):
    """`RowSpec` on a target with recurrent layers: the draft proposes on a copy of its cache, which then gets the
    step's kept tokens; the target's cache is copied before its verify pass and the copy gets them (the twin), or
    (bug) only its attention layers are cropped."""

    def _row(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
        k = max(1, self.k)
        target_cache, draft_cache = DynamicCache(config=self.target.config), DynamicCache(config=self.draft.config)
        if len(prompt) > 1:
            self._call(self.target, target_cache, prompt[:-1], 0)
            self._call(self.draft, draft_cache, prompt[:-1], 0)
        if self.bug == "crop":  # the cache keeps each call's convolution inputs until `crop` rolls them back
            target_cache.activate_past_recording()
        length, pending, out = len(prompt) - 1, prompt[-1], []
        while len(out) < max_new_tokens and not (eos is not None and eos in out):
            drafting, proposals, fed = copy.deepcopy(draft_cache), [], pending
            for i in range(k):
                fed = int(self._call(self.draft, drafting, [fed], length + i)[-1].argmax())
                proposals.append(fed)
            saved = None if self.buggy or self.bug else copy.deepcopy(target_cache)
            choices = self._call(self.target, target_cache, [pending] + proposals, length).argmax(-1).tolist()
            accepted = 0
            while accepted < k and proposals[accepted] == choices[accepted]:
                accepted += 1
            kept = [pending] + proposals[:accepted]
            if self.bug == "crop":  # the cache's own rollback: the attention and the convolution windows, not an SSM state
                target_cache.crop(-(k - accepted))
            elif saved is None:  # the bug: the attention layers cropped, the recurrent states left after every proposal
                for layer in target_cache.layers:
                    if not isinstance(layer, LinearAttentionCacheLayerMixin):
                        layer.crop(-(k - accepted))
            else:
                target_cache = saved
                self._call(self.target, target_cache, kept, length)
            self._call(self.draft, draft_cache, kept, length)
            out += proposals[:accepted] + [int(choices[accepted])]
            pending, length = int(choices[accepted]), length + accepted + 1
        return _finish(out, max_new_tokens, eos)


class Recompute(Batched):
    """No cache: the whole padded batch every step, under a 4-D additive mask [B, 1, W, W]."""

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        model = self.target
        ids, keep = _left_pad(prompts, self.pad)
        rows: list[list[int]] = [[] for _ in prompts]
        while not all(len(r) >= max_new_tokens or (eos is not None and eos in r) for r in rows):
            width = ids.shape[1]
            allowed = torch.ones(width, width, dtype=torch.bool).tril().expand(len(prompts), width, width)
            if not self.buggy:
                allowed = allowed & keep.bool().unsqueeze(1)  # padding hidden from every query
            mask = torch.zeros(len(prompts), 1, width, width, dtype=model.dtype)
            mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(model.dtype).min)
            positions = (keep.cumsum(-1) - 1).clamp(min=0)
            chosen = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
            for b, token in enumerate(chosen.tolist()):
                rows[b].append(int(token))
            ids = torch.cat([ids, chosen.unsqueeze(1)], dim=1)
            keep = torch.cat([keep, torch.ones(len(prompts), 1, dtype=keep.dtype)], dim=1)
        return [_finish(r, max_new_tokens, eos) for r in rows]


class Generate(Batched):
    """`model.generate` on each left-padded chunk: the chunk's mask, or (bug) all ones."""

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        ids, keep = _left_pad(prompts, self.pad)
        mask = torch.ones_like(ids) if self.buggy else keep
        out = self.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=self.pad, eos_token_id=eos, num_beams=1)
        return [_finish([int(t) for t in row[ids.shape[1]:]], max_new_tokens, eos) for row in out]


def _factory(kind: type[Batched], buggy: bool, bug: str | None = None):
    def make(target: Any, draft: Any, *, batch_size: int, draft_tokens: int = 4, pad_token_id: int | None = None,
             **_: Any) -> Batched:
        return kind(target, draft, batch_size, int(draft_tokens or 4), 0 if pad_token_id is None else int(pad_token_id),
                    buggy, bug)
    return make


loop_padded_positions, loop = _factory(Loop, True), _factory(Loop, False)
holes_all_slots, holes = _factory(Holes, True), _factory(Holes, False)
recompute_sees_padding, recompute = _factory(Recompute, True), _factory(Recompute, False)
generate_all_ones, generate = _factory(Generate, True), _factory(Generate, False)
rows_not_cropped, rows = _factory(RowSpec, True), _factory(RowSpec, False)
pad_id_masked = _factory(Loop, False, "pad_mask")  # its correct twin: `loop`
padding_shown_late = _factory(Loop, False, "pad_late")  # its correct twin: `loop`
state_not_rolled_back, state_rolled_back = _factory(StateSpec, True), _factory(StateSpec, False)
state_cropped = _factory(StateSpec, False, "crop")  # exact where the state is a convolution window alone (tiny-lfm2)
