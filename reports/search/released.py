"""The search, blind, against the released builds of the suite and the same builds without speculation.

    python reports/search/released.py CASE OUT [BUDGET] [SEED]
    python reports/search/released.py CASE OUT BUNDLE.json [BUNDLE.json ...]

CASE is one of `CASES`: a vLLM CPU release (tests/vllm_models.py `VLLMServer`, the server arguments of
tests/test_wild_vllm_0_21.py) or the pinned llama.cpp build (tests/llamacpp_models.py `LlamaServer`, the f32 GGUF
of tests/test_wild_llamacpp.py), serving the table model of tests/wild_models.py with or without speculation.
Every case is searched with the same prompts file, the table model's two ordinary prompts (the alphabet, which its
continuation cycles through, and the digits, which count up to EOS) and no parameter: which parameters, shapes
and arrivals to send is the search's to draw. Prints the command, its exit status and the search's lines. Given bundles instead of a budget, replays each
against the case's server (`specaudit replay`): what a false alarm's fix is checked with.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import llamacpp_models as lm  # noqa: E402
import vllm_models as vm  # noqa: E402
import wild_models as wm  # noqa: E402
import wild_requests as wr  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
             "--served-model-name", "table"]
# case: (server, version or speculation type, speculative)
CASES = {
    "vllm-0.21.0-ngram": ("vllm", "0.21.0", True),  # vllm #47616, #49391 (stop strings inside a burst)
    "vllm-0.32.0-ngram": ("vllm", "0.32.0", True),  # min_tokens at the bonus position (reports/wild)
    "vllm-0.32.0-plain": ("vllm", "0.32.0", False),
    "vllm-0.21.0-plain": ("vllm", "0.21.0", False),
    "llamacpp-draft": ("llamacpp", "draft-simple", True),  # llama.cpp #27972 (log-probability 0.0)
    "llamacpp-ngram": ("llamacpp", "ngram-simple", True),
    "llamacpp-plain": ("llamacpp", "none", False),
}


def server_for(case: str, out: Path):
    kind, version, speculative = CASES[case]
    if kind == "vllm":
        args = VLLM_ARGS + (["--speculative-config", json.dumps(NGRAM)] if speculative else [])
        return vm.VLLMServer(vm.vllm_python(version), wm.table_pair().target, args, out / "server.log")
    llama_dir = lm.llama_cpp_dir()
    pair = wm.table_pair()
    target, draft = wm.gguf_files(llama_dir)
    gguf = lm.GGUFPair(pair.folder, pair.target, pair.draft, target, draft)
    return lm.LlamaServer(llama_dir, gguf, lm.EXACT_ARGS + ["--spec-type", version], out / "server.log")


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in CASES:
        print(__doc__ + "\ncases: " + ", ".join(CASES))
        return 2
    case, out = sys.argv[1], Path(sys.argv[2])
    bundles = [a for a in sys.argv[3:] if a.endswith(".json")]
    if bundles:
        return replay(case, out, bundles)
    budget = sys.argv[3] if len(sys.argv) > 3 else "10m"
    seed = sys.argv[4] if len(sys.argv) > 4 else "0"
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in (wr.CYCLE_PROMPT, wr.DIGITS_PROMPT)))
    pair = wm.table_pair()
    kind = CASES[case][0]
    with server_for(case, out) as server:
        print(f"{case} healthy at {server.url}", flush=True)
        command = [sys.executable, "-m", "specaudit", "audit", "--engine", f"{kind}:{server.url}",
                   "--target", str(pair.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", "20",
                   "--prompts", str(prompts), "--search", "--budget", budget, "--seed", seed, "--no-progress",
                   "--out", str(out / "audit")]
        print("$ " + " ".join(command), flush=True)
        started = time.monotonic()
        done = subprocess.run(command, text=True, capture_output=True)
        print(done.stdout[-4000:])
        print(done.stderr[-6000:])
        print(f"exit {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    return done.returncode


def replay(case: str, out: Path, bundles: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    pair, kind, worst = wm.table_pair(), CASES[case][0], 0
    with server_for(case, out) as server:
        for bundle in bundles:
            command = [sys.executable, "-m", "specaudit", "replay", bundle, "--engine", f"{kind}:{server.url}",
                       "--target", str(pair.target)]
            print("$ " + " ".join(command), flush=True)
            done = subprocess.run(command, text=True, capture_output=True)
            print(done.stdout[-3000:] + done.stderr[-3000:])
            print(f"exit {done.returncode}", flush=True)
            worst = max(worst, done.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(main())
