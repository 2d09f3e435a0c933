"""The payoff: does speculation make the engine faster than its plain counterpart, on these prompts?

With `--payoff N` every run also times the speculative engine and a plain engine beside it (the configured
`--plain-engine`, else the plain control `batched` at the same batch size) on the same prompts and batch
mix, alternately, N times each: tokens per second of each call (its own new tokens over its wall time),
the ratio speculative / plain per repeat, and their median and spread (the lowest and highest ratio).

"speculation slower than plain" is a finding when every repeat's ratio is below 1 (the whole spread lies
below it). An absolute time is never a verdict: only the ratio in one run, on one machine, is reported.
The outputs' verdict is unchanged.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

Generate = Callable[[], list[list[int]]]


@dataclass(frozen=True)
class Payoff:
    plain_engine: str
    repeats: int
    speculative_tokens_per_second: tuple[float, ...]
    plain_tokens_per_second: tuple[float, ...]
    ratios: tuple[float, ...]  # speculative / plain, per repeat
    ratio_median: float
    ratio_low: float
    ratio_high: float
    finding: str | None  # "speculation slower than plain", or None

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("speculative_tokens_per_second", "plain_tokens_per_second", "ratios"):
            record[name] = list(record[name])
        return record


def _tokens_per_second(generate: Generate) -> float:
    started = time.perf_counter()
    outputs = generate()
    seconds = time.perf_counter() - started
    return sum(len(output) for output in outputs) / max(seconds, 1e-9)


def measure(speculative: Generate, plain: Generate, repeats: int, plain_engine: str) -> Payoff:
    """Time `speculative` and `plain` alternately `repeats` times (after one untimed call of each: caches,
    allocations, lazy imports) and compare their tokens per second."""
    if repeats < 1:
        raise ValueError("the payoff needs at least one repeat")
    speculative(), plain()  # warm-up, untimed
    fast, slow = [], []
    for _ in range(repeats):
        fast.append(_tokens_per_second(speculative))
        slow.append(_tokens_per_second(plain))
    ratios = tuple(a / b for a, b in zip(fast, slow))
    finding = None
    if max(ratios) < 1:
        finding = (f"speculation slower than plain: {statistics.median(ratios):.2f}x the plain engine's tokens per "
                   f"second (every one of {repeats} repeats below 1: {min(ratios):.2f} to {max(ratios):.2f})")
    return Payoff(plain_engine, repeats, tuple(fast), tuple(slow), ratios, statistics.median(ratios), min(ratios),
                  max(ratios), finding)


def headline(payoff: dict[str, Any] | None) -> str:
    """One line for the reports."""
    if not payoff:
        return ""
    if payoff.get("error"):
        return f"payoff not measured: {payoff['error']}"
    text = (f"payoff: {payoff['ratio_median']:.2f}x the tokens per second of {payoff['plain_engine']} "
            f"(spread {payoff['ratio_low']:.2f} to {payoff['ratio_high']:.2f} over {payoff['repeats']} repeats)")
    return text + (f"; {payoff['finding']}" if payoff.get("finding") else "")
