"""The planted-fault table: which check caught each fault, and how small its counterexample is.

    python -m specaudit.testing.faults.table            # hunts every fault, writes reports/faults.md
    python -m specaudit.testing.faults.table --out -    # prints it instead

It runs the hunts through `pytest tests/property/test_faults.py` itself, so the file holds what
the test run finds (the hunts are derandomized: the same counterexamples every run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

from specaudit.testing.faults.classes import EXPECTED_CLASS, INVISIBLE_BELOW_FLOAT64
from specaudit.testing.faults.hunt import Finding
from specaudit.testing.models import pairs_device

REPORT = Path(__file__).resolve().parents[2] / "reports" / "faults.md"

HEADER = """# Planted faults

Each row is a fault engine from `property_tests/faults/`: one known bug class of batched
speculative decoding, planted as a minimal line edit of EQSPEC or EXSPEC. Hypothesis searched the
decoding cases (up to 4 prompts of up to 8 tokens, k <= 4, up to 8 new tokens, acceptance
schedules, EOS, a pad id that is also content, pool windows) for a case where the fault breaks
output equivalence with greedy decoding (tokens, then float64 logits), shrank it, and the audit
classified the minimal case. The two draft-cache faults cannot change any output (the target alone
decides every token); the hunt finds them with the draft-proposal check, which compares every
proposal with the draft model's own greedy continuation of the row, and the audit reports their
minimal case through its draft-fidelity check (`detected_by: draft`). "Diagnosed as" is the class
the audit's diagnosis gives the minimal example (`equivalence/diagnosis/core.py`); the class each fault
must get is in `property_tests/faults/classes.py`.

Minimal example: prompts (batch size), longest prompt, new tokens, draft tokens k.
"""


def audit_verdict(finding: Finding) -> str:
    if finding.case is None:
        if finding.dtype != "float64" and (finding.fault, finding.pair) in INVISIBLE_BELOW_FLOAT64:
            return f"no structural ruling in {finding.examples} cases"
        return "not caught"
    if not finding.divergences:
        return "no output divergence"
    kinds = ", ".join(sorted(finding.kinds))
    channels = ", ".join(sorted({d["detected_by"] for d in finding.divergences}))
    return f"{len(finding.divergences)} {kinds} ({channels})"


def diagnosed_as(finding: Finding) -> str:
    """The diagnosis classes of the audit of the minimal example, marked when not the expected one."""
    classes = sorted({(d.get("diagnosis") or {}).get("class") or "none" for d in finding.divergences
                      if d.get("kind") == "structural"})
    if not classes:
        return "-"
    expected = EXPECTED_CLASS.get(finding.fault)
    text = ", ".join(f"`{c}`" for c in classes)
    if expected is not None and classes != [expected]:
        text += f" (expected `{expected}`)"
    return text


def render_table(findings: list[Finding]) -> str:
    rows = [
        "| Fault | Engine | Pair | Detected through | Prompts (batch) | Longest prompt | New tokens | k "
        "| Audit of the minimal example | Diagnosed as |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in findings:
        size = f.size
        if size is None:
            cells = ["-"] * 4
        else:
            cells = [f"{size['rows']} ({size['batch_size']})", str(size["max_prompt_length"]), str(size["new_tokens"]),
                     str(size["draft_tokens"])]
        rows.append(f"| {f.bug_class} | {f.engine.upper()} | {f.pair} | {f.detected_by or ('no output fault' if (f.fault, f.pair) in INVISIBLE_BELOW_FLOAT64 and f.dtype != 'float64' else 'NOT CAUGHT')} | "
                    + " | ".join(cells) + f" | {audit_verdict(f)} | {diagnosed_as(f)} |")
    return "\n".join(rows)


OUTSIDE_MARKER = "<!-- faults from outside the zoo: kept when the hunts are written again -->"


def kept_section(path: Path = REPORT) -> str:
    """The section of the report from `OUTSIDE_MARKER` on (written by hand from measured runs)."""
    text = path.read_text() if path.exists() else ""
    return text[text.index(OUTSIDE_MARKER):] if OUTSIDE_MARKER in text else ""


BFLOAT16 = """## In bfloat16

The same hunts with `--dtype bfloat16` on the CPU. Below float64 a correct engine flips near-ties, so
no exact property holds; the property a hunt searches with is the audit's own verdict: the fault
engine, run in bfloat16 on the case, gets a structural ruling (the float64 replay, the same-dtype replay
and the plain batched control all fail to explain a flip; for a model drafter, a proposal beyond the
draft's own precision: docs/reports.md, "Below float64"). Each hunt first runs the float64 hunt's
minimal counterexample in bfloat16 and takes it when the audit rules it structural there (1 property
run); only where rounding hides it does it search in bfloat16. The case is then audited in bfloat16
and diagnosed. A fault that changes no output in exact arithmetic on a pair must get no structural
ruling in any case searched (`INVISIBLE_BELOW_FLOAT64` in `property_tests/faults/classes.py`); the
correct engine and model drafter are hunted the same way as controls (`tests/property/test_faults.py`).
"""


def render_report(findings: list[Finding], seconds: float | None = None) -> str:
    exact = [f for f in findings if f.dtype == "float64"]
    lower = [f for f in findings if f.dtype != "float64"]
    parts = [HEADER, render_table(exact), ""]
    if seconds is not None:
        where = device = pairs_device()
        if device == "cpu":
            where = "one CPU thread"
        elif device.startswith("cuda"):
            where = f"{device} ({torch.cuda.get_device_name(device)})"
        parts.append(f"{len(findings)} hunts ({len(exact)} in float64, {len(lower)} in bfloat16), {seconds:.0f} s on "
                     f"{where}.\n")
    if lower:
        parts += [BFLOAT16, render_table(lower), ""]
        invisible = [f for f in lower if (f.fault, f.pair) in INVISIBLE_BELOW_FLOAT64]
        parts += [f"- {f.bug_class} on {f.pair}: no structural ruling in {f.examples} cases, as it must: "
                  f"{INVISIBLE_BELOW_FLOAT64[(f.fault, f.pair)]}." for f in invisible] + ([""] if invisible else [])
    parts.append("## Minimal counterexamples\n")
    for finding in exact + lower:
        parts += ["```", finding.report(), "```", ""]
    kept = kept_section()
    return "\n".join(parts) + ("\n" + kept if kept else "")


class FindingCollector:
    """A pytest plugin that keeps the planted-fault findings of the run it joins."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.exit_status = 0

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        summary = session.config.pluginmanager.get_plugin("specaudit-planted-faults")
        self.findings = list(summary.findings) if summary is not None else []
        self.exit_status = int(exitstatus)


def hunt_all() -> tuple[list[Finding], int]:
    """Run the planted-fault tests; their findings and pytest's exit status."""
    collector = FindingCollector()
    test_file = Path(__file__).resolve().parents[2] / "tests" / "property" / "test_faults.py"
    # this module's package is imported before pytest starts, so pytest cannot rewrite its asserts
    args = ["-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    pytest.main([*args, str(test_file), "-k", "planted_fault"], plugins=[collector])
    return collector.findings, collector.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPORT), help="file to write, or - for stdout")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    findings, status = hunt_all()
    if not findings:
        print("the planted-fault tests produced no findings", file=sys.stderr)
        return 1
    text = render_report(findings, time.perf_counter() - started)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
