"""The planted-fault hunts keep their outcome (`property_tests/faults/hunt.py`, `SPECAUDIT_HUNT_MEMO`): a hunt of
the same key replays the kept minimal counterexample instead of searching and shrinking again, a kept case that
no longer breaks the property is searched for again, and the key changes with what the search depends on."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from specaudit.testing import models
from specaudit.testing.faults import FAULTS
from specaudit.testing.faults import hunt as hunts

FAULT = next(f for f in FAULTS if f.slug() == "bonus_token_doubled")
PAIR = "tiny-llama"


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv(models.HUNT_MEMO, str(tmp_path))
    return tmp_path


def counting_checks(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = hunts.check_fault

    def counted(fault, case):
        calls.append(1)
        return original(fault, case)

    monkeypatch.setattr(hunts, "check_fault", counted)
    return calls


def test_a_hunt_of_the_same_key_replays_the_kept_counterexample(memo, monkeypatch) -> None:
    searched = hunts.hunt(FAULT, PAIR)
    assert searched.case is not None and not searched.kept
    (kept,) = memo.glob(f"{FAULT.slug()}-{PAIR}-float64-*.pkl")
    calls = counting_checks(monkeypatch)
    replayed = hunts.hunt(FAULT, PAIR)
    assert replayed.kept and len(calls) == 1  # the replay of the kept case, no search
    assert replayed.case == searched.case and replayed.examples == searched.examples
    assert replayed.detected_by == searched.detected_by and replayed.kinds == searched.kinds == {"structural"}
    assert "kept from an earlier hunt" in replayed.report()


def test_a_kept_case_that_no_longer_breaks_the_property_is_searched_for_again(memo, monkeypatch) -> None:
    searched = hunts.hunt(FAULT, PAIR)
    (kept,) = memo.glob("*.pkl")
    stored = pickle.loads(kept.read_bytes())
    # one new token: the first comes from the prefill, so no speculative step, no bonus to double
    stored["case"] = dataclasses.replace(stored["case"], max_new_tokens=1)
    kept.write_bytes(pickle.dumps(stored))
    calls = counting_checks(monkeypatch)
    again = hunts.hunt(FAULT, PAIR)
    assert not again.kept and len(calls) > 1 and again.case == searched.case


def test_the_key_names_the_fault_the_pair_the_dtype_and_the_source(monkeypatch) -> None:
    other = next(f for f in FAULTS if f.slug() != FAULT.slug())
    key = hunts.hunt_key(FAULT, PAIR, "float64", 300)
    assert key == hunts.hunt_key(FAULT, PAIR, "float64", 300)
    assert len({key, hunts.hunt_key(other, PAIR, "float64", 300), hunts.hunt_key(FAULT, "tiny-gpt2", "float64", 300),
                hunts.hunt_key(FAULT, PAIR, "bfloat16", 300), hunts.hunt_key(FAULT, PAIR, "float64", 50)}) == 5
    monkeypatch.setattr(hunts, "_sources_digest", lambda: "an edited engine")
    assert hunts.hunt_key(FAULT, PAIR, "float64", 300) != key
    # below float64 the CPU's kernels decide near-ties: another set is another hunt; a float64 hunt's kept case is
    # replayed before it stands, so its key leaves them out
    low, exact = hunts.hunt_key(FAULT, PAIR, "bfloat16", 300), hunts.hunt_key(FAULT, PAIR, "float64", 300)
    monkeypatch.setattr(hunts.reference_memo, "cpu_kernels", lambda: "another processor")
    assert hunts.hunt_key(FAULT, PAIR, "bfloat16", 300) != low
    assert hunts.hunt_key(FAULT, PAIR, "float64", 300) == exact
