"""Structured outputs under sampling (docs/structured.md#under-sampling): the grammar mask comes first, so every
token is drawn from the masked, renormalized distribution. One speculative step of sampled-spec under a regex is
exact (every emitted token, given the tokens before it, has the masked target's distribution), with the draft
masked or not; a matcher not rolled back or an unmasked bonus departs exactly. The sampled audit passes the
project's engines under each constraint kind (every output satisfies its constraint) and rejects and names each
planted fault; a teacher without the mask rejects a correct engine; the command line takes the constraint with
`--temperature`."""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import audit as cli_audit, runs

from specaudit.engines.constraints import Constraint
from specaudit.engines.constraints.matcher import allowed_after
from specaudit.engines.models import zoo
from specaudit.engines.registry import make_engine
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.sampled import request_table
from specaudit.engines.sampling.engine import SampledRow, SampledSpeculative
from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling.audit import audit_samples
from specaudit.equivalence.sampling.exact import outcomes_of
from specaudit.equivalence.sampling.run import sampled_audit
from specaudit.testing.faults.constrained import EXPECTED_CLASS
from table_models import PositionTableModel

EXACT = 1e-9
FAULTS = "specaudit.testing.faults.constrained"


# --- one step, enumerated -----------------------------------------------------------------------------------

class _Letters:
    """Five tokens: a, b, -, 1 and the stop id 4."""

    def token_bytes(self) -> list[bytes]:
        return [b"a", b"b", b"-", b"1", b""]


LETTERS, STOP, PROMPT = _Letters(), 4, [0]
REGEX = RequestParams(temperature=1.0, constraint=Constraint("regex", "[ab]{1,3}-1"))


class _NotRolledBack(SampledSpeculative):
    def rollback_drafts(self, row, consumed):  # the drafts stay in the grammar state
        return None


class _DraftUnmasked(SampledSpeculative):
    masks_drafts = False


class _BonusUnmasked(SampledSpeculative):
    def verify_masks(self, row, drafts, vocab_size):
        masks = super().verify_masks(row, drafts, vocab_size)
        return masks[:-1] + [torch.ones_like(masks[-1])]


def _step(engine_class: type, target: torch.Tensor, draft: torch.Tensor, output: list[int], k: int = 2):
    engine = engine_class(PositionTableModel(target), PositionTableModel(draft), temperature=1.0, draft_tokens=k)
    engine.request_tokenizer = LETTERS

    def run(draws) -> list[int]:
        return engine.step([SampledRow(list(PROMPT), list(output), REGEX, (STOP,))], [draws])[0]

    return outcomes_of(run)


def _departure(outcomes: dict[tuple[int, ...], float], target: torch.Tensor, output: list[int]) -> float:
    """The largest TV between the step's token given each emitted prefix and the masked target's given it."""
    worst = 0.0
    for j in range(max(len(seq) for seq in outcomes)):
        for prefix in {seq[:j] for seq in outcomes if len(seq) > j}:
            mass = torch.zeros(target.shape[-1], dtype=torch.float64)
            for seq, p in outcomes.items():
                if len(seq) > j and seq[:j] == prefix:
                    mass[seq[j]] += p
            history = output + list(prefix)
            allowed = allowed_after(REGEX.constraint, LETTERS, target.shape[-1], [STOP], history)
            expected = request_table(target[len(PROMPT) - 1 + len(history)].unsqueeze(0), PROMPT, history, [], REGEX,
                                     (STOP,), allowed=[allowed])[0]
            worst = max(worst, 0.5 * float((mass / mass.sum() - expected).abs().sum()))
    return worst


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 5, generator=generator, dtype=torch.float64),
            torch.randn(8, 5, generator=generator, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(3))
def test_a_constrained_speculative_step_is_exact_with_or_without_the_draft_mask(seed: int) -> None:
    target, draft = _tables(seed)
    for output in ([], [0], [0, 1]):  # the masks change along the step: {a, b}, then {a, b, -}, then {-}
        for engine_class in (SampledSpeculative, _DraftUnmasked):
            outcomes = _step(engine_class, target, draft, output)
            assert abs(sum(outcomes.values()) - 1) < EXACT
            assert _departure(outcomes, target, output) < EXACT, (engine_class.__name__, output)
            assert all(token in (0, 1, 2, 3, STOP) for seq in outcomes for token in seq)


def test_a_matcher_not_rolled_back_and_an_unmasked_bonus_depart_exactly() -> None:
    target, draft = _tables(0)
    assert _departure(_step(_NotRolledBack, target, draft, [0]), target, [0]) > 0.05
    assert _departure(_step(_BonusUnmasked, target, draft, [0]), target, [0]) > 0.05


# --- the sampled audit on tiny-llama ------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
KINDS = [Constraint("json_schema", json.dumps(SCHEMA), any_whitespace=False), Constraint("regex", r"[a-f]{2,5}-\d+"),
         Constraint("choice", choices=("alpha", "beta", "gamma")),
         Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"')]
PROMPTS = [list(b"Hello"), list(b"The JSON is"), list(b"x"), list(b"answer: ")]
PARAMS = [RequestParams(temperature=1.0, constraint=c) for c in KINDS]
SAMPLES, NEW_TOKENS, K = 40, 16, 4
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def pair():
    return zoo.load_pair("tiny-llama", dtype="float64")


def _audit(pair, spec: str, seed: int = 5) -> tuple[dict, object]:
    engine = make_engine(spec, pair.target, pair.draft, batch_size=8, draft_tokens=K, sampling=SamplingParams(1.0),
                         seed=seed)
    report = sampled_audit(engine, pair.target, PROMPTS, SamplingParams(1.0), samples=SAMPLES,
                           max_new_tokens=NEW_TOKENS, eos_token_id=pair.eos_token_id, seed=seed, draft=pair.draft,
                           request_params=PARAMS, tokenizer=pair.tokenizer, draft_tokens=K, seed_checks=False)
    return report, engine


def _accepted_drafts(engine) -> int:
    """Draft tokens accepted: each token at step offset 1 or more follows one."""
    return sum(1 for offsets in engine.last_step_offsets for offset in offsets if offset >= 1)


@pytest.fixture(scope="module")
def eqspec_run(pair):
    return _audit(pair, "eqspec")


def test_eqspec_under_every_kind_passes_and_satisfies_its_constraints(eqspec_run) -> None:
    report, _ = eqspec_run
    assert report["verdict"] == "no departure found", report.get("finding")
    found = report["constraints"]
    assert found["constrained_samples"] == SAMPLES and found["violations"] == 0 and found["class"] is None
    assert report["impossible_count"] == 0


@pytest.mark.parametrize("spec", ["sampled-spec", "sampled-reference"])
def test_the_small_sampled_engines_pass_under_a_constraint(pair, spec: str) -> None:
    engine = make_engine(spec, pair.target, pair.draft, batch_size=8, draft_tokens=K, sampling=SamplingParams(1.0),
                         seed=2)
    report = sampled_audit(engine, pair.target, PROMPTS[:2], SamplingParams(1.0), samples=16, max_new_tokens=10,
                           eos_token_id=pair.eos_token_id, seed=2, request_params=PARAMS[:2],
                           tokenizer=pair.tokenizer, draft_tokens=K, seed_checks=False)
    assert report["verdict"] == "no departure found", report.get("finding")
    assert report["constraints"]["violations"] == 0


@pytest.mark.parametrize("fault", sorted(EXPECTED_CLASS))
def test_each_planted_fault_departs_and_is_named(pair, fault: str) -> None:
    report, _ = _audit(pair, f"{FAULTS}:{fault}")
    assert report["verdict"] == "departure"
    found = report["constraints"]
    assert found["violations"] > 0 and found["class"] == EXPECTED_CLASS[fault], found["reason"]
    assert EXPECTED_CLASS[fault] in report["finding"] and "constraint_violation" in report["finding"]


def test_an_unmasked_draft_is_exact_but_accepts_fewer_drafts(pair, eqspec_run) -> None:
    report, engine = _audit(pair, f"{FAULTS}:DraftUnmasked")
    assert report["verdict"] == "no departure found" and report["constraints"]["violations"] == 0
    assert _accepted_drafts(engine) * 3 < _accepted_drafts(eqspec_run[1])


def test_a_teacher_without_the_mask_rejects_a_correct_engine(pair, eqspec_run) -> None:
    """The masked samples against the unmasked target: tokens drawn from the masked distribution are too likely."""
    engine = make_engine("eqspec", pair.target, pair.draft, batch_size=8, draft_tokens=K, sampling=SamplingParams(1.0),
                         seed=5)
    engine.request_params, engine.request_tokenizer = [PARAMS[1]] * 16, pair.tokenizer
    outputs = engine.generate([PROMPTS[1]] * 16, NEW_TOKENS, pair.eos_token_id)
    samples = [(PROMPTS[1], o) for o in outputs]
    masked = audit_samples(pair.target, samples, SamplingParams(1.0), requests=[PARAMS[1]] * 16,
                           stop_ids=(pair.eos_token_id,), tokenizer=pair.tokenizer)
    unmasked = audit_samples(pair.target, samples, SamplingParams(1.0), requests=[RequestParams(temperature=1.0)] * 16,
                             stop_ids=(pair.eos_token_id,))
    assert not masked["departs"] and unmasked["departs"]


def test_the_cli_audits_a_constraint_with_temperature(tmp_path) -> None:
    common = ("--pair", "tiny-llama", "--num-prompts", "2", "--max-new-tokens", "10", "--temperature", "1",
              "--samples", "16", "--regex", "[a-f]{2,5}-[0-9]+", "--batch-size", "8")
    ok = cli_audit(*common, "--engine", "eqspec", out=tmp_path / "ok")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    [record] = runs(tmp_path / "ok")
    assert record["sampled"]["constraints"]["violations"] == 0
    assert record["sampled"]["request_params"][0]["constraint"] == {"kind": "regex", "text": "[a-f]{2,5}-[0-9]+"}
    bad = cli_audit(*common, "--engine", f"{FAULTS}:BonusTokenUnmasked", out=tmp_path / "bad")
    assert bad.returncode == 1
    [record] = runs(tmp_path / "bad")
    assert record["sampled"]["constraints"]["class"] == "constraint_unmasked"
    refused = cli_audit(*common, "--engine", "hf-assisted", out=tmp_path / "no")
    assert refused.returncode == 2 and "engine hf-assisted takes no" in refused.stderr, refused.stderr


def test_the_plugins_sampled_test_takes_a_constraint(pytester) -> None:
    """`--specaudit-request-params` with a constraint: EQSPEC's sampled test runs under it and passes (without the
    pair's tokenizer passed on, the constraint cannot be applied and the test fails)."""
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    plugin = ["-p", "no:cacheprovider", "--specaudit-pair", "tiny-llama", "--specaudit-temperature", "1.0",
              "--specaudit-samples", "40", "--specaudit-seed", "3", "-k", "specaudit-sampled",
              "--specaudit-request-params", json.dumps({"constraint": {"kind": "regex", "text": "[a-f]{2,5}-[0-9]+"}})]
    pytester.runpytest_inprocess("--specaudit-engine", "eqspec", *plugin).assert_outcomes(passed=1)
