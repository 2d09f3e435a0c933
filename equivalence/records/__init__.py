"""The records of `audit.json`, typed: an audit, its runs, their divergences and each one's diagnosis
(docs/reports.md#auditjson, field by field). `equivalence/records/serialize.py` is the one place that maps them to and
from JSON; `specaudit.read_report(DIR).records` gives them.

Every record is a frozen dataclass with keyword fields named as the JSON keys (the key "class" is the field
`cls`), built by the dataclass itself. What a record holds cannot change after it is made: a sequence is a
tuple, and an open-ended bag (`evidence`, `timing`, `acceptance`, `sampled`, ...) a `FrozenDict` whose lists
are tuples too; `dataclasses.replace` makes a changed copy.

Three kinds of field:
- required: every producer writes the key (a divergence's `kind`, a run's `engine`);
- greedy fields (`GREEDY_FIELDS`: `Run.exact_matches` ... `Run.failures`): a greedy run always has them and a
  sampled run never, so their defaults are what a greedy run that compared nothing holds
  (`run_record.GREEDY_DEFAULTS`);
- optional: a key some runs or divergences have and others lack. Its default is `ABSENT` (the key is not
  written), distinct from None (the key is written as null): an in-process run's `noise_band` is null, a failed
  run has none. `ABSENT` is falsy, so `if run.noise_band:` reads both as "nothing there".

Keys no field names (an engine's own, or a later version's) are kept in `extra` and written back.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Literal

# a run's `mode` (the same strings as run_record.GREEDY and SAMPLED, which builds today's runs)
GREEDY: Final = "greedy"
SAMPLED: Final = "sampled"


class Absent(enum.Enum):
    """The value of an optional field whose key the record's JSON does not have (a null key is None)."""

    ABSENT = "absent"

    def __bool__(self) -> Literal[False]:
        return False

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = Absent.ABSENT


def given(value: Any, default: Any = None) -> Any:
    """An optional field's value, `default` where its key is not written (`ABSENT`): what a reader that
    tells "not written" from null only by `default` reads."""
    return default if value is ABSENT else value


class FrozenDict(dict):  # type: ignore[type-arg]  # a JSON object: str keys, JSON values
    """A dict that refuses every change after it is made: a record's open-ended bag. It is still a dict, so
    `json.dumps`, `==` against a plain dict and `{**bag}` work as on one; it hashes, so a record does too."""

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a record's mapping is read-only: build a new record (dataclasses.replace)")

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]

    def __hash__(self) -> int:  # frozen all the way down (`freeze`), so its values hash too
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and copy rebuild it whole (not key by key)
        return (FrozenDict, (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


def freeze(value: Any) -> Any:
    """`value` with every dict made a `FrozenDict` and every list a tuple, all the way down; records and
    scalars as they are."""
    if isinstance(value, FrozenDict):
        return value
    if isinstance(value, Mapping):
        return FrozenDict({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """`freeze` undone: every mapping a plain dict and every tuple a list, all the way down (a bag handed to
    a caller that may change it, or compare it with lists); records and scalars as they are."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


EMPTY: Final[Mapping[str, Any]] = FrozenDict()


class _Record:
    """What every record does on construction: its mappings and sequences frozen, whatever the caller gave."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, (Mapping, list, tuple)) and not isinstance(value, FrozenDict):
                object.__setattr__(self, f.name, freeze(value))


@dataclass(frozen=True, kw_only=True)
class Context(_Record):
    """The tokens around a divergence: the end of the common prefix, then each side's continuation."""

    common: tuple[int, ...]
    reference: tuple[int, ...]
    engine: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ContextText(_Record):
    """`Context` decoded by the target's tokenizer."""

    common: str
    reference: str
    engine: str


@dataclass(frozen=True, kw_only=True)
class StepBatch(_Record):
    """The batch of the engine step that emitted a divergence's token (engines/trace.py `StepRecord`)."""

    kind: str  # "prefill", "batch", "group" (EXSPEC's same-length group) or "fallback"
    rows: tuple[int, ...]  # the prompt index of each row, in batch order
    pad_lengths: tuple[int, ...]  # each row's left padding when the step began


@dataclass(frozen=True, kw_only=True)
class Diagnosis(_Record):
    """A structural divergence's cause (equivalence/diagnosis/): its class, what showed it, every check tried,
    the check that named it; a served ruling says whether naming it needs the weights."""

    cls: str  # the JSON key "class"
    evidence: str | None
    tried: tuple[str, ...]
    named_by: str | None | Absent = ABSENT  # the check, replay or ruling that named the class
    decided_by: str | None | Absent = ABSENT  # files of earlier versions: what `named_by` says now
    mechanism: str | None | Absent = ABSENT
    would_decide: str | None | Absent = ABSENT  # class `unknown`: the experiment that would name it
    shared: int | Absent = ABSENT  # how many divergences of the run share this class and mechanism
    needs_weights: bool | Absent = ABSENT  # served rulings: outputs alone cannot name it
    extra: Mapping[str, Any] = EMPTY


@dataclass(frozen=True, kw_only=True)
class Divergence(_Record):
    """One divergence of a run, every mode alike: in process, black-box, served, a report check or a
    constraint check."""

    prompt_index: int
    position: int | None  # the new token's index in the output (None: a finding about the whole output)
    reference_token: int | None  # None: the reference ends there
    engine_token: int | None  # None: the engine ends there
    margin: float | None | Absent = ABSENT  # the reference's top-2 margin on the common prefix
    kind: str  # "structural", "numerical" or "reference_mismatch"
    decided_by: str | None | Absent = ABSENT  # the ruling's control
    detected_by: str  # "tokens", "logits", "draft", or a report check's
    logit_error: float | None | Absent = ABSENT
    evidence: Mapping[str, Any]  # what decided the ruling: its reason, margins, band
    context: Context | None | Absent = ABSENT
    text: ContextText | None | Absent = ABSENT
    step: int | None | Absent = ABSENT  # the engine step that emitted it (None: not traced)
    accepted_history: tuple[int, ...] | None | Absent = ABSENT  # the row's accepted counts up to that step
    batch: StepBatch | None | Absent = ABSENT
    # past a numerical flip: the flip it was judged past, and the output of a correct decoder on the engine's own
    # prefix it was judged against (the reference's output otherwise)
    continued_after: int | Absent = ABSENT
    continued_reference: tuple[int, ...] | Absent = ABSENT
    # the three-way ruling against the plain run (rulings/plain.py)
    plain_token: int | None | Absent = ABSENT
    plain_first_divergence: int | None | Absent = ABSENT
    ruled_by: str | Absent = ABSENT
    diagnosis: Diagnosis | Absent = ABSENT  # structural divergences
    bundle: str | Absent = ABSENT  # its repro bundle's file
    extra: Mapping[str, Any] = EMPTY

    @property
    def structural(self) -> bool:
        return self.kind == "structural"

    @property
    def diagnosis_class(self) -> str | None:
        """The diagnosis's class (None: not diagnosed)."""
        return self.diagnosis.cls if self.diagnosis else None


@dataclass(frozen=True, kw_only=True)
class Run(_Record):
    """One run of `audit.json`: an engine at a batch size and dtype on one pair, greedy or sampled, finished
    or failed (equivalence/run_record.py builds them today)."""

    engine: str
    mode: str  # GREEDY or SAMPLED
    pair: str
    batch_size: int | None
    dtype: str  # the audit dtype; "served" against a served reference
    device: str
    num_prompts: int
    # greedy fields: what a greedy run found (equivalence/run_record.py GREEDY_DEFAULTS)
    exact_matches: int = 0
    equivalent: bool  # every run: no structural divergence (greedy), no departure found (sampled)
    structural_divergences: int = 0
    numerical_divergences: int = 0
    max_logit_error: float | None = None
    logit_tolerance: float | None = None
    seconds: float | None  # every run
    tokens_generated: int = 0
    trace: Mapping[str, Any] | None = None  # the engine trace's summary
    prompts: tuple[Mapping[str, Any], ...] = ()  # per prompt: index, exact, matched_prefix, first_divergence, ...
    divergences: tuple[Divergence, ...] = ()
    failures: tuple[Mapping[str, Any], ...] = ()  # the prompts that made the engine fail (equivalence/isolate.py)
    error: str | None  # every run: None, or why it did not finish, in one line
    # a run that did not finish
    failed: bool | Absent = ABSENT
    traceback: str | Absent = ABSENT
    server_died: Mapping[str, Any] | Absent = ABSENT
    # a sampled run: its verdict and its tests' report (docs/sampling.md)
    verdict: str | Absent = ABSENT
    sampled: Mapping[str, Any] | Absent = ABSENT
    reference_mismatches: int | Absent = ABSENT  # request parameters: the reference against its own contract
    noise_band: Mapping[str, Any] | None | Absent = ABSENT  # servers and recordings (width, parts, notes)
    speculation: Mapping[str, Any] | None | Absent = ABSENT  # the engine's speculation counters
    speculation_observed: bool | None | Absent = ABSENT
    acceptance: Mapping[str, Any] | None | Absent = ABSENT  # observed against expected per draft position
    plain_engine: Mapping[str, Any] | None | Absent = ABSENT  # the plain run of the three-way rulings
    engine_description: Mapping[str, Any] | None | Absent = ABSENT
    isolation: Mapping[str, Any] | None | Absent = ABSENT  # crash isolation's re-runs and notes
    timing: Mapping[str, Any] | Absent = ABSENT  # seconds per stage, and diagnosis_mode
    eos_token_ids: tuple[int, ...] | Absent = ABSENT  # the EOS set the run stopped at
    pair_info: Mapping[str, Any] | Absent = ABSENT  # layouts and float64 switches
    adversarial: Mapping[str, Any] | None | Absent = ABSENT  # which adversarial prompts ran, which were left out
    # a served run (--reference)
    seconds_per_request: float | Absent = ABSENT
    description: Mapping[str, Any] | None | Absent = ABSENT
    outputs: tuple[tuple[int, ...], ...] | Absent = ABSENT
    # a greedy run with request parameters (equivalence/blackbox/requests_run.py)
    request_params: tuple[Mapping[str, Any], ...] | Absent = ABSENT
    penalty_scope: str | None | Absent = ABSENT
    logprob_definition: str | None | Absent = ABSENT
    refused_parameters: tuple[Mapping[str, Any], ...] | Absent = ABSENT
    extra: Mapping[str, Any] = EMPTY

    def __post_init__(self) -> None:
        if self.mode not in (GREEDY, SAMPLED):
            raise ValueError(f"run mode {self.mode!r}: give {GREEDY!r} or {SAMPLED!r}")
        super().__post_init__()

    @property
    def greedy(self) -> bool:
        return self.mode == GREEDY

    @property
    def passed(self) -> bool:
        """The run finished and is equivalent (`run_record.passed`)."""
        return bool(self.equivalent) and not self.error

    @property
    def structural(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if d.structural)

    @property
    def divergence_classes(self) -> tuple[str, ...]:
        """The diagnosis class of each structural divergence that has one, in the run's order."""
        return tuple(d.diagnosis.cls for d in self.structural if d.diagnosis)


# the greedy fields: written for a greedy run, never for a sampled one (serialize.py); with `equivalent` and
# `seconds`, what run_record.GREEDY_DEFAULTS gives a greedy run before anything was compared
GREEDY_FIELDS: Final = ("exact_matches", "structural_divergences", "numerical_divergences", "max_logit_error",
                        "logit_tolerance", "tokens_generated", "trace", "prompts", "divergences", "failures")


@dataclass(frozen=True, kw_only=True)
class Audit(_Record):
    """A whole `audit.json`: its header, its runs, and what a served reference adds at the top level."""

    specaudit_version: str
    created: str
    machine: Mapping[str, Any]
    config: Mapping[str, Any]  # the audit's options
    complete: bool  # false while the audit runs or after Ctrl-C
    runs: tuple[Run, ...]
    reference: Mapping[str, Any] | Absent = ABSENT  # a served reference: how it was asked, its determinism
    num_prompts: int | Absent = ABSENT
    adversarial: Mapping[str, Any] | None | Absent = ABSENT
    extra: Mapping[str, Any] = EMPTY
