"""The property the pytest plugin runs: one Hypothesis search per (engine, pair, batch size)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from specaudit.engines.registry import BUILTIN_ENGINES, resolve


def run_property(engine: str, pair: str, batch_size: int, *, max_examples: int, max_new_tokens: int,
                 max_draft_tokens: int, max_prompt_length: int = 32) -> None:
    """Raise (with Hypothesis' shrunk counterexample) when the engine differs from greedy decoding."""
    from specaudit.testing.properties import check_equivalence
    from specaudit.testing.strategies import decoding_cases

    factory = resolve(engine)
    # a user engine drafts with its own draft model; a built-in one also takes scripted schedules
    drafter = "auto" if engine in BUILTIN_ENGINES else "model"

    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=True, report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=decoding_cases(pairs=[pair], min_batch_size=batch_size, max_batch_size=batch_size,
                               max_new_tokens=max_new_tokens, max_draft_tokens=max_draft_tokens,
                               max_prompts=max(2 * batch_size, 2), max_prompt_length=max_prompt_length))
    def equivalent_to_greedy(case) -> None:
        try:
            check_equivalence(factory, case, drafter=drafter)
        except AssertionError:
            failing.append(case)
            raise

    # Hypothesis replays the shrunk example last, so the last failing case is the minimal one; it is
    # shown in the plugin's own words, whatever a Hypothesis release calls it.
    failing: list = []
    try:
        equivalent_to_greedy()
    except AssertionError as exc:
        if failing:
            exc.add_note(f"shrunk counterexample: {failing[-1]!r}")
        raise
