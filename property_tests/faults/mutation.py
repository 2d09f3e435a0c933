"""Fault engines as line edits of the shipped engine sources, built side by side with them.

A planted fault is a `LineChange` (or a few): an exact line of `engines/<module>.py` and what it
becomes. `mutant_modules` compiles fresh copies of the engine modules (`ragged`, `batch`,
`drafters`, `eqspec` and, when present, `exspec`) with the changes applied, wired to each other
instead of to the originals, and registered under their own names. The shipped modules are
never touched: a fault engine and the correct engine run in the same process.

A line that is not found exactly once raises `StaleFault`: the shipped engine changed, and the
fault must be re-planted against the new line.

`FaultEngine` is the base of every fault: its constructor has the engine-factory contract
`(target, draft, *, batch_size, draft_tokens, drafter=None, pad_token_id=None,
record_logits=False, **options)`, and it delegates `generate` and `last_trace` to the mutant
engine. A step budget of twice what a correct engine could need stops a fault that no longer
makes progress: an EQSPEC batch then ends with the tokens it has, an EXSPEC pool raises
`RunawayDecoding`.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_MODULES = ("specaudit.engines.sampling.rules", "specaudit.engines.ops.recurrent", "specaudit.engines.ops.ragged",
                  "specaudit.engines.batch", "specaudit.engines.drafters", "specaudit.engines.acceptance", "specaudit.engines.eqspec", "specaudit.engines.exspec", "specaudit.engines.inplace")
MUTANT_PACKAGE = "specaudit.testing.faults.mutants"


class StaleFault(RuntimeError):
    """A fault's line no longer occurs exactly once in the shipped engine source."""


class RunawayDecoding(AssertionError):
    """A fault engine took more steps than any correct engine could need."""

    through = "step budget"


@dataclass(frozen=True)
class LineChange:
    """Replace the line(s) `old` of `module` (compared without surrounding whitespace) by `new`.

    `old` may span consecutive lines and `new` may be several lines ("\\n"); `new` is indented
    like the first line of `old`. An empty `new` becomes `pass`.
    """

    module: str
    old: str
    new: str

    def apply(self, source: str, path: str) -> str:
        lines = source.splitlines()
        old = [line.strip() for line in self.old.strip().splitlines()]
        hits = [i for i in range(len(lines) - len(old) + 1)
                if [line.strip() for line in lines[i:i + len(old)]] == old]
        if len(hits) != 1:
            raise StaleFault(f"{path}: expected exactly one occurrence of {self.old.strip()!r}, found {len(hits)}")
        start = hits[0]
        first = lines[start]
        indent = first[: len(first) - len(first.lstrip())]
        new = [line.strip() for line in self.new.strip().splitlines()] or ["pass"]
        lines[start:start + len(old)] = [indent + line for line in new]
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        path = self.module.removeprefix("specaudit.").replace(".", "/") + ".py"
        old = "; ".join(line.strip() for line in self.old.strip().splitlines())
        new = "; ".join(line.strip() for line in self.new.strip().splitlines()) or "pass"
        return f"{path}: `{old}` -> `{new}`"


_BUILD_LOCK = threading.Lock()
_BUILT: dict[tuple[str, tuple[LineChange, ...]], dict[str, types.ModuleType]] = {}


def _original(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def _rewire(copy: types.ModuleType, originals: dict[str, types.ModuleType], copies: dict[str, types.ModuleType]) -> None:
    """Point every name `copy` imported from an original engine module at that module's copy."""
    by_identity = {id(module): name for name, module in originals.items()}
    for attr, value in list(vars(copy).items()):
        if isinstance(value, types.ModuleType) and id(value) in by_identity:
            source = by_identity[id(value)]
            if source in copies:
                setattr(copy, attr, copies[source])
            continue
        home = getattr(value, "__module__", None)
        name = getattr(value, "__name__", None)
        if home in copies and name and getattr(originals[home], name, None) is value:
            setattr(copy, attr, getattr(copies[home], name))


def mutant_modules(tag: str, changes: tuple[LineChange, ...]) -> dict[str, types.ModuleType]:
    """Fresh copies of the engine modules with `changes` applied, keyed by original name."""
    key = (tag, changes)
    with _BUILD_LOCK:
        if key in _BUILT:
            return _BUILT[key]
        known = {c.module for c in changes} - set(ENGINE_MODULES)
        if known:
            raise ValueError(f"fault {tag}: cannot change {sorted(known)}; engine modules are {ENGINE_MODULES}")
        originals = {name: m for name in ENGINE_MODULES if (m := _original(name)) is not None}
        missing = {c.module for c in changes} - set(originals)
        if missing:
            raise StaleFault(f"fault {tag}: {sorted(missing)} does not exist")
        copies: dict[str, types.ModuleType] = {}
        for name, original in originals.items():
            path = original.__file__
            source = Path(path).read_text()
            for change in changes:
                if change.module == name:
                    source = change.apply(source, path)
            copy_name = f"{MUTANT_PACKAGE}.{tag}.{name.rsplit('.', 1)[-1]}"
            copy = types.ModuleType(copy_name, original.__doc__)
            copy.__file__ = path
            sys.modules[copy_name] = copy
            exec(compile(source, f"{path} [fault {tag}]", "exec"), vars(copy))
            copies[name] = copy
            _rewire(copy, originals, copies)
        _BUILT[key] = copies
        return copies


class StepBudget:
    """Wraps a mutant module's `speculative_step`; `left` is set before each `generate`."""

    def __init__(self, step, result_type, record_type, *, graceful: bool) -> None:
        self.step, self.result_type, self.record_type = step, result_type, record_type
        self.graceful = graceful
        self.left = math.inf

    def __call__(self, target, drafter, state, *args, **kwargs):
        if self.left <= 0:
            if not self.graceful:
                raise RunawayDecoding("the fault engine took more steps than a correct engine could need")
            rows, state.rows = list(state.rows), []
            record = self.record_type(step=-1, kind="stopped", rows=[], pad_lengths=[], accepted_counts=[], emitted_counts=[])
            return self.result_type(record, [], None, rows)
        self.left -= 1
        return self.step(target, drafter, state, *args, **kwargs)


class FaultEngine:
    """Base of the planted faults: a shipped engine rebuilt with `changes` applied.

    Subclasses set `changes`, `engine` ("eqspec" or "exspec") and, when the fault lives in the
    model drafter and cannot change any output, `drafter_kind = "model"`. `pairs` are the
    built-in pairs the fault is hunted on; `schedule_kinds` the acceptance schedules, when a fault
    needs others than the usual ones (steps with no draft).
    """

    changes: tuple[LineChange, ...] = ()
    engine: str = "eqspec"
    pairs: tuple[str, ...] = ("tiny-llama",)
    drafter_kind: str = "scripted"
    schedule_kinds: tuple[str, ...] | None = None  # the acceptance schedules hunted (None: the usual ones)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.changes:
            lines = "\n".join(f"    {c.describe()}" for c in cls.changes)
            cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\n    Planted by:\n{lines}\n"

    @classmethod
    def slug(cls) -> str:
        return "".join(f"_{c.lower()}" if c.isupper() else c for c in cls.__name__).lstrip("_")

    @classmethod
    def summary(cls) -> str:
        """The bug class: the docstring up to its first colon."""
        return " ".join((cls.__doc__ or cls.__name__).split(":", 1)[0].split())

    @classmethod
    def modules(cls) -> dict[str, types.ModuleType]:
        return mutant_modules(cls.slug(), cls.changes)

    def __init__(self, target, draft=None, *, batch_size: int, draft_tokens: int, drafter=None,
                 pad_token_id: int | None = None, record_logits: bool = False, **options: Any) -> None:
        modules = self.modules()
        eqspec = modules["specaudit.engines.eqspec"]
        if self.engine == "exspec":
            exspec = modules["specaudit.engines.exspec"]
            if "window" in options and "window_size" not in options:
                options["window_size"] = options.pop("window")
            self.inner = exspec.EXSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, drafter=drafter,
                                       pad_token_id=pad_token_id, record_logits=record_logits, **options)
            host, graceful = exspec, False
        else:
            self.inner = eqspec.EQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, drafter=drafter,
                                       pad_token_id=pad_token_id, record_logits=record_logits, **options)
            host, graceful = eqspec, True
        step = vars(host)["speculative_step"]
        self.budget = step if isinstance(step, StepBudget) else StepBudget(
            step, eqspec.StepResult, eqspec.StepRecord, graceful=graceful)
        host.speculative_step = self.budget

    @property
    def drafter(self):
        return self.inner.drafter

    @drafter.setter
    def drafter(self, value) -> None:
        self.inner.drafter = value

    @property
    def record_logits(self) -> bool:
        return self.inner.record_logits

    @record_logits.setter
    def record_logits(self, value: bool) -> None:
        self.inner.record_logits = value

    @property
    def last_trace(self):
        return self.inner.last_trace

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> list[list[int]]:
        self.budget.left = 2 * max(len(prompts), 1) * max(max_new_tokens, 1) + 4
        try:
            return self.inner.generate(prompts, max_new_tokens, eos_token_id)
        finally:
            self.budget.left = math.inf
