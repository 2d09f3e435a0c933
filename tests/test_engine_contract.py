"""The engine contract: `generate` is all an engine must have (the `Engine` protocol); each optional
capability is declared once in `Capabilities` with its default, and read with it where an engine lacks it."""

from __future__ import annotations

import pytest

from specaudit.engines.contract import DEFAULTS, Capabilities, Engine, capability, declares
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.models import zoo
from specaudit.equivalence.guard import GuardedEngine


class Bare:
    """An engine written elsewhere: `generate` and nothing else."""

    def generate(self, prompts, max_new_tokens, eos_token_id):
        return [[] for _ in prompts]


class Counting(Capabilities):
    """An engine that derives from `Capabilities` and keeps speculation counters of its own."""

    def __init__(self) -> None:
        self.last_speculation = {"drafted_tokens": 3}

    def generate(self, prompts, max_new_tokens, eos_token_id):
        return [[] for _ in prompts]


def test_a_bare_engine_is_an_engine_and_reads_every_default() -> None:
    bare = Bare()
    assert isinstance(bare, Engine) and not isinstance(object(), Engine)
    for name, default in DEFAULTS.items():
        assert capability(bare, name) == default
        assert not declares(bare, name)


def test_an_inherited_default_is_not_declared_but_an_own_value_is() -> None:
    engine = Counting()
    # set in __init__: its own counters
    assert declares(engine, "last_speculation") and capability(engine, "last_speculation") == {"drafted_tokens": 3}
    assert not declares(engine, "black_box") and capability(engine, "black_box") is False
    with pytest.raises(KeyError):
        declares(engine, "no_such_capability")


def test_the_projects_engines_declare_what_the_audit_sets_and_the_guard_hands_it_on() -> None:
    pair = zoo.load_pair("tiny-llama")
    engine = EQSpec(pair.target, pair.draft, batch_size=2)
    assert declares(engine, "record_logits") and declares(engine, "proposals_from_draft_model")
    guarded = GuardedEngine(engine, timeout=None, vocab_size=None)
    assert declares(guarded, "record_logits") and capability(guarded, "proposals_from_draft_model") is True
    guarded.record_logits = True
    assert engine.record_logits is True
