"""Record engines' outputs on one device and precision, for `specaudit audit --engine recorded:FILE` elsewhere.

This is how `tests/data/gpu-h100-bf16/` was made on an H100: each engine built from the registry as
`factory(target, draft, batch_size=B, draft_tokens=K)` (the reference at batch size 1) and called once
on every prompt of the prompt file.

    python scripts/record_engines.py --pair tiny-qwen3 --dtype bfloat16 --device cuda \
        --prompts tests/data/gpu-h100-bf16/prompts_ids.jsonl --out recordings/
    specaudit audit --engine recorded:recordings/tiny-qwen3-eqspec-b8-bf16-cuda.jsonl --pair tiny-qwen3 \
        --dtype bfloat16 --engine-dtype bfloat16 --prompts recordings/prompts_ids.jsonl --no-adversarial \
        --max-new-tokens 48 --out out/

`--attention eager` records with another attention kernel than the audit's reference uses (SDPA by
default): on a CPU it stands in for the kernel differences a GPU brings. Files are named
`{pair}-{engine}-b{B}-{dtype short}-{device}.jsonl`, one JSON line per prompt (`prompt_ids`, `output_ids`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from specaudit.engines.models.zoo import load_pair
from specaudit.engines.registry import make_engine

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
CORRECT = ("reference", "batched", "eqspec", "exspec", "inplace")
BUGGY = ("bsp", "dsd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pair", required=True, help="a built-in pair")
    parser.add_argument("--engine", action="append", default=None,
                        help=f"engines to record (repeatable; default: {', '.join(CORRECT + BUGGY)})")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(SHORT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", required=True, type=Path, help="JSONL with input_ids per line")
    parser.add_argument("--attention", default=None, help="attention implementation to record with (eager, sdpa)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    prompts = [json.loads(line)["input_ids"] for line in args.prompts.read_text().splitlines() if line.strip()]
    pair = load_pair(args.pair, dtype=args.dtype, device=args.device)
    if args.attention:
        for model in (pair.target, pair.draft):
            model.set_attn_implementation(args.attention)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.prompts.resolve() != (args.out / "prompts_ids.jsonl").resolve():
        shutil.copyfile(args.prompts, args.out / "prompts_ids.jsonl")
    device = args.device.split(":")[0]
    for name in args.engine or list(CORRECT + BUGGY):
        batch_size = 1 if name == "reference" else args.batch_size
        engine = make_engine(name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=args.draft_tokens)
        started = time.perf_counter()
        with torch.no_grad():
            outputs = engine.generate([list(p) for p in prompts], args.max_new_tokens, pair.eos_token_id)
        path = args.out / f"{args.pair}-{name}-b{batch_size}-{SHORT[args.dtype]}-{device}.jsonl"
        path.write_text("".join(json.dumps({"prompt_ids": p, "output_ids": [int(t) for t in o]}) + "\n"
                                for p, o in zip(prompts, outputs)))
        print(f"{path}: {len(prompts)} prompts in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
