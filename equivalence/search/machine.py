"""The Hypothesis state machine that draws request mixes (equivalence/search/model.py `Mix`).

Each step is one request: a fresh prompt, a prompt sharing a prefix of a drawn length with an earlier request,
or an earlier request's prompt again, each with its own parameters and arrival (equivalence/search/strategies.py).
The example is judged once, at teardown, as the greedy audit judges a run (equivalence/search/judging.py); a run
that does not pass fails the example, and Hypothesis shrinks the steps (fewer requests, shorter prompts, fewer
parameters, simpler arrivals) to a minimal mix that still fails. Every step says what it drew (`note`), and
`target` steers the search toward mixes with more parameter families and longer shared prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import note, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from specaudit.equivalence.search.judging import Unanswerable, failed
from specaudit.equivalence.search.model import Mix, Request, families_of
from specaudit.equivalence.search.strategies import (FAMILIES, ConstraintScope, arrivals, fresh_prompts,
                                                     prefix_lengths, request_params)


class MixFailed(AssertionError):
    """A drawn mix whose run does not pass the audit."""


@dataclass
class MachineContext:
    """What every example of one search shares (set on the machine's class by `machine_for`)."""

    judging: Any  # equivalence/search/judging.py `Judging`
    pool: list[list[int]]  # prompts fresh ones are cut from
    vocab_size: int
    tokens: tuple[int, ...] = ()  # what drawn prompt tokens come from (strategies.text_tokens); () every id
    eos_ids: tuple[int, ...] = ()  # the run's EOS ids (where a plain continuation stops)
    sampled: bool = False  # the engine takes sampled requests with seeds: the `seeded` step is drawn
    max_prompt_length: int = 64
    families: tuple[str, ...] = FAMILIES
    bad_words_as_text: bool = False
    constraint_scope: ConstraintScope = ConstraintScope()  # the structured outputs the engine takes (none: never drawn)
    diagnosis: str = "off"
    expired: Callable[[], bool] = lambda: False  # the budget in minutes spent: examples pass unjudged
    judge_more: Callable[[], bool] = lambda: True  # False: the budget's examples were judged, no failure found
    on_judged: Callable[[Mix, dict[str, Any], bool], None] = lambda mix, run, failed: None
    # whether a judged run fails the example: it fails the audit, and (equivalence/search/run.py) not only as an
    # earlier finding of the same search failed
    is_failure: Callable[[dict[str, Any]], bool] = failed
    failures: list[tuple[Mix, dict[str, Any]]] = field(default_factory=list)  # the last is the shrunk one
    failed_keys: dict[tuple, str] = field(default_factory=dict)  # Mix.key() of each failing mix: its message


class RequestMixes(RuleBasedStateMachine):
    context: MachineContext  # set by `machine_for`

    def __init__(self) -> None:
        super().__init__()
        self.mix = Mix()

    def _add(self, data: st.DataObject, kind: str, prompt: tuple[int, ...], shared_with: int | None = None,
             shared_length: int = 0) -> None:
        ctx = self.context
        continuation = ctx.judging.continuation(prompt)
        params = data.draw(request_params(continuation=continuation, vocab_size=ctx.vocab_size,
                                          max_new_tokens=ctx.judging.settings.max_new_tokens, families=ctx.families,
                                          bad_words_as_text=ctx.bad_words_as_text, eos_ids=ctx.eos_ids,
                                          constraint_scope=ctx.constraint_scope),
                           label="params")
        arrival = data.draw(arrivals(), label="arrival")
        self.mix.requests.append(Request(prompt, params, arrival, kind, shared_with, shared_length))
        note(f"request {len(self.mix.requests) - 1}: {kind} prompt of {len(prompt)} tokens"
             + (f" sharing {shared_length} with request {shared_with}" if shared_with is not None else "")
             + f", {arrival}, params {params.to_dict()}")

    @rule(data=st.data())
    def fresh(self, data: st.DataObject) -> None:
        ctx = self.context
        kind, prompt = data.draw(fresh_prompts(pool=ctx.pool, tokens=ctx.tokens or range(ctx.vocab_size),
                                               max_length=ctx.max_prompt_length), label="fresh prompt")
        note(f"fresh prompt ({kind})")
        self._add(data, "fresh", prompt)

    @precondition(lambda self: bool(self.mix.requests))
    @rule(data=st.data())
    def shared_prefix(self, data: st.DataObject) -> None:
        ctx = self.context
        # counted back from the latest request (the shrink target): the one most likely still in flight
        earlier = len(self.mix.requests) - 1 - data.draw(st.integers(0, len(self.mix.requests) - 1),
                                                         label="shares with (back from the latest)")
        base = self.mix.requests[earlier].prompt
        length = data.draw(prefix_lengths(max_length=len(base)), label="prefix length")
        tail = tuple(data.draw(st.lists(st.sampled_from(ctx.tokens or range(ctx.vocab_size)), min_size=1, max_size=16), label="tail"))
        self._add(data, "shared", base[:length] + tail, earlier, length)

    @precondition(lambda self: bool(self.mix.requests))
    @rule(data=st.data())
    def identical(self, data: st.DataObject) -> None:
        earlier = len(self.mix.requests) - 1 - data.draw(st.integers(0, len(self.mix.requests) - 1),
                                                         label="repeats (back from the latest)")
        base = self.mix.requests[earlier].prompt
        self._add(data, "identical", base, earlier, len(base))

    @precondition(lambda self: bool(self.mix.requests) and not self.mix.probes and self.context.sampled)
    @rule(data=st.data())
    def seeded(self, data: st.DataObject) -> None:
        """A sampled probe of an earlier request's prompt with seeds (equivalence/search/seeds.py)."""
        from specaudit.equivalence.search.seeds import TEMPERATURES, SeedProbe

        earlier = len(self.mix.requests) - 1 - data.draw(st.integers(0, len(self.mix.requests) - 1),
                                                         label="probes (back from the latest)")
        probe = SeedProbe(earlier, data.draw(st.sampled_from(TEMPERATURES), label="temperature"),
                          data.draw(st.integers(0, 2 ** 16), label="seed"))
        self.mix.probes.append(probe)
        note(f"seeded probe of request {earlier}'s prompt: temperature {probe.temperature:g}, seeds from {probe.seed}")

    def teardown(self) -> None:
        ctx, mix = self.context, self.mix
        if not mix.requests:
            return
        target(float(len({f for r in mix.requests for f in families_of(r.params)})), label="parameter families")
        target(float(max((r.shared_length for r in mix.requests if r.kind == "shared"), default=0)),
               label="shared prefix tokens")
        target(float(max(len(w) for w in mix.waves())), label="requests in flight together")
        key = mix.key()
        if not ctx.judge_more() or ctx.expired():  # past the budget: drawn (the draws stay the same), not judged;
            if key in ctx.failed_keys:  # a mix that failed before fails again (Hypothesis replays its best)
                raise MixFailed(ctx.failed_keys[key])
            return
        try:
            run = ctx.judging.judge(mix, ctx.diagnosis)
        except Unanswerable as exc:  # no output satisfies the request (its constraint, banned words): passes
            note(f"not judged: {exc}")  # unjudged, not rejected (a rejection in teardown, Hypothesis freezes on)
            return
        bad = ctx.is_failure(run)
        ctx.on_judged(mix, run, bad)
        if bad:
            ctx.failures.append((mix, run))
            ctx.failed_keys[key] = f"{len(mix.requests)} request(s) in {len(mix.waves())} wave(s) not equivalent"
            found = [f"request {d.get('prompt_index')} at {d.get('position')}: {(d.get('diagnosis') or {}).get('class')}"
                     for d in run.get("divergences") or [] if d.get("kind") == "structural"]
            raise MixFailed(f"{len(mix.requests)} request(s) in {len(mix.waves())} wave(s) not equivalent: "
                            + ("; ".join(found) or str(run.get("error"))))


def machine_for(context: MachineContext) -> type[RequestMixes]:
    """A state-machine class bound to one search's context."""
    return type("RequestMixes", (RequestMixes,), {"context": context})
