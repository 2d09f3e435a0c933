"""Counts the divergences of an audit of the outside-style engines (tests/outside_styles.py) by kind and, for the
structural ones, by diagnosis class; prints one Markdown row per run, then the observation lines that say "not made".

    python reports/outside-styles/tabulate.py /tmp/outside/tiny-gpt2 [more audit folders...]
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

PLANTED = {"positions_over_padding": "position_ids", "padding_visible": "attention_mask", "stale_cache": "kv_cache"}


def planted(engine: str) -> str:
    return next((cause for suffix, cause in PLANTED.items() if engine.endswith(suffix)), "none (correct twin)")


def main(folders: list[str]) -> None:
    print("| pair | engine | planted | divergences by kind | structural | structural by class | named right | diagnosis s |")
    print("|---|---|---|---|---|---|---|---|")
    not_made: Counter = Counter()  # (pair, engine, reason with its prompt lists elided) -> structural divergences
    for folder in folders:
        report = json.loads((Path(folder) / "audit.json").read_text())
        for run in report["runs"]:
            engine = run["engine"].split(":")[-1]
            divergences = run["divergences"]
            kinds = Counter(d["kind"] for d in divergences)
            structural = [d for d in divergences if d["kind"] == "structural"]
            classes = Counter(d["diagnosis"]["class"] for d in structural)
            cause = planted(engine)
            right = sum(n for c, n in classes.items() if c == cause)
            kinds_text = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "0"
            classes_text = ", ".join(f"{c} {n}" for c, n in classes.most_common()) or "-"
            failures = f" (failures: {len(run['failures'])})" if run.get("failures") else ""
            named = f"{right}/{len(structural)}" if structural and cause in PLANTED.values() else (
                "exact" if not divergences and not run.get("failures") else "-")
            print(f"| {run['pair']} | {engine}{failures} | {cause} | {kinds_text} | {len(structural)} | {classes_text} "
                  f"| {named} | {run.get('timing', {}).get('diagnosis') or 0:.0f} |")
            for d in structural:
                for line in d["diagnosis"].get("tried", []):
                    if "not made" in line:
                        clause = next(part for part in line.split("; ") if "not made" in part)
                        prefix = "observed: (what it saw); " if line.startswith("observed: ") else ""
                        reason = prefix + re.sub(r"prompt\(s\) \[[0-9, ]*\]", "prompt(s) [...]", clause)
                        not_made[(run["pair"], engine, reason)] += 1
    if not_made:
        print("\nObservations not made (structural divergences per pair, engine and reason):\n")
        for (pair, engine, reason), n in sorted(not_made.items()):
            print(f"- {pair} {engine}: {n} x `{reason}`")


if __name__ == "__main__":
    main(sys.argv[1:])
