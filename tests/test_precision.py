"""The one ruler (`equivalence/rulings/ruler.py`): what each control decides in float64 and below it, with
and without a black-box engine's band, on models whose logits are set by hand (each position's logits
depend on the token there alone)."""

from __future__ import annotations

import pytest
import torch

from specaudit.equivalence.rulings import NoiseBand, Ruler, dtype_noise
from table_models import TableModel

pytestmark = pytest.mark.precision  # what it sees rounds below float64: run under other kernels too

V = 6


def ruler(exact: dict[int, list[float]], low: dict[int, list[float]] | None = None) -> Ruler:
    return Ruler("bfloat16", TableModel(low or exact, torch.bfloat16, V), TableModel(exact, torch.float64, V))


NOISE = dtype_noise("bfloat16", 4.0)  # 0.25 at a top logit of 4


def test_an_engine_token_far_below_the_top_is_structural_with_every_control_in_the_evidence() -> None:
    exact = {0: [4.0, 1.0, 0.0, 0, 0, 0], 1: [0, 4.0, 0, 0, 0, 0]}
    kind, evidence = ruler(exact).rule([1], [1, 1], [1, 2], 1)
    assert kind == "structural" and evidence["decided_by"] == "float64-replay"
    assert evidence["replay_float64_gaps"]["engine"] == 4.0 and evidence["measured_band"] == NOISE
    assert evidence["replay_same_dtype_gaps"]["engine"] == 4.0


def test_a_near_tie_within_the_dtype_noise_is_numerical() -> None:
    exact = {1: [0, 4.0, 4.0 - NOISE / 2, 0, 0, 0]}
    kind, evidence = ruler(exact).rule([1], [1, 1], [1, 2], 1)
    assert kind == "numerical" and evidence["decided_by"] == "float64-replay"


def test_the_band_widens_to_the_references_own_departure_on_the_prompt() -> None:
    """The reference (a computation in the audit dtype) chose token 1 after token 3, 0.6 below the float64
    top: a correct decoder in this precision strays 0.6 on this prompt, so an engine token 0.5 below the
    top later on is numerical; without that departure the same flip is structural."""
    exact = {3: [0, 3.4, 4.0, 0, 0, 0], 1: [0, 4.0, 3.5, 0, 0, 0]}
    kind, evidence = ruler(exact).rule([3], [1, 1], [1, 2], 1)
    assert kind == "numerical" and evidence["decided_by"] == "float64-replay"
    assert abs(evidence["reference_departure"] - 0.6) < 1e-9 and evidence["measured_band"] > NOISE
    kind, evidence = ruler(exact).rule([1], [1, 1], [1, 2], 1)
    assert kind == "structural" and evidence["reference_departure"] == 0.0


def test_a_same_dtype_replay_that_chooses_the_engine_token_makes_it_numerical() -> None:
    exact = {1: [0, 4.0, 3.4, 0, 0, 0]}  # 0.6 apart in float64
    low = {1: [0, 3.9, 4.0, 0, 0, 0]}  # the low-precision computation prefers token 2
    kind, evidence = ruler(exact, low).rule([1], [1, 1], [1, 2], 1)
    assert kind == "numerical" and evidence["decided_by"] == "same-dtype-replay"
    kind, _ = ruler(exact).rule([1], [1, 1], [1, 2], 1)  # without it: structural
    assert kind == "structural"


def test_a_length_mismatch_is_structural() -> None:
    kind, evidence = ruler({1: [0, 4.0, 0, 0, 0, 0]}).rule([1], [1, 1], [1], 1)
    assert kind == "structural" and evidence["decided_by"] == "length"


def test_a_rerun_is_equivalent_when_exact_or_its_flip_is_numerical() -> None:
    exact = {1: [0, 4.0, 4.0 - NOISE / 2, 0, 0, 0], 2: [0, 4.0, 0, 0, 0, 0]}
    judge = ruler(exact)
    assert judge.equivalent([1], [1, 1], [1, 1])
    assert judge.equivalent([1], [1, 1], [1, 2])
    assert not judge.equivalent([2], [1, 1], [1, 3])


def test_in_float64_every_mismatch_is_structural_even_a_tie() -> None:
    """float64 without a band: a tie in the float64 logits is still a bug (decided by `float64`), and a
    re-run is equivalent only when exact; a length mismatch is decided by `length`."""
    tie = {1: [0, 4.0, 4.0, 0, 0, 0]}
    exact = Ruler("float64", TableModel(tie, torch.float64, V), TableModel(tie, torch.float64, V))
    kind, evidence = exact.rule([1], [1, 1], [1, 2], 1)
    assert kind == "structural" and evidence["decided_by"] == "float64"
    assert evidence["replay_float64_margin"] == 0.0
    assert exact.rule([1], [1, 1], [1], 1)[1]["decided_by"] == "length"
    assert exact.equivalent([1], [1, 1], [1, 1]) and not exact.equivalent([1], [1, 1], [1, 2])


def test_a_black_box_band_rules_a_float64_audit_against_the_band() -> None:
    """A black-box engine's declared band makes a float64 audit measure precision: a flip inside the band
    is numerical, one beyond it structural."""
    table = {1: [0, 4.0, 3.9, 1.0, 0, 0]}
    model = TableModel(table, torch.float64, V)
    band = NoiseBand("declared-tolerance", "declared", tolerance=0.5)
    assert Ruler("float64", model, model, band).rule([1], [1, 1], [1, 2], 1)[0] == "numerical"
    assert Ruler("float64", model, model, band).rule([1], [1, 1], [1, 3], 1)[0] == "structural"
