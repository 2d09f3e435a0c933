"""The paper's published EQSPEC and EXSPEC code (arXiv 2510.22876; github.com/eBay/spec_dec,
`src/custom/batch_speculative.py` and `src/custom/cross_batch_speculative.py`), re-written as a
minimal transformers-5 port of its decisions, to audit code the diagnosis was not written with.

Written from a reading of that code, not copied from it. No KV cache: every pass recomputes the
whole sequence, so only the published decisions about tokens, masks and stopping remain:

1. every prompt is cut to its first `max_input_len` (1024) tokens;
2. the attention mask is `ids != pad_id`, position ids its cumulative sum; rows are unpadded at
   their first token that is not the pad id and re-padded on the left after every step;
3. a row is finished when any of its tokens (prompt and padding included) equals the EOS id; a
   step's accepted tokens and bonus token are appended whole, not cut at an EOS;
4. a step drafts min(k, the smallest room left in the batch) tokens; when all match, it keeps
   k - 1 of them and the target's own choice (the published `first_false_positions` default);
5. EQSPEC's output slice starts at the first non-pad token plus the count of non-pad prompt tokens;
6. EXSPEC keeps a pool of sequences (sorted by length with `sort_by_length`, and then returned in
   that sorted order), steps same-length groups or else realigns the first `batch_size` rows of
   its window; unpadding a sequence made only of pad ids takes the first of no non-pad tokens
   (an IndexError), as the published `nonzero()[0]` does.

Like the published code, the factories take no pad option: the pad id is the one the target's
config declares (what its tokenizer would say). `make_eqspec_with_pad_option` takes one.
"""

from __future__ import annotations

from typing import Any

import torch


def _positions(mask: torch.Tensor) -> torch.Tensor:  # [B, L]
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B, L, V]
    return model(input_ids=ids, attention_mask=mask.long(), position_ids=_positions(mask)).logits


def _left_pad(seqs: list[torch.Tensor], pad_id: int) -> torch.Tensor:  # [B, W]
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=seqs[0].device)
    for b, s in enumerate(seqs):
        if len(s):
            out[b, width - len(s):] = s
    return out


def _draft_and_verify(target: Any, draft: Any, ids: torch.Tensor, n: int, pad_id: int
                      ) -> tuple[list[list[int]], list[int]]:
    """One step on the rows `ids` [B, L]: n greedy draft tokens, then one target pass over them.
    Returns each row's new tokens (accepted draft tokens and the target's token) and the count of
    accepted draft tokens."""
    mask = ids != pad_id  # [B, L]
    drafted, draft_mask = ids, mask
    for _ in range(n):  # 1. draft: greedy, the mask by pad-id equality
        choice = _logits(draft, drafted, draft_mask)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        drafted = torch.cat([drafted, choice], dim=1)
        draft_mask = torch.cat([draft_mask, torch.ones_like(choice, dtype=torch.bool)], dim=1)
    proposals = drafted[:, ids.shape[1]:]  # [B, n]
    # 2. verify: the target's choice after the last token and after each but the last proposal
    combined_mask = torch.cat([mask, torch.ones_like(proposals, dtype=torch.bool)], dim=1)
    predicted = _logits(target, drafted, combined_mask)[:, ids.shape[1] - 1:-1].argmax(-1)  # [B, n]
    # 3. accept: first mismatch, or n - 1 when every proposal matches
    matches = predicted == proposals
    first_false = torch.where(matches.all(1), torch.full_like(matches[:, 0], n - 1, dtype=torch.long),
                              (~matches).long().argmax(1))
    new_tokens = [proposals[b, :f].tolist() + [int(predicted[b, f])] for b, f in enumerate(first_false.tolist())]
    return new_tokens, first_false.tolist()


class PaperEQSpec:
    """EQSPEC as published: consecutive batches, left padding found by pad-id equality."""

    def __init__(self, target: Any, draft: Any, *, batch_size: int, draft_tokens: int, pad_token_id: int,
                 max_input_len: int = 1024) -> None:
        self.target, self.draft = target, draft
        self.batch_size, self.k, self.pad_id, self.max_input_len = batch_size, draft_tokens, pad_token_id, max_input_len

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            outputs += self._batch(prompts[start:start + self.batch_size], max_new_tokens, eos_token_id)
        return outputs

    def _batch(self, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
        pad, device = self.pad_id, self.target.device
        cut = [torch.tensor(p[: self.max_input_len], dtype=torch.long, device=device) for p in prompts]
        generated = _left_pad(cut, pad)  # [B, W]
        input_lengths = (generated != pad).sum(1).tolist()  # non-pad tokens of each prompt
        made = torch.zeros(len(prompts), dtype=torch.long)
        while True:
            finished = made >= max_new_tokens
            if eos is not None:
                finished |= (generated == eos).any(1).cpu()
            rows = (~finished).nonzero().flatten().tolist()
            if not rows:
                break
            n = min(self.k, min(max_new_tokens - int(made[r]) for r in rows))
            new_tokens, _ = _draft_and_verify(self.target, self.draft, generated[rows], n, pad)
            sequences = []
            for b in range(len(prompts)):  # unpad at the first non-pad token, append, re-pad
                seq = generated[b]
                seq = seq[int((seq != pad).long().argmax()):]
                if b in rows:
                    tokens = new_tokens[rows.index(b)]
                    seq = torch.cat([seq, torch.tensor(tokens, dtype=torch.long, device=device)])
                    made[b] += len(tokens)
                sequences.append(seq)
            generated = _left_pad(sequences, pad)
        outputs = []
        for b in range(len(prompts)):  # the output slice, found by pad-id equality
            seq = generated[b]
            real = (seq != pad).nonzero().flatten()
            first = int(real[0]) if real.numel() else 0
            outputs.append(seq[first + input_lengths[b]:].tolist())
        return outputs


class PaperEXSpec:
    """EXSPEC as published: a pool with a window, same-length groups, realignment as fallback."""

    def __init__(self, target: Any, draft: Any, *, batch_size: int, draft_tokens: int, pad_token_id: int,
                 max_input_len: int = 1024, window_size: int = 32, sort_by_length: bool = False) -> None:
        self.target, self.draft = target, draft
        self.batch_size, self.k, self.pad_id, self.max_input_len = batch_size, draft_tokens, pad_token_id, max_input_len
        self.window_size, self.sort_by_length = window_size, sort_by_length

    def _unpad(self, seq: torch.Tensor) -> torch.Tensor:
        return seq[(seq != self.pad_id).nonzero()[0].item():]  # IndexError when every token is the pad id

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        device, pad = self.target.device, self.pad_id
        pool = [torch.tensor(p[: self.max_input_len], dtype=torch.long, device=device) for p in prompts]
        if self.sort_by_length:
            pool.sort(key=len)  # and never mapped back
        prompt_lengths = [len(s) for s in pool]
        made = [0] * len(pool)
        active = [True] * len(pool)
        stepped = [False] * len(pool)  # the published pool keeps a cache per sequence after its first step
        window: list[int] = []
        next_in = 0

        def refill() -> None:
            nonlocal next_in, window
            window = [i for i in window if active[i]]
            while len(window) < self.window_size and next_in < len(pool):
                if active[next_in]:
                    window.append(next_in)
                next_in += 1

        refill()
        while any(active):
            groups: dict[tuple[int, bool], list[int]] = {}
            chosen: list[int] = []
            for i in window:  # 1. a same-length group of batch_size rows, else the first rows realigned
                group = groups.setdefault((len(pool[i]), stepped[i]), [])
                group.append(i)
                if len(group) >= self.batch_size:
                    chosen = group
                    break
            if chosen:
                ids = torch.stack([pool[i] for i in chosen])
            else:
                chosen = [i for i in window if active[i]][: self.batch_size]
                if not chosen:
                    break
                ids = _left_pad([self._unpad(pool[i]) for i in chosen], pad)
                for b, i in enumerate(chosen):
                    pool[i] = ids[b]
            n = min(self.k, min(max_new_tokens - made[i] for i in chosen))
            if n <= 0:
                for i in chosen:
                    active[i] = False
                continue
            new_tokens, _ = _draft_and_verify(self.target, self.draft, ids, n, pad)
            for b, i in enumerate(chosen):  # 2. write back; finished when any token is EOS
                pool[i] = torch.cat([pool[i], torch.tensor(new_tokens[b], dtype=torch.long, device=device)])
                made[i] += len(new_tokens[b])
                stepped[i] = True
                if (eos_token_id is not None and bool((pool[i] == eos_token_id).any())) or made[i] >= max_new_tokens:
                    active[i], stepped[i] = False, False
            refill()
        return [self._unpad(seq)[length:].tolist() for seq, length in zip(pool, prompt_lengths)]


def _declared_pad(target: Any) -> int:
    pad = getattr(target.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def make_eqspec(target, draft, *, batch_size: int, draft_tokens: int, max_input_len: int = 1024) -> PaperEQSpec:
    return PaperEQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens,
                       pad_token_id=_declared_pad(target), max_input_len=int(max_input_len))


def make_eqspec_with_pad_option(target, draft, *, batch_size: int, draft_tokens: int, pad_token_id: int | None = None,
                                max_input_len: int = 1024) -> PaperEQSpec:
    pad = _declared_pad(target) if pad_token_id is None else int(pad_token_id)
    return PaperEQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, pad_token_id=pad,
                       max_input_len=int(max_input_len))


def make_exspec(target, draft, *, batch_size: int, draft_tokens: int, max_input_len: int = 1024,
                window_size: int = 32, sort_by_length: Any = False) -> PaperEXSpec:
    sort = sort_by_length if isinstance(sort_by_length, bool) else str(sort_by_length).lower() in ("1", "true", "yes")
    return PaperEXSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens,
                       pad_token_id=_declared_pad(target), max_input_len=int(max_input_len),
                       window_size=int(window_size), sort_by_length=sort)
