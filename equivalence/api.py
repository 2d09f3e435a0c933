"""The public Python API, re-exported at `specaudit`: load a pair, run an audit, read a report.

    import specaudit
    pair = specaudit.load_pair("tiny-llama")                      # or target=..., draft=...
    report = specaudit.audit(["eqspec", "exspec"], pairs=["tiny-llama"], batch_sizes=[1, 4],
                             out="audit-out")
    report.equivalent, report.exit_status, report.runs[0]["exact_matches"]
    same = specaudit.read_report("audit-out")                     # a folder or its audit.json
    same.records[0].exact_matches, same.records[0].divergence_classes  # typed runs (equivalence/records/)

`audit` is `specaudit audit` without the command line: the same runs, the same `audit.json`,
`report.md` and `report.html` when `out` is given, the same exit status.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from specaudit.engines.models import zoo
from specaudit.equivalence.pipeline.runner import AuditSettings, UserPair, exit_status, run_audit
from specaudit.equivalence.records import Audit, Run, thaw
from specaudit.equivalence.reports.summary import summary_table


@dataclass(frozen=True)
class AuditReport:
    """An audit's result: `data` is exactly what `audit.json` holds, `records` its runs typed."""

    data: dict[str, Any]
    path: Path | None = None  # the audit.json it came from or was written to

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.data["runs"]

    @cached_property
    def records(self) -> tuple[Run, ...]:
        """Every run as a frozen `Run` (equivalence/records/), read by the one serializer
        (equivalence/records/serialize.py), an older file's in this version's names."""
        from specaudit.equivalence.records.serialize import run_from_json

        return tuple(run_from_json(run) for run in self.runs)

    @cached_property
    def record(self) -> Audit:
        """The whole audit as a frozen `Audit` (equivalence/records/), read once by the one serializer; what
        the properties below read."""
        from specaudit.equivalence.records.serialize import as_audit

        return as_audit(self.data)

    @property
    def exit_status(self) -> int:
        """0 when every run is equivalent, 1 otherwise (as `specaudit audit` exits)."""
        return exit_status(self.record)

    @property
    def equivalent(self) -> bool:
        return self.exit_status == 0

    @property
    def divergences(self) -> list[dict[str, Any]]:
        """Every divergence of every run, each with its run's engine, pair, batch size and dtype."""
        from specaudit.equivalence.records.serialize import divergence_to_json

        return [{"engine": run.engine, "pair": run.pair, "batch_size": run.batch_size, "dtype": run.dtype,
                 **divergence_to_json(d)} for run in self.record.runs for d in run.divergences]

    @property
    def sampled(self) -> dict[str, dict[str, Any]]:
        """Each sampled run's report by engine (`specaudit audit --temperature`): its verdict, p-value, the
        test that decided, the power; a failed run's `error` (equivalence/reports/sampled.py)."""
        from specaudit.equivalence.reports.sampled import sampled_reports

        return {spec: thaw(report) for spec, report in sampled_reports(self.record).items()}

    def summary(self) -> str:
        """The terminal table `specaudit audit` prints: one line per run."""
        return summary_table(self.record)


def load_pair(
    name: str | None = None,
    *,
    target: str | Path | None = None,
    draft: str | Path | None = None,
    dtype: str = "float64",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> zoo.ModelPair:
    """A built-in pair by name (`tiny-llama`, ...), or a user's pair from two local HF folders."""
    if name is not None:
        return zoo.load_pair(name, dtype=dtype, device=device)
    return zoo.load_pair(target_path=None if target is None else str(target),
                         draft_path=None if draft is None else str(draft),
                         dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def audit(
    engines: str | Sequence[str],
    *,
    pairs: Sequence[str] = (),
    target: str | Path | None = None,
    draft: str | Path | None = None,
    out: str | Path | None = None,
    trust_remote_code: bool = False,
    **options: Any,
) -> AuditReport:
    """Audit `engines` (built-in names, `package.module:factory`, `recorded:FILE` or a server `vllm:URL`, ...) on
    built-in `pairs` and/or a user pair (`target` and `draft` folders). With `out`, writes `audit.json` and the
    reports there.

    `options` are the audit's settings by their names in `AuditSettings` (equivalence/pipeline/settings.py), each
    the `specaudit audit` option of the same name, with the same default: `batch_sizes` ([8]), `dtypes`
    (["float64"]), `device`, `prompts` ("builtin" or a JSONL file), `num_prompts`, `max_new_tokens` (32),
    `draft_tokens` (4), `eos_token_id` ("pair": every EOS id the target declares; an id, ids, or None),
    `engine_options`, `adversarial` (True: the adversarial prompts are added), `pad_token_id`, `engine_dtype` /
    `logit_tolerance` (a black box's noise band, equivalence/rulings/band.py), `require_speculation`,
    `plain_engine` (the same engine without speculation: three-way rulings), `speculation`,
    `acceptance_baseline`, `require_acceptance`, `payoff`, `diagnosis`, `request_params` (one `RequestParams`),
    `reference` / `tokenizer` (a served reference, no weights: then no pair), `sampling` (`SamplingSettings`),
    and the rest of `AuditSettings`. An unknown name is a `TypeError` naming the known ones.
    Recordings and servers need only `target` (or a pair)."""
    from dataclasses import fields

    from specaudit.engines.registry import black_box_prefix

    known = {f.name for f in fields(AuditSettings)} - {"engines", "pairs"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"audit() got unknown option(s) {', '.join(unknown)}; the options are: {', '.join(sorted(known))}")
    engine_names = [engines] if isinstance(engines, str) else list(engines)
    pair_specs: list[str | UserPair] = list(pairs)
    plain_engine = options.get("plain_engine")
    if draft is not None and target is None:
        raise ValueError("a draft needs its target")
    if target is not None and draft is None and not all(black_box_prefix(name) for name in
                                                        engine_names + ([plain_engine] if plain_engine else [])):
        raise ValueError("target needs a draft, except when every engine is a recording or a server")
    if target is not None:
        pair_specs.append(UserPair(str(target), None if draft is None else str(draft), trust_remote_code))
    if not engine_names or (not pair_specs and options.get("reference") is None):
        raise ValueError("give at least one engine and one pair (a built-in name, or target and draft)")
    for name in ("batch_sizes", "dtypes"):  # sequences as the settings keep them
        if name in options:
            options[name] = list(options[name])
    if isinstance(options.get("eos_token_id"), tuple):
        options["eos_token_id"] = list(options["eos_token_id"])
    if "engine_options" in options:
        options["engine_options"] = dict(options["engine_options"] or {})
    config = AuditSettings(engines=engine_names, pairs=pair_specs, **options)
    if out is None:
        with tempfile.TemporaryDirectory() as scratch:
            return AuditReport(run_audit(config, Path(scratch)))
    from specaudit.equivalence.reports.markdown import write_reports

    out_dir = Path(out)
    data = run_audit(config, out_dir)
    write_reports(data, out_dir)
    return AuditReport(data, out_dir / "audit.json")


def read_report(path: str | Path) -> AuditReport:
    """An `audit.json` written by `specaudit audit` or `audit(out=...)`: the file or its folder; one of an
    earlier version is read in this version's field names (`serialize.upgrade`); `.records` its typed runs."""
    from specaudit.equivalence.records.serialize import upgrade

    path = Path(path)
    if path.is_dir():
        path = path / "audit.json"
    return AuditReport(upgrade(json.loads(path.read_text(encoding="utf-8"))), path)
