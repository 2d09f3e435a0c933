"""The sampled audit's statistics: p-values, the randomized PIT, Holm, and power that is computed
and then confirmed by simulation."""

from __future__ import annotations

import math

import torch

from specaudit.equivalence.sampling import stats

F64 = torch.float64


def test_chi_square_survival_matches_its_closed_form_at_two_degrees() -> None:
    for x in (0.5, 3.0, 9.21):
        assert abs(stats.chi_square_survival(x, 2) - math.exp(-x / 2)) < 1e-12
    assert abs(stats.chi_square_critical(2, 0.01) - (-2 * math.log(0.01))) < 1e-9
    # noncentrality 0 is the central distribution
    assert abs(stats.noncentral_chi_square_survival(5.0, 3, 0.0) - stats.chi_square_survival(5.0, 3)) < 1e-12


def test_randomized_pit_is_uniform_under_the_target_and_not_under_another() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2000, 6, generator=gen, dtype=F64), -1)  # [n, V]
    tokens = torch.multinomial(p, 1, generator=gen)[:, 0]
    u = stats.randomized_pit(p, tokens, torch.rand(2000, generator=gen, dtype=F64))
    assert stats.ks_uniform(u)["p_value"] > 1e-3
    sharper = torch.softmax(2 * p.log(), -1)  # the same contexts at temperature 0.5
    drawn = torch.multinomial(sharper, 1, generator=gen)[:, 0]
    u_sharp = stats.randomized_pit(p, drawn, torch.rand(2000, generator=gen, dtype=F64))
    assert stats.ks_uniform(u_sharp)["p_value"] < 1e-6 and float(u_sharp.mean()) < 0.5


def test_a_token_of_probability_zero_has_no_pit_value() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0]], dtype=F64)
    assert torch.isnan(stats.randomized_pit(p, torch.tensor([2]), torch.tensor([0.3], dtype=F64))).all()


def test_holm() -> None:
    assert stats.holm([0.01, 0.04, 0.03]) == [0.03, 0.06, 0.06]


def test_detectable_tv_has_the_power_it_claims() -> None:
    """At the computed smallest TV, a chi-square test on a departure of that TV rejects in about 80% of
    simulated runs (and at half of it, far less often)."""
    n, bins, alpha = 400, 4, 0.01
    d = stats.detectable_tv(n, bins - 1, alpha)
    gen = torch.Generator().manual_seed(1)

    def rejection_rate(tv: float) -> float:
        # mass tv moved from bins {0, 1} to bins {2, 3}: the least detectable direction
        q = torch.tensor([0.25 - tv / 2, 0.25 - tv / 2, 0.25 + tv / 2, 0.25 + tv / 2], dtype=F64)
        runs = 600
        draws = torch.multinomial(q.expand(runs, -1), n, replacement=True, generator=gen)
        rejected = 0
        for row in draws:
            counts = torch.bincount(row, minlength=bins).to(F64)
            rejected += stats.chi_square_counts(counts, torch.full((bins,), 0.25, dtype=F64))["p_value"] < alpha
        return rejected / runs

    assert 0.7 < rejection_rate(d) < 0.9
    assert rejection_rate(d / 2) < 0.3
    assert abs(stats.detectable_tv(4 * n, bins - 1, alpha) - d / 2) < 0.1 * d  # N grows as 1 / TV^2
