"""The property search's seed: chosen once per run, printed, and replayable.

Order: `--specaudit-seed N`; else the `SPECAUDIT_SEED` environment variable; else `CI_SEED` when the `CI`
environment variable is set (a merge gate draws the same examples on every run of the same code); else a
fresh random seed. Every (engine, pair, batch size) search of the run uses it (`hypothesis.seed`), so the
same seed draws the same examples, and a failure's replay command repeats its search exactly.
"""

from __future__ import annotations

import os
import random
import shlex
from dataclasses import dataclass
from typing import Any

import pytest

CI_SEED = 0


@dataclass(frozen=True)
class Seed:
    value: int
    source: str  # where it came from, in words


SEED = pytest.StashKey[Seed]()

# the options that change what the search draws, with their defaults (the plugin's own)
SEARCH_OPTIONS = {"specaudit_max_examples": ("--specaudit-max-examples", 25),
                  "specaudit_max_new_tokens": ("--specaudit-max-new-tokens", 16),
                  "specaudit_max_draft_tokens": ("--specaudit-max-draft-tokens", 8),
                  "specaudit_max_prompt_length": ("--specaudit-max-prompt-length", 32)}


def search_seed(option: int | None, environ: dict[str, str] | None = None) -> Seed:
    env = os.environ if environ is None else environ
    if option is not None:
        return Seed(option, "--specaudit-seed")
    if env.get("SPECAUDIT_SEED"):
        try:
            return Seed(int(env["SPECAUDIT_SEED"]), "SPECAUDIT_SEED")
        except ValueError:
            raise pytest.UsageError(f"SPECAUDIT_SEED={env['SPECAUDIT_SEED']!r} is not an integer") from None
    if env.get("CI"):
        return Seed(CI_SEED, "the fixed seed of CI runs (CI is set)")
    return Seed(random.SystemRandom().randrange(2**32), "drawn at random for this run")


def replay_command(config: Any, engine: str, pair: str, batch_size: int, seed: int) -> str:
    """`pytest -k specaudit --specaudit-engine E --specaudit-pair P --specaudit-batch-size B --specaudit-seed N`,
    with the run's own values of the options that change what is drawn."""
    words = ["pytest", "-k", "specaudit", "--specaudit-engine", engine, "--specaudit-pair", pair,
             "--specaudit-batch-size", str(batch_size), "--specaudit-seed", str(seed)]
    for name, (flag, default) in SEARCH_OPTIONS.items():
        value = config.getoption(name)
        if value != default:
            words += [flag, str(value)]
    if config.getoption("specaudit_no_adversarial"):
        words.append("--specaudit-no-adversarial")
    return shlex.join(words)
