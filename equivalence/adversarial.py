"""Adversarial prompts: the cases that real batched engines get wrong, added to every audit.

Each prompt says why it is there (`AdversarialPrompt.why`); the report shows it beside any
divergence on that prompt. The set is small on purpose (a handful of prompts, ordered so that at
batch size 4 the identical prompts fill one batch and the very long and very short ones share
the next):

- four identical prompts: rows that accept alike must stay alike; state shared or crossed between
  rows shows as identical rows that differ;
- a prompt longer than 2048 tokens (so past 1024 too), beside a prompt of one token: engines that
  cut prompts at 1024 or 2048 tokens, or overflow a position table, diverge here, and the padding
  of a short row beside a long one is at its widest. Only where the model allows it: the prompt
  plus the new tokens plus one verify pass of k draft tokens must fit its position limit; where it
  does not, a prompt past 1024 stands in, or else one of half that room (the skip is reported);
  one long prompt, not two, because it dominates the audit's time;
- the one-token prompt is the pad id alone; another has the pad id first and inside: a row is
  told apart from padding by its length, never by token value;
- the EOS id inside a prompt: only a generated EOS ends a row;
- the BOS id at the start and inside a prompt: a BOS is content like any other token.

The pad id is the one the engines under audit are given (`--pad-token-id` sets it, so
`--pad-token-id <EOS id>` audits the pad-equals-EOS set-up); EOS is the audit's stop token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from specaudit.engines.limits import eos_ids

LONG_LENGTHS = (2100, 1100)  # past 2048 (and so past 1024); past 1024 where 2048 does not fit
IDENTICAL_COPIES = 4
MIN_TEXT = 4  # tokens of ordinary content around a special id


@dataclass(frozen=True)
class AdversarialPrompt:
    case: str  # short name, e.g. "pad-inside"
    tokens: list[int]
    why: str  # one sentence: what an engine gets wrong on it

    def describe(self) -> dict[str, Any]:
        record = asdict(self)
        record["length"] = len(record.pop("tokens"))
        return record


def position_limit(config: Any) -> int | None:
    """The model's position limit from its config (`max_position_embeddings`, GPT-2's
    `n_positions`), or None when it declares none."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _content(filler: list[int], length: int, avoid: set[int]) -> list[int]:
    """`length` tokens of ordinary content, cycled from `filler`, without the special ids."""
    plain = [t for t in filler if t not in avoid] or [0]
    return [plain[i % len(plain)] for i in range(length)]


def adversarial_prompts(
    filler: list[int],
    *,
    pad_token_id: int | None,
    eos_token_id: int | Sequence[int] | None,
    bos_token_id: int | None,
    max_positions: int | None,
    max_new_tokens: int,
    draft_tokens: int,
) -> tuple[list[AdversarialPrompt], list[str]]:
    """The adversarial prompts for one pair, and a sentence for each case left out and why.

    `filler` is ordinary content in the pair's own tokens (the audit's prompts, concatenated)."""
    ends = eos_ids(eos_token_id)
    specials = {t for t in (pad_token_id, *ends, bos_token_id) if t is not None}
    text = _content(filler, 12, specials)
    prompts: list[AdversarialPrompt] = []
    skipped: list[str] = []

    same = _content(filler[3:] + filler[:3], 6, specials)
    prompts += [AdversarialPrompt("identical", list(same),
                                  f"one of {IDENTICAL_COPIES} identical prompts in a row: rows that accept alike "
                                  "must give identical outputs; a difference is state crossed between rows")
                for _ in range(IDENTICAL_COPIES)]

    # room a row needs beyond its prompt: the new tokens and one verify pass of k draft tokens
    room = max_new_tokens + draft_tokens + 1
    allowed = None if max_positions is None else max_positions - room
    long_prompts: list[AdversarialPrompt] = []
    # one long prompt: the longest case the model allows (a prompt past 2048 is past 1024 too)
    for length in LONG_LENGTHS:
        limit = 2048 if length > 2048 else 1024
        if allowed is not None and length <= allowed and not long_prompts:
            past = "2048 and 1024" if limit == 2048 else "1024"
            long_prompts.append(AdversarialPrompt(
                f"longer-than-{limit}", _content(filler, length, specials),
                f"{length} tokens, past {past}: engines that cut prompts or size position tables at "
                f"{limit} diverge; beside a one-token row it makes the widest padding"))
        elif not long_prompts:
            reason = ("the model declares no position limit" if max_positions is None else
                      f"the model allows {max_positions} positions and this needs {length + room}")
            skipped.append(f"longer-than-{limit} ({length} tokens) left out: {reason}")
    if not long_prompts and allowed is not None and allowed // 2 >= 2 * MIN_TEXT:
        # half the room the model allows: long beside one-token rows, with slack for engines whose
        # positions run ahead (they show as divergences rather than as a crash at the table's end)
        length = allowed // 2
        long_prompts.append(AdversarialPrompt(
            "long", _content(filler, length, specials),
            f"{length} tokens, half of what this model's {max_positions} positions allow here: beside a "
            "one-token row it makes wide padding"))
    short = AdversarialPrompt("length-1", text[:1], "one token: the shortest row, padded the most beside long rows")
    if pad_token_id is not None:  # the one-token row is the pad id itself
        short = AdversarialPrompt(
            "pad-only", [pad_token_id],
            f"the pad id {pad_token_id} as the whole one-token prompt: a row is told from padding by its "
            "length, never by token value; beside long rows it is padded the most")
    else:
        skipped.append("pad-id prompts left out: the pair declares no pad id")
    # ordered so that a batch of 4 holds the long row and the one-token row
    prompts += long_prompts + [short]

    if pad_token_id is not None:
        prompts.append(AdversarialPrompt(
            "pad-inside", [pad_token_id] + text[:MIN_TEXT] + [pad_token_id] + text[MIN_TEXT:2 * MIN_TEXT],
            f"the pad id {pad_token_id} first and inside the prompt: it is content there; an engine that "
            "finds padding by value drops it"))
    if ends:  # every id of the EOS set inside the prompt
        prompts.append(AdversarialPrompt(
            "eos-inside", text[:MIN_TEXT] + list(ends) + text[MIN_TEXT:2 * MIN_TEXT],
            (f"the EOS id {ends[0]}" if len(ends) == 1 else f"the EOS ids {list(ends)}")
            + " inside the prompt: only a generated EOS ends a row"))
    else:
        skipped.append("EOS-id prompt left out: the audit has no EOS")
    if bos_token_id is not None:
        prompts.append(AdversarialPrompt(
            "bos-inside", [bos_token_id] + text[:MIN_TEXT] + [bos_token_id] + text[MIN_TEXT:2 * MIN_TEXT],
            f"the BOS id {bos_token_id} at the start and inside: it is content like any other token"))
    else:
        skipped.append("BOS-id prompt left out: the pair declares no BOS id")
    return prompts, skipped


def pair_adversarial_prompts(pair: Any, base_prompts: list[list[int]], *, eos_token_id: int | Sequence[int] | None,
                             max_new_tokens: int, draft_tokens: int) -> tuple[list[AdversarialPrompt], list[str]]:
    """`adversarial_prompts` for a loaded `ModelPair`, its content drawn from `base_prompts`."""
    filler = [t for p in base_prompts for t in p] or list(range(32))
    bos = getattr(pair.tokenizer, "bos_token_id", None)  # a tokenizer that names one (the byte tokenizer does not)
    if bos is None:
        bos = getattr(pair.target.config, "bos_token_id", None)
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    return adversarial_prompts(
        filler, pad_token_id=pair.pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos,
        max_positions=position_limit(pair.target.config), max_new_tokens=max_new_tokens,
        draft_tokens=draft_tokens)


def declare_pad_token_id(pair: Any, pad_token_id: int) -> None:
    """Make `pad_token_id` the pad id the pair declares: the pair's own and both models' configs
    (and generation configs), so every engine built from the pair sees it."""
    pair.pad_token_id = int(pad_token_id)
    for model in (pair.target, pair.draft):
        if model is None:
            continue
        model.config.pad_token_id = int(pad_token_id)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.pad_token_id = int(pad_token_id)


def with_adversarial_prompts(pair: Any, prompts: list[list[int]], *, eos_token_id: int | Sequence[int] | None,
                             max_new_tokens: int, draft_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """`prompts` followed by the pair's adversarial prompts, and what a run record keeps about them:
    `{"first_index", "cases": [{"prompt_index", "case", "length", "why"}], "skipped": [...]}`."""
    cases, skipped = pair_adversarial_prompts(pair, prompts, eos_token_id=eos_token_id,
                                              max_new_tokens=max_new_tokens, draft_tokens=draft_tokens)
    first = len(prompts)
    described = [{"prompt_index": first + i, **case.describe()} for i, case in enumerate(cases)]
    return list(prompts) + [list(case.tokens) for case in cases], {
        "first_index": first, "cases": described, "skipped": skipped}
