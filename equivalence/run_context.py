"""One audited run's means beside its outputs: fresh engines on chosen prompts, and its plain run.

The audit of a run (`audit.audit_engine`) may need more of the engine than its one call: the crash
isolation runs subsets of the prompts, the diagnosis re-runs rows (alone, beside others, with another
pad id), and the rulings below float64 need a plain run of the same rows (rulings/plain.py). The
runner hands all of that over as one `RunContext`, which the audit passes on to the diagnosis; an
engine object audited on its own (the pytest plugin, the API) gets one around itself.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from specaudit.engines.contract import capability

# the plain control of in-process engines below float64: batched greedy decoding, no speculation
PLAIN_CONTROL = "batched"

# (prompt indices, pad id or None) -> outputs; one that takes `around=` (a context factory) enters it around its
# engine's own `generate` call alone, so that the diagnosis may observe that call (diagnosis/observe.py)
Reruns = Callable[..., list[list[int]]]


def takes_around(reruns: Callable[..., Any]) -> bool:
    """Whether a caller's re-run callable takes the `around` keyword."""
    try:
        parameters = inspect.signature(reruns).parameters
    except (TypeError, ValueError):
        return False
    return "around" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def wrapped(generate: Callable[..., Any], around: Callable[[], ContextManager[Any]] | None) -> Callable[..., Any]:
    """`generate`, entered inside `around()` when given (the context then covers that call alone)."""
    if around is None:
        return generate

    def call(*args: Any, **kwargs: Any) -> Any:
        with around():
            return generate(*args, **kwargs)
    return call


@dataclass
class RunContext:
    """How to run the audited engine again on some of the run's prompts, and its plain run.

    Fresh engines come from `engine_name` (a registered name, built with `options`: the runner), else
    from `reruns` (a caller's own: property tests, the pytest plugin), else the audited `engine` object
    itself is run again (it cannot change its pad id). A recording, or an engine whose drafter is
    scripted per prompt index, is never re-run."""

    pair: Any
    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_id: Any
    dtype: str
    batch_size: int | None = None
    engine_name: str | None = None
    engine: Any = None
    reruns: Reruns | None = None
    draft_tokens: int = 4
    options: dict[str, Any] = field(default_factory=dict)  # engine options: pad id, record_logits, the user's
    timeout: float | None = None  # seconds per engine call (a fresh engine is guarded like the audited one)
    rerun_budget: float | None = None  # seconds for all the diagnosis's re-runs of the run together
    plain_engine: str | None = None  # a configured plain engine (`--plain-engine`): run for every run
    plain_runs: dict[Any, dict[str, Any]] = field(default_factory=dict)  # shared by the runs of one pair
    rerunnable: bool = True  # False: a recording, which answers the same whatever it is asked beside
    pad_option: bool = True  # `reruns` take another pad id (a registered engine's own options say it)
    _deadline: float | None = None

    # ---- the diagnosis's re-runs ---------------------------------------------------------------
    @property
    def can_rerun(self) -> bool:
        # a recording answers the same whatever its batch
        if not self.rerunnable or capability(self.engine, "recorded_prompts") is not None:
            return False
        if self.engine_name is not None or self.reruns is not None:
            return True
        from specaudit.engines.drafters import ScriptedDrafter

        # an engine object scripted per prompt index: its proposals would follow the wrong prompts
        return self.engine is not None and not isinstance(capability(self.engine, "drafter"), ScriptedDrafter)

    @property
    def takes_pad_option(self) -> bool:
        if self.engine_name is not None:
            from specaudit.engines.registry import takes_option

            return takes_option(self.engine_name, "pad_token_id")
        return self.pad_option

    @property
    def confines_reruns(self) -> bool:
        """Whether a re-run can wrap the engine's own `generate` call alone (`rerun(..., around=)`): always for
        a registered name or the engine object; for a caller's `reruns` only when it takes `around`."""
        if self.engine_name is None and self.reruns is not None:
            return takes_around(self.reruns)
        return True

    def rerun(self, indices: list[int], pad_token_id: int | None,
              around: Callable[[], ContextManager[Any]] | None = None) -> list[list[int]]:
        """A fresh engine on the prompts at `indices` (repeats allowed), with another pad id when given.
        The re-runs of one run together get at most `rerun_budget` seconds (a re-run past it is
        abandoned as the run itself would be, and the diagnosis reports it as not finished). `around`: a
        context entered around the engine's own `generate` call and nothing else (not the building of the
        engine, not a caller's reference decoding for a scripted drafter); a caller's `reruns` that does
        not take it is refused one (`confines_reruns`)."""
        prompts = [list(self.prompts[i]) for i in indices]
        if self.engine_name is None and self.reruns is not None:
            if around is None:
                return self.reruns(indices, pad_token_id)
            if not takes_around(self.reruns):
                raise ValueError("this re-run callable takes no `around`: it cannot say where the engine's call starts")
            return self.reruns(indices, pad_token_id, around=around)
        if self.engine_name is None:
            if pad_token_id is not None:
                raise ValueError("this engine object cannot change its pad id; audit it through a factory")
            return wrapped(self.engine.generate, around)(prompts, self.max_new_tokens, self.eos_token_id)
        from specaudit.equivalence.errors import RunTimeout
        from specaudit.equivalence.guard import call_with_timeout

        left = None
        if self.rerun_budget is not None:
            if self._deadline is None:  # set at the first re-run: all of them share one budget
                self._deadline = time.monotonic() + self.rerun_budget
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise RunTimeout(f"the diagnosis re-runs used up their {self.rerun_budget:g} s")
        fresh = self._build(self.engine_name, {} if pad_token_id is None else {"pad_token_id": pad_token_id})
        return call_with_timeout(wrapped(fresh.generate, around), (prompts, self.max_new_tokens, self.eos_token_id),
                                 left)

    # ---- the crash isolation -------------------------------------------------------------------
    def run_subset(self, indices: list[int]) -> list[list[int]]:
        """The engine on the prompts at `indices` (crash isolation): a fresh one, guarded like the
        audited one, when it has a registered name; else the audited engine object again."""
        prompts = [list(self.prompts[i]) for i in indices]
        if self.engine_name is None:
            return self.engine.generate(prompts, self.max_new_tokens, self.eos_token_id)
        return self._guarded(self._build(self.engine_name)).generate(prompts, self.max_new_tokens, self.eos_token_id)

    # ---- the plain run -------------------------------------------------------------------------
    def plain(self, needed: bool, black_box: bool, requests: list[Any] | None = None) -> dict[str, Any] | None:
        """The plain run of the same rows for the three-way rulings (rulings/plain.py): the configured
        plain engine, always (handed the same `requests` where the run has request parameters); else, below
        float64 for an in-process engine with a batch size and no request parameters, the plain control
        (`batched`), made only when a flip `needed` it. None when there is none."""
        if self.plain_engine and requests is not None:
            from specaudit.equivalence.blackbox.requests_run import plain_under_requests

            engine = self._guarded(self._build(self.plain_engine))  # one that cannot be built: the run's error
            return plain_under_requests(engine, self.plain_engine, self.prompts, requests, self.max_new_tokens,
                                        self.eos_token_id, self.pair.tokenizer)
        if requests is not None:
            return None
        if self.plain_engine:
            return self._plain_run(self.plain_engine)
        if needed and not black_box and self.dtype != "float64" and self.batch_size:
            return self._plain_run(PLAIN_CONTROL)
        return None

    def _plain_run(self, name: str) -> dict[str, Any]:
        """The plain engine `name` on the run's prompts, once per engine, batch size and prompt set,
        shared by every run and flip it controls: its outputs, or the error that stopped it (the rulings
        then go without it), and its seconds."""
        from specaudit.equivalence import speculation
        from specaudit.equivalence.errors import one_line

        key = (name, self.batch_size, tuple(tuple(p) for p in self.prompts))
        if key in self.plain_runs:
            return self.plain_runs[key]
        started = time.perf_counter()
        try:
            engine = self._build(name)
            outputs = self._guarded(engine).generate([list(p) for p in self.prompts], self.max_new_tokens,
                                                     self.eos_token_id)
            describe = capability(engine, "describe")
            result = {"engine": name, "outputs": outputs, "error": None,
                      "description": describe() if callable(describe) else None,
                      "speculation": speculation.of_run(engine, capability(engine, "last_trace"))}
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the audited run goes on, ruled without the plain run
            result = {"engine": name, "outputs": None, "description": None, "speculation": None,
                      "error": one_line(f"the plain engine {name} failed ({type(exc).__name__}: {exc}); the "
                                        "divergences are ruled without it")}
        result["seconds"] = time.perf_counter() - started
        self.plain_runs[key] = result
        return result

    # ---- the payoff ----------------------------------------------------------------------------
    def payoff(self, repeats: int) -> dict[str, Any]:
        """Tokens per second of the speculative engine against the plain engine (`--plain-engine`, else the plain
        control) on the run's prompts, `repeats` times each (equivalence/acceptance/payoff.py); or the error."""
        from specaudit.equivalence.acceptance.payoff import measure
        from specaudit.equivalence.errors import one_line

        plain_name = self.plain_engine or PLAIN_CONTROL
        prompts = [list(p) for p in self.prompts]
        try:
            speculative = (self._guarded(self._build(self.engine_name, {"record_logits": False}))
                           if self.engine_name is not None else self.engine)
            plain = self._guarded(self._build(plain_name, {"record_logits": False}))
            return measure(lambda: speculative.generate(prompts, self.max_new_tokens, self.eos_token_id),
                           lambda: plain.generate(prompts, self.max_new_tokens, self.eos_token_id),
                           repeats, plain_name).to_json()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the run goes on without its payoff
            return {"plain_engine": plain_name, "error": one_line(f"{type(exc).__name__}: {exc}")}

    # ---- engines -------------------------------------------------------------------------------
    def _build(self, name: str, overrides: dict[str, Any] | None = None) -> Any:
        from specaudit.engines.registry import make_engine

        options = {**self.options, **(overrides or {})}
        if "pad_token_id" not in options and self.pair.pad_token_id is not None:
            options["pad_token_id"] = self.pair.pad_token_id
        return make_engine(name, self.pair.target, self.pair.draft, batch_size=self.batch_size or 1,
                           draft_tokens=self.draft_tokens, **options)

    def _guarded(self, engine: Any) -> Any:
        from specaudit.equivalence.guard import GuardedEngine

        return GuardedEngine(engine, timeout=self.timeout, vocab_size=getattr(self.pair.target.config, "vocab_size", None))
