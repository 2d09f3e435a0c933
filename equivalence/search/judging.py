"""One drawn example judged exactly as the greedy audit judges a run (equivalence/audit.py `audit_engine` with
`RunSettings(requests=...)`), against a reference memoized by prompt and parameters.

`Judging` holds what every example of one search shares: the pair, the audited engine (built once: a server's
client, or an in-process engine), the reference's continuations (what the strategies draw stop strings from) and
its decodes under parameters (`decode_with_params`), each made once per (prompt, parameters). An example is sent
wave by wave (equivalence/search/arrival.py) and ruled by the audit's own stages; the run record it returns is the
audit's. The replay of a bundle (equivalence/search/bundle.py) judges through the same class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specaudit.engines.constraints import ConstraintError
from specaudit.engines.requests import RequestParams, with_bad_words_resolved
from specaudit.engines.requests.reference import RequestResult, decode_with_params
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.blackbox.requests_run import RequestReference, penalty_scope
from specaudit.equivalence.guard import GuardedEngine, failure_message
from specaudit.equivalence.run_record import failed_run, passed
from specaudit.equivalence.search.arrival import ArrivalEngine
from specaudit.equivalence.search.model import Mix
from specaudit.equivalence.search.strategies import Continuation


class Unanswerable(ValueError):
    """A drawn request that no engine can answer: the reference finds no token its parameters leave (a
    constraint whose only tokens are banned or biased away). Not a mix: the search draws another."""


@dataclass(frozen=True)
class JudgingSettings:
    """The run settings every example of one search is judged under."""

    engine_name: str
    batch_size: int
    dtype: str
    max_new_tokens: int
    eos_token_id: Any
    device: str = "cpu"
    timeout: float | None = None
    engine_dtype: str | None = None
    logit_tolerance: float | None = None
    draft_tokens: int | None = None
    speculation: str | None = None


class Judging:
    def __init__(self, pair: Any, engine: Any, settings: JudgingSettings, replay: Any = None) -> None:
        self.pair, self.engine, self.settings = pair, engine, settings
        self.replay = replay if replay is not None else pair  # the float64 pair that rules flips below float64
        self.scope = penalty_scope(engine)
        self.continuations: dict[tuple[int, ...], Continuation] = {}
        self.results: dict[tuple[tuple[int, ...], RequestParams], RequestResult] = {}
        self.reference_seconds = 0.0
        self.engine_seconds = 0.0  # judging the examples (the engine's answers and the rulings)
        self.answer_seconds = 0.0  # the engine answering the examples' requests (inside its `generate`)
        self.examples = 0
        # the last example's answers, per request: the engine's and the reference's (what a bundle keeps)
        self.last_outputs: list[list[int]] = []
        self.last_reference_outputs: list[list[int]] = []

    def continuation(self, prompt: tuple[int, ...]) -> Continuation:
        """The reference's plain greedy continuation of `prompt` (memoized)."""
        if prompt not in self.continuations:
            result = self._result(prompt, RequestParams())
            self.continuations[prompt] = Continuation(tuple(result.tokens), result.text or "")
        return self.continuations[prompt]

    def _result(self, prompt: tuple[int, ...], params: RequestParams) -> RequestResult:
        key = (prompt, params)
        if key not in self.results:
            started = time.perf_counter()
            s = self.settings
            try:
                self.results[key] = decode_with_params(self.pair.target, list(prompt), params, s.max_new_tokens,
                                                       s.eos_token_id, self.pair.tokenizer, penalty_scope=self.scope)
            except ValueError as exc:  # no token left at some step (engines/requests/reference.py), a grammar refused
                if not (isinstance(exc, ConstraintError) or str(exc).startswith("no token left")):
                    raise
                raise Unanswerable(str(exc)) from None
            self.reference_seconds += time.perf_counter() - started
        return self.results[key]

    def params_of(self, mix: Mix) -> list[RequestParams]:
        """Each request's parameters as sent: banned words given as text resolved to ids with the target's
        tokenizer (what the reference applies)."""
        return [with_bad_words_resolved(r.params, self.pair.tokenizer) for r in mix.requests]

    def judge(self, mix: Mix, diagnosis: str = "off", bundle_dir: Any = None) -> dict[str, Any]:
        """The example's run record (equivalence/audit.py `audit_engine`); an engine that fails on it is a run
        with `error` (not passed)."""
        s, pair = self.settings, self.pair
        prompts = [list(r.prompt) for r in mix.requests]
        params = self.params_of(mix)
        started = time.perf_counter()
        reference = RequestReference([self._result(tuple(p), q) for p, q in zip(prompts, params)], 0.0)
        reference.seconds = time.perf_counter() - started
        arrival = ArrivalEngine(self.engine, mix.waves())
        engine = GuardedEngine(arrival, timeout=s.timeout,
                               vocab_size=getattr(pair.target.config, "vocab_size", None))
        run_settings = RunSettings(
            max_new_tokens=s.max_new_tokens, eos_token_id=s.eos_token_id, dtype=s.dtype, engine_name=s.engine_name,
            batch_size=s.batch_size, device=s.device, engine_dtype=s.engine_dtype, logit_tolerance=s.logit_tolerance,
            pad_token_id=pair.pad_token_id, draft_tokens=s.draft_tokens, diagnosis=diagnosis,
            speculation=s.speculation, requests=tuple(params))
        self.examples += 1
        started = time.perf_counter()
        try:
            run = audit_engine(engine, pair, prompts, run_settings, reference=reference,
                               replay_target=self.replay.target,
                               replay_draft=self.replay.draft if s.dtype != "float64" else None,
                               bundle_dir=bundle_dir)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the engine failed on this mix: a failed example, shrunk like any other
            run = failed_run({"engine": s.engine_name, "pair": pair.name, "batch_size": s.batch_size, "dtype": s.dtype,
                              "device": s.device, "num_prompts": len(prompts)},
                             failure_message(s.engine_name, exc, batch_size=s.batch_size, device=s.device), exc)
        if mix.probes and not run.get("error"):
            self._judge_probes(mix, run)
        self.engine_seconds += time.perf_counter() - started
        self.answer_seconds += arrival.answer_seconds
        self.last_outputs = [list(o) for o in arrival.last_outputs]
        self.last_reference_outputs = [list(o) for o in reference.outputs]
        return run

    @property
    def sampled(self) -> bool:
        """Whether the engine takes sampled requests with seeds (equivalence/search/seeds.py)."""
        from specaudit.equivalence.search.seeds import sampler_for

        return sampler_for(self.engine, 1.0) is not None

    def _judge_probes(self, mix: Mix, run: dict[str, Any]) -> None:
        """Each seeded probe's findings added to `run` as structural divergences (seeds.py)."""
        from specaudit.equivalence.records.serialize import divergence_to_json
        from specaudit.equivalence.search.seeds import probe_findings, sampler_for

        s = self.settings
        seen = []
        for probe in mix.probes:
            sampler = sampler_for(self.engine, probe.temperature)
            if sampler is None:
                continue
            prompt = mix.requests[probe.request].prompt
            plain = self._result(tuple(prompt), RequestParams())  # memoized: its logits[0] are the prompt's last
            try:
                found, facts = probe_findings(probe.request, probe, prompt, sampler, plain.logits[0],
                                              s.max_new_tokens, s.eos_token_id)
            except Exception as exc:  # a server refusing sampled requests: said, not a finding
                seen.append({"probe": probe.__dict__, "refused": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            seen.append({"probe": probe.__dict__, **facts})
            for divergence in found:
                run.setdefault("divergences", []).append(divergence_to_json(divergence))
                run["structural_divergences"] = int(run.get("structural_divergences") or 0) + 1
                run["equivalent"] = False
        run["seed_probes"] = seen


def failed(run: dict[str, Any]) -> bool:
    """The example fails as a run fails the audit (equivalence/run_record.py `passed`)."""
    return not passed(run)
