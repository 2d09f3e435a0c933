"""The acceptance rule of speculative decoding, written once for every engine.

A step verifies `k` draft tokens per row with one target pass over [pending token, k draft tokens],
whose logits are `[B, k+1, V]`: position `i` holds the target's distribution after the pending token and
the first `i` draft tokens. From them the rule decides, per row:

- accepted tokens: the longest prefix of the row's own draft tokens the target agrees with (`accepted[b]`);
- the recovered token: when a draft token is rejected (`accepted < k`), the target's own token at that
  position replaces it;
- the bonus token: when every draft token is accepted (`accepted == k`), the target's token after them.

Either way a row offers `accepted + 1` tokens, `tokens[b, :accepted[b] + 1]`; `accept` then cuts them
after the first EOS id (any id of the set: `limits.eos_ids`) and at the row's room (its budget of new
tokens left), and says which rows are done. Which draft tokens are accepted and what the recovered or
bonus token is belongs to a `Sampler`: `GREEDY` (the default) takes the target's greedy choice at every
position, which makes speculative decoding exactly greedy decoding. The sampled rule is another `Sampler`
with the same call (`engines/sampling/step.StepSampler`): per sampled row, with p_j the target's
processed distribution at position j (temperature, top-k, top-p) and q_j the draft's, from which the
draft drew x_j (the draft's logits are passed in `draft_logits` [B, k, V]; None: a deterministic drafter,
q_j the one-hot of x_j), draw u_j ~ U[0, 1):

- x_j is accepted while u_j < min(1, p_j(x_j) / q_j(x_j));
- at the first rejection the recovered token is drawn from max(0, p_j - q_j) / sum(max(0, p_j - q_j));
- after every draft token is accepted the bonus token is drawn from p_{k+1};

so each emitted token is distributed as p_j exactly. Each row draws from its own request's generator.
A pass whose request context has sampled rows (`requests.sampler`) takes that sampler; greedy rows in
it are decided by the greedy rule as before, and a pass without sampled rows never reaches it.

Request parameters (`engines/requests/rows.py`): given a request context (`requests`, the rows'
`StepRequests`), `accept` first processes each row's logits at each verify position with the row's
history there (prompt, committed output, the draft tokens before that position), ends a row at its own
stop ids (EOS and its `stop_token_ids`) instead of the EOS set, and cuts the emitted tokens at a
completed stop string, committing them as the rows' output. Without it (plain greedy) none of that runs.

EQSPEC (and EXSPEC and INPLACE, which step through EQSPEC's `speculative_step`), the fixed-shape engine
(`static/loop.py`) and, with request parameters, `batched` call `accept` through this module
(`acceptance.accept`), so changing it changes all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from specaudit.engines.limits import is_eos
from specaudit.engines.sampling.rules import greedy_accepted

if TYPE_CHECKING:
    from specaudit.engines.requests.rows import StepRequests


class Sampler(Protocol):
    """The rule's choice: the step's tokens [B, k+1] and accepted draft tokens [B]."""

    def __call__(self, target_logits: torch.Tensor, drafts: torch.Tensor, own: torch.Tensor,
                 draft_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class GreedySampler:
    """Greedy verification: a draft token is accepted while it equals the target's greedy token; the
    recovered or bonus token is the target's greedy token at the first position not accepted."""

    def __call__(self, target_logits: torch.Tensor, drafts: torch.Tensor, own: torch.Tensor,
                 draft_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = target_logits.argmax(-1)  # [B, k+1]
        return tokens, greedy_accepted(tokens, drafts, own)


GREEDY = GreedySampler()


@dataclass
class Verdict:
    """One step's outcome per row."""

    tokens: torch.Tensor  # [B, k+1]: accepted draft tokens, then the recovered or bonus token at `accepted`
    accepted: torch.Tensor  # [B] draft tokens accepted
    emitted: torch.Tensor  # [B] new tokens of the step: tokens[b, :emitted[b]] (accepted + 1, cut at EOS and room)
    done: torch.Tensor  # [B] bool: the row emitted an EOS id or reached its budget
    ended_by_eos: torch.Tensor  # [B] bool: the row's last emitted token is an EOS id (with requests: a stop id)


def accept(target_logits: torch.Tensor | None, drafts: torch.Tensor, room: torch.Tensor | int,
           eos_token_id: int | Sequence[int] | None, *, own: torch.Tensor | None = None,
           target_tokens: torch.Tensor | None = None, sampler: Sampler = GREEDY,
           draft_logits: torch.Tensor | None = None, requests: StepRequests | None = None) -> Verdict:
    """The rule on one verify pass.

    `target_logits` [B, k+1, V] (or, for the greedy rule only, `target_tokens` [B, k+1] instead); `drafts`
    [B, k] the verified draft tokens; `room` [B] (or one int) the new tokens each row may still emit, at
    least 1 for a running row; `eos_token_id` the EOS id set; `own` [B, k] True on a row's own draft tokens
    (all of them when None); `requests` the rows' request parameters (module docstring; they need
    `target_logits`)."""
    if own is None:
        own = torch.ones_like(drafts, dtype=torch.bool)
    if requests is not None:
        if target_logits is None:
            raise ValueError("request parameters process the target's logits: pass target_logits")
        target_logits = requests.process(target_logits, drafts, own)  # [B, k+1, V]
        if requests.sampler is not None and sampler is GREEDY:  # some row samples: the rows' own rule and streams
            sampler = requests.sampler
    if target_logits is None:
        if sampler is not GREEDY or target_tokens is None:
            raise ValueError("without target logits only the greedy rule can decide, from target_tokens")
        tokens, accepted = target_tokens, greedy_accepted(target_tokens, drafts, own)
    else:
        tokens, accepted = sampler(target_logits, drafts, own, draft_logits)
    k = drafts.shape[1]
    emitted = torch.minimum(accepted + 1, torch.as_tensor(room, device=accepted.device))  # [B]
    position = torch.arange(k + 1, device=tokens.device).unsqueeze(0)  # [1, k+1]
    is_stop = is_eos(tokens, eos_token_id) if requests is None else requests.stops(tokens)  # [B, k+1]
    eos = is_stop & (position < emitted.unsqueeze(1))  # [B, k+1] EOS (a row's stop id) among the offered tokens
    ended = eos.any(1)  # [B]
    first_eos = eos.float().argmax(1)  # [B] (0 where there is none; used only where `ended`)
    emitted = torch.where(ended, first_eos + 1, emitted)
    ended_by_eos = ended
    if requests is not None:  # a stop string completed inside the burst ends the row at the completing token
        emitted, ended = requests.commit(tokens, emitted, ended)
        ended_by_eos = ended_by_eos & (first_eos + 1 == emitted)
    done = (emitted >= torch.as_tensor(room, device=accepted.device)) | ended
    return Verdict(tokens=tokens, accepted=accepted, emitted=emitted, done=done, ended_by_eos=ended_by_eos)


def first_tokens(last_logits: torch.Tensor, budget: torch.Tensor | int, eos_token_id: int | Sequence[int] | None,
                 requests: StepRequests | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's first new token of each row [B] from the logits after its prompt `last_logits` [B, V],
    and whether the row is already done [B] (`first_token_done`); with `requests`, position 0 of `accept`
    (processed with an empty output, committed)."""
    if requests is None:
        first = last_logits.argmax(-1)  # [B]
        return first, first_token_done(first, budget, eos_token_id)
    # a sampled row's first token: the bonus of a step with no drafts, drawn from p_1 with the row's stream
    no_drafts = torch.zeros(last_logits.shape[0], 0, dtype=torch.long, device=last_logits.device)  # [B, 0]
    verdict = accept(last_logits.unsqueeze(1), no_drafts, budget, eos_token_id, requests=requests)
    return verdict.tokens[:, 0], verdict.done


def first_token_done(first: torch.Tensor, budget: torch.Tensor | int, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
    """[B] bool: after a prefill's first new token `first` [B], whether the row is already done (an EOS id,
    or a budget of one token)."""
    return is_eos(first, eos_token_id) | (torch.as_tensor(budget, device=first.device) <= 1)
