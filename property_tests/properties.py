"""The equivalence property: an engine's output equals greedy decoding, token by token and, in
float64, logit by logit.

Public: `check_equivalence(engine_factory, case)` builds an engine the way the harness does,
`factory(target, draft, batch_size=..., draft_tokens=..., drafter=..., pad_token_id=...,
record_logits=True)`, passing only the keywords the factory accepts, runs it on the case's
prompts, and compares with `engines.reference.ReferenceDecoder` on the same prompts, EOS and
budget. Engines that take a `drafter` get a `ScriptedDrafter` following the case's acceptance
schedule; the others draft with their own model. Any difference raises `EquivalenceFailure`
(an AssertionError) naming the prompt, the output position, the engine step and both tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from hypothesis import note, settings
from hypothesis.control import currently_in_test_context

from specaudit.engines import reference_memo
from specaudit.engines.contract import capability
from specaudit.engines.limits import eos_ids
from specaudit.engines.drafters import ScriptedDrafter
from specaudit.engines.reference import greedy_decode
from specaudit.engines.models.zoo import ModelPair
from specaudit.engines.trace import StepRecord, Trace
from specaudit.testing import models
from specaudit.testing.strategies import DecodingCase, EosChoice
from specaudit.equivalence.rulings.thresholds import FLOAT64_LOGIT_TOLERANCE

LOGIT_TOLERANCE = FLOAT64_LOGIT_TOLERANCE
DrafterMode = Literal["auto", "scripted", "model"]


class ReferenceOracle:
    """Greedy outputs and logits per (pair, prompt), cached: decoded once without EOS to the
    longest budget asked for; any EOS and shorter budget is a truncation of that run.

    A built-in prompt on a built-in pair within 24 new tokens reads the kept run of `models.reference`.
    Where `SPECAUDIT_REFERENCE_MEMO` names a folder, any other run is read from its `oracle/` folder when kept
    there (engines/reference_memo.py names each file by what the run depends on), and a run decoded under a
    derandomized search (the `ci` profile, whose cases are the same from run to run) is kept there; a random
    search's prompts would only pile up."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}
        self._environment_keys: dict[int, tuple[torch.nn.Module, str]] = {}  # id(target) -> target, its key

    def decode(self, pair: ModelPair, prompt: tuple[int, ...], max_new_tokens: int,
               eos_token_id: int | Sequence[int] | None) -> tuple[list[int], torch.Tensor]:
        key = (pair_key(pair), tuple(prompt))
        run = self._runs.get(key)
        if run is None or len(run[0]) < max_new_tokens:
            # a built-in prompt on a cached built-in pair: its kept reference run (models.builtin_run)
            run = models.builtin_run(pair.target, tuple(prompt), max_new_tokens) or self._kept_or_decoded(
                pair, tuple(prompt), max_new_tokens)
            self._runs[key] = run
        tokens = run[0][:max_new_tokens]
        ends = eos_ids(eos_token_id)  # one id or a set: the first of any of them ends the row
        first = next((i for i, t in enumerate(tokens) if t in ends), None)
        if first is not None:
            tokens = tokens[: first + 1]
        return tokens, run[1][: len(tokens)]

    def _kept_or_decoded(self, pair: ModelPair, prompt: tuple[int, ...],
                         max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        path = self._kept_path(pair, prompt, max_new_tokens)
        run = reference_memo.read_run(path, pair.target.device)
        if run is None:
            run = greedy_decode(pair.target, list(prompt), max_new_tokens, None, record_logits=True)
            if settings.default.derandomize:
                reference_memo.keep_run(path, run)
        return run

    def _kept_path(self, pair: ModelPair, prompt: tuple[int, ...], max_new_tokens: int) -> Path | None:
        folder = reference_memo.memo_folder()
        if folder is None:
            return None
        target = pair.target
        known = self._environment_keys.get(id(target))
        if known is None or known[0] is not target:
            known = self._environment_keys[id(target)] = (target, reference_memo.environment_key(target))
        request = reference_memo.request_digest([prompt], max_new_tokens, (), target.device)
        return reference_memo.run_path(folder / "oracle", pair.name, target, request, known[1])


DEFAULT_ORACLE = ReferenceOracle()


def pair_key(pair: ModelPair) -> str:
    return f"{pair.name}/{pair.target.dtype}/{pair.target.device}/{id(pair.target)}"


def resolve_eos(case: DecodingCase, pair: ModelPair, oracle: ReferenceOracle) -> int | None:
    """The case's EOS as a token id: an `EosChoice` names the token the reference emits there."""
    if case.eos is None or isinstance(case.eos, int):
        return case.eos
    choice: EosChoice = case.eos
    tokens, _ = oracle.decode(pair, case.prompts[choice.row].tokens, case.max_new_tokens, None)
    return tokens[min(choice.position, len(tokens) - 1)]


@dataclass
class EquivalenceReport:
    """What a passing check saw, for summaries."""

    outputs: list[list[int]]
    reference: list[list[int]]
    eos_token_id: int | None
    drafter: str
    max_logit_error: float | None = None
    steps: int | None = None
    accepted: list[list[int]] | None = None  # per prompt, accepted draft tokens at each of its speculative steps


class EquivalenceFailure(AssertionError):
    """The engine differs from greedy decoding at `prompt_index`, output `position`."""

    def __init__(self, message: str, *, prompt_index: int, position: int, step: int | None,
                 reference_token: int | None, engine_token: int | None, through: str,
                 logit_error: float | None = None) -> None:
        super().__init__(message)
        self.prompt_index = prompt_index
        self.position = position
        self.step = step
        self.reference_token = reference_token
        self.engine_token = engine_token
        self.through = through  # "tokens" or "logits"
        self.logit_error = logit_error


def _accepted_keywords(factory: Callable[..., Any], wanted: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return wanted
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return wanted
    names = {p.name for p in parameters}
    return {key: value for key, value in wanted.items() if key in names}


def takes_drafter(factory: Callable[..., Any]) -> bool:
    """True when the factory names a `drafter` parameter (EQSPEC, EXSPEC and planted faults do)."""
    try:
        return "drafter" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def build_engine(engine_factory: Callable[..., Any], case: DecodingCase, pair: ModelPair,
                 drafter: ScriptedDrafter | None, **engine_options: Any) -> Any:
    wanted: dict[str, Any] = {
        "batch_size": case.batch_size,
        "draft_tokens": case.draft_tokens,
        "pad_token_id": case.pad_token_id if case.pad_token_id is not None else pair.pad_token_id,
        "record_logits": True,
    }
    if drafter is not None:
        wanted["drafter"] = drafter
    if case.window is not None:
        wanted["window_size"] = case.window
    wanted.update(engine_options)
    return engine_factory(pair.target, pair.draft, **_accepted_keywords(engine_factory, wanted))


def _step_of(trace: Trace | None, prompt_index: int, position: int) -> int | None:
    """The step that emitted the token (an index into `trace.steps`); None without a trace or past its record."""
    if trace is None:
        return None
    try:
        return int(trace.emitted_at[prompt_index][position])
    except IndexError:
        return None


def _fmt(tokens: list[int], around: int, width: int = 6) -> str:
    start = max(0, around - width)
    head = "... " if start else ""
    return head + str(tokens[start: around + width + 1])


def _token_failure(case: DecodingCase, prompt_index: int, expected: list[int], got: list[int], trace: Trace | None,
                   eos: int | None) -> EquivalenceFailure:
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    reference_token = expected[position] if position < len(expected) else None
    engine_token = got[position] if position < len(got) else None
    step = _step_of(trace, prompt_index, min(position, len(got) - 1)) if got else None
    if engine_token is None:
        what = f"the engine stopped after {len(got)} tokens; the reference goes on with {reference_token}"
    elif reference_token is None:
        what = f"the engine emitted {engine_token} after the reference stopped (EOS {eos}, budget {case.max_new_tokens})"
    else:
        what = f"reference token {reference_token}, engine token {engine_token}"
    message = (
        f"prompt {prompt_index}, position {position}, step {step}: {what}\n"
        f"  reference: {_fmt(expected, position)}\n"
        f"  engine:    {_fmt(got, position)}\n"
        f"  {case.describe_row(prompt_index)}\n  eos token {eos}"
    )
    return EquivalenceFailure(message, prompt_index=prompt_index, position=position, step=step,
                              reference_token=reference_token, engine_token=engine_token, through="tokens")


def compare_logits(case: DecodingCase, outputs: list[list[int]], engine_logits: list[Any],
                   reference_logits: list[torch.Tensor], trace: Trace | None, tolerance: float) -> float:
    """Largest |engine - reference| over every row's output, in float64; raises past `tolerance`."""
    worst = 0.0
    for prompt_index, (got, expected) in enumerate(zip(engine_logits, reference_logits)):
        n = len(outputs[prompt_index])
        if n == 0:
            continue
        if got is None or got.shape[0] != n:
            shape = None if got is None else tuple(got.shape)
            raise AssertionError(f"prompt {prompt_index}: engine logits {shape} do not cover its {n} output tokens")
        errors = (got.detach().to("cpu", torch.float64) - expected.detach().to("cpu", torch.float64)).abs().amax(dim=-1)
        worst = max(worst, float(errors.max()))
        beyond = (~(errors < tolerance)).nonzero().flatten()
        if beyond.numel():
            position = int(beyond[0])
            error = float(errors[position])
            step = _step_of(trace, prompt_index, position)
            token = outputs[prompt_index][position]
            message = (
                f"prompt {prompt_index}, position {position}, step {step}: tokens agree ({token}) but the "
                f"target logits differ from the reference's by {error:.3g} (tolerance {tolerance:g}; "
                f"largest on this row {float(errors.max()):.3g})\n  {case.describe_row(prompt_index)}"
            )
            raise EquivalenceFailure(message, prompt_index=prompt_index, position=position, step=step,
                                     reference_token=token, engine_token=token, through="logits", logit_error=error)
    return worst


def check_equivalence(
    engine_factory: Callable[..., Any],
    case: DecodingCase,
    *,
    pair: ModelPair | None = None,
    drafter: DrafterMode = "auto",
    logit_tolerance: float = LOGIT_TOLERANCE,
    oracle: ReferenceOracle | None = None,
    **engine_options: Any,
) -> EquivalenceReport:
    """Run the engine on the case and assert it equals the reference decoder.

    `pair` defaults to the cached built-in pair named by the case. `drafter`: "scripted" hands the
    engine a `ScriptedDrafter` on the case's schedule, "model" lets it draft with its own model,
    "auto" picks scripted when the factory takes a `drafter` and the case has a schedule. Logits
    are compared when the target is float64 and the engine exposes `last_trace.logits`.
    """
    oracle = oracle or DEFAULT_ORACLE
    pair = pair if pair is not None else models.pair(case.pair, case.dtype)
    eos = resolve_eos(case, pair, oracle)
    decoded = [oracle.decode(pair, p.tokens, case.max_new_tokens, eos) for p in case.prompts]
    reference = [tokens for tokens, _ in decoded]
    scripted = case.schedule is not None and (drafter == "scripted" or (drafter == "auto" and takes_drafter(engine_factory)))
    scripted_drafter = None
    if scripted:
        vocab_size = int(pair.target.config.vocab_size)
        scripted_drafter = ScriptedDrafter(reference, case.schedule, vocab_size)
    if currently_in_test_context():
        note(f"eos token {eos}; drafter {'scripted' if scripted else 'model'}; reference lengths {[len(r) for r in reference]}")
    engine = build_engine(engine_factory, case, pair, scripted_drafter, **engine_options)
    outputs = engine.generate(case.prompt_tokens, case.max_new_tokens, eos)
    trace: Trace | None = capability(engine, "last_trace")
    if len(outputs) != len(reference):
        raise AssertionError(f"the engine answered {len(outputs)} prompts out of {len(reference)}")
    for prompt_index, (expected, got) in enumerate(zip(reference, outputs)):
        if list(got) != expected:
            raise _token_failure(case, prompt_index, expected, list(got), trace, eos)
    max_logit_error = None
    engine_logits = trace.logits if trace is not None else None
    if pair.target.dtype == torch.float64 and engine_logits is not None and any(x is not None for x in engine_logits):
        max_logit_error = compare_logits(case, outputs, list(engine_logits), [logits for _, logits in decoded],
                                         trace, logit_tolerance)
    steps = trace.steps if trace is not None else None
    return EquivalenceReport(outputs=[list(o) for o in outputs], reference=reference, eos_token_id=eos,
                             drafter="scripted" if scripted else "model", max_logit_error=max_logit_error,
                             steps=len(steps) if steps is not None else None,
                             accepted=accepted_per_prompt(steps, len(outputs)) if steps is not None else None)


def accepted_per_prompt(steps: list[StepRecord], num_prompts: int) -> list[list[int]]:
    accepted: list[list[int]] = [[] for _ in range(num_prompts)]
    for step in steps:
        if step.kind == "prefill":
            continue
        for row, count in zip(step.rows, step.accepted_counts):
            accepted[row].append(int(count))
    return accepted


def check_scripted_acceptance(case: DecodingCase, report: EquivalenceReport) -> None:
    """The trace shows the acceptance the schedule dictated: at every speculative step of a row but
    its last (where the reference may end inside the draft), exactly min(schedule, k) accepted (none
    at a step where the schedule proposed no draft)."""
    assert case.schedule is not None and report.drafter == "scripted" and report.accepted is not None
    for prompt_index, counts in enumerate(report.accepted):
        expected = [max(min(case.schedule(prompt_index, step), case.draft_tokens), 0) for step in range(len(counts))]
        if counts[:-1] != expected[:-1]:
            step = next(i for i, (a, b) in enumerate(zip(counts, expected)) if a != b)
            raise AssertionError(
                f"prompt {prompt_index}, its speculative step {step}: accepted {counts[step]} draft tokens, "
                f"the schedule dictated {expected[step]}\n  accepted {counts}\n  schedule {expected}\n"
                f"  {case.describe_row(prompt_index)}"
            )
