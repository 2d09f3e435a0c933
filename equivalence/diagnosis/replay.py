"""Logit replays under hypotheses: which wrong batching explains what the engine computed?

The target is replayed on one row alone, batch size 1, along the engine's own output (`forward.py`: whole, or
after the cache of the prefix a replay shares with the plain sequence), with the position ids or the visible
context that a suspected bug would give that row:

- positions shifted by the row's padding (or masked columns) at the step that fed each token,
  counted as the trace records it (`StepRecord.pad_lengths`): positions counted over padding or
  over masked rejected draft slots;
- positions shifted by the row's rejected draft slots so far (k - accepted, summed over its
  earlier steps): positions that keep counting past rejected tokens;
- every position shifted by a constant (an offset applied twice, a 1-based count);
- the row's left padding visible to its queries, at position 0 or counted (a mask blind to
  padding);
- for an engine without a trace: positions shifted by the row's left padding in its batch (consecutive
  batches), and past its rejected draft slots, the steps rebuilt from the draft's proposals.

A hypothesis explains the engine's logits at a position when it brings them at least 100 times
closer than the plain replay does (in float64 an exact hypothesis reproduces them to ~1e-13).
Below float64 no replay reproduces an engine's logits closer than the precision's own error: there a
hypothesis explains when it brings them within that error (`noise`, the audit-dtype reference's
largest logit error against float64 on the prompt, measured) and at least 4 times closer than the
plain replay. Without recorded logits, a hypothesis explains the engine's token when its argmax is
that token and the plain replay's is not. Replays run on the float64 target wherever the audit has one.
Token replays run only for a run the provenance did not see and that cannot run again (a recording):
elsewhere what the queries read, or the controlled re-runs, decide (`core.Diagnoser._reproducing_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specaudit.engines.trace import Trace
from specaudit.equivalence.diagnosis.forward import GrowingReplay, PrefixReplay, replay_all, replay_last
from specaudit.equivalence.rulings.thresholds import EXPLAIN_RATIO, NOISY_EXPLAIN_RATIO, TOKEN_WINDOW

CONSTANT_SHIFTS = (1, -1, 2)


@dataclass
class Hypothesis:
    cls: str  # the diagnosis class it stands for
    name: str  # what it assumes, in words
    # (ids, positions) or (ids, positions, allowed [L, L] bool: key j visible to query i), None when it does not apply
    build: Callable[[], tuple[Any, ...] | None]
    mechanism: str = ""  # the bug it stands for, shared by hypotheses that differ only in how they count
    # a replay of its own (the target -> logits [V] or None), for a hypothesis no (ids, positions) can state
    replay: Callable[[Any], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if not self.mechanism:
            text = self.name
            self.mechanism = ("position ids counted past rejected draft slots" if "rejected" in text else
                              "position ids counted over the row's padding" if "padding" in text and self.cls == "position_ids"
                              else "the row's padding visible to its queries" if self.cls == "attention_mask"
                              else "position ids shifted by a constant")


def row_steps(trace: Trace | None, index: int) -> list[int]:
    """The steps (indices into `trace.steps`) in which prompt `index` took part, in order."""
    return [s for s, step in enumerate(trace.steps if trace is not None else []) if index in step.rows]


def fed_steps(trace: Trace | None, index: int, count: int) -> list[int | None]:
    """For each of the row's first `count` new tokens, the step whose forward pass fed it to the
    target: an accepted draft token in the step that verified it, the bonus (last token of a
    step) in the row's next step; None when the trace does not say."""
    emitted_at = trace.emitted_at if trace is not None else []
    emitted = emitted_at[index] if index < len(emitted_at) else []
    steps = row_steps(trace, index)
    fed: list[int | None] = []
    for j in range(count):
        if j >= len(emitted):
            fed.append(None)
            continue
        step = emitted[j]
        last_of_step = j + 1 >= len(emitted) or emitted[j + 1] != step
        if not last_of_step:
            fed.append(step)
            continue
        later = [s for s in steps if s > step]
        fed.append(later[0] if later else None)
    return fed


def _pad_at(trace: Trace, step: int | None, index: int) -> int | None:
    if step is None:
        return None
    record = trace.steps[step]
    if index not in record.rows or not record.pad_lengths:
        return None
    return int(record.pad_lengths[record.rows.index(index)])


@dataclass
class RowContext:
    """What a replay may use when the engine keeps no trace: the row's left padding in its batch
    (consecutive batches of the run's batch size) and the draft model with k, to rebuild its steps."""

    batch_padding: int | None = None
    draft: Any = None
    draft_tokens: int = 0


@torch.no_grad()
def _draft_greedy(draft: GrowingReplay, ids: list[int], k: int) -> list[int] | None:
    """The draft's k greedy proposals after `ids`; None where it refuses the positions."""
    out: list[int] = []
    for _ in range(k):
        sequence = ids + out
        logits = draft.last(sequence, list(range(len(sequence))))
        if logits is None:
            return None
        out.append(int(logits.argmax()))
    return out


def rebuilt_rejections(draft: Any, k: int, prompt: list[int], output: list[int], q: int) -> list[int] | None:
    """Without a trace: for each of the row's first `q` new tokens, the rejected draft slots before
    the step that fed it, with the steps rebuilt from the draft model's greedy proposals along the
    engine's own output (token 0 from the prefill; each step keeps the proposals equal to the output,
    then one token more)."""
    if draft is None or not k or q == 0:
        return None
    emitted_at, rejected_before = [0], {}
    rejected, done, step = 0, 1, 0
    drafting = GrowingReplay(draft)
    while done <= q and done < len(output):
        step += 1
        rejected_before[step] = rejected
        proposals = _draft_greedy(drafting, list(prompt) + list(output[:done]), k)
        if proposals is None:
            return None
        accepted = 0
        while accepted < k and done + accepted < len(output) and proposals[accepted] == output[done + accepted]:
            accepted += 1
        emitted = min(accepted + 1, len(output) - done)
        emitted_at += [step] * emitted
        done += emitted
        rejected += k - accepted
    rejected_before[step + 1] = rejected
    shifts = []
    for j in range(q):  # a bonus token (last of its step) is fed by the next step
        last = j + 1 >= len(emitted_at) or emitted_at[j + 1] != emitted_at[j]
        shifts.append(rejected_before.get(emitted_at[j] + (1 if last else 0), rejected))
    return shifts


def hypotheses(prompt: list[int], output: list[int], q: int, trace: Trace | None, index: int, pad_id: int | None,
               row: RowContext | None = None) -> list[Hypothesis]:
    """The hypotheses that can be built for the logits of new token `q` of prompt `index`."""
    sequence = list(prompt) + list(output[:q])  # the last token is the query
    true_positions = list(range(len(sequence)))
    n = len(prompt)
    found: list[Hypothesis] = []

    if (trace is None or not trace.steps) and row is not None:
        if row.batch_padding:
            def batch_padding(pad: int = row.batch_padding) -> tuple[list[int], list[int]] | None:
                return sequence, [p + pad for p in true_positions]

            found.append(Hypothesis("position_ids", f"every position shifted by the row's left padding in its batch "
                                    f"({row.batch_padding}, consecutive batches)", batch_padding))

            def new_tokens_past_padding(pad: int = row.batch_padding) -> tuple[list[int], list[int]] | None:
                return sequence, true_positions[:n] + [p + pad for p in true_positions[n:]]

            found.append(Hypothesis("position_ids", f"each new token numbered past the row's padding in its batch "
                                    f"({row.batch_padding}, consecutive batches; the prompt numbered from 0)",
                                    new_tokens_past_padding, "position ids counted over the row's padding"))

        rebuilt: list[list[int] | None] = []  # the draft's rebuilt steps, computed once for both hypotheses

        def rejected_rebuilt(pad: int = 0) -> tuple[list[int], list[int]] | None:
            if not rebuilt:
                rebuilt.append(rebuilt_rejections(row.draft, row.draft_tokens, prompt, output, q))
            shifts = rebuilt[0]
            if not shifts or not any(shifts):
                return None
            return sequence, true_positions[:n] + [n + j + s + pad for j, s in enumerate(shifts)]

        found.append(Hypothesis("position_ids", "each new token numbered past the row's rejected draft slots "
                                "(steps rebuilt from the draft model's proposals)", rejected_rebuilt))
        if row.batch_padding:
            found.append(Hypothesis("position_ids", f"each new token numbered past the row's padding in its batch "
                                    f"({row.batch_padding}) and its rejected draft slots (steps rebuilt from the "
                                    "draft model's proposals)", lambda: rejected_rebuilt(row.batch_padding),
                                    "position ids counted over the row's padding and rejected slots"))

    if trace is not None and trace.steps:
        fed = fed_steps(trace, index, q)
        steps = row_steps(trace, index)
        prefill_pad = _pad_at(trace, steps[0], index) if steps else None

        def padding_counted() -> tuple[list[int], list[int]] | None:
            shifts = [_pad_at(trace, step, index) for step in fed]
            if any(s is None for s in shifts) or not any(shifts):
                return None
            return sequence, true_positions[:n] + [n + j + s for j, s in enumerate(shifts)]

        found.append(Hypothesis("position_ids", "each new token numbered over the row's padding and masked "
                                "columns at the step that fed it (as the trace records them)", padding_counted))

        k = trace.draft_tokens

        def rejected_counted() -> tuple[list[int], list[int]] | None:
            # the row's rejected draft slots before each step, counted into its positions
            before: dict[int, int] = {}
            total = 0
            for step in steps:
                before[step] = total
                record = trace.steps[step]
                if record.kind not in ("prefill", "stopped") and k:
                    total += k - record.accepted_counts[record.rows.index(index)]
            shifts = [before.get(step) if step is not None else None for step in fed]
            if any(s is None for s in shifts) or not any(shifts):
                return None
            return sequence, true_positions[:n] + [n + j + s for j, s in enumerate(shifts)]

        found.append(Hypothesis("position_ids", "each new token numbered past the row's rejected draft slots "
                                "(k - accepted, summed over its earlier steps)", rejected_counted))

        def columns_counted() -> tuple[list[int], list[int]] | None:
            # every token numbered by its column in the padded batch: the prompt over its left
            # padding at the prefill, each new token over the padding of the step that fed it
            shifts = [_pad_at(trace, step, index) for step in fed]
            if not prefill_pad or any(s is None for s in shifts):
                return None
            return sequence, [prefill_pad + i for i in range(n)] + [n + j + s for j, s in enumerate(shifts)]

        found.append(Hypothesis("position_ids", "every token numbered by its column in the padded batch (the "
                                "prompt over its left padding, each new token over the padding of its step)",
                                columns_counted))

        def padding_visible(counted: bool) -> Callable[[], tuple[list[int], list[int]] | None]:
            def build() -> tuple[list[int], list[int]] | None:
                if not prefill_pad or pad_id is None:
                    return None
                ids = [pad_id] * prefill_pad + sequence
                if counted:
                    return ids, list(range(len(ids)))
                return ids, [0] * prefill_pad + true_positions
            return build

        found.append(Hypothesis("attention_mask", "the row's left padding visible to its queries (pad "
                                "positions at 0)", padding_visible(False)))
        found.append(Hypothesis("attention_mask", "the row's left padding visible to its queries and "
                                "counted in its positions", padding_visible(True)))

        # padding that appears after the prefill (rows that accepted different numbers of tokens): the query of
        # new token q sees as many zeroed cache columns as the trace records for the row at the step that fed it
        fed_query = fed[q - 1] if q >= 1 else (steps[0] if steps else None)
        zeroed = _pad_at(trace, fed_query, index)
        if zeroed:
            found.append(Hypothesis("attention_mask", f"the row's padding ({zeroed} zeroed cache columns at the step "
                                    "that fed the query) visible to its queries", lambda: None,
                                    "the row's padding visible to its queries",
                                    replay=lambda target, pad=zeroed: replay_with_zeroed_columns(target, sequence, pad)))

    for shift in CONSTANT_SHIFTS:
        def constant(shift: int = shift) -> tuple[list[int], list[int]] | None:
            positions = [p + shift for p in true_positions]
            return (sequence, positions) if min(positions) >= 0 else None

        found.append(Hypothesis("position_ids", f"every position shifted by {shift:+d}", constant))
    found += prefill_hypotheses(prompt, sequence)
    return found


CHUNK_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def prefill_hypotheses(prompt: list[int], sequence: list[int]) -> list[Hypothesis]:
    """How a prefill can number or mask the prompt wrong, the new tokens then right: positions reset at
    every chunk of a chunked prefill; a causal mask one column off (each query also sees the next token,
    or misses its own), in the prompt only (a cached prefill) or everywhere (a recomputing engine)."""
    n, total = len(prompt), len(sequence)
    found: list[Hypothesis] = []
    for chunk in CHUNK_SIZES:
        if chunk >= n:
            break

        def reset(chunk: int = chunk) -> tuple[list[int], list[int]] | None:
            return sequence, [i % chunk for i in range(n)] + list(range(n, total))

        found.append(Hypothesis("position_ids", f"the prompt's positions reset every {chunk} tokens (a chunked "
                                "prefill numbering each chunk from 0)", reset, "position ids reset per prefill chunk"))
    for offset, what in ((1, "also sees the next token"), (-1, "misses its own token")):
        for where in ("prompt", "sequence"):
            def shifted(offset: int = offset, where: str = where) -> tuple[Any, ...] | None:
                rows = torch.arange(total).unsqueeze(1)  # [L, 1]
                cols = torch.arange(total).unsqueeze(0)  # [1, L]
                allowed = cols <= rows + offset  # [L, L]
                if offset < 0:
                    allowed[0, 0] = True  # the first query must see something
                if where == "prompt":
                    allowed[n:] = cols.expand(total - n, total) <= rows[n:]
                return sequence, list(range(total)), allowed

            found.append(Hypothesis("attention_mask", f"a causal mask one column off: each query {what} "
                                    f"({'in the prefill' if where == 'prompt' else 'in every pass'})", shifted,
                                    "a causal mask off by one column"))
    return found


@torch.no_grad()
def replay_with_zeroed_columns(target: Any, sequence: list[int], pad: int) -> torch.Tensor | None:
    """The target's logits [V] after `sequence` when its last token (the query) also sees `pad` cache
    columns of zeros in front of the row's own (a left-padded cache whose padding the mask lets through),
    the earlier tokens computed without them; None when the model keeps no key/value cache to pad."""
    from transformers import DynamicCache

    from specaudit.engines.ops.hf_call import cached_forward

    if len(sequence) < 2 or pad <= 0:
        return None
    device = target.device
    cache = DynamicCache(config=target.config)
    prefix = torch.tensor([sequence[:-1]], dtype=torch.long, device=device)
    try:
        cached_forward(target, cache, input_ids=prefix, attention_mask=torch.ones_like(prefix),
                       position_ids=torch.arange(prefix.shape[1], device=device).unsqueeze(0))
        layers = getattr(cache, "layers", [])
        if not layers or not all(getattr(layer, "keys", None) is not None for layer in layers):
            return None  # recurrent or windowed layers: no plain column cache to pad
        for layer in layers:
            keys, values = layer.keys, layer.values  # [1, H, L, D]
            layer.keys = torch.cat([keys.new_zeros(*keys.shape[:2], pad, keys.shape[-1]), keys], dim=2)
            layer.values = torch.cat([values.new_zeros(*values.shape[:2], pad, values.shape[-1]), values], dim=2)
        query = torch.tensor([[sequence[-1]]], dtype=torch.long, device=device)
        out = cached_forward(target, cache, input_ids=query,
                             attention_mask=torch.ones(1, pad + len(sequence), dtype=torch.long, device=device),
                             position_ids=torch.tensor([[len(sequence) - 1]], device=device))
    except (IndexError, RuntimeError, ValueError, AttributeError):
        return None
    return out.logits[0, -1]


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs().max())


def explains(error: float, base: float, noise: float) -> bool:
    """A hypothesis replay `error` away from the engine's logits explains them, where the plain replay is
    `base` away and the precision reproduces logits to `noise` at best (0 in float64)."""
    if noise <= 0:
        return error <= EXPLAIN_RATIO * base
    return error <= max(EXPLAIN_RATIO * base, noise) and error <= NOISY_EXPLAIN_RATIO * base


def explain(target: Any, prompt: list[int], output: list[int], q: int, trace: Trace | None, index: int,
            pad_id: int | None, engine_logits: torch.Tensor | None, plain: torch.Tensor | None,
            prefer: tuple[str, ...] = (), row: RowContext | None = None,
            noise: float = 0.0) -> tuple[Hypothesis | None, list[str]]:
    """The first hypothesis that explains the engine at new token `q`, and what each one showed.
    Hypotheses named in `prefer` (those that explained other divergences of the run) go first;
    `noise` is the precision's own logit error (0 in float64, see `explains`). Without the engine's
    logits, see `explain_tokens`."""
    tried: list[str] = []
    if target is None:
        return None, tried
    if engine_logits is None:
        return explain_tokens(target, prompt, output, q, trace, index, pad_id, prefer, row)
    if plain is None:
        plain = replay_last(target, list(prompt) + list(output[:q]), list(range(len(prompt) + q)))
    if plain is None:
        return None, tried
    base = _error(engine_logits, plain)
    if base <= 0:
        return None, tried
    sequence = list(prompt) + list(output[:q])
    shared = PrefixReplay(target, sequence, list(range(len(sequence))))  # most hypotheses keep the prompt as it is
    for hypothesis in _ordered(hypotheses(prompt, output, q, trace, index, pad_id, row), prefer):
        if hypothesis.replay is not None:
            logits = hypothesis.replay(target)
        else:
            built = hypothesis.build()
            rows = shared.rows(*built, first=len(built[0]) - 1) if built is not None and len(built) < 4 else None
            logits = None if rows is None else rows[-1]
        if logits is None:
            continue
        error = _error(engine_logits, logits)
        within = f", precision noise {noise:.3g}" if noise > 0 else ""
        tried.append(f"{hypothesis.name}: logit error {error:.3g} (plain replay {base:.3g}{within})")
        if explains(error, base, noise):
            return hypothesis, tried
    return None, tried


def _ordered(found: list[Hypothesis], prefer: tuple[str, ...]) -> list[Hypothesis]:
    return sorted(found, key=lambda h: prefer.index(h.name) if h.name in prefer else len(prefer))


def explain_tokens(target: Any, prompt: list[int], output: list[int], q: int, trace: Trace | None, index: int,
                   pad_id: int | None, prefer: tuple[str, ...] = (),
                   row: RowContext | None = None) -> tuple[Hypothesis | None, list[str]]:
    """Without the engine's logits a hypothesis is judged on tokens, teacher-forced along the engine's own
    output: it must choose the engine's token at `q` where the plain replay does not, and agree with the
    engine on more of the next new tokens (up to TOKEN_WINDOW in all) than the plain replay does, or on as
    many when the draft model's own choice is not the engine's token. One token
    alone can agree by chance (a small vocabulary, a draft close to its target); a wrong numbering or
    mask that the engine really applied goes on agreeing after it."""
    tried: list[str] = []
    if q >= len(output):
        return None, tried
    end = min(len(output) - 1, q + TOKEN_WINDOW - 1)  # the window: new tokens q..end
    width = end - q + 1
    plain_logits = replay_all(target, list(prompt) + list(output[:end]), list(range(len(prompt) + end)))
    if plain_logits is None:
        return None, tried
    plain = plain_logits[-width:].argmax(-1).tolist()
    engine = [int(t) for t in output[q:end + 1]]
    if plain[0] == engine[0]:
        return None, tried
    plain_agree = sum(a == b for a, b in zip(plain[1:], engine[1:]))
    draft_choice = None  # a tie on the window is no evidence when the draft itself chose the engine's token
    kept_agree = -1  # along the window: the engine's tokens that are the target's or the draft's own choice
    if row is not None and row.draft is not None:
        drafted = replay_all(row.draft, list(prompt) + list(output[:end]), list(range(len(prompt) + end)))
        if drafted is not None:
            by_draft = drafted[-width:].argmax(-1).tolist()
            draft_choice = by_draft[0]
            kept_agree = sum(e in (t, d) for e, t, d in zip(engine[1:], plain[1:], by_draft[1:]))
    passing: list[tuple[int, Hypothesis]] = []
    found = hypotheses(prompt, output, end, trace, index, pad_id, row)
    sequence = list(prompt) + list(output[:end])
    shared = PrefixReplay(target, sequence, list(range(len(sequence))))  # most hypotheses keep the prompt as it is
    for hypothesis in _ordered(found, prefer):
        if hypothesis.replay is not None:
            continue  # a single-query replay: no window
        built = hypothesis.build()
        if built is None:
            continue
        first = len(built[0]) - width  # the rows of the window's new tokens: the last `width`
        logits = shared.rows(*built, first=first)
        if logits is None:
            continue
        chosen = logits.argmax(-1).tolist()
        agree = sum(a == b for a, b in zip(chosen[1:], engine[1:]))
        tried.append(f"{hypothesis.name}: chooses {chosen[0]} at new token {q} (engine {engine[0]}, plain replay "
                     f"{plain[0]}); the next {width - 1} new token(s): {agree} agree (plain replay {plain_agree})")
        if chosen[0] != engine[0]:
            continue
        if width == 1 or agree > plain_agree or (agree == plain_agree and draft_choice != engine[0]):
            passing.append((agree, hypothesis))
            if agree == width - 1:
                break  # the whole window reproduced: nothing can do better
    if not passing:
        return None, tried
    if draft_choice == engine[0] and kept_agree >= max(agree for agree, _ in passing):
        # the engine's tokens are the target's or the draft's own choices at least as often as any replay's:
        # kept draft tokens explain them as well (the acceptance checks decide)
        tried.append(f"the engine's tokens are the target's or the draft's own choices on {kept_agree} of the next "
                     f"{width - 1} new token(s), as many as the best replay reproduces: no replay decides")
        return None, tried
    # of the hypotheses that pass, the one that reproduces most of the window (the first of those)
    best = max(passing, key=lambda item: item[0])[1]
    if best is not passing[-1][1] or len(passing) > 1:
        tried.append(f"chosen: {best.name} (reproduces the most of the window)")
    return best, tried
