"""Hypothesis strategies for batched speculative decoding: the hard cases, drawn and shrunk.

Public: import these to property-test any engine (see `specaudit.testing.properties`). Every
strategy takes keyword-only bounds and shrinks toward the small case: one row, length-1 prompts,
k = 1, nothing accepted, no EOS, few new tokens. Everything random comes from Hypothesis draws,
so a failure replays from its seed or its printed blob; torch's global RNG is never touched.

    from hypothesis import given
    from specaudit.testing import strategies as sst
    from specaudit.testing.properties import check_equivalence

    @given(case=sst.decoding_cases(pairs=["tiny-llama"]))
    def test_my_engine(case):
        check_equivalence(my_package.make_engine, case)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hypothesis import strategies as st

BYTE_VOCAB_SIZE = 259  # the built-in pairs: UTF-8 bytes, then <pad>, <bos>, <eos>
MAX_DRAFT_TOKENS = 8
MAX_BATCH_SIZE = 16

PROMPT_SHAPES = ("random", "ones", "equal", "skewed")
SCHEDULE_KINDS = ("none", "all", "alternating", "one_row_full", "random")
# drawn per row and step like "random", with steps where the row proposes nothing (`ScriptedDrafter`'s NO_DRAFT);
# asked for by name (not in SCHEDULE_KINDS): engines then verify fewer than k tokens for some rows
NO_DRAFTS = "no_drafts"
NO_DRAFTS_PARTIAL = "no_drafts_partial"  # the same, never every draft accepted: the steps with nothing to undo have no drafts
NO_DRAFT = -1  # the schedule value of a step with no draft (`specaudit.engines.drafters.NO_DRAFT`)
PROMPT_STYLES = ("synthetic", "builtin", "mixed")


def builtin_pair_names() -> list[str]:
    from specaudit.engines.models import zoo

    return zoo.builtin_pair_names()


def builtin_prompt_pool() -> tuple[tuple[int, ...], ...]:
    from specaudit.testing import models

    return models.prompts()


# --- scalar knobs -------------------------------------------------------------------------


def draft_token_counts(*, min_k: int = 1, max_k: int = MAX_DRAFT_TOKENS) -> st.SearchStrategy[int]:
    """k, the number of draft tokens per step."""
    return st.integers(min_k, max_k)


def batch_sizes(*, min_size: int = 1, max_size: int = MAX_BATCH_SIZE) -> st.SearchStrategy[int]:
    return st.integers(min_size, max_size)


def pool_windows(*, batch_size: int, max_multiple: int = 6) -> st.SearchStrategy[int]:
    """EXSPEC window sizes W: multiples of the batch size B, from B up to `max_multiple` * B."""
    return st.integers(1, max_multiple).map(lambda multiple: multiple * batch_size)


def token_ids(*, vocab_size: int = BYTE_VOCAB_SIZE) -> st.SearchStrategy[int]:
    return st.integers(0, vocab_size - 1)


# --- prompts ------------------------------------------------------------------------------


@st.composite
def prompt_lengths(
    draw: st.DrawFn, *, num_rows: int, min_length: int = 1, max_length: int = 64,
    shapes: Sequence[str] = PROMPT_SHAPES,
) -> list[int]:
    """Per-row prompt lengths of one shape: random, all length 1, all equal, or very skewed
    (each row either `min_length` or `max_length`, both present when there are two rows)."""
    shape = draw(st.sampled_from(list(shapes)))
    if shape == "ones":
        return [min_length] * num_rows
    if shape == "equal":
        return [draw(st.integers(min_length, max_length))] * num_rows
    if shape == "skewed":
        long_rows = draw(st.lists(st.booleans(), min_size=num_rows, max_size=num_rows))
        if num_rows >= 2 and len(set(long_rows)) == 1:
            flip = draw(st.integers(0, num_rows - 1))
            long_rows[flip] = not long_rows[flip]
        elif num_rows == 1:
            long_rows = [True]
        return [max_length if is_long else min_length for is_long in long_rows]
    return draw(st.lists(st.integers(min_length, max_length), min_size=num_rows, max_size=num_rows))


@st.composite
def synthetic_prompts(
    draw: st.DrawFn, *, lengths: Sequence[int], vocab_size: int = BYTE_VOCAB_SIZE,
) -> list[tuple[int, ...]]:
    """Prompts of the given lengths, tokens drawn from the whole vocabulary (specials included)."""
    tokens = token_ids(vocab_size=vocab_size)
    return [tuple(draw(st.lists(tokens, min_size=n, max_size=n))) for n in lengths]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a case: its token ids and where they came from (`builtin[i]` or `synthetic`)."""

    tokens: tuple[int, ...]
    source: str

    def describe(self, shown: int = 10) -> str:
        head = ", ".join(str(t) for t in self.tokens[:shown])
        more = f", ... ({len(self.tokens) - shown} more)" if len(self.tokens) > shown else ""
        return f"{self.source}, length {len(self.tokens)}: [{head}{more}]"


@st.composite
def prompt_sets(
    draw: st.DrawFn, *, num_prompts: int, vocab_size: int = BYTE_VOCAB_SIZE, max_length: int = 64,
    prompt_pool: Sequence[Sequence[int]] | None = None, max_pool_length: int = 1024,
    styles: Sequence[str] = PROMPT_STYLES,
) -> list[Prompt]:
    """`num_prompts` prompts: synthetic (a drawn length shape, random tokens), taken from the
    built-in pool (natural text, lengths 1 to several hundred), or a mix of both per row."""
    pool = builtin_prompt_pool() if prompt_pool is None else tuple(tuple(p) for p in prompt_pool)
    usable = [i for i, p in enumerate(pool) if 0 < len(p) <= max_pool_length]
    style = draw(st.sampled_from([s for s in styles if usable or s == "synthetic"]))
    synthetic: list[tuple[int, ...]] = []
    if style != "builtin":
        lengths = draw(prompt_lengths(num_rows=num_prompts, max_length=max_length))
        synthetic = draw(synthetic_prompts(lengths=lengths, vocab_size=vocab_size))
    prompts = []
    for row in range(num_prompts):
        from_pool = style == "builtin" or (style == "mixed" and draw(st.booleans()))
        if from_pool:
            index = draw(st.sampled_from(usable))
            prompts.append(Prompt(tuple(pool[index]), f"builtin[{index}]"))
        else:
            prompts.append(Prompt(synthetic[row], "synthetic"))
    return prompts


def pad_token_ids(*, prompts: Sequence[Prompt]) -> st.SearchStrategy[int | None]:
    """None (the pair's own pad id) or a token that occurs in the prompts: a pad id that is also
    real content, which an engine must tell apart from padding by row lengths alone."""
    real_tokens = sorted({t for p in prompts for t in p.tokens})
    return st.one_of(st.none(), st.sampled_from(real_tokens)) if real_tokens else st.none()


# --- acceptance schedules -----------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceSchedule:
    """How many draft tokens the drafter gets right, per prompt and per step of that row.

    `rows[p]` is prompt p's cycle of counts, repeated over its steps; a count of k or more means
    everything is accepted. Callable as `ScriptedDrafter`'s `schedule(prompt_index, row_step)`.
    """

    kind: str
    rows: tuple[tuple[int, ...], ...]

    def __call__(self, prompt_index: int, row_step: int) -> int:
        cycle = self.rows[prompt_index % len(self.rows)]
        return cycle[row_step % len(cycle)]

    def describe_row(self, prompt_index: int) -> str:
        counts = self.rows[prompt_index % len(self.rows)]
        return "[" + ", ".join("no draft" if n == NO_DRAFT else str(n) for n in counts) + ", ...]"

    def __repr__(self) -> str:
        return f"AcceptanceSchedule({self.kind!r}, rows={[list(r) for r in self.rows]})"


@st.composite
def acceptance_schedules(
    draw: st.DrawFn, *, num_rows: int, k: int, kinds: Sequence[str] = SCHEDULE_KINDS, max_cycle: int = 4,
) -> AcceptanceSchedule:
    """Per-row acceptance: nothing accepted, everything accepted, alternating all/nothing (rows
    out of phase), one row always full while the others are drawn, or drawn per row and step
    (`NO_DRAFTS`: some steps with no draft at all; `NO_DRAFTS_PARTIAL`: and never every draft accepted)."""
    kind = draw(st.sampled_from(list(kinds)))
    counts = (st.integers(NO_DRAFT, k) if kind == NO_DRAFTS else st.integers(NO_DRAFT, k - 1) if kind == NO_DRAFTS_PARTIAL
              else st.integers(0, k))
    drawn_cycles = st.lists(st.lists(counts, min_size=1, max_size=max_cycle).map(tuple), min_size=num_rows, max_size=num_rows)
    if kind == "none":
        rows = [(0,)] * num_rows
    elif kind == "all":
        rows = [(k,)] * num_rows
    elif kind == "alternating":
        rows = [(0, k) if row % 2 == 0 else (k, 0) for row in range(num_rows)]
    elif kind == "one_row_full":
        rows = draw(drawn_cycles)
        rows[draw(st.integers(0, num_rows - 1))] = (k,)
    else:
        rows = draw(drawn_cycles)
    return AcceptanceSchedule(kind, tuple(tuple(r) for r in rows))


# --- stopping -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EosChoice:
    """EOS is the token that the reference emits for prompt `row` at new-token `position`.

    The tiny models rarely emit their own EOS, so a case names a step instead; the token is
    resolved against the reference decoder's output (`properties.resolve_eos`). Position 0 is
    the token chosen right after the prompt: that row finishes at its very first step.
    """

    row: int
    position: int

    def __repr__(self) -> str:
        return f"EosChoice(row={self.row}, position={self.position})"


def eos_choices(*, num_rows: int, max_new_tokens: int) -> st.SearchStrategy[EosChoice | None]:
    """No EOS, or EOS at any step of any row."""
    choice = st.builds(EosChoice, row=st.integers(0, num_rows - 1), position=st.integers(0, max_new_tokens - 1))
    return st.one_of(st.none(), choice)


# --- whole cases --------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodingCase:
    """One decoding run: a pair, the prompts, k, batch size, acceptance schedule, EOS, budget.

    `schedule` drives a `ScriptedDrafter` for engines that take a drafter; engines that do not
    use their own draft model on the same prompts, and the case still holds. `window` is the
    EXSPEC pool window (a multiple of the batch size) when drawn; engines get it as `window_size`.
    """

    pair: str
    prompts: tuple[Prompt, ...]
    batch_size: int
    draft_tokens: int
    max_new_tokens: int
    schedule: AcceptanceSchedule | None = None
    eos: EosChoice | int | None = None
    pad_token_id: int | None = None
    window: int | None = None
    dtype: str = "float64"

    @property
    def prompt_tokens(self) -> list[list[int]]:
        return [list(p.tokens) for p in self.prompts]

    def describe_row(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        schedule = self.schedule.describe_row(prompt_index) if self.schedule is not None else "model drafter"
        return f"row {prompt_index}: {prompt.describe()}; accepts {schedule}"

    def __repr__(self) -> str:
        head = (
            f"DecodingCase(pair={self.pair!r}, batch_size={self.batch_size}, draft_tokens={self.draft_tokens}, "
            f"max_new_tokens={self.max_new_tokens}, eos={self.eos!r}, pad_token_id={self.pad_token_id}, "
            f"window={self.window}, dtype={self.dtype!r},"
        )
        lengths = [len(p.tokens) for p in self.prompts]
        kind = self.schedule.kind if self.schedule is not None else None
        rows = [f"    {self.describe_row(i)}" for i in range(len(self.prompts))]
        return "\n".join([head, f"  prompt lengths {lengths}, schedule {kind!r}:", *rows, ")"])

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))


@st.composite
def decoding_cases(
    draw: st.DrawFn,
    *,
    pairs: Sequence[str] | None = None,
    vocab_size: int = BYTE_VOCAB_SIZE,
    min_batch_size: int = 1,
    max_batch_size: int = MAX_BATCH_SIZE,
    min_draft_tokens: int = 1,
    max_draft_tokens: int = MAX_DRAFT_TOKENS,
    max_prompts: int = 16,
    min_new_tokens: int = 1,
    max_new_tokens: int = 24,
    max_prompt_length: int = 64,
    prompt_pool: Sequence[Sequence[int]] | None = None,
    max_pool_length: int = 1024,
    prompt_styles: Sequence[str] = PROMPT_STYLES,
    schedule_kinds: Sequence[str] = SCHEDULE_KINDS,
    with_eos: bool = True,
    with_pad_token: bool = True,
    with_window: bool = False,
    dtype: str = "float64",
) -> DecodingCase:
    """A whole decoding case. The number of prompts is drawn from 1 to `max_prompts` (at least
    the batch size drawn, so batches are full unless the last one is partial)."""
    pair = draw(st.sampled_from(list(pairs) if pairs is not None else builtin_pair_names()))
    batch_size = draw(batch_sizes(min_size=min_batch_size, max_size=min(max_batch_size, max_prompts)))
    k = draw(draft_token_counts(min_k=min_draft_tokens, max_k=max_draft_tokens))
    num_prompts = draw(st.integers(batch_size, max(batch_size, max_prompts)))
    prompts = draw(prompt_sets(
        num_prompts=num_prompts, vocab_size=vocab_size, max_length=max_prompt_length,
        prompt_pool=prompt_pool, max_pool_length=max_pool_length, styles=prompt_styles,
    ))
    new_tokens = draw(st.integers(min_new_tokens, max_new_tokens))
    schedule = draw(acceptance_schedules(num_rows=num_prompts, k=k, kinds=schedule_kinds))
    eos = draw(eos_choices(num_rows=num_prompts, max_new_tokens=new_tokens)) if with_eos else None
    pad = draw(pad_token_ids(prompts=prompts)) if with_pad_token else None
    window = draw(pool_windows(batch_size=batch_size)) if with_window else None
    return DecodingCase(
        pair=pair, prompts=tuple(prompts), batch_size=batch_size, draft_tokens=k,
        max_new_tokens=new_tokens, schedule=schedule, eos=eos, pad_token_id=pad, window=window, dtype=dtype,
    )


@st.composite
def first_step_finisher_cases(
    draw: st.DrawFn, *, pairs: Sequence[str] | None = None, min_rows: int = 2, max_rows: int = 8,
    max_new_tokens: int = 24, max_prompt_length: int = 64, max_pool_length: int = 1024,
) -> DecodingCase:
    """One row finishes at its first step (EOS at its position 0, or inside its first accepted
    run with everything accepted) while the other rows run long in the same batch."""
    pair = draw(st.sampled_from(list(pairs) if pairs is not None else builtin_pair_names()))
    num_rows = draw(st.integers(min_rows, max_rows))
    k = draw(draft_token_counts())
    prompts = draw(prompt_sets(num_prompts=num_rows, max_length=max_prompt_length, max_pool_length=max_pool_length))
    finisher = draw(st.integers(0, num_rows - 1))
    schedule = draw(acceptance_schedules(num_rows=num_rows, k=k, kinds=("random",)))
    rows = list(schedule.rows)
    rows[finisher] = (k,)
    position = draw(st.integers(0, k + 1))
    return DecodingCase(
        pair=pair, prompts=tuple(prompts), batch_size=num_rows, draft_tokens=k, max_new_tokens=max_new_tokens,
        schedule=AcceptanceSchedule("first_step_finisher", tuple(rows)), eos=EosChoice(finisher, position),
    )
