"""Sampling inside the project's engines (EQSPEC, EXSPEC, INPLACE, batched, the reference): the exact
distribution of the engines' own step (drafter's draw and `acceptance.accept` with the rows' sampler)
equals the target's; each engine passes the sampled audit and keeps the seed's promises; a fault
planted in the shared acceptance rule makes EQSPEC's audit fail; greedy requests stay greedy.

Cost (2 loaded cores): the exact check about 10 s; the engines' audits about 5-15 s each on the tiny pair."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings

from specaudit import read_report
from specaudit.cli import main
from specaudit.engines import acceptance
from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.registry import make_engine as make_project_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.rows import RowRequests
from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.engines.sampling.rules import SpeculativeRule
from specaudit.equivalence.sampling.exact import departure, outcomes_of
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.sampling import SAMPLING_FAULTS
from specaudit.testing.sampling_strategies import SamplingCase, sampling_cases

EXACT = 1e-6
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PARAMS = SamplingParams(temperature=0.7, top_k=8)
NEW_TOKENS, K = 4, 2  # the prefill's token, then one full step of k + 1 (offset k: its bonus token)


def engine_step_outcomes(case: SamplingCase, *, deterministic_drafter: bool = False,
                         rule: SpeculativeRule | None = None) -> dict[tuple[int, ...], float]:
    """Every outcome of one step of the engines' sampled path on one row: the request's `RowRequests`
    (as EQSPEC, EXSPEC and INPLACE build it), its pass sampler drawing the drafts as `ModelDrafter` and
    `InplaceDrafter` do (or a deterministic proposal: the draft's argmax, q one-hot), then
    `acceptance.accept` with the processed target logits and the draft logits."""
    params = case.params
    request = RequestParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=0)
    k = case.k

    def run(draws) -> list[int]:
        requests = RowRequests([[0]], [request], eos_token_id=None, rule=rule)
        if requests.rows[0].sampling is not None:
            requests.rows[0].sampling.draws = draws  # the scripted stream walks every branch
        step = requests.step([0])
        if deterministic_drafter or step.sampler is None:
            drafts = case.draft_logits[:k].argmax(-1)  # [k]
            draft_logits = None
        else:
            drafts = torch.stack([step.sampler.draft_tokens(case.draft_logits[j:j + 1])[0] for j in range(k)])  # [k]
            draft_logits = case.draft_logits[None, :k]  # [1, k, V]
        verdict = acceptance.accept(case.target_logits[None], drafts[None], k + 1, None, requests=step,
                                    draft_logits=draft_logits)
        return verdict.tokens[0, : int(verdict.emitted[0])].tolist()

    return outcomes_of(run)


def engine_departure(case: SamplingCase, **kwargs) -> float:
    outcomes = engine_step_outcomes(case, **kwargs)
    assert abs(sum(outcomes.values()) - 1.0) < 1e-9
    return departure(outcomes, process_logits(case.target_logits, case.params)).total_variation


@FAST
@given(case=sampling_cases())
def test_the_engines_sampled_step_is_exact(case: SamplingCase) -> None:
    assert engine_departure(case) < EXACT


@FAST
@given(case=sampling_cases())
def test_a_deterministic_drafter_is_exact_with_one_hot_q(case: SamplingCase) -> None:
    assert engine_departure(case, deterministic_drafter=True) < EXACT


def test_a_fault_planted_in_the_acceptance_rule_is_seen_by_the_exact_check() -> None:
    """The uniform stuck at 0, through the same path: accepted drafts follow q, not p."""
    target = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]], dtype=torch.float64)
    draft = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    case = SamplingCase(target, draft, SamplingParams(temperature=1.0))
    assert engine_departure(case) < EXACT
    assert engine_departure(case, rule=SAMPLING_FAULTS["uniform_stuck_at_zero"]()) > 0.1


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny-llama")


def _audit(engine, pair, samples: int, seed: int, params: SamplingParams = PARAMS, **kwargs):
    return sampled_audit(engine, pair.target, builtin_prompts()[:1], params, samples=samples, max_new_tokens=NEW_TOKENS,
                         eos_token_id=pair.eos_token_id, seed=seed, draft=pair.draft, **kwargs)


@pytest.mark.parametrize("name", ["eqspec", "exspec", "inplace", "fixedshape"])
def test_each_engine_passes_the_sampled_audit_and_keeps_the_seed(pair, name: str) -> None:
    engine = make_project_engine(name, pair.target, pair.draft, sampling=PARAMS, seed=5, draft_tokens=K, batch_size=64)
    report = _audit(engine, pair, 300, seed=5)
    assert report["verdict"] == "no departure found", report["worst_test"]
    assert report["seeds"]["same_seed_same_output"] and report["seeds"]["alone_equals_batch"]
    assert any(t["scope"] == f"step offset {K}" for t in report["tests"])  # the bonus tokens, tested apart


# the uniform stuck at 0 (caught by the draft-ordered tests: reports/sampling/README.md; without a cut seeds 1-3
# all caught at 300, p at most 2e-5; at T 0.7 top-k 8 seeds 1-10 all caught at 600, p at most 3e-7); top-k on
# the draft only by tokens outside the target's top-k
@pytest.mark.parametrize("fault, params, samples", [
    ("uniform_stuck_at_zero", SamplingParams(temperature=1.0), 300),
    ("uniform_stuck_at_zero", PARAMS, 600),
    ("top_k_on_draft_only", PARAMS, 100),
])
def test_a_fault_in_the_shared_acceptance_rule_fails_the_audit_of_eqspec(pair, fault: str, params: SamplingParams,
                                                                          samples: int) -> None:
    engine = make_project_engine("eqspec", pair.target, pair.draft, sampling=params, seed=1, draft_tokens=K, batch_size=64,
                         rule=SAMPLING_FAULTS[fault]())
    report = _audit(engine, pair, samples, seed=1, params=params, seed_checks=False)
    assert report["verdict"] == "departure" and report["p_value"] < 0.01, report["worst_test"]


def _sampled(engine, prompts, seeds, new_tokens, eos):
    engine.request_params = [RequestParams(temperature=0.7, top_k=8, seed=s) for s in seeds]
    return engine.generate(prompts, new_tokens, eos)


def test_engines_that_draw_in_the_same_order_give_the_same_tokens(pair) -> None:
    """EQSPEC, EXSPEC and INPLACE draw each row's decisions in the same order (drafts, then verify), and
    batched and the reference one draw per token: with the same seeds they give the same tokens (float64
    logits agree to rounding, far below any draw's resolution). Another seed gives other tokens."""
    prompts, seeds = builtin_prompts()[:3], [11, 12, 13]
    speculative = {name: _sampled(make_project_engine(name, pair.target, pair.draft, batch_size=2, draft_tokens=K),
                                  prompts, seeds, 6, pair.eos_token_id) for name in ("eqspec", "exspec", "inplace")}
    plain = {name: _sampled(make_project_engine(name, pair.target, pair.draft, batch_size=2, draft_tokens=K),
                            prompts, seeds, 6, pair.eos_token_id) for name in ("batched", "reference")}
    assert speculative["eqspec"] == speculative["exspec"] == speculative["inplace"]
    assert plain["batched"] == plain["reference"]
    eqspec = make_project_engine("eqspec", pair.target, pair.draft, batch_size=2, draft_tokens=K)
    assert _sampled(eqspec, prompts, [21, 22, 23], 6, pair.eos_token_id) != speculative["eqspec"]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_on_eqspec(pair) -> None:
    prompts, seeds = builtin_prompts()[:4], [31, 32, 33, 34]
    eqspec = make_project_engine("eqspec", pair.target, pair.draft, batch_size=4, draft_tokens=K)
    together = _sampled(eqspec, prompts, seeds, 6, pair.eos_token_id)
    assert _sampled(eqspec, prompts, seeds, 6, pair.eos_token_id) == together  # same seed, same output
    assert [_sampled(eqspec, [p], [s], 6, pair.eos_token_id)[0] for p, s in zip(prompts, seeds)] == together


def test_greedy_requests_beside_sampled_ones_stay_greedy(pair) -> None:
    """Temperature 0 rows in a pass with sampled rows: the greedy rule, the reference's tokens."""
    prompts = builtin_prompts()[:3]
    eqspec = make_project_engine("eqspec", pair.target, pair.draft, batch_size=3, draft_tokens=K)
    eqspec.request_params = [RequestParams(), RequestParams(temperature=1.0, seed=3), RequestParams()]
    mixed = eqspec.generate(prompts, 8, pair.eos_token_id)
    reference = make_project_engine("reference", pair.target, pair.draft, batch_size=1, draft_tokens=K)
    greedy = reference.generate(prompts, 8, pair.eos_token_id)
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]


def test_a_sampled_request_cuts_min_p_after_its_temperature() -> None:
    """vLLM's order: the tempered probabilities are cut. Logits [0, -1]: at T 0.5 the second token's ratio to
    the top one is e^-2 = 0.135, below min_p 0.2 (cut); before the temperature it would be e^-1 = 0.37 (kept)."""
    from specaudit.engines.requests.sampled import request_table

    params = RequestParams(temperature=0.5, min_p=0.2)
    probs = request_table(torch.tensor([[0.0, -1.0, -9.0]]), [1], [], [], params, ())[0]
    assert probs.tolist() == [1.0, 0.0, 0.0]
    looser = request_table(torch.tensor([[0.0, -1.0, -9.0]]), [1], [], [], RequestParams(temperature=0.5, min_p=0.1), ())[0]
    assert 0 < float(looser[1]) < 0.2 and float(looser[2]) == 0.0


def test_the_command_line_audits_a_sampled_eqspec(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["audit", "--pair", "tiny-llama", "--engine", "eqspec", "--temperature", "0.7", "--top-k", "8",
                 "--samples", "60", "--num-prompts", "1", "--max-new-tokens", "3", "--draft-tokens", "2",
                 "--batch-size", "16", "--seed", "2", "--out", str(out)]) == 0
    report = read_report(out).sampled["eqspec"]
    assert report["seeds"]["checked"] and report["seeds"]["alone_equals_batch"]
    assert any(t["scope"].startswith("ordered by the draft") for t in report["tests"])
    assert "eqspec: no departure found" in capsys.readouterr().out
