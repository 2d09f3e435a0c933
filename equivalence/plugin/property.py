"""What the pytest plugin runs per (engine, pair, batch size): a Hypothesis search for a case that
breaks equivalence with greedy decoding, then the adversarial prompts (`equivalence/adversarial.py`).

A failure carries the diagnosis of its divergence (`equivalence/diagnosis/core.py`) as
`exc.specaudit_diagnosis`, so that the plugin's message starts with it: for a Hypothesis failure,
the audit of the shrunk counterexample; for the adversarial prompts, the audit of those prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from specaudit.engines.registry import BUILTIN_ENGINES, make_engine, resolve
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.records.serialize import as_run, diagnosis_to_json


class AdversarialDivergence(AssertionError):
    """The engine diverges from greedy decoding on the adversarial prompts."""


def audit_case(factory: Callable[..., Any], case: Any, drafter: str) -> tuple[Divergence, ...]:
    """The audit's divergences (diagnosed) for the engine on one decoding case, float64, with the
    drafter the property used; re-runs keep each row's acceptance schedule."""
    from specaudit.engines.drafters import ScriptedDrafter
    from specaudit.equivalence.audit import RunSettings, audit_engine
    from specaudit.equivalence.run_context import wrapped
    from specaudit.testing import models
    from specaudit.testing.properties import DEFAULT_ORACLE, build_engine, resolve_eos, takes_drafter

    pair = models.pair(case.pair, case.dtype)
    eos = resolve_eos(case, pair, DEFAULT_ORACLE)
    scripted = case.schedule is not None and (drafter == "scripted" or (drafter == "auto" and takes_drafter(factory)))

    def engine_for(indices: list[int], pad_token_id: int | None) -> Any:
        prompts = [case.prompts[i].tokens for i in indices]
        scripted_drafter = None
        if scripted:
            reference = [DEFAULT_ORACLE.decode(pair, tuple(p), case.max_new_tokens, eos)[0] for p in prompts]
            scripted_drafter = ScriptedDrafter(reference, lambda row, step: case.schedule(indices[row], step),
                                               int(pair.target.config.vocab_size))
        rerun_case = dataclasses.replace(case, pad_token_id=pad_token_id if pad_token_id is not None else case.pad_token_id)
        return build_engine(factory, rerun_case, pair, scripted_drafter)

    def rerun(indices: list[int], pad_token_id: int | None, around: Any = None) -> list[list[int]]:
        engine = engine_for(indices, pad_token_id)  # its scripted drafter's reference decoding outside `around`
        return wrapped(engine.generate, around)([list(case.prompts[i].tokens) for i in indices],
                                                case.max_new_tokens, eos)

    everyone = list(range(len(case.prompts)))
    record = audit_engine(engine_for(everyone, None), pair, case.prompt_tokens, RunSettings(max_new_tokens=case.max_new_tokens, eos_token_id=eos, dtype=case.dtype, batch_size=case.batch_size, pad_token_id=case.pad_token_id),
                          rerun=rerun)
    return as_run(record).divergences


def first_diagnosis(divergences: Sequence[Divergence]) -> dict[str, Any] | None:
    """The first diagnosed structural divergence's diagnosis as `exc.specaudit_diagnosis` carries it (its
    JSON object, with the divergence's prompt and position), or None."""
    structural = [d for d in divergences if d.structural and d.diagnosis]
    if not structural:
        return None
    first = structural[0]
    return {**diagnosis_to_json(first.diagnosis), "prompt_index": first.prompt_index, "position": first.position}


def run_adversarial(engine: str, pair_name: str, batch_size: int, *, max_new_tokens: int, draft_tokens: int) -> int:
    """Audit the engine on the pair's adversarial prompts (float64); raise `AdversarialDivergence`
    with the diagnosis on a structural divergence. Returns the number of prompts audited."""
    from specaudit.engines.models import zoo
    from specaudit.equivalence.adversarial import pair_adversarial_prompts
    from specaudit.equivalence.audit import RunSettings, audit_engine
    from specaudit.equivalence.run_context import wrapped
    from specaudit.testing import models

    pair = models.pair(pair_name, "float64")
    cases, _ = pair_adversarial_prompts(pair, zoo.builtin_prompts(), eos_token_id=pair.eos_token_id,
                                        max_new_tokens=max_new_tokens, draft_tokens=draft_tokens)
    prompts = [list(case.tokens) for case in cases]

    def build(pad_token_id: int | None = None) -> Any:
        return make_engine(engine, pair.target, pair.draft, batch_size=batch_size, draft_tokens=draft_tokens,
                           pad_token_id=pair.pad_token_id if pad_token_id is None else pad_token_id,
                           record_logits=True)

    def rerun(indices: list[int], pad_token_id: int | None, around: Any = None) -> list[list[int]]:
        return wrapped(build(pad_token_id).generate, around)([prompts[i] for i in indices], max_new_tokens,
                                                             pair.eos_token_id)

    record = audit_engine(build(), pair, prompts, RunSettings(max_new_tokens=max_new_tokens, eos_token_id=pair.eos_token_id, dtype="float64", engine_name=engine, batch_size=batch_size),
                          rerun=rerun)
    structural = as_run(record).structural
    if structural:
        first = structural[0]
        case = cases[first.prompt_index]
        failure = AdversarialDivergence(
            f"{len(structural)} structural divergence(s) on the adversarial prompts; first: prompt "
            f"{first.prompt_index} ({case.case}, {len(case.tokens)} tokens: {case.why}), new token "
            f"{first.position}: reference {first.reference_token}, engine {first.engine_token}")
        failure.specaudit_diagnosis = first_diagnosis(structural)
        raise failure
    return len(prompts)


def run_property(engine: str, pair: str, batch_size: int, *, max_examples: int, max_new_tokens: int,
                 max_draft_tokens: int, max_prompt_length: int = 32, seed: int | None = None) -> None:
    """Raise (with Hypothesis' shrunk counterexample and its diagnosis) when the engine differs
    from greedy decoding. `seed` fixes the examples drawn (`hypothesis.seed`)."""
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

    if seed is not None:
        equivalent_to_greedy = hypothesis_seed(seed)(equivalent_to_greedy)

    # Hypothesis replays the shrunk example last, so the last failing case is the minimal one; it is
    # shown in the plugin's own words, whatever a Hypothesis release calls it.
    failing: list = []
    try:
        equivalent_to_greedy()
    except AssertionError as exc:
        if failing:
            exc.add_note(f"shrunk counterexample: {failing[-1]!r}")
            try:
                exc.specaudit_diagnosis = first_diagnosis(audit_case(factory, failing[-1], drafter))
            except Exception as problem:  # the failure itself must still be reported
                exc.specaudit_diagnosis = {"class": "unknown", "evidence": f"the diagnosis failed: {problem}"}
        raise
