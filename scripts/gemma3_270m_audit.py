"""Audit EQSPEC and EXSPEC on the Gemma-3 270M pair of `scripts/gemma3_270m.sh`.

What `specaudit audit --engine eqspec --engine exspec --target T --draft D --prompts P ...` does,
with one difference: the adversarial prompts are left out (`AuditSettings(adversarial=False)`),
because on a 270M model with a 262144-token vocabulary their longest cases (thousands of tokens)
would take hours on a 2-core CPU. The Spec-Bench prompts chosen (`select_prompts`) include long
retrieval and summarisation prompts, so prompt plus output crosses the 512-token sliding window.

Usage: python scripts/gemma3_270m_audit.py --pair DIR --questions question.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specaudit.equivalence.reports.markdown import write_reports
from specaudit.equivalence.pipeline.runner import AuditSettings, UserPair, exit_status, run_audit
from specaudit.equivalence.reports.summary import summary_table


def select_prompts(questions: Path, per_category: int, out: Path) -> Path:
    """The first `per_category` questions of each Spec-Bench category, in file order."""
    taken: dict[str, int] = {}
    lines = []
    for line in questions.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        category = record.get("category", "?")
        if taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            lines.append(json.dumps({"turns": record["turns"][:1], "category": category,
                                     "question_id": record.get("question_id")}))
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts: {taken}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, required=True, help="folder with target/ and draft/")
    parser.add_argument("--questions", type=Path, required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="report folder")
    parser.add_argument("--per-category", type=int, default=1, help="questions per Spec-Bench category (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="(default: 32)")
    parser.add_argument("--batch-size", type=int, default=4, help="(default: 4)")
    parser.add_argument("--dtype", action="append", help="repeatable (default: float32 and bfloat16)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = select_prompts(args.questions, args.per_category, args.out / "prompts.jsonl")
    config = AuditSettings(
        engines=["eqspec", "exspec"], pairs=[UserPair(str(args.pair / "target"), str(args.pair / "draft"))],
        batch_sizes=[args.batch_size], dtypes=args.dtype or ["float32", "bfloat16"], prompts=str(prompts),
        max_new_tokens=args.max_new_tokens, draft_tokens=4, adversarial=False,
    )
    audit = run_audit(config, args.out)
    write_reports(audit, args.out)
    print(summary_table(audit))
    return exit_status(audit)


if __name__ == "__main__":
    raise SystemExit(main())
