"""Evidence checks of a diagnosis that need no re-run: the outputs, the lengths and the trace.

Each check looks at one divergent prompt and returns a `Finding` (a class and the evidence in
words) when what it sees decides the class, or None. They read only the prompts, the reference and
engine outputs, the engine's trace and recorded logits, and (for the draft check) one forward pass
of the draft model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specaudit.engines.limits import eos_ids
from specaudit.engines.trace import Trace
from specaudit.equivalence.rulings.outputs import other_references_matched


@dataclass
class Finding:
    cls: str
    evidence: str


def output_order(index: int, references: list[list[int]], outputs: list[list[int]]) -> Finding | None:
    """The output of prompt `index` is another prompt's reference (`outputs.other_references_matched`)."""
    others = other_references_matched(index, references, outputs[index])
    if not others:
        return None
    permuted = sorted(map(tuple, outputs)) == sorted(map(tuple, references)) and outputs != references
    whole = " The outputs as a whole are a permutation of the references." if permuted else ""
    return Finding("output_order", f"the output for prompt {index} is exactly the reference of prompt "
                   f"{others[0]}{' (and ' + str(len(others) - 1) + ' more)' if len(others) > 1 else ''}: "
                   f"answered for the wrong prompt.{whole}")


def stop_eos(index: int, prompt: list[int], reference: list[int], output: list[int], position: int,
             eos: int | Sequence[int] | None, trace: Trace | None, outputs: list[list[int]],
             batch: list[int] | None = None) -> Finding | None:
    """Tokens after the row's EOS (any id of the set), or a stop at an EOS that is not the row's own."""
    ends = eos_ids(eos)
    if not ends:
        return None
    if position == len(reference) and reference and reference[-1] in ends and len(output) > position:
        return Finding("stop_eos", f"the reference ends with EOS {reference[-1]}{_of_set(ends)} at position "
                       f"{position - 1}; the engine went on with {len(output) - position} more token(s) "
                       f"({output[position:position + 4]})")
    if _stopped_without_eos(reference, output, position, ends):
        at = [i for i, t in enumerate(prompt) if t in ends]
        if at:
            return Finding("stop_eos", f"the engine stopped after {len(output)} token(s) with no EOS of its own; "
                           f"the prompt holds the EOS id {prompt[at[0]]}{_of_set(ends)} at position(s) {at[:4]}, "
                           "which it took for the end")
        other = _foreign_eos(index, output, ends, trace, outputs)
        if other is not None:
            return Finding("stop_eos", f"the engine stopped after {len(output)} token(s) with no EOS of its own, "
                           f"in the step where prompt {other} of its batch emitted "
                           + (f"EOS {ends[0]}" if len(ends) == 1 else f"an EOS id of {list(ends)}"))
        if trace is None or not trace.steps:
            # no trace: a row of its batch (consecutive batches) whose EOS is its new token at the same count
            same = [j for j in batch or [] if j != index and len(outputs[j]) == len(output) and outputs[j]
                    and outputs[j][-1] in ends]
            if same:
                return Finding("stop_eos", f"the engine stopped after {len(output)} token(s) with no EOS of its own; "
                               f"prompt {same[0]} of its batch ended with EOS {outputs[same[0]][-1]} as its new token "
                               f"{len(output) - 1}, the same count: the row stopped at another row's EOS")
    return None


def _stopped_without_eos(reference: list[int], output: list[int], position: int, ends: Sequence[int]) -> bool:
    """Whether the engine's output ends at the divergence `position`, before the reference's, on no EOS of its own."""
    return position == len(output) < len(reference) and (not output or output[-1] not in ends)


def _of_set(ends: tuple[int, ...]) -> str:
    """Where the EOS set has several ids, say which: " (of the EOS ids [a, b])"."""
    return f" (of the EOS ids {list(ends)})" if len(ends) > 1 else ""


def _foreign_eos(index: int, output: list[int], eos: tuple[int, ...], trace: Trace | None,
                 outputs: list[list[int]]) -> int | None:
    emitted_at = trace.emitted_at if trace is not None else []
    if not emitted_at or index >= len(emitted_at) or not emitted_at[index]:
        return None
    last = emitted_at[index][-1]
    record = trace.steps[last]
    for row in record.rows:
        if row == index or row >= len(outputs):
            continue
        theirs = [j for j, s in enumerate(emitted_at[row]) if s == last]
        if any(outputs[row][j] in eos for j in theirs if j < len(outputs[row])):
            return row
    return None


def acceptance_from_trace(index: int, reference: list[int], output: list[int], position: int,
                          max_new_tokens: int, eos: int | Sequence[int] | None, trace: Trace | None) -> Finding | None:
    """A step that accepted a draft token the target did not choose, or that dropped or doubled
    its bonus token, read from the trace's proposals and counts."""
    steps = trace.steps if trace is not None else []
    if not steps:
        return None
    done = 0
    k = trace.draft_tokens
    for s, record in enumerate(steps):
        if index not in record.rows:
            continue
        b = record.rows.index(index)
        accepted = record.accepted_counts[b] if b < len(record.accepted_counts) else None
        emitted = record.emitted_counts[b] if b < len(record.emitted_counts) else None
        if record.kind not in ("prefill",) and record.proposed is not None and accepted is not None \
                and b < len(record.proposed):
            proposal = record.proposed[b]
            # the target's choices after the row's pending token, while its prefix equals the reference
            for j in range(min(accepted, len(proposal))):
                slot = done + j
                # strictly before the split: there the engine's own target agreed with the reference
                if slot >= position or slot >= len(reference):
                    break
                if proposal[j] != reference[slot]:
                    return Finding("acceptance_rule", f"step {s} accepted {accepted} draft token(s) of {proposal}, "
                                   f"but draft token {j + 1} ({proposal[j]}) is not the target's choice there "
                                   f"({reference[slot]}, new token {slot}): a rejected draft token was kept")
        if emitted is not None and accepted is not None and record.kind not in ("prefill", "stopped") and k:
            room = max_new_tokens - done
            ended = any(t in eos_ids(eos) for t in output[done:done + emitted])
            if emitted == accepted and emitted < room and not ended and done <= position:
                return Finding("acceptance_rule", f"step {s} accepted {accepted} draft token(s) and emitted "
                               f"{emitted}: no bonus token, though {room} token(s) of room were left")
            if emitted > accepted + 1:
                return Finding("acceptance_rule", f"step {s} accepted {accepted} draft token(s) and emitted "
                               f"{emitted}: more than the accepted tokens and one bonus token")
        done += emitted or 0
    counted = sum(step.emitted_counts[step.rows.index(index)] for step in steps
                  if index in step.rows and step.rows.index(index) < len(step.emitted_counts))
    if counted and counted != len(output) and _doubled_at(reference, output, position) is not None:
        return Finding("acceptance_rule", f"the trace counts {counted} emitted tokens for this row, the output "
                       f"holds {len(output)}; token {position} repeats the token before it and without it the "
                       "output agrees with the reference: the bonus token was emitted twice")
    return None


def _doubled_at(reference: list[int], output: list[int], position: int) -> int | None:
    """`position` when the engine's token there repeats the one before it and dropping it makes
    the output agree with the reference further (a doubled token)."""
    if position < 1 or position >= len(output) or output[position] != output[position - 1]:
        return None
    if position < len(reference) and reference[position] == output[position]:
        return None  # the tokens agree here (a logit divergence): nothing was doubled
    without = output[:position] + output[position + 1:]
    agree = 0
    for a, b in zip(reference, without):
        if a != b:
            break
        agree += 1
    return position if agree > position or (agree == len(reference) and agree >= position) else None


def doubled_token(reference: list[int], output: list[int], position: int) -> Finding | None:
    if _doubled_at(reference, output, position) is None:
        return None
    return Finding("acceptance_rule", f"new token {position} ({output[position]}) repeats the token before it, and "
                   "without it the output agrees with the reference: the bonus token was emitted twice")


# (output position, raw logits [V]) -> the token a correct decoder chooses from them there (request parameters
# processed); None: the argmax
Choice = Callable[[int, torch.Tensor], int]


def own_logits_not_chosen(output: list[int], position: int, engine_logits: torch.Tensor | None,
                          choice: Choice | None = None) -> Finding | None:
    """The engine emitted a token that its own recorded target logits did not choose."""
    if engine_logits is None:
        return None
    for j in range(min(position + 1, len(output), engine_logits.shape[0])):
        chosen = choice(j, engine_logits[j]) if choice is not None else int(engine_logits[j].argmax())
        if chosen != output[j]:
            return Finding("acceptance_rule", f"at new token {j} the engine emitted {output[j]}, but its own target "
                           f"logits there choose {chosen}: it kept a token the target did not choose")
    return None


DraftChose = Callable[[list[int], int, int], bool]  # (prefix, the draft's choice, a token): the draft chose it


@torch.no_grad()
def draft_token_kept(prompt: list[int], reference: list[int], output: list[int], position: int, draft: Any,
                     engine_logits: torch.Tensor | None, chose: DraftChose | None = None,
                     choice: Choice | None = None) -> Finding | None:
    """The engine's token at the split is the draft model's greedy choice, not the target's.

    `chose(prefix, choice, token)` says whether a draft that chooses `choice` on `prefix` (the audit-dtype
    draft here) may have chosen `token` in the engine's precision: below float64 the engine's own draft rounds
    differently and flips its near-ties (the draft ruling of `draft_fidelity`); without it, only `choice` itself."""
    if draft is None or position >= len(output) or position >= len(reference):
        return None
    if engine_logits is not None and position < engine_logits.shape[0] and (
            choice(position, engine_logits[position]) if choice is not None
            else int(engine_logits[position].argmax())) == output[position]:
        return None  # the token came from the engine's target logits, not from the draft
    prefix = list(prompt) + list(output[:position])
    ids = torch.tensor([prefix], dtype=torch.long, device=draft.device)
    choice = int(draft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].argmax())
    if output[position] == reference[position]:
        return None
    if choice == output[position]:
        how = "the draft model's own greedy choice on the common prefix"
    elif chose is not None and chose(prefix, choice, output[position]):
        how = (f"within the draft's precision of its own choice on the common prefix (there it chooses {choice}; "
               "the float64 draft puts both within the draft's measured band)")
    else:
        return None
    return Finding("acceptance_rule", f"the engine's token {output[position]} at new token {position} is {how}; the "
                   f"target chooses {reference[position]}: a rejected draft token was kept")


def length_stop(reference: list[int], output: list[int], position: int, max_new_tokens: int,
                eos: int | Sequence[int] | None,
                continuation: list[int] | None) -> Finding | None:
    """More tokens than `max_new_tokens`, or fewer with neither EOS nor the budget reached."""
    if len(output) > max_new_tokens:
        extra = output[max_new_tokens:]
        same = continuation is not None and continuation[:len(output)] == output
        tail = (" The extra tokens are the target's own greedy continuation: correct decoding that did not stop."
                if same else "")
        return Finding("stop_length", f"{len(output)} tokens for max_new_tokens = {max_new_tokens} "
                       f"({len(extra)} past the budget: {extra[:4]}).{tail}")
    if _stopped_without_eos(reference, output, position, eos_ids(eos)) and len(output) < max_new_tokens:
        return Finding("stop_length", f"the engine stopped after {len(output)} token(s), with no EOS and "
                       f"max_new_tokens = {max_new_tokens}; the reference goes on to {len(reference)}")
    return None


def group_of_unequal_rows(index: int, position: int, trace: Trace | None) -> Finding | None:
    """A step recorded as a same-length group (no realignment) whose rows had different lengths."""
    last = _emitting_step(index, position, trace)
    for s, record in enumerate(trace.steps if trace is not None else []):
        if last is not None and s > last:
            break
        if record.kind == "group" and index in record.rows and len(set(record.pad_lengths)) > 1:
            return Finding("kv_cache", f"step {s} stepped rows {record.rows} as a same-length group (no "
                           f"realignment) though their caches had different padding {record.pad_lengths}: each "
                           "row's cache was cut out at columns that are not its own")
    return None


def rejection_before(index: int, position: int, trace: Trace | None) -> int | None:
    """The last step before the one that emitted new token `position` in which the row rejected
    draft tokens; None when it rejected none (or the trace does not say)."""
    until = _emitting_step(index, position, trace)
    if until is None:
        return None
    k = trace.draft_tokens
    found = None
    for s, record in enumerate(trace.steps):
        if s >= until:
            break
        if index in record.rows and record.kind not in ("prefill", "stopped"):
            b = record.rows.index(index)
            if b < len(record.accepted_counts) and record.accepted_counts[b] < k:
                found = s
    return found


def finished_beside(index: int, position: int, trace: Trace | None) -> tuple[int, int] | None:
    """A step before the divergence where another row of the batch finished: (step, row)."""
    until = _emitting_step(index, position, trace)
    if until is None:
        return None
    last_step = {row: max(steps) for row, steps in enumerate(trace.emitted_at) if steps}
    found = None
    for s, record in enumerate(trace.steps):
        if s >= until:
            break
        if index in record.rows:
            for row in record.rows:
                if row != index and last_step.get(row) == s:
                    found = (s, row)
    return found


def uneven_acceptance(index: int, position: int, trace: Trace | None) -> tuple[int, list[int], list[int]] | None:
    """The last step before the divergence where the row accepted more draft tokens than some other
    row of its batch: (step, rows, accepted counts)."""
    until = _emitting_step(index, position, trace)
    if until is None:
        return None
    found = None
    for s, record in enumerate(trace.steps):
        if s >= until:
            break
        if index in record.rows and record.kind not in ("prefill", "stopped") and len(record.rows) > 1:
            mine = record.accepted_counts[record.rows.index(index)]
            if mine > min(record.accepted_counts):
                found = (s, list(record.rows), list(record.accepted_counts))
    return found


def _emitting_step(index: int, position: int, trace: Trace | None) -> int | None:
    """The step that emitted new token `position` of row `index` (its last step where the row emitted fewer
    tokens), or None where the trace records no step of that row."""
    emitted_at = trace.emitted_at if trace is not None else []
    if index >= len(emitted_at) or not emitted_at[index]:
        return None
    return emitted_at[index][min(position, len(emitted_at[index]) - 1)]
