"""Causes a diagnosis examines before any symptom: a prompt cut to a common limit, and token values
read as padding.

Both are shown by replays of the reference that reproduce the engine's own tokens:

- `truncation`: greedy decoding of the prompt cut to 512, 1024, 2048 or 4096 tokens (its first or
  its last ones) gives exactly the engine's output;
- `masked_replay`: greedy decoding with every pad-id token of the row left out of the context (as a
  mask built by pad-id equality leaves it out) gives the engine's output, possibly shifted by the
  count of pad-id tokens in the prompt (an output slice found by counting non-pad tokens);
  failing that, `masked_along_output`: along the engine's own output, the target with those tokens
  masked chooses the engine's token at the divergence and most tokens after it.

`pad_evidence` gathers what needs no re-run: where the pad ids sit, whether the divergence starts
there, and how the rows without pad ids fared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specaudit.engines.limits import eos_ids
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.rulings.thresholds import MASKED_REPLAY_AGREEMENT, MASKED_WINDOW, float64_equal

TRUNCATION_LIMITS = (1024, 2048, 512, 4096)  # common prompt limits, the most common first


@dataclass
class Cause:
    cls: str
    evidence: str
    named_by: str  # the evidence that decided, in a few words
    mechanism: str  # the same words for every divergence with this mechanism


@torch.no_grad()
def _first_token(target: Any, prompt: list[int]) -> int:
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    return int(target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].argmax())


def _agrees(engine: list[int], replay: list[int]) -> bool:
    """The engine's tokens are the replay's (the shorter a prefix of the longer, at least one token)."""
    common = min(len(engine), len(replay))
    return common >= 1 and engine[:common] == replay[:common]


def _same_logits(target: Any, cut: list[int], output: list[int], engine_logits: torch.Tensor | None) -> bool:
    """With float64 logits recorded by the engine: the cut prompt's replay reproduces them too (a
    token match alone can be a coincidence, e.g. a periodic prompt under rotary positions)."""
    if engine_logits is None or engine_logits.dtype != torch.float64:
        return True
    from specaudit.equivalence.compare import replay_logits

    upto = min(len(output), engine_logits.shape[0])
    if upto == 0:
        return True
    replay = replay_logits(target, list(cut), list(output[:upto]))
    return float64_equal(float((replay.to(torch.float64) - engine_logits[:upto].to(replay.device)).abs().max()))


def truncation(target: Any, prompt: list[int], output: list[int], position: int, max_new_tokens: int,
               eos: int | None, tried: list[str], engine_logits: torch.Tensor | None = None) -> Cause | None:
    """The engine's output is greedy decoding of the prompt cut to a common limit (and, when the
    engine recorded float64 logits, its logits are the cut prompt's)."""
    if target is None or not output:
        return None
    from specaudit.engines.reference import greedy_decode

    n = len(prompt)
    for limit in TRUNCATION_LIMITS:
        if n <= limit:
            continue
        for side, cut in (("first", prompt[:limit]), ("last", prompt[-limit:])):
            if _first_token(target, cut) != output[0]:  # one pass rules most cuts out
                tried.append(f"reference on the prompt cut to its {side} {limit} tokens: first token differs")
                continue
            replay = greedy_decode(target, list(cut), max_new_tokens, eos)[0]
            same = replay[:len(output)] == output and len(output) > min(position, len(replay) - 1)
            if same and not _same_logits(target, cut, output, engine_logits):
                tried.append(f"reference on the prompt cut to its {side} {limit} tokens: the tokens agree, the "
                             "engine's float64 logits do not (a coincidence)")
                continue
            tried.append(f"reference on the prompt cut to its {side} {limit} tokens: "
                         f"{'reproduces the engine' if same else 'differs'}")
            if same:
                return Cause("prompt_truncated",
                             f"the prompt has {n} tokens; greedy decoding of its {side} {limit} tokens alone gives "
                             f"exactly the engine's {len(output)} tokens (the full prompt gives another output from "
                             f"new token {position}): the engine cut the prompt to {limit} tokens",
                             f"a reference replay on the prompt cut to {limit} tokens", f"prompts cut to {limit} tokens")
    return None


@torch.no_grad()
def masked_decode(target: Any, prompt: list[int], steps: int, pad: int, eos: int | None) -> list[int] | None:
    """Greedy decoding with every pad-id token (prompt and new) left out of the context, positions
    counting only the tokens kept; None when nothing of the prompt is left."""
    context = [t for t in prompt if t != pad]
    if not context:
        return None
    out: list[int] = []
    for _ in range(steps):
        ids = torch.tensor([context], dtype=torch.long, device=target.device)
        token = int(target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].argmax())
        out.append(token)
        if token != pad:
            context.append(token)
        if token in eos_ids(eos):
            break
    return out


@dataclass
class PadEvidence:
    in_prompt: list[int]  # prompt positions holding the pad id
    in_output: list[int]  # new tokens (of the engine's output, up to the divergence) equal to the pad id
    pad_is_eos: bool
    others: tuple[int, int] | None  # (exact, total) over the run's rows without any pad id

    @property
    def any(self) -> bool:
        return bool(self.in_prompt or self.in_output or self.pad_is_eos)

    def where(self) -> str:
        parts = []
        if self.in_prompt:
            parts.append(f"prompt position(s) {self.in_prompt[:4]}")
        if self.in_output:
            parts.append(f"new token(s) {self.in_output[:4]}")
        return ", ".join(parts)

    def others_text(self) -> str:
        if not self.others or not self.others[1]:
            return ""
        exact, total = self.others
        return f"; the rows without a pad id: {exact} of {total} exact"


def pad_evidence(index: int, prompts: list[list[int]], references: list[list[int]], outputs: list[list[int]],
                 position: int, pad: int | None, eos: int | None) -> PadEvidence | None:
    if pad is None:
        return None
    prompt, output = prompts[index], outputs[index]
    clean = [i for i in range(len(prompts)) if pad not in prompts[i] and pad not in references[i]]
    others = (sum(outputs[i] == references[i] for i in clean), len(clean)) if clean else None
    return PadEvidence([i for i, t in enumerate(prompt) if t == pad],
                       [j for j, t in enumerate(output[:position + 1]) if t == pad],
                       pad in eos_ids(eos), others)


def slice_shift(prompt: list[int], reference: list[int], output: list[int], pad: int,
                evidence: PadEvidence) -> Cause | None:
    """The engine's output is the prompt's last s tokens and then the reference, s at most the count
    of pad ids in the prompt (those before the first other token are taken for left padding): the
    output slice starts at the count of non-pad prompt tokens."""
    count = len(evidence.in_prompt)
    for s in range(count, 0, -1):  # a leading pad id is skipped as left padding, so the shift can be smaller
        if len(output) < s or output[:s] != prompt[len(prompt) - s:]:
            continue
        if len(output) == s:  # nothing but prompt tokens: no new token, and the slice still started early
            return Cause("pad_as_content", f"the prompt holds the pad id {pad} {count} time(s) ({evidence.where()}); "
                         f"the engine's whole output is the prompt's last {s} token(s) {output}: its output slice "
                         "starts at the count of non-pad prompt tokens, found by pad-id equality",
                         "the output slice against the prompt", "pad-id tokens treated as padding")
        if _agrees(output[s:], reference):
            return Cause("pad_as_content", f"the prompt holds the pad id {pad} {count} time(s) ({evidence.where()}); "
                         f"the engine's output starts with the prompt's last {s} token(s) {output[:s]} and then is the "
                         "reference: its output slice starts at the count of non-pad prompt tokens, found by pad-id "
                         "equality", "the output slice against the prompt and the reference",
                         "pad-id tokens treated as padding")
    return None


def masked_replay(target: Any, prompt: list[int], reference: list[int], output: list[int], pad: int,
                  max_new_tokens: int, eos: int | None, evidence: PadEvidence, tried: list[str],
                  position: int = 0) -> Cause | None:
    """The engine's output is greedy decoding with the pad-id tokens masked, perhaps shifted by the
    count of pad ids in the prompt (an output slice found by counting non-pad tokens)."""
    if target is None:
        return None
    if not (evidence.in_prompt or pad in reference):
        return masked_along_output(target, prompt, output, position, pad, evidence, tried)
    replay = masked_decode(target, prompt, max_new_tokens + len(evidence.in_prompt), pad, eos)
    if replay is None:
        tried.append("replay with the pad-id tokens masked: nothing of the prompt is left")
        return None
    if replay[:max_new_tokens] == reference:
        tried.append("replay with the pad-id tokens masked: the same as the reference (the pad ids change nothing)")
        return None
    m = len(evidence.in_prompt)
    shifts = [0] + [s for s in range(1, m + 1)]
    for s in shifts:
        # the slice starts s tokens early (the engine's first s tokens are the prompt's last s) or late
        early = output[:s] == prompt[len(prompt) - s:] and _agrees(output[s:], replay)
        late = s > 0 and _agrees(output, replay[s:])
        if s == 0 and _agrees(output, replay) or s and (early or late):
            tried.append("replay with the pad-id tokens masked: reproduces the engine"
                         + (f" with its output slice {s} token(s) {'early' if early else 'late'}" if s else ""))
            slice_text = ""
            if s:
                slice_text = (f"; the engine's output starts {s} token(s) {'before' if early else 'after'} the new "
                              f"tokens, the count of pad ids in the prompt: its output slice is found by pad-id "
                              "equality too")
            return Cause("pad_as_content",
                         f"the pad id {pad} sits in the row as content ({evidence.where() or 'the reference'}); greedy "
                         f"decoding with those tokens masked reproduces the engine's tokens{slice_text}"
                         f"{evidence.others_text()}: the engine tells padding by token value",
                         "a replay with the pad-id tokens masked", "pad-id tokens treated as padding")
    tried.append("replay with the pad-id tokens masked: does not reproduce the engine")
    return masked_along_output(target, prompt, output, position, pad, evidence, tried)




@torch.no_grad()
def _choices(target: Any, context: list[int], keep: list[bool]) -> list[int | None]:
    """The target's greedy choice after every position of `context`, the positions not kept left
    out (positions renumbered over the kept ones); None after a position left out."""
    kept = [t for t, k in zip(context, keep) if k]
    if not kept:
        return [None] * len(context)
    ids = torch.tensor([kept], dtype=torch.long, device=target.device)
    chosen = target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].argmax(-1).tolist()
    out: list[int | None] = []
    j = -1
    for k in keep:
        j += int(k)
        out.append(int(chosen[j]) if k and j >= 0 else None)
    return out


def masked_along_output(target: Any, prompt: list[int], output: list[int], position: int, pad: int,
                        evidence: PadEvidence, tried: list[str]) -> Cause | None:
    """Along the engine's own output (teacher-forced), the target with the pad-id tokens left out
    chooses the engine's token at the divergence, where the plain target does not, and agrees with
    the engine on most new tokens after it. A free-running masked replay can miss this when the
    engine saw a generated pad id unmasked in the pass that produced it and masked it afterwards."""
    pads_before = [j for j in evidence.in_output if j < position]
    if target is None or position >= len(output) or not (evidence.in_prompt or pads_before):
        return None
    end = min(len(output), position + MASKED_WINDOW)
    context = prompt + output[:end - 1]
    masked = _choices(target, context, [t != pad for t in context])
    plain = _choices(target, context, [True] * len(context))
    base = len(prompt) - 1  # the choice after context position base + q is new token q
    window = range(position, end)
    masked_agree = sum(masked[base + q] == output[q] for q in window)
    plain_agree = sum(plain[base + q] == output[q] for q in window)
    decisive = masked[base + position] == output[position] != plain[base + position]
    tried.append(f"replay along the engine's output with the pad-id tokens masked: new token {position} "
                 f"{'is' if masked[base + position] == output[position] else 'is not'} the engine's; new tokens "
                 f"{position} to {end - 1}: masked {masked_agree} of {len(window)} agree, plain {plain_agree}")
    if not decisive or masked_agree < MASKED_REPLAY_AGREEMENT * len(window) or masked_agree <= plain_agree:
        return None
    return Cause("pad_as_content",
                 f"the pad id {pad} sits in the row as content ({evidence.where()}); along the engine's own output, "
                 f"the target with those tokens masked chooses the engine's token {output[position]} at new token "
                 f"{position} (the plain target chooses {plain[base + position]}) and agrees with the engine on "
                 f"{masked_agree} of {len(window)} new tokens from there (plain: {plain_agree})"
                 f"{evidence.others_text()}: the engine tells padding by token value",
                 "a replay along the engine's output with the pad-id tokens masked", "pad-id tokens treated as padding")


def note_shared_mechanisms(divergences: Sequence[Divergence]) -> list[Divergence]:
    """`divergences`, each diagnosis whose mechanism explains more than one divergence of the run saying so
    (`shared`, and a sentence of its evidence)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for at, divergence in enumerate(divergences):
        found = divergence.diagnosis
        if found and found.mechanism:
            groups.setdefault((found.cls, found.mechanism), []).append(at)
    noted = list(divergences)
    for (cls, mechanism), members in groups.items():
        if len(members) > 1:
            for at in members:
                found = noted[at].diagnosis
                assert found  # grouped above
                noted[at] = replace(noted[at], diagnosis=replace(found, shared=len(members), evidence=(
                    f"{found.evidence} One mechanism: {mechanism} explains {len(members)} divergences of this run "
                    f"(all `{cls}`).")))
    return noted
