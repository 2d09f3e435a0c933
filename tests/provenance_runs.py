"""An audited run through the provenance hooks, and the provenance check on each of its structural divergences
(shared by tests/test_provenance.py and the cost measurement)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from specaudit.engines.models import zoo
from specaudit.equivalence.audit import Reference, RunSettings, audit_engine
from specaudit.equivalence.diagnosis.provenance import Provenance, provenance_diagnosis
from specaudit.equivalence.diagnosis.provenance.hooks import Hooked


@dataclass
class ProvenanceRun:
    record: dict[str, Any]  # the audit's run record (diagnosis off)
    classes: list[str]  # per structural divergence, the class the provenance check names
    evidence: list[str]
    hook_seconds: float  # the hooks' own time inside the engine's call
    engine_seconds: float  # the hooked call's time, the hooks' included


def provenance_run(pair_name: str, make: Callable[..., Any], *, num_prompts: int = 8, max_new_tokens: int = 12,
                   batch_size: int = 4, dtype: str = "float64") -> ProvenanceRun:
    pair = zoo.load_pair(pair_name, dtype=dtype)
    prompts = zoo.builtin_prompts()[:num_prompts]
    engine = make(pair.target, pair.draft, batch_size=batch_size, pad_token_id=pair.pad_token_id)
    hooked = Hooked(engine, pair.target, pair.pad_token_id)
    reference = Reference(pair, prompts, max_new_tokens, None)
    record = audit_engine(hooked, pair, prompts, RunSettings(max_new_tokens=max_new_tokens, eos_token_id=None,
                                                             dtype=dtype, batch_size=batch_size, diagnosis="off"),
                          reference=reference)
    outputs, references = hooked.outputs, [list(r) for r in reference.outputs]
    structural = [d for d in record["divergences"] if d["kind"] == "structural"]
    provenance = Provenance(hooked.hooks.log, [list(p) + list(o) for p, o in zip(prompts, outputs)])
    found = [provenance_diagnosis(hooked.hooks.log, prompts, outputs, references, d, max_new_tokens=max_new_tokens,
                                  provenance=provenance) for d in structural]
    return ProvenanceRun(record, [r.cls for r in found], [r.evidence for r in found], hooked.hooks.log.hook_seconds,
                         hooked.generate_seconds)
