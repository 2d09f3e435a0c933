"""The plugin's acceptance gate: `--specaudit-require-acceptance R` adds one test per (engine, pair, batch
size) that runs the engine on the built-in prompts in float64 and fails when its observed acceptance is
below R x what its proposer reaches along the outputs at some draft position, significantly (Holm,
alpha 0.01): the same record and finding as `specaudit audit --require-acceptance R`
(equivalence/acceptance/), so a merge fails on a proposer that silently stopped paying.
"""

from __future__ import annotations

from typing import Any

from specaudit.engines.registry import make_engine
from specaudit.equivalence.acceptance.findings import headline, short_of_required
from specaudit.equivalence.acceptance.run import acceptance_of_run

PROMPTS = 8  # the first built-in prompts
DRAFT_TOKENS = 4


class AcceptanceShort(AssertionError):
    """The engine's acceptance is short of the required ratio of the expected."""


def check_ratio(value: float | None) -> None:
    """ValueError with one line unless 0 < R <= 1 (or not given)."""
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"--specaudit-require-acceptance {value:g}: give a ratio 0 < R <= 1")


def run_acceptance(engine_name: str, pair_name: str, batch_size: int, required: float, *,
                   max_new_tokens: int) -> dict[str, Any]:
    """The engine's acceptance record on the first built-in prompts; raises `AcceptanceShort` when it fails
    the gate."""
    from specaudit.testing import models

    pair = models.pair(pair_name)
    prompts = [list(p) for p in models.prompts()[:PROMPTS]]
    engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=DRAFT_TOKENS,
                         pad_token_id=pair.pad_token_id)
    outputs = engine.generate(prompts, max_new_tokens, pair.eos_token_id)
    trace = getattr(engine, "last_trace", None)
    record = acceptance_of_run(engine, trace, None, target=pair.target, draft=pair.draft, prompts=prompts,
                               outputs=outputs, failed=set(), dtype="float64", k=DRAFT_TOKENS, required=required,
                               engine_name=engine_name, pair_name=pair_name, batch_size=batch_size)
    if short_of_required(record):
        raise AcceptanceShort(f"{engine_name} on {pair_name}, batch size {batch_size}: acceptance below "
                              f"{required:g} x expected: {headline(record)}")
    if record.get("expected") is None:
        raise AcceptanceShort(f"{engine_name} on {pair_name}, batch size {batch_size}: no expected acceptance "
                              f"({record.get('unavailable')}), so the gate cannot pass")
    return record
