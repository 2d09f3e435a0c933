"""Findings on acceptance: observed against expected per draft position, with family-wise control.

Acceptance at position k is accepted at k / proposals at k (equivalence/acceptance/observed.py). Per
position with proposals on both sides:

- the ratio observed rate / expected rate, with its interval at level 1 - alpha: against an expectation
  without sampling error (a replay), the Wilson interval of the observed rate over the expected rate;
  against a baseline (an earlier run's counts), the log-ratio interval of two proportions (Katz);
- "acceptance short": the observed rate below the expected rate beyond chance: against a replay the exact
  binomial test P(X <= accepted | proposals, expected rate), against a baseline the two-proportion z-test of
  observed - baseline; the positions' p-values Holm-adjusted, a finding where the adjusted p is below alpha.
  The gate (`--require-acceptance R`) runs the same tests against R x the expected rate: the positions where
  it rejects are `below_required`, and the run fails;
- "acceptance impossible": against an exact expectation (the replay in the engine's own precision), an
  observed rate above the expected one beyond chance (the upper binomial test, Holm): the stated proposer
  cannot reach it, so the counters count something else or the proposer is not the one stated. Against an
  estimate (below float64, a baseline) the same excess is "acceptance above expected", a note;
- "acceptance counters inconsistent": what the counters contradict in themselves (`observed.consistency`).

Under sampling (`expected.method` "sampled overlap", equivalence/acceptance/sampled.py) the expectation at
position k is E_k = sum of alpha over the verify steps that reached k, each step's acceptance there a
Bernoulli(alpha) given everything before it, with the predictable variance V_k = sum alpha (1 - alpha). The
accepted count X_k less E_k is a martingale, so z = (X_k - E_k) / sqrt(V_k) is standard normal in the limit
(the martingale central limit theorem): "short" is P(Z <= (X_k + 1/2 - E_k) / sqrt(V_k)), "excess"
P(Z >= (X_k - 1/2 - E_k) / sqrt(V_k)) (half a count of continuity correction each way), the gate the same
against R alpha (mean R E_k, variance R E_k - R^2 (E_k - V_k)), Holm across positions as above; the ratio's
interval is (X_k -+ z sqrt(V_k)) / E_k.

The findings never change the outputs' verdict; `--require-acceptance` makes a short acceptance fail the
audit (`unmet`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from specaudit.equivalence.acceptance.expected import ExpectedAcceptance

if TYPE_CHECKING:
    from specaudit.equivalence.records import Run
from specaudit.equivalence.acceptance.observed import ObservedAcceptance, consistency
from specaudit.equivalence.sampling.stats import holm

from specaudit.equivalence.rulings.thresholds import ALPHA  # family-wise, over the draft positions of one run
SAMPLED = "sampled overlap"  # the expectation's method under sampling (equivalence/acceptance/sampled.py)
DEFINITION = ("acceptance at draft position k = accepted at k / proposals at k (a proposal at k: one row's verify "
              "step whose proposer made at least k+1 draft tokens; accepted at k: its first k+1 were all "
              "accepted); overall = accepted tokens / drafted tokens")


@dataclass(frozen=True)
class PositionComparison:
    position: int
    observed_accepted: int
    observed_proposals: int
    expected_accepted: float  # a count (a replay, a baseline), or a sum of acceptance probabilities (sampled)
    expected_proposals: int
    observed_rate: float | None
    expected_rate: float | None
    ratio: float | None  # observed rate / expected rate
    ratio_low: float | None
    ratio_high: float | None
    p_short: float | None  # one-sided, observed below expected (Holm-adjusted in p_short_holm)
    p_short_holm: float | None
    p_below_required_holm: float | None  # one-sided against required x expected, Holm-adjusted (with a gate)
    p_excess: float | None  # one-sided, observed above expected
    p_excess_holm: float | None


@dataclass(frozen=True)
class AcceptanceFinding:
    kind: str  # "acceptance short", "acceptance impossible", "acceptance above expected", "acceptance counters inconsistent"
    positions: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class AcceptanceRecord:
    """A run's `acceptance` in audit.json."""

    definition: str
    expected: ExpectedAcceptance | None
    observed: ObservedAcceptance | None
    positions: tuple[PositionComparison, ...]  # the counts of `compared` where given, else `observed`
    overall: dict[str, float | None]
    findings: tuple[AcceptanceFinding, ...]
    required: float | None  # --require-acceptance R
    below_required: tuple[int, ...] = ()  # positions short of required x expected beyond chance: the gate fails
    alpha: float = ALPHA
    unavailable: str | None = None  # why no comparison was made
    payoff: dict[str, Any] | None = field(default=None)
    implied: str | None = None  # where no flag stated the proposer and one was implied (--draft for a server): why

    def to_json(self) -> dict[str, Any]:
        return {"definition": self.definition,
                "expected": self.expected.to_json() if self.expected is not None else None,
                "observed": self.observed.to_json() if self.observed is not None else None,
                "positions": [asdict(p) for p in self.positions], "overall": dict(self.overall),
                "findings": [{**asdict(f), "positions": list(f.positions)} for f in self.findings],
                "required": self.required, "below_required": list(self.below_required), "alpha": self.alpha,
                "unavailable": self.unavailable,
                "payoff": self.payoff, **({"implied": self.implied} if self.implied is not None else {})}


def binomial_cdf(successes: int, trials: int, rate: float) -> float:
    """P(X <= successes), X ~ Binomial(trials, rate)."""
    if successes < 0:
        return 0.0
    if successes >= trials or rate <= 0.0:
        return 1.0
    if rate >= 1.0:
        return 0.0
    log_rate, log_miss = math.log(rate), math.log1p(-rate)
    terms = [math.lgamma(trials + 1) - math.lgamma(i + 1) - math.lgamma(trials - i + 1) + i * log_rate
             + (trials - i) * log_miss for i in range(successes + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def wilson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """The Wilson interval of a proportion at level 1 - alpha."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    rate = successes / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def _ratio_interval(a: int, n: int, b: int, m: int, exact: bool, alpha: float) -> tuple[float | None, float | None]:
    expected = b / m
    if exact:
        low, high = wilson(a, n, alpha)
        return low / expected, high / expected
    if a == 0:
        return 0.0, None
    z = NormalDist().inv_cdf(1 - alpha / 2)
    spread = math.sqrt(max(0.0, 1 / a - 1 / n + 1 / b - 1 / m))  # Katz: se of log(ratio)
    ratio = (a / n) / expected
    return ratio * math.exp(-z * spread), ratio * math.exp(z * spread)


def _two_sample_p(a: int, n: int, b: int, m: int, factor: float, below: bool) -> float:
    """One-sided z-test of a/n - factor * b/m (below: that it is < 0; else > 0), unpooled variances."""
    observed, expected = a / n, factor * b / m
    variance = observed * (1 - observed) / n + factor * factor * (b / m) * (1 - b / m) / m
    if variance <= 0:
        return 1.0 if (observed >= expected if below else observed <= expected) else 0.0
    z = (observed - expected) / math.sqrt(variance)
    return NormalDist().cdf(z) if below else 1 - NormalDist().cdf(z)


def _normal_p(observed: float, mean: float, variance: float, below: bool) -> float:
    """One-sided normal p-value of `observed` against `mean` with `variance`, half a count of continuity
    correction (below: P(X <= observed); else P(X >= observed))."""
    shifted = observed + 0.5 if below else observed - 0.5
    if variance <= 0:
        return 1.0 if (shifted >= mean if below else shifted <= mean) else 0.0
    z = (shifted - mean) / math.sqrt(variance)
    return NormalDist().cdf(z) if below else 1 - NormalDist().cdf(z)


def _sampled_interval(a: int, b: float, variance: float, alpha: float) -> tuple[float | None, float | None]:
    """The ratio X/E's interval at level 1 - alpha, (X -+ z sqrt(V)) / E (module docstring)."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    spread = z * math.sqrt(max(0.0, variance))
    return max(0.0, a - spread) / b, (a + spread) / b


def compare(observed: ObservedAcceptance | None, expected: ExpectedAcceptance | None, *,
            required: float | None = None, alpha: float = ALPHA, unavailable: str | None = None,
            compared: ObservedAcceptance | None = None) -> AcceptanceRecord:
    """The run's acceptance record: per-position comparison and findings (module docstring). `compared`: the
    observed counts the expectation covers, where it covers fewer steps than the engine's counters (sampled:
    the verify positions the outputs show); the record keeps `observed` and checks its consistency."""
    findings: list[AcceptanceFinding] = []
    problems = consistency(observed) if observed is not None else []
    if problems:
        findings.append(AcceptanceFinding("acceptance counters inconsistent", (), "; ".join(problems)))
    counted = compared if compared is not None else observed
    if counted is None or expected is None or counted.accepted_per_position is None \
            or counted.drafts_per_position is None:
        reason = unavailable or ("no per-position counters were observed" if expected is not None
                                 else "no expectation for this proposer")
        return AcceptanceRecord(DEFINITION, expected, observed, (), _overall(counted, expected, alpha),
                                tuple(findings), required, (), alpha, reason)
    rows = []
    width = max(len(counted.drafts_per_position), len(expected.drafts_per_position))
    for k in range(width):
        a, n = _at(counted.accepted_per_position, k), _at(counted.drafts_per_position, k)
        b, m = _at(expected.accepted_per_position, k), _at(expected.drafts_per_position, k)
        rows.append((k, a, n, b, m))
    tested = [row for row in rows if row[2] > 0 and row[4] > 0 and row[3] > 0]
    sampled = expected.method == SAMPLED
    variances = expected.variance_per_position or ()
    shorts, excesses, gated = {}, {}, {}
    for k, a, n, b, m in tested:
        if sampled:
            v = variances[k] if k < len(variances) else 0.0
            shorts[k] = _normal_p(a, b, v, below=True)
            excesses[k] = _normal_p(a, b, v, below=False)
            if required is not None:  # each step's acceptance R alpha: mean R E, variance R E - R^2 sum alpha^2
                gated[k] = _normal_p(a, required * b, max(0.0, required * b - required ** 2 * (b - v)), below=True)
        elif expected.method == "baseline":
            shorts[k] = _two_sample_p(a, n, b, m, 1.0, below=True)
            excesses[k] = _two_sample_p(a, n, b, m, 1.0, below=False)
            if required is not None:
                gated[k] = _two_sample_p(a, n, b, m, required, below=True)
        else:
            shorts[k] = binomial_cdf(a, n, b / m)
            excesses[k] = 1.0 - binomial_cdf(a - 1, n, b / m)
            if required is not None:
                gated[k] = binomial_cdf(a, n, min(1.0, required * b / m))
    order = sorted(shorts)
    short_holm = dict(zip(order, holm([shorts[k] for k in order])))
    excess_holm = dict(zip(order, holm([excesses[k] for k in order])))
    gated_holm = dict(zip(order, holm([gated[k] for k in order]))) if required is not None else {}
    comparisons = []
    for k, a, n, b, m in rows:
        if not (n and m and b):
            low, high = None, None
        elif sampled:
            low, high = _sampled_interval(a, b, variances[k] if k < len(variances) else 0.0, alpha)
        else:
            low, high = _ratio_interval(a, n, b, m, expected.method != "baseline", alpha)
        comparisons.append(PositionComparison(
            position=k, observed_accepted=a, observed_proposals=n, expected_accepted=b, expected_proposals=m,
            observed_rate=(a / n) if n else None, expected_rate=(b / m) if m else None,
            ratio=((a / n) / (b / m)) if (n and m and b) else None, ratio_low=low, ratio_high=high,
            p_short=shorts.get(k), p_short_holm=short_holm.get(k), p_below_required_holm=gated_holm.get(k),
            p_excess=excesses.get(k), p_excess_holm=excess_holm.get(k)))
    short = tuple(k for k in order if short_holm[k] < alpha)
    if short:
        worst = min((c for c in comparisons if c.position in short), key=lambda c: c.ratio or 0.0)
        findings.append(AcceptanceFinding("acceptance short", short, (
            f"acceptance short at draft position{'s' if len(short) > 1 else ''} {', '.join(map(str, short))}: below "
            f"expected beyond chance (Holm, alpha {alpha:g}); worst at position {worst.position}: "
            f"{worst.observed_accepted}/{worst.observed_proposals} observed against "
            f"{_count(worst.expected_accepted)}/{worst.expected_proposals} expected ({expected.method}), ratio "
            f"{_number(worst.ratio)} [{_number(worst.ratio_low)}, {_number(worst.ratio_high)}]")))
    excess = tuple(k for k in order if excess_holm[k] < alpha)
    if excess:
        kind = "acceptance impossible" if expected.exact else "acceptance above expected"
        reason = ("the stated proposer cannot reach it: the counters count something else, or the proposer is not "
                  "the one stated" if expected.exact else
                  f"above an estimate ({expected.note or expected.method}), beyond chance")
        findings.append(AcceptanceFinding(kind, excess, (
            f"{kind} at draft position{'s' if len(excess) > 1 else ''} {', '.join(map(str, excess))}: "
            f"observed above the {expected.method}'s {_rates(expected, excess)}; {reason}")))
    below = tuple(k for k in order if gated_holm.get(k, 1.0) < alpha)
    return AcceptanceRecord(DEFINITION, expected, observed, tuple(comparisons), _overall(counted, expected, alpha),
                            tuple(findings), required, below, alpha, None)


def _at(counts: tuple[float, ...] | None, k: int) -> float:
    return counts[k] if counts is not None and k < len(counts) else 0


def _count(value: float) -> str:
    """A count as the reports write it: whole, or a sum of probabilities to one decimal."""
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rates(expected: ExpectedAcceptance, positions: tuple[int, ...]) -> str:
    rates = expected.position_rates()
    return ", ".join(f"{_number(rates[k])} at {k}" for k in positions if k < len(rates))


def _overall(observed: ObservedAcceptance | None, expected: ExpectedAcceptance | None,
             alpha: float) -> dict[str, float | None]:
    observed_rate = observed.rate if observed is not None else None
    expected_rate = expected.rate if expected is not None else None
    overall: dict[str, float | None] = {"observed_rate": observed_rate, "expected_rate": expected_rate,
                                        "ratio": None, "ratio_low": None, "ratio_high": None}
    if observed_rate is not None and expected_rate:
        overall["ratio"] = observed_rate / expected_rate
        assert observed is not None and expected is not None
        if expected.method == SAMPLED:  # the increments of every position form one martingale: variances add
            low, high = _sampled_interval(observed.accepted_tokens or 0, expected.accepted_tokens,
                                          sum(expected.variance_per_position or ()), alpha)
        else:
            low, high = _ratio_interval(observed.accepted_tokens or 0, observed.drafted_tokens or 0,
                                        expected.accepted_tokens, expected.drafted_tokens,
                                        expected.method != "baseline", alpha)
        overall["ratio_low"], overall["ratio_high"] = low, high
    return overall


def unmet(run: Run | Mapping[str, Any]) -> bool:
    """Whether the run fails `--require-acceptance`: acceptance short of the required ratio of the expected at
    some draft position, beyond chance. `run`: a `Run`, or the JSON object of one (`serialize.as_run`)."""
    from specaudit.equivalence.records.serialize import as_run

    return short_of_required(as_run(run).acceptance or None)


def short_of_required(record: Mapping[str, Any] | None) -> bool:
    """Whether an acceptance record (`Comparison.to_json`, a run's `acceptance`) fails the ratio it was
    compared with: short at some draft position, beyond chance; False without a record or a ratio."""
    record = record or {}
    return record.get("required") is not None and bool(record.get("below_required"))


def headline(record: Mapping[str, Any] | None) -> str:
    """One line for reports and the terminal: observed against expected, overall, and the findings."""
    if not record:
        return "acceptance not measured"
    overall = record.get("overall") or {}
    observed, expected = overall.get("observed_rate"), overall.get("expected_rate")
    parts = []
    if observed is not None:
        parts.append(f"observed {observed:.1%}")
    if expected is not None:
        method = (record.get("expected") or {}).get("method", "expected")
        parts.append(f"expected {expected:.1%} ({method})")
    if overall.get("ratio") is not None:
        parts.append(f"ratio {overall['ratio']:.3f} [{_number(overall.get('ratio_low'))}, "
                     f"{_number(overall.get('ratio_high'))}]")
    text = "acceptance " + (", ".join(parts) if parts else "not measured")
    if record.get("unavailable") and expected is None:
        text += f" (no expectation: {record['unavailable']})"
    kinds = [f"{f['kind']} at {', '.join(map(str, f['positions']))}" if f.get("positions") else f["kind"]
             for f in record.get("findings") or []]
    if record.get("below_required"):
        kinds.append(f"below {record['required']:g} x expected at {', '.join(map(str, record['below_required']))}")
    return text + (f"; {'; '.join(kinds)}" if kinds else "")
