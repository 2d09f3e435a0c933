"""Hunting a planted fault: Hypothesis searches the decoding cases for one where the fault
engine breaks its property, shrinks it to a minimal counterexample, and the audit classifies
what that counterexample shows.

A hunt's outcome is kept where `SPECAUDIT_HUNT_MEMO` names a folder (tests/conftest.py:
`$SPECAUDIT_CACHE/hunts`), in a file named by a digest of everything the derandomized search depends on
(`hunt_key`): the fault, the pair's weights, the dtype, the search budget, the source of the engines, the
audit and the property tests, the Hypothesis, torch and transformers versions and, below float64, the CPU
kernels (`reference_memo.cpu_kernels`; their name is in the file's too). A later hunt with the same
key replays the kept minimal counterexample (it must still break the property, else the hunt searches again)
and audits it, instead of searching and shrinking again to the same case: the search is 90-98% of a hunt.

The property is output equivalence (`specaudit.testing.properties.check_equivalence`: tokens, then
float64 logits) for every fault that can change an output, and the draft-proposal property
(`draft_check`) for the faults that live in the model drafter's cache. The search is
derandomized with no example database, so a hunt gives the same counterexample on every run.

Below float64 (`hunt(..., dtype="bfloat16")`) no exact property holds: a correct engine flips
near-ties. There the property is the audit's own verdict: the fault engine, run in that dtype on
the case, gets a structural ruling (`equivalence/rulings/ruler.py`: the float64 replay, the same-dtype
replay and the plain control all fail to explain a flip; for the model drafter, a proposal beyond
the draft's own precision). That is what a user auditing in bfloat16 relies on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import torch
import transformers
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from specaudit.engines import reference_memo
from specaudit.engines.drafters import ScriptedDrafter
from specaudit.engines.reference import greedy_decode
from specaudit.equivalence.audit import RunSettings, audit_engine
from specaudit.equivalence.run_context import wrapped
from specaudit.testing import models
from specaudit.testing.faults.draft_check import check_draft_proposals
from specaudit.testing.faults.mutation import FaultEngine
from specaudit.testing.properties import DEFAULT_ORACLE, build_engine, check_equivalence, resolve_eos
from specaudit.testing.strategies import DecodingCase, decoding_cases

DETECTIONS = ("tokens", "logits", "draft tokens")  # the `through` of a property failure that counts
HUNT_MEMO = models.HUNT_MEMO
MAX_EXAMPLES = 300  # generation budget per hunt; the hunt stops at the first failure, then shrinks

CASE_BOUNDS: dict[str, Any] = dict(
    max_batch_size=4, max_prompts=4, max_draft_tokens=4, max_new_tokens=8, max_prompt_length=8,
    prompt_styles=("synthetic",),
)


def fault_cases(fault: type[FaultEngine], pair: str, dtype: str = "float64") -> st.SearchStrategy[DecodingCase]:
    """Small decoding cases on `pair`: up to 4 rows of up to 8 tokens, k <= 4, <= 8 new tokens;
    EOS and a pad id that is also content drawn as usual; a pool window for EXSPEC faults."""
    kinds = {"schedule_kinds": fault.schedule_kinds} if fault.schedule_kinds else {}
    cases = decoding_cases(pairs=[pair], with_window=fault.engine == "exspec", dtype=dtype, **CASE_BOUNDS, **kinds)
    if fault.drafter_kind == "model":  # the model drafter decides acceptance; no schedule to show
        cases = cases.map(lambda case: dataclasses.replace(case, schedule=None))
    return cases


class StructuralRuling(AssertionError):
    """The audit in the case's dtype ruled a divergence of the fault engine structural."""

    def __init__(self, divergence: dict[str, Any]) -> None:
        super().__init__(f"{divergence['kind']} divergence through {divergence['detected_by']}: prompt "
                         f"{divergence['prompt_index']}, position {divergence['position']}, reference "
                         f"{divergence['reference_token']}, engine {divergence['engine_token']} "
                         f"(decided by {divergence.get('decided_by')}: {divergence['evidence'].get('reason')})")
        self.through = {"draft": "draft tokens"}.get(divergence["detected_by"], divergence["detected_by"])


def check_fault(fault: type[FaultEngine], case: DecodingCase) -> None:
    """The property the fault must break; raises AssertionError when it does. (A draft-cache
    fault passes output equivalence by construction; the audit of its minimal case shows that.)
    Below float64: the audit's structural ruling (see the module docstring)."""
    if case.dtype != "float64":
        structural = [d for d in audit_case(fault, case, diagnosis="off") if d["kind"] == "structural"]
        if structural:
            raise StructuralRuling(structural[0])
    elif fault.drafter_kind == "model":
        check_draft_proposals(fault, case)
    else:
        check_equivalence(fault, case, drafter="scripted")


@dataclass
class Finding:
    """The outcome of one hunt: the minimal counterexample and what it shows."""

    fault: str
    bug_class: str
    engine: str
    pair: str
    case: DecodingCase | None
    detected_by: str | None  # "tokens", "logits", "draft tokens"; "step budget" or "other" are not detections
    message: str
    divergences: list[dict[str, Any]] = field(default_factory=list)  # the audit's, on the minimal case
    examples: int = 0
    crashes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    planted: list[str] = field(default_factory=list)  # the line edits that plant the fault
    dtype: str = "float64"  # the precision the hunt searched and audited in
    kept: bool = False  # the search's outcome read back from an earlier hunt of the same key (`hunt_key`)

    @property
    def kinds(self) -> set[str]:
        return {d["kind"] for d in self.divergences}

    @property
    def size(self) -> dict[str, int] | None:
        if self.case is None:
            return None
        return {
            "rows": len(self.case.prompts),
            "batch_size": self.case.batch_size,
            "max_prompt_length": max(len(p.tokens) for p in self.case.prompts),
            "new_tokens": self.case.max_new_tokens,
            "draft_tokens": self.case.draft_tokens,
        }

    def size_text(self) -> str:
        size = self.size
        if size is None:
            return "none found"
        rows = "row" if size["rows"] == 1 else "rows"
        return (f"{size['rows']} {rows} (batch {size['batch_size']}), prompts <= {size['max_prompt_length']}, "
                f"{size['new_tokens']} new tokens, k = {size['draft_tokens']}")

    def report(self) -> str:
        head = f"{self.fault} on {self.pair} ({self.engine}{', ' + self.dtype if self.dtype != 'float64' else ''}): " \
               f"{self.bug_class}"
        head += "".join(f"\n  planted by {line}" for line in self.planted)
        if self.case is None:
            return f"{head}\n  NOT DETECTED in {self.examples} cases" + "".join(f"\n  crash: {c}" for c in self.crashes[:3])
        lines = [
            head,
            f"  detected through {self.detected_by}; minimal example: {self.size_text()}; "
            f"{self.examples} property runs, {self.seconds:.1f} s"
            + (" (the search kept from an earlier hunt of the same code, replayed)" if self.kept else ""),
            *([f"  {len(self.crashes)} runs crashed or failed otherwise, first: {self.crashes[0]}"] if self.crashes else []),
            "  " + repr(self.case).replace("\n", "\n  "),
            "  " + self.message.replace("\n", "\n  "),
        ]
        if self.divergences:
            lines.append("  audit of the minimal example:")
            lines += [
                f"    {d['kind']} divergence through {d['detected_by']}: prompt {d['prompt_index']}, position "
                f"{d['position']}, step {d.get('step')}, reference {d['reference_token']}, engine {d['engine_token']}"
                + (f"\n      diagnosed as {d['diagnosis']['class']}: {d['diagnosis']['evidence']}"
                   if d.get("diagnosis") else "")
                for d in self.divergences
            ]
        else:
            lines.append("  audit of the minimal example: no divergence in tokens or logits")
        return "\n".join(lines)


def audit_case(fault: type[FaultEngine], case: DecodingCase, diagnosis: str = "full") -> list[dict[str, Any]]:
    """The audit's divergences for the fault engine on `case` (the case's dtype and drafter; below
    float64 ruled with the float64 pair and the plain control, as `specaudit audit` rules them)."""
    pair = models.pair(case.pair, case.dtype)
    exact = models.pair(case.pair, "float64") if case.dtype != "float64" else None
    eos = resolve_eos(case, pair, DEFAULT_ORACLE)
    drafter = None
    if fault.drafter_kind != "model" and case.schedule is not None:
        reference = [DEFAULT_ORACLE.decode(pair, p.tokens, case.max_new_tokens, eos)[0] for p in case.prompts]
        drafter = ScriptedDrafter(reference, case.schedule, int(pair.target.config.vocab_size))
    engine = build_engine(fault, case, pair, drafter)
    record = audit_engine(engine, pair, case.prompt_tokens, RunSettings(max_new_tokens=case.max_new_tokens, eos_token_id=eos, dtype=case.dtype, engine_name=fault.slug(), batch_size=case.batch_size, pad_token_id=case.pad_token_id, diagnosis=diagnosis),
                          rerun=case_rerun(fault, case, pair, eos, drafter is not None),
                          replay_target=exact.target if exact is not None else None,
                          replay_draft=exact.draft if exact is not None else None)
    return record["divergences"]


def case_rerun(fault: type[FaultEngine], case: DecodingCase, pair: Any, eos: int | None, scripted: bool):
    """The diagnosis's re-runs of `case`: a fresh fault engine on the prompts at `indices`, each
    row keeping the acceptance schedule of the prompt it copies; optionally another pad id."""

    def rerun(indices: list[int], pad_token_id: int | None, around: Any = None) -> list[list[int]]:
        prompts = [list(case.prompts[i].tokens) for i in indices]
        rerun_case = dataclasses.replace(case, pad_token_id=pad_token_id if pad_token_id is not None else case.pad_token_id)
        drafter = None
        if scripted:
            def schedule(row: int, step: int) -> int:
                return case.schedule(indices[row], step)
            # the target's own greedy tokens for the re-run's prompts
            reference = [greedy_decode(pair.target, list(p), case.max_new_tokens, eos)[0] for p in prompts]
            drafter = ScriptedDrafter(reference, schedule, int(pair.target.config.vocab_size))
        engine = build_engine(fault, rerun_case, pair, drafter)
        return wrapped(engine.generate, around)(prompts, case.max_new_tokens, eos)  # around: the engine's call alone

    return rerun


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """The source of what a hunt runs: the engines, the audit and the property tests (faults included)."""
    import specaudit.engines
    import specaudit.equivalence
    import specaudit.testing

    digest = hashlib.sha256()
    for package in (specaudit.engines, specaudit.equivalence, specaudit.testing):
        folder = Path(package.__file__).parent
        for source in sorted(folder.rglob("*.py")):
            digest.update(f"{package.__name__}/{source.relative_to(folder)}".encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


def _kernels(dtype: str) -> str:
    """The CPU kernels a hunt's outcome depends on: below float64 which way near-ties round; in float64 none (a
    kept counterexample is replayed, and must break the property again, before it stands)."""
    return "" if dtype == "float64" else reference_memo.cpu_kernels()


def hunt_key(fault: type[FaultEngine], pair: str, dtype: str, max_examples: int) -> str:
    """A digest of everything the derandomized search of `hunt` depends on (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(f"{fault.slug()}|{pair}|{dtype}|{max_examples}|{CASE_BOUNDS}|{models.pairs_device()}|"
                  f"{hypothesis.__version__}|{torch.__version__}|{transformers.__version__}|{_kernels(dtype)}|"
                  f"{_sources_digest()}".encode())
    loaded = models.pair(pair)
    for model in (loaded.target, loaded.draft):
        reference_memo.update_with_model(digest, model)
    return digest.hexdigest()[:16]


def _kept_path(fault: type[FaultEngine], pair: str, dtype: str, max_examples: int) -> Path | None:
    memo = os.environ.get(HUNT_MEMO)
    if not memo:
        return None
    kernels = "" if dtype == "float64" else f"-{reference_memo.kernels_tag()}"
    return Path(memo) / f"{fault.slug()}-{pair}-{dtype}{kernels}-{hunt_key(fault, pair, dtype, max_examples)}.pkl"


def _replay_kept(fault: type[FaultEngine], path: Path, finding: Finding) -> bool:
    """Take the kept outcome at `path` when its case still breaks the property; False to search again."""
    try:
        kept = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return False
    try:
        check_fault(fault, kept["case"])
        return False
    except AssertionError as failure:
        if getattr(failure, "through", None) not in DETECTIONS:
            return False
        finding.detected_by, finding.message = failure.through, str(failure)
    except Exception:
        return False
    finding.case, finding.examples, finding.crashes, finding.kept = kept["case"], kept["calls"], kept["crashes"], True
    return True


def hunt(fault: type[FaultEngine], pair: str, *, max_examples: int = MAX_EXAMPLES, dtype: str = "float64") -> Finding:
    """Search, shrink and audit (or replay a kept search: the module docstring); never raises for a fault that
    escapes (the Finding says so)."""
    started = time.perf_counter()
    calls, crashes = 0, []
    kept = _kept_path(fault, pair, dtype, max_examples)
    finding = Finding(fault.slug(), fault.summary(), fault.engine, pair, None, None, "",
                      planted=[change.describe() for change in fault.changes], dtype=dtype)
    if kept is not None and kept.is_file() and _replay_kept(fault, kept, finding):
        finding.divergences = audit_case(fault, finding.case)
        finding.seconds = time.perf_counter() - started
        return finding

    def breaks_property(case: DecodingCase) -> bool:
        nonlocal calls
        calls += 1
        try:
            check_fault(fault, case)
        except AssertionError as failure:
            if getattr(failure, "through", None) in DETECTIONS:
                return True
            crashes.append(f"{type(failure).__name__}: {failure}".splitlines()[0])
        except Exception as exc:  # a crash is not a detection: keep searching, but remember it
            crashes.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
        return False

    search = settings(
        max_examples=max_examples, derandomize=True, database=None, deadline=None,
        phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
    )
    try:
        minimal = find(fault_cases(fault, pair, dtype), breaks_property, settings=search)
    except NoSuchExample:
        minimal = None
    if minimal is not None:
        finding.case = minimal
        try:
            check_fault(fault, minimal)
            finding.message = "the minimal example no longer fails when replayed"
        except AssertionError as failure:
            finding.detected_by = getattr(failure, "through", "other")
            finding.message = str(failure)
            if kept is not None and finding.detected_by in DETECTIONS:
                reference_memo.keep_file(kept, pickle.dumps({"case": minimal, "calls": calls, "crashes": crashes}))
        finding.divergences = audit_case(fault, minimal)
    finding.examples, finding.crashes = calls, crashes
    finding.seconds = time.perf_counter() - started
    return finding


def hunt_below_float64(fault: type[FaultEngine], pair: str, exact: Finding, *, dtype: str = "bfloat16",
                       max_examples: int = MAX_EXAMPLES) -> Finding:
    """The hunt in `dtype`, started from the float64 hunt's minimal counterexample (`exact`): that case,
    run and ruled in `dtype`, is the finding when the audit rules it structural there; otherwise
    (rounding can hide what exact arithmetic shows) a search in `dtype` as `hunt` does it."""
    if exact.case is None or exact.dtype != "float64":
        return hunt(fault, pair, max_examples=max_examples, dtype=dtype)
    started = time.perf_counter()
    case = dataclasses.replace(exact.case, dtype=dtype)
    finding = Finding(fault.slug(), fault.summary(), fault.engine, pair, None, None, "",
                      planted=[change.describe() for change in fault.changes], dtype=dtype, examples=1)
    try:
        check_fault(fault, case)
    except AssertionError as failure:
        if getattr(failure, "through", None) in DETECTIONS:
            finding.case, finding.detected_by, finding.message = case, failure.through, str(failure)
            finding.message += "\n(the float64 minimal counterexample, run in " + dtype + ")"
    except Exception as exc:  # a crash is not a detection: search as usual
        finding.crashes.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
    if finding.case is None:
        return hunt(fault, pair, max_examples=max_examples, dtype=dtype)
    finding.divergences = audit_case(fault, case)
    finding.seconds = time.perf_counter() - started
    return finding
