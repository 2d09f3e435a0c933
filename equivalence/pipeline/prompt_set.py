"""Where an audit's prompts come from, resolved in one place, once per oracle group (equivalence/pipeline/runner.py).

The rules, in order:

1. A recording brings its own prompts. Where no prompts file is given and the oracle needs the group's prompts
   from recordings (`from_recordings`: a served reference is asked once for the group's prompts, so every
   recording among the engines and the reference defines them; the weights decode any prompt, so recordings
   define the group's prompts only where every audited engine is one), the first recording's prompts are the
   set; where a recording holds one line per sample (`unique`), every distinct prompt of the recordings once,
   in order.
   Against the weights a recording is always audited on its own prompts (`PromptSet.for_recording`).
2. Else the prompts file (`--prompts FILE`, every format `equivalence/prompts.py` reads), or the built-in set,
   cut to `--num-prompts`, each checked against the model's vocabulary and positions.
3. The adversarial additions (`equivalence/adversarial.py`) follow, where the oracle makes them
   (`adversarial`) and the set is not a recording's.
4. Each prompt's request parameters (a prompts file line's `params` over the command line's, bad words
   resolved with the tokenizer): `requests`, None where the audit sends none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from specaudit.equivalence.errors import UsageError
from specaudit.equivalence.pipeline.settings import AuditSettings

# the adversarial additions of a prompt set: (the prompts with the additions, what the run record keeps of them)
Adversarial = Callable[[list[list[int]]], tuple[list[list[int]], dict[str, Any]]]


@dataclass(frozen=True)
class PromptSet:
    """The prompts one oracle group judges, the adversarial cases among them, and each prompt's parameters."""

    prompts: list[list[int]]
    adversarial: dict[str, Any] | None  # {"first_index", "cases", "skipped"}; None: none added
    requests: list[Any] | None  # one RequestParams per prompt; None: no request parameters
    source: str  # "builtin", the prompts file, or "recorded:FILE"

    @property
    def from_recording(self) -> bool:
        return self.source.startswith("recorded:")

    def for_recording(self, recorded_prompts: Sequence[Sequence[int]], num_prompts: int | None) -> PromptSet:
        """The set a recording is audited on against the weights: its own prompts (rule 1), no additions, no
        request parameters (a recording answers as it was recorded)."""
        prompts = [list(p) for p in recorded_prompts]
        return replace(self, prompts=prompts[:num_prompts] if num_prompts else prompts, adversarial=None,
                       requests=None)


def recording_specs(specs: Sequence[str | None]) -> list[str]:
    from specaudit.equivalence.pipeline.settings import source_of

    return [spec for spec in specs if spec is not None and source_of(spec) == "recording"]


def recorded_prompts(spec: str, unique: bool) -> list[list[int]]:
    """A recording's prompts, in file order; each distinct one once where `unique` (one line per sample)."""
    from specaudit.engines.adapters.recorded import read_recording

    prompts = [list(line.prompt_ids) for line in read_recording(spec.partition(":")[2])]
    return [list(p) for p in dict.fromkeys(tuple(p) for p in prompts)] if unique else prompts


def resolve_prompts(settings: AuditSettings, *, tokenizer: Any, vocab_size: int | None = None,
                    max_positions: int | None = None, from_recordings: Sequence[str] = (), unique: bool = False,
                    adversarial: Adversarial | None = None, with_requests: bool = True) -> PromptSet:
    """The group's prompt set by the module's rules; `UsageError` for prompts that cannot be read or judged."""
    from specaudit.equivalence.prompts import check_ids, load_prompts

    if from_recordings and settings.prompts == "builtin":
        spec = from_recordings[0]
        # one line per sample: every distinct prompt of the recordings once, in order; else the first's lines
        prompts = ([list(p) for p in dict.fromkeys(tuple(p) for r in from_recordings for p in recorded_prompts(r, True))]
                   if unique else recorded_prompts(spec, False))
        prompts = prompts[: settings.num_prompts] if settings.num_prompts else prompts
        for number, ids in enumerate(prompts, 1):  # a PromptError is a UsageError: exit 2
            check_ids(f"{spec}: prompt {number}", ids, vocab_size, None, settings.max_new_tokens)
        return PromptSet(prompts, None, None, spec)
    prompts = load_prompts(settings.prompts, tokenizer, settings.num_prompts, vocab_size=vocab_size,
                           max_positions=max_positions, max_new_tokens=settings.max_new_tokens)
    extra = None
    if settings.adversarial and adversarial is not None:
        prompts, extra = adversarial(prompts)
    requests = prompt_requests(settings, len(prompts), tokenizer) if with_requests else None
    return PromptSet(prompts, extra, requests, settings.prompts)


def prompt_requests(settings: AuditSettings, count: int, tokenizer: Any, common: Any = None) -> list[Any] | None:
    """One RequestParams per prompt (a prompts file line's `params` over `common`, the command line's by default;
    bad words resolved with `tokenizer` where given), or None where the audit sends no request parameter."""
    import json

    from specaudit.engines.requests import with_bad_words_resolved
    from specaudit.equivalence.blackbox.requests_run import has_request_params, prompt_params

    if not has_request_params(settings.prompts, settings.request_params):
        return None
    try:
        params = prompt_params(settings.prompts, count, settings.request_params if common is None else common,
                               settings.num_prompts)
    except (ValueError, json.JSONDecodeError) as exc:
        raise UsageError(str(exc)) from None
    return [with_bad_words_resolved(p, tokenizer) for p in params] if tokenizer is not None else params
