"""What the reports lead with: the diagnosis of the structural divergences, one line per class.

Each line has the class, how many structural divergences it names and their share of all of
them, what decided it (the experiments that named that class, with how many each), the first
example (run, prompt, position, and why that prompt is in the audit when it is an adversarial
one), the evidence of that example and the fix in one sentence. Shared by `report.md`, `report.html` and
the pytest plugin's failure message, so all three say the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specaudit.equivalence.blackbox.outputs import REQUEST_CLASSES, REQUEST_FIXES
from specaudit.equivalence.diagnosis.core import CLASSES, FIXES
from specaudit.equivalence.records import Audit, Divergence, Run, given
from specaudit.equivalence.records.serialize import as_audit


@dataclass(frozen=True)
class ClassLine:
    cls: str
    count: int
    share: float  # of all structural divergences of the audit
    named_by: str  # the experiments that named this class, with their counts; for unknown, what would
    example: str  # where the first one is
    evidence: str  # what showed its class
    fix: str


def adversarial_case(run: Run, prompt_index: Any) -> Mapping[str, Any] | None:
    """The adversarial case of `prompt_index` in `run` (a mapping of the run's open-ended `adversarial` bag:
    case, length, why, prompt_index), or None for an ordinary prompt."""
    for case in (run.adversarial or {}).get("cases") or []:
        if case.get("prompt_index") == prompt_index:
            return case
    return None


def example_text(run: Run, divergence: Divergence) -> str:
    where = (f"{run.engine} · {run.pair} · batch {run.batch_size} · "
             f"{run.dtype}: prompt {divergence.prompt_index}, new token "
             f"{divergence.position}")
    case = adversarial_case(run, divergence.prompt_index)
    if case is not None:
        where += f" (adversarial prompt `{case.get('case')}`: {case.get('why')})"
    return where


def class_lines(audit: Audit | Mapping[str, Any]) -> list[ClassLine]:
    """One line per diagnosed class, most frequent first (`unknown` last)."""
    counts: dict[str, int] = {}
    deciders: dict[str, dict[str, int]] = {}
    first: dict[str, tuple[Run, Divergence]] = {}
    for run in as_audit(audit).runs:
        for divergence in run.structural:
            found = divergence.diagnosis or None
            cls = (found.cls if found else None) or "unknown"
            counts[cls] = counts.get(cls, 0) + 1
            would_decide = given(found.would_decide) if found else None
            named_by = given(found.named_by) if found else None
            decider = (f"would decide: {would_decide}" if cls == "unknown" and would_decide
                       else str(named_by or "not recorded"))
            deciders.setdefault(cls, {})[decider] = deciders.setdefault(cls, {}).get(decider, 0) + 1
            first.setdefault(cls, (run, divergence))
    total = sum(counts.values())
    known = list(CLASSES) + [c for c in REQUEST_CLASSES if c not in CLASSES]
    order = sorted(counts, key=lambda c: (c == "unknown", -counts[c], known.index(c) if c in known else 99))
    lines = []
    for cls in order:
        run, divergence = first[cls]
        evidence = str((divergence.diagnosis.evidence if divergence.diagnosis else None) or "not diagnosed")
        decided = "; ".join(f"{name} ({n})" for name, n in sorted(deciders[cls].items(), key=lambda kv: -kv[1]))
        lines.append(ClassLine(cls, counts[cls], counts[cls] / total, decided, example_text(run, divergence),
                               evidence, FIXES.get(cls) or REQUEST_FIXES.get(cls) or FIXES["unknown"]))
    return lines


def adversarial_note(audit: Audit) -> str | None:
    """One sentence on the adversarial prompts of the audit (how many, what was left out), said once for
    every pair whose prompts got the same ones: "tiny-gpt2, tiny-opt: 9 adversarial prompts ..."."""
    seen: dict[str, str] = {}  # pair -> what its runs got
    for run in audit.runs:
        info = run.adversarial  # an open-ended bag: cases, first_index, skipped
        if info and str(run.pair) not in seen:
            cases = info.get("cases") or []
            names = list(dict.fromkeys(str(c.get("case")) for c in cases))
            text = f"{len(cases)} adversarial prompts from index {info.get('first_index')} ({', '.join(names)})"
            if info.get("skipped"):
                text += "; " + "; ".join(info["skipped"])
            seen[str(run.pair)] = text
    if not seen:
        return None
    pairs_of: dict[str, list[str]] = {}
    for pair, text in seen.items():
        pairs_of.setdefault(text, []).append(pair)
    return ". ".join(f"{', '.join(pairs)}: {text}" for text, pairs in pairs_of.items()) + "."


@dataclass(frozen=True)
class FailureLine:
    run: str  # the run's title
    prompt_index: Any
    reason: str
    traceback_tail: str  # the last lines of the traceback
    case: str  # why the prompt is in the audit, for an adversarial one


def failure_lines(audit: Audit | Mapping[str, Any], tail_lines: int = 6) -> list[FailureLine]:
    """One line per prompt that made an engine fail (crash isolation), run by run."""
    lines = []
    for run in as_audit(audit).runs:
        title = f"{run.engine} · {run.pair} · batch {run.batch_size} · {run.dtype}"
        for failure in run.failures:  # each an open-ended mapping (equivalence/isolate.py)
            case = adversarial_case(run, failure.get("prompt_index"))
            tail = "\n".join(str(failure.get("traceback") or "").rstrip().splitlines()[-tail_lines:])
            lines.append(FailureLine(title, failure.get("prompt_index"), str(failure.get("reason")), tail,
                                     f"adversarial prompt `{case.get('case')}`: {case.get('why')}" if case else ""))
    return lines
