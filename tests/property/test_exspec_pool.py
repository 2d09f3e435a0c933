"""The EXSPEC pool, driven rule by rule beside a plain model of it.

Hypothesis admits requests, steps the pool, and ends requests early, in any order; after every
rule the invariants say that each active sequence's tokens are a prefix of its reference output,
that each sequence's target and draft caches hold exactly its token count minus one positions,
and that no request is lost, duplicated, answered by a step it was not part of, or let into the
window out of turn. After a step, the caches of the sequences it touched are also compared with a
fresh prefill of their tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.drafters import ModelDrafter, ScriptedDrafter
from specaudit.engines.exspec import ExspecPool, Sequence
from specaudit.testing import models
from specaudit.testing.faults.mutation import LineChange, mutant_modules
from specaudit.testing.profiles import examples

PAIRS = ("tiny-llama", "tiny-gpt2", "tiny-opt", "tiny-lfm2", "tiny-bamba")
SHORT_PROMPTS = [i for i, p in enumerate(models.prompts()) if len(p) <= 200]
CACHE_TOLERANCE = 1e-9


def fresh_cache(model, tokens: list[int]) -> torch.Tensor:
    """`[L, 2, H, n, D]`: the keys and values a single-row prefill of `tokens` gives."""
    inputs = torch.tensor([tokens], dtype=torch.long, device=model.device)
    cache, _ = batch_ops.prefill(model, inputs, torch.tensor([len(tokens)], device=model.device))
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in ragged.cache_layers(cache)])


class PoolMachine(RuleBasedStateMachine):
    pool_class = ExspecPool  # a planted-fault copy in `test_the_machine_catches_planted_faults`

    @initialize(
        pair_name=st.sampled_from(PAIRS),
        batch_size=st.integers(1, 4),
        window_factor=st.integers(1, 3),
        k=st.integers(1, 4),
        max_new_tokens=st.integers(1, 10),
        drafter_kind=st.sampled_from(["model", "scripted"]),
        eos_position=st.none() | st.integers(0, 9),
        schedule=st.lists(st.integers(0, 5), min_size=1, max_size=6),
        hold=st.booleans(),
    )
    def start(self, pair_name, batch_size, window_factor, k, max_new_tokens, drafter_kind, eos_position, schedule, hold):
        torch.set_num_threads(1)
        self.pair = models.pair(pair_name)
        self.references, _ = models.reference(pair_name)
        # an EOS that one short prompt's reference emits at `eos_position` (others may emit it too)
        self.eos = None if eos_position is None else self.references[SHORT_PROMPTS[-1]][eos_position]
        self.max_new_tokens = max_new_tokens
        self.scripted_outputs: list[list[int]] = []  # by request id, for the scripted drafter
        if drafter_kind == "scripted":
            drafter = ScriptedDrafter(self.scripted_outputs, lambda p, s: schedule[(p + s) % len(schedule)],
                                      self.pair.target.config.vocab_size)
        else:
            drafter = ModelDrafter(self.pair.draft)
        self.pool = self.pool_class(self.pair.target, drafter, batch_size=batch_size, draft_tokens=k,
                               window_size=window_factor * batch_size, max_new_tokens=max_new_tokens,
                               eos_token_id=self.eos, pad_id=self.pair.pad_token_id, hold=hold)
        self.has_draft_cache = drafter_kind == "model"
        # the model: admission order, prompt of each request, window entries, early ends, answers seen
        self.admitted: list[int] = []
        self.prompt_of: dict[int, int] = {}
        self.entered: list[int] = []
        self.ended_early: set[int] = set()
        self.answered: list[int] = []
        note(f"pair={pair_name} B={batch_size} W={window_factor * batch_size} k={k} "
             f"max_new_tokens={max_new_tokens} eos={self.eos} drafter={drafter_kind} schedule={schedule} hold={hold}")

    def expected(self, request_id: int) -> list[int]:
        tokens = self.references[self.prompt_of[request_id]][: self.max_new_tokens]
        if self.eos is not None and self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        return tokens

    def active(self) -> dict[int, Sequence]:
        return {s.request_id: s for s in self.pool.window}

    @rule(prompt_indices=st.lists(st.sampled_from(SHORT_PROMPTS), min_size=1, max_size=3))
    def admit(self, prompt_indices):
        for index in prompt_indices:
            request_id = self.pool.admit(list(models.prompts()[index]))
            self.scripted_outputs.append(self.references[index])
            assert request_id == len(self.admitted)
            self.admitted.append(request_id)
            self.prompt_of[request_id] = index
        note(f"admit prompts {prompt_indices} as requests {self.admitted[-len(prompt_indices):]}")

    @precondition(lambda self: self.pool.busy)
    @rule()
    def step(self):
        self.run_step()

    @precondition(lambda self: self.pool.busy)
    @rule()
    def step_until_a_row_finishes(self):
        answered = len(self.pool.finished)
        while self.pool.busy and len(self.pool.finished) == answered:
            self.run_step()

    @precondition(lambda self: self.pool.busy)
    @rule(data=st.data())
    def finish_row(self, data):
        candidates = list(self.pool.waiting) + [s.request_id for s in self.pool.window]
        request_id = data.draw(st.sampled_from(candidates), label="request to end")
        was_waiting = request_id in self.pool.waiting
        self.pool.finish(request_id)
        note(f"finish request {request_id} early ({'waiting' if was_waiting else 'active'})")
        self.ended_early.add(request_id)
        self.answered.append(request_id)

    def run_step(self):
        waiting_before = list(self.pool.waiting)
        lengths_before = {r: s.length for r, s in self.active().items()}
        with torch.no_grad():
            record = self.pool.step()
        note(f"step {record.step}: {record.kind} rows={record.rows} accepted={record.accepted_counts} "
             f"emitted={record.emitted_counts}")
        assert 1 <= len(record.rows) <= self.pool.batch_size
        assert len(set(record.rows)) == len(record.rows)
        if record.kind == "prefill":  # the oldest waiting requests, in order
            assert record.rows == waiting_before[: len(record.rows)]
            self.entered.extend(record.rows)
        else:
            assert all(r in lengths_before for r in record.rows)
            row_lengths = {lengths_before[r] for r in record.rows}
            assert (len(row_lengths) == 1) == (record.kind == "group")
        newly_answered = [r for r in self.pool.finished if r not in self.answered]
        assert set(newly_answered) <= set(record.rows)  # answered only by a step it took part in
        self.answered.extend(newly_answered)
        with torch.no_grad():
            for request_id, sequence in self.active().items():
                if request_id in record.rows:
                    self.check_cache_contents(sequence)

    def check_cache_contents(self, sequence: Sequence):
        target_kv, draft_kv = self.pool.caches(sequence)  # its own, or its rows of the held batch
        caches = [(self.pair.target, target_kv)]
        if self.has_draft_cache:
            caches.append((self.pair.draft, draft_kv))
        for model, kv in caches:
            error = float((kv.tensor() - fresh_cache(model, sequence.tokens[:-1])).abs().max())
            assert error < CACHE_TOLERANCE, f"request {sequence.request_id}: cache differs by {error}"

    @invariant()
    def tokens_are_reference_prefixes(self):
        for request_id, sequence in self.active().items():
            prompt = list(models.prompts()[self.prompt_of[request_id]])
            assert sequence.tokens[: sequence.prompt_length] == prompt
            new = sequence.tokens[sequence.prompt_length:]
            expected = self.expected(request_id)
            assert 1 <= len(new) < len(expected) and new == expected[: len(new)], (request_id, new, expected)

    @invariant()
    def caches_hold_all_but_the_last_token(self):
        for sequence in self.pool.window:
            target_kv, draft_kv = self.pool.caches(sequence)
            assert target_kv.width == sequence.length - 1
            if self.has_draft_cache:
                assert draft_kv is not None and draft_kv.width == sequence.length - 1
            else:
                assert draft_kv is None

    @invariant()
    def no_request_lost_duplicated_or_out_of_turn(self):
        waiting = list(self.pool.waiting)
        active = [s.request_id for s in self.pool.window]
        finished = list(self.pool.finished)
        everyone = waiting + active + finished
        assert len(everyone) == len(set(everyone)) == len(self.admitted)
        assert set(everyone) == set(self.admitted)
        assert len(active) <= self.pool.window_size
        # first in, first into the window: the queue is the admission order minus those that left it
        assert waiting == [r for r in self.admitted if r not in self.entered and r not in self.ended_early]
        assert active == [r for r in self.entered if r in active]
        assert finished == self.answered
        for request_id, tokens in self.pool.finished.items():
            expected = self.expected(request_id)
            if request_id in self.ended_early:
                assert tokens == expected[: len(tokens)]
            else:
                assert tokens == expected, (request_id, tokens, expected)


PoolMachine.TestCase.settings = settings(settings(), max_examples=examples(0.6), stateful_step_count=20)
TestExspecPool = PoolMachine.TestCase


# Pool bugs the machine must catch: each is one line of `engines/exspec.py`, changed in a copy.
PLANTED_FAULTS = {
    "refill-takes-newest-first": ("ids = [self.waiting.popleft() for _ in range(count)]",
                                  "ids = [self.waiting.pop() for _ in range(count)]"),
    "group-cache-one-column-short": (
        "ends = [old_lengths[b] + result.record.accepted_counts[b] for b in running]",
        "ends = [old_lengths[b] + result.record.accepted_counts[b] - 1 for b in running]"),
    "group-caches-from-wrong-rows": (
        "self._cut_caches(state, [group[b] for b in running], running, [0] * len(running), ends)",
        "self._cut_caches(state, [group[b] for b in running], list(range(len(running))), [0] * len(running), ends)"),
    "grouped-by-prompt-length": ("same_length = len({s.length for s in group}) == 1",
                                 "same_length = len({s.prompt_length for s in group}) == 1"),
    "ended-waiting-request-lost": ("self.waiting.remove(request_id)\nself.finished[request_id] = []",
                                   "self.waiting.remove(request_id)"),
    "held-batch-taken-for-another-group": (
        "if self._held is not None and held_ids == {id(s) for s in group}:",
        "if self._held is not None:"),
    "joined-rows-before-the-held-ones": ("group = held + newcomers", "group = newcomers + held"),
}


# two cases are rare in the search, so each has a built case below instead: a group whose first row
# finishes while a later one runs on (wrong rows), and rows of one prompt length whose lengths differ
# while they share a window (grouped by prompt length)
SEARCHED_FAULTS = [fault for fault in PLANTED_FAULTS
                   if fault not in ("group-caches-from-wrong-rows", "grouped-by-prompt-length")]


@pytest.mark.parametrize("fault", SEARCHED_FAULTS)
def test_the_machine_catches_planted_faults(fault: str) -> None:
    old, new = PLANTED_FAULTS[fault]
    mutant = mutant_modules(f"exspec_pool_{fault.replace('-', '_')}", (LineChange("specaudit.engines.exspec", old, new),))

    class FaultyPool(PoolMachine):
        pool_class = mutant["specaudit.engines.exspec"].ExspecPool

    search = settings(max_examples=60, stateful_step_count=20, phases=[Phase.generate], derandomize=True,
                      database=None, deadline=None, print_blob=False)
    with pytest.raises((AssertionError, RuntimeError)):
        run_state_machine_as_test(FaultyPool, settings=search)


@pytest.mark.parametrize("planted", [False, True], ids=["correct", "group-caches-from-wrong-rows"])
def test_group_whose_first_row_finishes_keeps_the_other_rows_caches(planted: bool) -> None:
    """Two same-length rows step as one group; the first stops at EOS mid-run, the second goes on.
    The search above rarely meets this case, so it is built here: the correct pool answers both
    exactly, and the planted wrong-rows copy must not."""
    if planted:
        old, new = PLANTED_FAULTS["group-caches-from-wrong-rows"]
        module = mutant_modules("exspec_group_rows", (LineChange("specaudit.engines.exspec", old, new),))["specaudit.engines.exspec"]
    else:
        import specaudit.engines.exspec as module
    pair = models.pair("tiny-llama")
    references, _ = models.reference("tiny-llama")
    first, second = 2, 3  # two 4-byte prompts: equal lengths, so both rows stay in one group
    assert len(models.prompts()[first]) == len(models.prompts()[second])
    # an EOS the first row emits after its second step that the second row never emits early
    eos, stop = next((t, i) for i, t in enumerate(references[first])
                     if i >= 4 and t not in references[second][: i + 8] and t not in references[first][:i])
    expected = [references[first][: stop + 1], references[second][: stop + 8]]
    outputs = [expected[0] + [0] * 16, references[second]]  # what the scripted drafter proposes
    drafter = ScriptedDrafter(outputs, lambda prompt, step: 99, pair.target.config.vocab_size)
    engine = module.EXSpec(pair.target, None, batch_size=2, draft_tokens=2, window_size=2, drafter=drafter,
                           pad_token_id=pair.pad_token_id)
    got = engine.generate([list(models.prompts()[first]), list(models.prompts()[second])], stop + 8, eos)
    assert "group" in engine.last_trace.totals()["step_kinds"]
    if planted:
        assert got != expected
    else:
        assert got == expected


@pytest.mark.parametrize("planted", [False, True], ids=["correct", "grouped-by-prompt-length"])
def test_rows_of_equal_prompt_length_but_unequal_length_are_not_one_group(planted: bool) -> None:
    """Two prompts of one length: the first accepts every draft, the second none, so after one step their
    lengths differ. A pool that groups by prompt length stacks them as if equal; the correct one realigns.
    Built here because the search above rarely keeps both rows in one window long enough."""
    if planted:
        old, new = PLANTED_FAULTS["grouped-by-prompt-length"]
        module = mutant_modules("exspec_prompt_length", (LineChange("specaudit.engines.exspec", old, new),))["specaudit.engines.exspec"]
    else:
        import specaudit.engines.exspec as module
    pair = models.pair("tiny-llama")
    references, _ = models.reference("tiny-llama")
    first, second = 2, 3  # two 4-byte prompts
    assert len(models.prompts()[first]) == len(models.prompts()[second])
    drafter = ScriptedDrafter([references[first], references[second]], lambda prompt, step: 99 if prompt == 0 else 0,
                              pair.target.config.vocab_size)
    engine = module.EXSpec(pair.target, None, batch_size=2, draft_tokens=3, window_size=2, drafter=drafter,
                           pad_token_id=pair.pad_token_id)
    expected = [references[first][:12], references[second][:12]]
    try:
        got = engine.generate([list(models.prompts()[first]), list(models.prompts()[second])], 12, None)
    except (RuntimeError, IndexError, ValueError):
        assert planted, "the correct pool raised"
        return
    if planted:
        assert got != expected
    else:
        assert got == expected
