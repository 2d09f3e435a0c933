"""Audit target: BSP-style batched speculation, written from the published algorithm.

Follows "The Synergy of Speculative Decoding and Batching in Serving Large Language Models"
(Su et al., 2023) as released in the baselines of "Batch Speculative Decoding Done Right"
(arXiv 2510.22876), where it is shown to break output equivalence. It is an audit target, not a
correct engine: it is here so that the harness has a real, published implementation to catch.

Contract (every engine): `generate(prompts, max_new_tokens, eos_token_id)` returns, per prompt,
only the new tokens, up to and including the first EOS, never more than `max_new_tokens`.

The published algorithm never compacts the batch. Every row keeps one growing column layout
shared by tokens, attention mask and both KV caches; per step, with k draft tokens:

1. draft:   the draft model proposes k tokens per row, fed [uncached tokens] then one token
            at a time, with the shared mask                                        # [B, k]
2. verify:  one target pass over [pending token, k draft tokens]                   # [B, k+1, V]
3. accept:  the longest prefix equal to the target's greedy choices, then the target's own next
            token (bonus)
4. "repair": the rejected draft columns are set to 0 in the attention mask; their keys and
            values stay in both caches, masked; a column of 1 is appended for the bonus

Known defects, kept on purpose because they are the published behaviour:

- Position ids are not passed; the model derives them (transformers 5.x: from the number of
  cached columns for Llama, Qwen3, GLM-4, GPT-NeoX, GPT-2). Masked columns (right padding of
  the prompts, rejected draft tokens) are therefore still counted: after the first rejection a
  row's next token sits at a position past its real length. RoPE models see wrong relative
  distances, GPT-2 wrong absolute positions. OPT derives positions from the attention mask
  itself, which hides this defect there.
- Prompts are right-padded (the published tokenizer setting), so the first new token of a short
  prompt is placed after its padding columns: the same over-counting from the first step on.
- Finished rows keep running until every row of the batch is done (their outputs are cut at the
  first EOS or at `max_new_tokens`, as the contract requires).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from specaudit.engines.ops import layout
from specaudit.engines.adapters._hf import as_float, cut_at_eos, resolve_pad_id
from specaudit.engines.limits import eos_ids
from specaudit.engines.batch import ConsecutiveBatches
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.trace import StepRecord, Trace


def right_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-align token lists: returns `tokens` [B, W] and `mask` [B, W] (1 on real tokens)."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):  # host-side build of the initial batch, once per batch
        tokens[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    return tokens.to(device), mask.to(device)


def _extend(mask: torch.Tensor) -> torch.Tensor:
    """Append one attended column to the shared mask: [B, S] -> [B, S+1]."""
    return torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)


class BSPEngine(ConsecutiveBatches):
    """BSP-style batch speculation (Su et al., 2023): rejected tokens masked, never removed."""

    name = "bsp"

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        *,
        batch_size: int = 8,
        draft_tokens: int = 4,
        pad_token_id: int | None = None,
        record_logits: bool = False,
        **_: object,
    ) -> None:
        if draft is None:
            raise ValueError("bsp needs a draft model")
        if batch_size < 1 or draft_tokens < 1:
            raise ValueError("batch_size and draft_tokens must be at least 1")
        self.target = target
        self.draft = draft
        self.batch_size = batch_size
        self.k = draft_tokens
        self.pad_id = resolve_pad_id(target, pad_token_id)
        self.record_logits = record_logits
        self.last_trace: Trace | None = None

    def _emit(
        self,
        trace: Trace,
        kind: str,
        offered: list[list[int]],  # per row of the batch, the tokens this step produced
        row_logits: torch.Tensor,  # [B, q, V] target logits of those tokens
        accepted: list[int],  # per row of the batch
        masked: list[int],  # per row of the batch: masked columns of its target cache
        rows: list[int],
        running: list[bool],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        outputs: list[list[int]],
        logits: list[list[torch.Tensor]],
    ) -> None:
        """Append each running row's tokens, cut at its first EOS or at `max_new_tokens`."""
        record = StepRecord(step=len(trace.steps), kind=kind, rows=[], pad_lengths=[], accepted_counts=[],
                            emitted_counts=[])
        for b, prompt in enumerate(rows):
            if not running[b]:
                continue
            room = max_new_tokens - len(outputs[prompt])
            n = cut_at_eos(offered[b], eos_token_id, room)
            outputs[prompt].extend(offered[b][:n])
            if self.record_logits:
                logits[prompt].append(as_float(row_logits[b, :n]))
            record.rows.append(prompt)
            record.pad_lengths.append(masked[b])
            record.accepted_counts.append(accepted[b])
            record.emitted_counts.append(n)
            hit_eos = any(t in eos_ids(eos_token_id) for t in offered[b][:n])
            running[b] = not (hit_eos or len(outputs[prompt]) >= max_new_tokens)
        trace.record(record)

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
        k = self.k
        device = self.target.device
        tokens, mask = right_pad([prompts[r] for r in rows], self.pad_id, device)  # [B, W], [B, W]
        lengths = mask.sum(1)  # [B]
        batch = torch.arange(len(rows), device=device)

        # prefill: no position ids (the model derives them); the first token is read at each
        # row's last real prompt column
        target_cache = layout.full_history_cache(self.target)
        out = cached_forward(self.target, target_cache, input_ids=tokens, attention_mask=mask)
        first_logits = out.logits[batch, lengths - 1]  # [B, V]
        pending = first_logits.argmax(-1, keepdim=True)  # [B, 1]
        mask = _extend(mask)  # [B, W+1]
        draft_inputs = torch.cat([tokens, pending], dim=1)  # the draft has cached nothing yet
        draft_cache = layout.full_history_cache(self.draft)
        running = [True] * len(rows)
        self._emit(trace, "prefill", pending.tolist(), first_logits.unsqueeze(1), [0] * len(rows),
                   (tokens.shape[1] - lengths).tolist(), rows, running, max_new_tokens, eos_token_id, outputs, logits)

        while any(running):
            masked_columns = (mask[:, :-1] == 0).sum(1).tolist()  # padding and rejected tokens, per row

            # 1. draft: k greedy tokens per row, the shared mask growing by one column each
            proposed = []
            inputs = draft_inputs
            for _ in range(k):
                d_out = cached_forward(self.draft, draft_cache, input_ids=inputs, attention_mask=mask)
                inputs = d_out.logits[:, -1:].argmax(-1)  # [B, 1]
                proposed.append(inputs)
                mask = _extend(mask)
            draft_tokens = torch.cat(proposed, dim=1)  # [B, k]

            # 2. verify: [pending, k draft tokens] against the whole (masked) history
            verify_inputs = torch.cat([pending, draft_tokens], dim=1)  # [B, k+1]
            v_out = cached_forward(self.target, target_cache, input_ids=verify_inputs, attention_mask=mask)
            verify_logits = v_out.logits  # [B, k+1, V]
            target_tokens = verify_logits.argmax(-1)  # [B, k+1]

            # 3. accept: longest matching prefix, then the target's bonus token
            matches = (draft_tokens == target_tokens[:, :k]).long().cumprod(dim=1)  # [B, k]
            accepted = matches.sum(1)  # [B]
            bonus = target_tokens[batch, accepted].unsqueeze(1)  # [B, 1]

            # 4. the published repair: mask the rejected draft columns, keep them (and their
            #    keys and values) in place, and keep counting positions over them
            mask[:, -k:] = matches
            mask = _extend(mask)
            draft_inputs = torch.cat([draft_tokens[:, -1:], bonus], dim=1)  # [B, 2] the draft's uncached columns
            pending = bonus

            accepted_list = accepted.tolist()
            offered = [target_tokens[b, : a + 1].tolist() for b, a in enumerate(accepted_list)]
            self._emit(trace, "batch", offered, verify_logits, accepted_list, masked_columns, rows, running,
                       max_new_tokens, eos_token_id, outputs, logits)
