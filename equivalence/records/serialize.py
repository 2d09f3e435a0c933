"""The one place that maps the records of `audit.json` (equivalence/records/) to and from JSON.

`*_to_json` writes a record's keys in the order the pipeline writes them (a greedy run as
`audit.audit_engine` and the runner build it, a sampled run as `sampling/run.sampled_run` does, a divergence as
`rulings/record.divergence`), leaves out every `ABSENT` field and writes the keys of `extra` last.
`*_from_json` reads today's keys into the fields, every other key into `extra`, so that
`run_to_json(run_from_json(run)) == run` for a run of today's files.

A file of an earlier version is read in this version's names first (`upgrade`): a served run's `band` is its
`noise_band`, its divergences' top-level `class`, `needs_weights` and `reason` a `diagnosis`, its report checks
(`findings`) among its divergences; a run without `mode` is greedy and has the greedy fields a greedy run has
(`records.GREEDY_FIELDS`, as `run_record.GREEDY_DEFAULTS`); a divergence without `detected_by` was detected by
its tokens.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from specaudit.equivalence.records import (ABSENT, GREEDY, GREEDY_FIELDS, SAMPLED, Audit, Context, ContextText,
                                           Diagnosis, Divergence, Run, StepBatch)

R = TypeVar("R")

KEYS = {"cls": "class"}  # a field whose JSON key is not its name (a Python keyword)

# a sampled run's first keys, in the order sampling/run.sampled_run writes them; the rest follow in field order
SAMPLED_ORDER = ("engine", "mode", "pair", "batch_size", "dtype", "device", "num_prompts", "error", "verdict",
                 "equivalent", "failed", "traceback", "seconds", "sampled", "acceptance")

# a greedy run's fields before anything was compared (run_record.GREEDY_DEFAULTS, with tuples for its lists)
GREEDY_FIELD_DEFAULTS = {f.name: f.default for f in fields(Run) if f.name in GREEDY_FIELDS}


def _key(name: str) -> str:
    return KEYS.get(name, name)


@functools.cache
def _names(record_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(record_type) if f.name != "extra")


def _json(value: Any) -> Any:
    """A field's value as JSON: records as their objects, mappings as dicts, tuples as lists."""
    if isinstance(value, Diagnosis):
        return diagnosis_to_json(value)
    if isinstance(value, Divergence):
        return divergence_to_json(value)
    if isinstance(value, Run):
        return run_to_json(value)
    if isinstance(value, (Context, ContextText, StepBatch)):
        return _to_json(value, _names(type(value)))
    if isinstance(value, Mapping):
        return {key: _json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(item) for item in value]
    return value


def _to_json(record: Any, order: tuple[str, ...]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for name in order:
        value = getattr(record, name)
        if value is not ABSENT:
            data[_key(name)] = _json(value)
    for key, value in getattr(record, "extra", {}).items():
        if key in data:
            raise ValueError(f"{type(record).__name__}.extra has {key!r}, a field of its own: set the field instead")
        data[key] = _json(value)
    return data


def _from_json(record_type: type[R], data: Any, what: str,
               convert: Mapping[str, Callable[[Any], Any]] | None = None) -> R:
    """`record_type` from the JSON object `data`: each field from its key (through `convert` where given),
    a missing optional key its default, every unknown key into `extra`."""
    if not isinstance(data, Mapping):
        raise ValueError(f"audit.json: {what} is {type(data).__name__}, not an object: not a specaudit audit.json")
    convert = convert or {}
    known, values = set(), {}
    has_extra = False
    for f in fields(record_type):  # type: ignore[arg-type]
        if f.name == "extra":
            has_extra = True
            continue
        key = _key(f.name)
        known.add(key)
        if key in data:
            value = data[key]
            values[f.name] = convert[f.name](value) if f.name in convert and value is not None else value
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"audit.json: {what} has no {key!r} (keys: {', '.join(data) or 'none'}); read a file "
                             "specaudit wrote, or give the record every key docs/reports.md lists")
    extra = {key: value for key, value in data.items() if key not in known}
    if extra:
        if not has_extra:
            raise ValueError(f"audit.json: {what} has unknown keys {', '.join(extra)}; expected "
                             f"{', '.join(sorted(known))}")
        values["extra"] = extra
    return record_type(**values)


def diagnosis_to_json(diagnosis: Diagnosis) -> dict[str, Any]:
    return _to_json(diagnosis, _names(Diagnosis))


def diagnosis_from_json(data: Mapping[str, Any]) -> Diagnosis:
    return _from_json(Diagnosis, data, "a diagnosis")


def divergence_to_json(divergence: Divergence) -> dict[str, Any]:
    return _to_json(divergence, _names(Divergence))


def divergence_from_json(data: Mapping[str, Any]) -> Divergence:
    return _from_json(Divergence, data, "a divergence", {
        "context": lambda value: _from_json(Context, value, "a divergence's context"),
        "text": lambda value: _from_json(ContextText, value, "a divergence's text"),
        "batch": lambda value: _from_json(StepBatch, value, "a divergence's batch"),
        "diagnosis": diagnosis_from_json,
    })


def run_to_json(run: Run) -> dict[str, Any]:
    """A run as `audit.json` keeps it: a greedy run's keys in the in-process audit's order, its greedy fields
    always; a sampled run's in `sampling/run.sampled_run`'s, without the greedy fields. (A failed greedy run's
    come in the greedy order too, where `run_record.failed_run` writes its base's first: the same object.)"""
    names = _names(Run)
    if run.mode == GREEDY:
        return _to_json(run, names)
    for name, default in GREEDY_FIELD_DEFAULTS.items():
        if getattr(run, name) != default:
            raise ValueError(f"a sampled run has the greedy field {name!r} set: leave it at {default!r}")
    rest = tuple(name for name in names if name not in SAMPLED_ORDER and name not in GREEDY_FIELDS)
    return _to_json(run, SAMPLED_ORDER + rest)


def run_from_json(data: Mapping[str, Any]) -> Run:
    """A run of `audit.json`, of this version or an earlier one (`upgrade_run`)."""
    upgraded = upgrade_run(data)
    where = f"run {upgraded.get('engine', '?')!s}"
    return _from_json(Run, upgraded, where, {
        "divergences": lambda value: tuple(divergence_from_json(d) for d in value)})


def audit_to_json(audit: Audit) -> dict[str, Any]:
    return _to_json(audit, _names(Audit))


def audit_from_json(data: Mapping[str, Any]) -> Audit:
    """A whole `audit.json`, of this version or an earlier one."""
    return _from_json(Audit, upgrade(data), "the top level", {
        "runs": lambda value: tuple(run_from_json(run) for run in value)})


def upgrade(audit: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an `audit.json` in this version's names (`upgrade_run` for each run)."""
    upgraded = dict(audit)
    if "runs" in upgraded:
        upgraded["runs"] = [upgrade_run(run) for run in upgraded["runs"] or []]
    return upgraded


def upgrade_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a run of `audit.json` in this version's names. An earlier served run kept its noise band as
    `band` (now `noise_band`, as every run) and its divergences' class, `needs_weights` and reason at top level,
    its report checks apart in `findings` (now each divergence's `diagnosis = {class, evidence, named_by,
    needs_weights, tried}`, the checks among the divergences). Runs before sampled runs had no `mode` (greedy),
    and before crash isolation no `failures`; a served divergence was detected by its tokens."""
    if not isinstance(run, Mapping):
        raise ValueError(f"audit.json: a run is {type(run).__name__}, not an object: not a specaudit audit.json")
    run = copy.deepcopy(dict(run))
    if "band" in run and "noise_band" not in run:
        run["noise_band"] = run.pop("band")
    findings = run.pop("findings", None) or []
    divergences = list(run.get("divergences") or []) + list(findings)
    for divergence in divergences:
        if not isinstance(divergence, dict):
            continue
        divergence.setdefault("detected_by", "tokens")
        if "diagnosis" in divergence or "class" not in divergence:
            continue
        cls, needs = divergence.pop("class"), bool(divergence.pop("needs_weights", False))
        reason = divergence.pop("reason", None)
        divergence.setdefault("evidence", {})
        if isinstance(divergence["evidence"], dict):
            divergence["evidence"].setdefault("reason", reason)
        if divergence.get("kind") == "structural":
            divergence["diagnosis"] = {"class": cls or "unknown", "evidence": reason,
                                       "named_by": divergence.get("decided_by"), "needs_weights": needs,
                                       "tried": []}
    if "divergences" in run or findings:
        run["divergences"] = divergences
    run.setdefault("mode", GREEDY)
    if run["mode"] == GREEDY:
        for name, default in GREEDY_FIELD_DEFAULTS.items():
            run.setdefault(name, _json(default))
    elif run["mode"] != SAMPLED:
        raise ValueError(f"audit.json: run {run.get('engine', '?')} has mode {run['mode']!r}; expected "
                         f"{GREEDY!r} or {SAMPLED!r}")
    return run


# ---- readers' entry points: a record as it is, or the JSON object of one ----------------------------------

# What a hand-built object (a test's, a script's: `{"runs": [...]}`) may leave out of the keys every producer
# writes, read as "not given": a name "?", a number or token None, a sequence empty. A file specaudit wrote has
# every one of them, so it reads exactly as `*_from_json` reads it.
HAND_DEFAULTS: dict[type, dict[str, Any]] = {
    Audit: {"specaudit_version": "", "created": "", "machine": {}, "config": {}, "complete": True, "runs": ()},
    Run: {"engine": "?", "pair": "?", "batch_size": None, "dtype": "?", "device": "?", "num_prompts": None,
          "equivalent": None, "seconds": None, "error": None},
    Divergence: {"prompt_index": None, "position": None, "reference_token": None, "engine_token": None,
                 "kind": None, "detected_by": "tokens", "evidence": {}},
    Diagnosis: {"class": None, "evidence": None, "tried": ()},
    Context: {"common": (), "reference": (), "engine": ()},
    ContextText: {"common": "", "reference": "", "engine": ""},
    StepBatch: {"kind": "?", "rows": (), "pad_lengths": ()},
}
_NESTED = {"context": Context, "text": ContextText, "batch": StepBatch}


def _completed(record_type: type, data: Any) -> Any:
    """`data` (a JSON object of `record_type`) with each missing key of HAND_DEFAULTS given, its nested
    records' too; anything but an object as it is (`*_from_json` says what is wrong with it)."""
    if not isinstance(data, Mapping):
        return data
    done = {**HAND_DEFAULTS[record_type], **data}
    if record_type is Audit and isinstance(done["runs"], (list, tuple)):
        done["runs"] = [_completed(Run, run) for run in done["runs"]]
    elif record_type is Run and isinstance(done.get("divergences"), (list, tuple)):
        done["divergences"] = [_completed(Divergence, d) for d in done["divergences"]]
    elif record_type is Divergence:
        if isinstance(done.get("diagnosis"), Mapping):
            done["diagnosis"] = _completed(Diagnosis, done["diagnosis"])
        for key, nested in _NESTED.items():
            if isinstance(done.get(key), Mapping):
                done[key] = _completed(nested, done[key])
    return done


def as_audit(audit: Audit | Mapping[str, Any]) -> Audit:
    """`audit` as an `Audit`: a record as it is, the JSON object of one (`audit.json`, of this version or an
    earlier one) read once by `audit_from_json`, the keys a hand-built one leaves out as not given."""
    if isinstance(audit, Audit):
        return audit
    return audit_from_json(_completed(Audit, upgrade(audit)))


def as_run(run: Run | Mapping[str, Any]) -> Run:
    """`run` as a `Run` (`as_audit`, for one run)."""
    if isinstance(run, Run):
        return run
    return run_from_json(_completed(Run, upgrade_run(run)))


def as_divergence(divergence: Divergence | Mapping[str, Any]) -> Divergence:
    """`divergence` as a `Divergence` (`as_audit`, for one divergence)."""
    if isinstance(divergence, Divergence):
        return divergence
    return divergence_from_json(_completed(Divergence, divergence))
