"""Measure the audit-target adapters against the reference decoder on the built-in pairs.

Prints one line per (engine, pair, batch size): prompts whose tokens match the reference
exactly, prompts whose recorded logits stay within 1e-9 of the reference's, and the largest
logit difference. For hf-* the recorded logits are what `generate` chose from (float32 casts);
`model` is the same comparison on the logits the model computed.

    python scripts/measure_adapters.py --max-new-tokens 12 --batch-sizes 1 4
"""

from __future__ import annotations

import argparse
import time

import torch

from engines import zoo
from engines.registry import make_engine
from property_tests import models

VARIANTS: dict[str, tuple[str, dict]] = {
    "hf-batched": ("hf-batched", {}),
    "hf-assisted": ("hf-assisted", {}),
    "bsp": ("bsp", {}),
    "dsd": ("dsd", {}),
    "dsd+target-token": ("dsd", {"take_target_token": True}),
    "dsd+target-token+no-cache": ("dsd", {"take_target_token": True, "reuse_cache": False}),
}


def max_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return float("nan")
    n = min(got.shape[0], want.shape[0])
    return float((got[:n].double() - want[:n]).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--pairs", nargs="+", default=zoo.builtin_pair_names())
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = [list(p) for p in models.prompts()]
    for pair_name in args.pairs:
        pair = models.pair(pair_name)
        ref, ref_logits = models.reference(pair_name, args.max_new_tokens)
        for label in args.engines:
            name, options = VARIANTS[label]
            sizes = [1] if name == "hf-assisted" else args.batch_sizes
            for batch_size in sizes:
                start = time.perf_counter()
                engine = make_engine(name, pair.target, pair.draft, batch_size=batch_size,
                                     draft_tokens=args.draft_tokens, pad_token_id=pair.pad_token_id,
                                     record_logits=True, **options)
                out = engine.generate(prompts, args.max_new_tokens, None)
                errors = [max_error(g, w) for g, w in zip(engine.last_trace.logits, ref_logits)]
                line = (f"{label:26s} {pair_name:14s} bs={batch_size:<2d} tokens-exact {sum(o == r for o, r in zip(out, ref)):2d}/{len(prompts)}"
                        f"  logits<1e-9 {sum(e < 1e-9 for e in errors):2d}/{len(prompts)}  max-logit-err {max(errors):.2e}")
                model_logits = getattr(engine, "last_model_logits", None)
                if model_logits:
                    line += f"  model-logit-err {max(max_error(g, w) for g, w in zip(model_logits, ref_logits)):.2e}"
                print(f"{line}  ({time.perf_counter() - start:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
