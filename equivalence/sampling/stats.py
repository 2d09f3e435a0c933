"""The statistics of the sampled audit, in float64 torch (no other dependency).

- `randomized_pit`: token t drawn from a distribution P becomes u = F(t-) + v P(t), v ~ U[0, 1), with
  the tokens ordered by descending probability (ties by id). u is exactly U[0, 1) when t ~ P; over a
  sequence where each token is drawn from its own conditional P given the tokens before, the u's are
  independent U[0, 1). The order puts likely tokens near 0, so a sampler too sharp (temperature too
  low, argmax, a cut too tight) piles u's near 0 and one too flat near 1, in every context alike.
  The departure of u from uniform in total variation equals TV(Q, P), the sampler's own departure;
  binned u's keep of it only what has the same direction across contexts. Ordering instead by the
  draft's ratio q/p (`draft_ratio_order`; still uniform under P) gives a departure toward the draft
  the same direction in every context, so binning keeps it.
- `chi_square_uniform` (binned u's), `ks_uniform` (Kolmogorov-Smirnov), `chi_square_counts` (tokens
  counted in one context against P, tokens of expected count below 5 merged into one bin).
- `holm`: Holm's step-down correction of a family of p-values (family-wise error at most alpha).
- `detectable_tv`: power. A chi-square test with `df` degrees of freedom on n draws sees a departure
  of TV d between its bins with noncentrality at least 4 n d^2 (the least detectable direction: mass
  d moved between two halves of probability 1/2 each). The smallest d whose power reaches `power` at
  level `alpha` is found by bisection on the noncentral chi-square's survival function.
- Below float64 (`audit.py`'s rounding allowance), a test is held against the largest departure rounding
  can make instead of none: a chi-square test's p-value is the noncentral chi-square's survival at that
  departure's noncentrality (`noncentral_chi_square_survival`), Kolmogorov-Smirnov's is taken at the
  distance less the allowance (`ks_survival`), and the power is computed from the same shifted null
  (`detectable_tv(..., null_noncentrality=)`).
"""

from __future__ import annotations

import math

import torch

from specaudit.equivalence.rulings.thresholds import MIN_EXPECTED_PER_BIN, POWER

F64 = torch.float64


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, jitter: torch.Tensor,
                   order: torch.Tensor | None = None) -> torch.Tensor:
    """probs [n, V], tokens [n], jitter [n] U[0, 1) -> u [n] (NaN where the token has probability 0).
    Tokens are ordered by descending `order` [n, V] (default: `probs`), ties by id. Any order fixed by the
    context before the token is drawn keeps u uniform under `probs`; ordering by a suspected alternative
    Q's ratio Q/P puts every context's departure toward Q at the same end (`draft_ratio_order`)."""
    p_t = probs.gather(-1, tokens[:, None])  # [n, 1]
    key = probs if order is None else order  # [n, V]
    key_t = key.gather(-1, tokens[:, None])  # [n, 1]
    ids = torch.arange(probs.shape[-1])[None, :]  # [1, V]
    before = (key > key_t) | ((key == key_t) & (ids < tokens[:, None]))  # [n, V]
    u = (probs * before).sum(-1) + jitter * p_t[:, 0]
    return torch.where(p_t[:, 0] > 0, u, torch.full_like(u, float("nan")))


def draft_ratio_order(probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """[n, V] the order key q/p (q the draft's processed distribution on the same prefix, p the target's):
    a sampler whose tokens lean toward the draft's (a bonus token from q, drafts accepted too often)
    puts its PIT values near 0 in every context alike. Tokens with p = 0 come last (they carry no mass)."""
    return torch.where(probs > 0, draft_probs / probs.clamp_min(1e-300), torch.full_like(probs, -1.0))


def chi_square_survival(statistic: float, df: int) -> float:
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=F64), torch.tensor(statistic / 2, dtype=F64)))


def chi_square_critical(df: int, alpha: float) -> float:
    low, high = 0.0, float(df) + 100.0 * math.sqrt(df) + 200.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if chi_square_survival(middle, df) > alpha else (low, middle)
    return high


def noncentral_chi_square_survival(threshold: float, df: int, noncentrality: float) -> float:
    """P(X > threshold) for X ~ chi^2(df, noncentrality): the Poisson(noncentrality/2) mixture of chi^2(df + 2i)."""
    half = noncentrality / 2
    terms = int(half + 12 * math.sqrt(half + 1) + 60)
    i = torch.arange(terms, dtype=F64)
    log_weights = -half + i * math.log(half) - torch.lgamma(i + 1) if half > 0 else torch.where(i == 0, 0.0, -math.inf)
    tails = torch.special.gammaincc(df / 2 + i, torch.full_like(i, threshold / 2))
    return float((log_weights.exp() * tails).sum())


def noncentral_chi_square_critical(df: int, alpha: float, noncentrality: float) -> float:
    """The x with P(X > x) = alpha for X ~ chi^2(df, noncentrality) (bisection)."""
    low, high = 0.0, float(df) + noncentrality + 100.0 * math.sqrt(df + 2 * noncentrality) + 200.0
    for _ in range(200):
        middle = (low + high) / 2
        above = noncentral_chi_square_survival(middle, df, noncentrality) > alpha
        low, high = (middle, high) if above else (low, middle)
    return high


def detectable_tv(n: int, df: int, alpha: float, power: float = POWER, null_noncentrality: float = 0.0) -> float:
    """The smallest total variation between a test's bins that it detects with `power` at level alpha on n draws;
    `null_noncentrality`: the test is held against a departure of that noncentrality (rounding), not against none."""
    if n <= 0 or df <= 0:
        return 1.0
    critical = (chi_square_critical(df, alpha) if null_noncentrality <= 0
                else noncentral_chi_square_critical(df, alpha, null_noncentrality))
    low, high = 0.0, 1.0
    if noncentral_chi_square_survival(critical, df, 4 * n) < power:
        return 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if noncentral_chi_square_survival(critical, df, 4 * n * middle ** 2) >= power:
            high = middle
        else:
            low = middle
    return high


def pit_histogram(u: torch.Tensor, bins: int) -> list[int]:
    """The counts of PIT values `u` [n] in `bins` equal bins of [0, 1) (uniform under a correct sampler)."""
    return torch.bincount((u * bins).long().clamp(0, bins - 1), minlength=bins).tolist()


def chi_square_uniform(u: torch.Tensor, bins: int) -> dict[str, float]:
    """Binned u's against uniform: statistic, df, p-value, observed TV between the bins."""
    n = u.numel()
    counts = torch.bincount((u * bins).long().clamp(0, bins - 1), minlength=bins).to(F64)
    expected = n / bins
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return {"test": "chi_square_pit", "n": n, "bins": bins, "df": bins - 1, "statistic": statistic,
            "p_value": chi_square_survival(statistic, bins - 1),
            "tv_observed": 0.5 * float((counts / n - 1 / bins).abs().sum())}


def ks_uniform(u: torch.Tensor) -> dict[str, float]:
    """Kolmogorov-Smirnov against U[0, 1): D and its asymptotic p-value (Stephens' small-n correction)."""
    n = u.numel()
    ordered = u.sort().values
    ranks = torch.arange(1, n + 1, dtype=F64)
    distance = float(torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max())
    return {"test": "ks_pit", "n": n, "statistic": distance, "p_value": ks_survival(distance, n)}


def ks_survival(distance: float, n: int) -> float:
    """P(D_n >= distance) under uniformity, asymptotic with Stephens' small-n correction."""
    root = math.sqrt(n)
    lam = (root + 0.12 + 0.11 / root) * distance
    j = torch.arange(1, 101, dtype=F64)
    p_value = float((2 * ((-1) ** (j - 1)) * torch.exp(-2 * j ** 2 * lam ** 2)).sum()) if lam > 0 else 1.0
    return min(1.0, max(0.0, p_value))


def chi_square_counts(counts: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    """Tokens counted in one context [V] against its distribution [V]; tokens of expected count below 5
    are merged into one bin (dropped when that bin still expects less than 5, folded into the smallest kept)."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= MIN_EXPECTED_PER_BIN
    observed_bins = [counts[big]]
    expected_bins = [expected[big]]
    rest_expected, rest_observed = float(expected[~big].sum()), float(counts[~big].sum())
    if rest_expected >= MIN_EXPECTED_PER_BIN:
        observed_bins.append(torch.tensor([rest_observed], dtype=F64))
        expected_bins.append(torch.tensor([rest_expected], dtype=F64))
    observed, wanted = torch.cat(observed_bins), torch.cat(expected_bins)
    if rest_expected < MIN_EXPECTED_PER_BIN and observed.numel():  # fold the small rest into the least likely kept bin
        smallest = int(wanted.argmin())
        observed[smallest] += rest_observed
        wanted[smallest] += rest_expected
    df = observed.numel() - 1
    statistic = float(((observed - wanted) ** 2 / wanted).sum()) if df > 0 else 0.0
    return {"test": "chi_square_context", "n": int(n), "df": df, "statistic": statistic,
            "p_value": chi_square_survival(statistic, df),
            # the least likely bin's probability: what bounds a small departure's noncentrality (audit.py)
            "min_bin_probability": float(wanted.min()) / n if wanted.numel() else 1.0,
            "tv_observed": 0.5 * float((counts / n - probs).abs().sum())}


def null_tv(probs: torch.Tensor, n: int, generator: torch.Generator, repeats: int = 200) -> float:
    """The mean TV between n draws from probs [V] and probs itself: what sampling noise alone gives."""
    draws = torch.multinomial(probs.expand(repeats, -1), n, replacement=True, generator=generator)  # [repeats, n]
    counts = torch.zeros(repeats, probs.numel(), dtype=F64).scatter_add_(1, draws, torch.ones_like(draws, dtype=F64))
    return float((0.5 * (counts / n - probs).abs().sum(-1)).mean())


def holm(p_values: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
