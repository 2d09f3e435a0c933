"""Observed acceptance: what an engine's counters say it drafted and accepted, per draft position.

The one definition of acceptance, used everywhere in the audit:

- per draft position k (0-based): acceptance_k = accepted at k / proposals at k, where a proposal at k is
  a verify step of one row whose drafter proposed at least k+1 tokens, and accepted at k is one where the
  first k+1 draft tokens were all accepted (accepted tokens are a prefix, so the counts never increase
  with k);
- overall: accepted_tokens / drafted_tokens.

An `ObservedAcceptance` holds the counters one run exposed; any of them may be unknown (None). Where
they come from: an in-process engine's trace (`from_trace`: every verify step of every row, its drafted
and accepted counts), counters an engine keeps itself (the engine contract's `last_acceptance`:
engines/contract.py), or a server's own counters (equivalence/acceptance/counters.py).

An accepted count is the acceptance rule's, before the row's stop: a row that ends at an EOS id or at its
budget inside a step may have accepted draft tokens it never emits. So emitted tokens lie between verify
steps (each emits at least one token) and verify steps + accepted tokens (each emits its accepted tokens
and a recovered or bonus token, unless cut), with equality at the top where nothing was cut.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specaudit.engines.contract import capability, declares
from specaudit.engines.trace import Trace


@dataclass(frozen=True)
class ObservedAcceptance:
    source: str  # where the counters come from, in words
    verify_steps: int | None  # verify passes, counted once per row (a row's step)
    drafted_tokens: int | None
    accepted_tokens: int | None
    accepted_per_position: tuple[int, ...] | None  # [K] verify steps whose first k+1 drafts were all accepted
    drafts_per_position: tuple[int, ...] | None  # [K] proposals made at position k
    emitted_tokens: int | None  # tokens the verify steps emitted (accepted + recovered or bonus, cut at stops)

    @property
    def rate(self) -> float | None:
        """accepted_tokens / drafted_tokens, or None when either is unknown or nothing was drafted."""
        if self.drafted_tokens is None or self.accepted_tokens is None or not self.drafted_tokens:
            return None
        return self.accepted_tokens / self.drafted_tokens

    def position_rates(self) -> tuple[float | None, ...] | None:
        """[K] accepted at k / proposals at k (None at a position with no proposal), or None when unknown."""
        if self.accepted_per_position is None or self.drafts_per_position is None:
            return None
        return tuple((a / d) if d else None for a, d in zip(self.accepted_per_position, self.drafts_per_position))

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for name in ("accepted_per_position", "drafts_per_position"):
            if record[name] is not None:
                record[name] = list(record[name])
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ObservedAcceptance:
        def counts(name: str) -> tuple[int, ...] | None:
            value = record.get(name)
            return tuple(int(v) for v in value) if value is not None else None

        def count(name: str) -> int | None:
            value = record.get(name)
            return int(value) if value is not None else None

        return cls(source=str(record.get("source", "")), verify_steps=count("verify_steps"),
                   drafted_tokens=count("drafted_tokens"), accepted_tokens=count("accepted_tokens"),
                   accepted_per_position=counts("accepted_per_position"),
                   drafts_per_position=counts("drafts_per_position"), emitted_tokens=count("emitted_tokens"))


def consistency(observed: ObservedAcceptance) -> list[str]:
    """What the counters contradict in themselves, one sentence each; [] when nothing (or nothing known)."""
    problems: list[str] = []
    o = observed
    for name in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens"):
        value = getattr(o, name)
        if value is not None and value < 0:
            problems.append(f"{name} is negative ({value})")
    if o.accepted_tokens is not None and o.drafted_tokens is not None and o.accepted_tokens > o.drafted_tokens:
        problems.append(f"more tokens accepted ({o.accepted_tokens}) than drafted ({o.drafted_tokens})")
    accepted, drafts = o.accepted_per_position, o.drafts_per_position
    if accepted is not None and drafts is not None:
        if len(accepted) != len(drafts):
            problems.append(f"accepted per position has {len(accepted)} positions, proposals per position {len(drafts)}")
        for k, (a, d) in enumerate(zip(accepted, drafts)):
            if a > d:
                problems.append(f"position {k}: more accepted ({a}) than proposed ({d})")
    for name, counts, total in (("accepted", accepted, o.accepted_tokens), ("proposals", drafts, o.drafted_tokens)):
        if counts is None:
            continue
        if total is not None and sum(counts) != total:
            problems.append(f"{name} per position sum to {sum(counts)}, not the total {total}")
        rises = [k for k in range(1, len(counts)) if counts[k] > counts[k - 1]]
        if rises:
            k = rises[0]
            problems.append(f"{name} per position rise from position {k - 1} ({counts[k - 1]}) to {k} ({counts[k]}); "
                            "a later position is reached only through the earlier ones")
    if drafts is not None and o.verify_steps is not None and drafts and drafts[0] > o.verify_steps:
        problems.append(f"proposals at position 0 ({drafts[0]}) exceed the verify steps ({o.verify_steps})")
    if o.emitted_tokens is not None and o.verify_steps is not None:
        if o.emitted_tokens < o.verify_steps:
            problems.append(f"fewer tokens emitted ({o.emitted_tokens}) than verify steps ({o.verify_steps}); "
                            "each step emits at least one")
        if o.accepted_tokens is not None and o.emitted_tokens > o.verify_steps + o.accepted_tokens:
            problems.append(f"more tokens emitted ({o.emitted_tokens}) than verify steps + accepted tokens "
                            f"({o.verify_steps} + {o.accepted_tokens})")
    return problems


def from_trace(trace: Trace | None) -> ObservedAcceptance | None:
    """Per-position counters from an in-process engine's trace: every decode step of every row, its drafted
    count (the drafter's own, else k) and accepted count. None when the engine keeps no trace or never drafts."""
    if trace is None or not trace.draft_tokens:
        return None
    width = trace.draft_tokens
    accepted_at, drafts_at = [0] * width, [0] * width
    verify_steps = emitted = 0
    for step in trace.steps:
        if step.kind == "prefill":
            continue
        drafted_counts = step.drafted_counts if step.drafted_counts is not None else [width] * len(step.rows)
        for drafted, accepted, emitted_count in zip(drafted_counts, step.accepted_counts, step.emitted_counts):
            if drafted > len(drafts_at):  # a drafter that proposed more than the engine's k
                grow = drafted - len(drafts_at)
                accepted_at, drafts_at = accepted_at + [0] * grow, drafts_at + [0] * grow
            for k in range(drafted):
                drafts_at[k] += 1
            for k in range(accepted):
                accepted_at[k] += 1
            verify_steps += 1
            emitted += emitted_count
    if not any(drafts_at):
        return None
    decode_steps = sum(1 for step in trace.steps if step.kind != "prefill")
    return ObservedAcceptance(
        source=f"the engine's trace: up to k={width} draft tokens per row per step, over {decode_steps} steps",
        verify_steps=verify_steps, drafted_tokens=sum(drafts_at), accepted_tokens=sum(accepted_at),
        accepted_per_position=tuple(accepted_at), drafts_per_position=tuple(drafts_at), emitted_tokens=emitted)


def from_speculation(speculation: dict[str, Any] | None) -> ObservedAcceptance | None:
    """Totals alone from a run's `speculation` record (equivalence/speculation.py): no per-position counts."""
    if not speculation or speculation.get("drafted_tokens") is None:
        return None
    return ObservedAcceptance(source=str(speculation.get("source") or "the run's speculation counters"),
                              verify_steps=None, drafted_tokens=int(speculation["drafted_tokens"]),
                              accepted_tokens=_int(speculation.get("accepted_tokens")),
                              accepted_per_position=None, drafts_per_position=None, emitted_tokens=None)


def of_run(engine: Any, trace: Trace | None, speculation: dict[str, Any] | None = None) -> ObservedAcceptance | None:
    """The observed acceptance of one run: counters the engine keeps itself (`last_acceptance`, an
    `ObservedAcceptance` or its JSON), else its trace, else the totals of its speculation record."""
    if declares(engine, "last_acceptance"):
        own = capability(engine, "last_acceptance")
        if isinstance(own, ObservedAcceptance):
            return own
        if isinstance(own, dict):
            return ObservedAcceptance.from_json(own)
    return from_trace(trace) or from_speculation(speculation)


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None
