"""Audit target: DSD-style batched speculation, written from the published algorithm.

Follows the batched baseline of "Decoding Speculative Decoding" (Yan et al.) as released in the
baselines of "Batch Speculative Decoding Done Right" (arXiv 2510.22876), where it is shown to
break output equivalence. It is an audit target, not a correct engine: it is here so that the
harness has a real, published implementation to catch.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

Per step, on one left-padded token tensor `tokens` [B, S]:

1. draft:   `draft.generate(tokens, max_new_tokens=d)`, d = min(k, smallest room left among
            unfinished rows); no attention mask is passed, so `generate` infers one from the
            pad id                                                                 # [B, d]
2. verify:  one target pass over the draft tokens (and any uncached tokens), with NO attention
            mask and no position ids                                              # [B, d, V]
3. accept:  up to the first mismatch, plus the mismatching DRAFT token itself; all d when all
            match (no target token is ever emitted; `take_target_token=True` emits the
            target's choice at the mismatch instead)
4. trim:    every row's target cache is cut to the batch's smallest acceptance (the fewest
            columns whose keys and values hold what some row now contains)
5. re-pad:  each row is left-padded by (largest acceptance - its acceptance), on top of the
            padding it already has

Known defects, kept on purpose because they are the published behaviour:

- Queries attend to padding: the target never gets an attention mask, so the pad tokens' keys
  and values enter every row's attention, and position ids count them. Rows with no padding
  (the longest prompt while it leads; any row at batch size 1) are unaffected.
- The first rejected draft token is accepted in place of the target's own token ("+1" in the
  published verification), so any rejection emits a token greedy decoding would not: this one
  breaks equivalence even at batch size 1. Every emitted token is then a draft token, and the
  draft decodes greedily from its own tokens (its `generate` masks the padding it infers), so
  the output is the draft model's own greedy decoding; the target only sets the pace. The other
  defects reach the tokens only with `take_target_token=True`, which emits the target's choice at
  the first mismatch (the standard rule) and keeps everything else as published.
- The target cache is trimmed to the batch's smallest acceptance for every row, and the re-padded
  rows no longer line up with it. With `reuse_cache=True` (default) the next pass feeds each row
  `tokens[:, cache_width:]`: the row that accepted most gets exactly its missing tokens, a row
  that accepted fewer gets tokens its cache already holds, a second time. With
  `reuse_cache=False` the target recomputes the whole batch every step (the released baseline
  code path, whose trimmed cache is returned but never read), which removes this defect.
- Padding only accumulates (re-pad without unpad), so the batch grows wider than its rows.

One departure, for the contract: the published loop stops as soon as the row that has produced
the most tokens reaches `max_new_tokens` (the draft budget is the batch's smallest room left,
and it breaks at zero), returning short outputs for slower rows. Here the budget is taken over
unfinished rows and the loop runs until every row is finished, so that every output has the
contract's length and the defects above show as token divergences.

`last_trace`: `accepted_counts` are the draft tokens DSD accepted (the rejected one included),
`emitted_counts` the tokens kept after the EOS / `max_new_tokens` cut; there is no bonus token.
With `record_logits`, the logits are the target's at each emitted position.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specaudit.engines.ops import ragged
from specaudit.engines.ops import layout
from specaudit.engines.adapters._hf import as_float, cut_at_eos, resolve_pad_id
from specaudit.engines.limits import eos_ids
from specaudit.engines.batch import ConsecutiveBatches
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.trace import StepRecord, Trace


def drop_last_columns(cache: DynamicCache, n: int) -> None:
    """Remove the last `n` cached positions of every row (the same count for all rows)."""
    if n <= 0:
        return
    for layer in ragged.cache_layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., : layer.keys.shape[-2] - n, :]
        layer.values = layer.values[..., : layer.values.shape[-2] - n, :]


class DSDEngine(ConsecutiveBatches):
    """DSD-style batch speculation (Yan et al.): re-pad, attend to padding, trim to the minimum."""

    name = "dsd"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        reuse_cache: bool = True,
        take_target_token: bool = False,
        **_: object,
    ) -> None:
        if draft is None:
            raise ValueError("dsd needs a draft model")
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        self.target = target
        self.draft = draft
        self.batch_size = batch_size
        self.k = draft_tokens
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.record_logits = record_logits
        self.reuse_cache = reuse_cache
        self.take_target_token = take_target_token
        self.last_trace: Trace | None = None

    def _draft(self, tokens: torch.Tensor, budget: int) -> torch.Tensor:
        """The published drafting call: `generate` on the padded batch, no mask given."""
        out = self.draft.generate(
            input_ids=tokens, max_new_tokens=budget, do_sample=False, pad_token_id=self.pad_id,
            return_dict_in_generate=True,
        )
        return out.sequences[:, tokens.shape[1]:]  # [B, d], d <= budget

    def _verify(
        self, tokens: torch.Tensor, drafts: torch.Tensor, cache: DynamicCache | None, carry: torch.Tensor | None
    ) -> tuple[torch.Tensor, DynamicCache, int]:
        """Target pass with no attention mask and no position ids.

        Returns `full` [B, 1+u+d, V]: `full[:, u + j]` predicts draft token j and `full[:, u + j + 1]`
        follows it, where u is the number of uncached tokens fed before the drafts; the cache; and u.
        """
        if cache is None or carry is None:
            cache = layout.full_history_cache(self.target)
            inputs = torch.cat([tokens, drafts], dim=1)  # [B, S+d] the whole batch, padding included
            out = cached_forward(self.target, cache, input_ids=inputs)
            u = tokens.shape[1] - 1
            return out.logits, cache, u
        uncached = tokens[:, ragged.cache_width(cache):]  # [B, u]: see the trim defect above
        inputs = torch.cat([uncached, drafts], dim=1)  # [B, u+d]
        out = cached_forward(self.target, cache, input_ids=inputs)
        full = torch.cat([carry.unsqueeze(1), out.logits], dim=1)  # [B, 1+u+d, V]
        return full, cache, uncached.shape[1]

    def _run_batch(
        self,
        prompts: list[list[int]],
        rows: list[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        trace: Trace,
        outputs: list[list[int]],
        logits: list[list[torch.Tensor]],
    ) -> None:
        tokens, real_lengths = ragged.left_pad([prompts[r] for r in rows], self.pad_id, self.target.device)  # [B, S]
        produced = [0] * len(rows)  # tokens DSD has appended per row (the published tokens_generated)
        running = [True] * len(rows)
        cache: DynamicCache | None = None
        carry: torch.Tensor | None = None  # [B, V] target logits after the last cached column
        while any(running):
            budget = min(self.k, min(max_new_tokens - produced[b] for b in range(len(rows)) if running[b]))
            pad_lengths = (tokens.shape[1] - real_lengths).tolist()

            # 1. draft
            drafts = self._draft(tokens, budget)  # [B, d]
            d = drafts.shape[1]

            # 2. verify: predictions for the d draft tokens
            full, cache, u = self._verify(tokens, drafts, cache if self.reuse_cache else None, carry)
            predictions = full[:, u: u + d]  # [B, d, V]
            matches = (predictions.argmax(-1) == drafts).long().cumprod(dim=1)  # [B, d]
            accepted = matches.sum(1)  # [B] true matches

            # 3. accept: the published "+1" keeps the first mismatching draft token; with
            #    `take_target_token` the target's own choice replaces it. Either way the cache
            #    columns that hold what the row now contains are `valid` per row.
            taken = torch.where(accepted < d, accepted + 1, accepted)  # [B], 1..d
            if self.take_target_token:
                appended = predictions.argmax(-1)  # [B, d] equals the drafts before the mismatch
                valid = accepted
            else:
                appended = drafts
                valid = taken
            smallest = int(valid.min())

            # 4. trim: every row's cache cut to the batch's smallest acceptance; the logits after
            #    the last kept column are carried to the next pass
            drop_last_columns(cache, d - smallest)
            carry = full[:, u + smallest]  # [B, V]

            # 5. re-pad: old row (its padding included) + accepted tokens, right-aligned
            width = torch.full_like(taken, tokens.shape[1])
            tokens, _ = ragged.append_and_repad(tokens, width, appended, taken, self.pad_id)  # [B, S + max taken]
            real_lengths = real_lengths + taken

            taken_list = taken.tolist()
            record = StepRecord(step=len(trace.steps), kind="batch", rows=[], pad_lengths=[], accepted_counts=[],
                                emitted_counts=[])
            for b, prompt in enumerate(rows):
                produced[b] += taken_list[b]
                if not running[b]:
                    continue
                offered = appended[b, : taken_list[b]].tolist()
                n = cut_at_eos(offered, eos_token_id, max_new_tokens - len(outputs[prompt]))
                outputs[prompt].extend(offered[:n])
                if self.record_logits:
                    logits[prompt].append(as_float(predictions[b, :n]))
                record.rows.append(prompt)
                record.pad_lengths.append(pad_lengths[b])
                record.accepted_counts.append(taken_list[b])
                record.emitted_counts.append(n)
                hit_eos = any(t in eos_ids(eos_token_id) for t in offered[:n])
                running[b] = not (hit_eos or len(outputs[prompt]) >= max_new_tokens)
            trace.record(record)
