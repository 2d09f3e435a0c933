"""The corpus's table for reports/foreign/README.md: every variant of every module audited on a pair,
with its structural divergences, the classes they were given and the share named by the variant's cause.

    PYTHONPATH=tests python -m foreign.table OUT [--pair tiny-gpt2] [--num-prompts 8] [--max-new-tokens 12]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foreign import expect


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--pair", default="tiny-gpt2")
    parser.add_argument("--num-prompts", default="8")
    parser.add_argument("--max-new-tokens", default="12")
    parser.add_argument("--modules", nargs="*", default=list(expect.EXPECTED))
    args = parser.parse_args()
    expect.SETTINGS = ("--batch-size", "4", "--num-prompts", args.num_prompts, "--max-new-tokens",
                       args.max_new_tokens, "--no-adversarial")
    rows = ["| engine | variant | cause | structural | classes | named by cause |", "|---|---|---|---|---|---|"]
    for module in args.modules:
        for run in expect.audit_module(module, args.pair, args.out / module):
            variant = run["engine"].split(":")[1]
            if variant == "correct" and any(r.startswith(f"| {module} | correct |") for r in rows):
                continue  # the correct variant runs beside every group; one line is enough
            cause = expect.EXPECTED[module][variant]
            found = expect.structural(run)
            counts = ", ".join(f"{cls} {n}" for cls, n in expect.classes(run).most_common()) or "-"
            share = f"{expect.share_named(run, cause):.0%}" if cause and found else ("exact" if not found else "-")
            rows.append(f"| {module} | {variant} | {cause or '(correct)'} | {len(found)} | {counts} | {share} |")
            print(rows[-1], flush=True)
    (args.out / "table.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
