"""What the per-position rollback costs a hybrid target's verify pass, on one CPU thread.

The engines run a cached pass of k+1 tokens on a model with recurrent layers as k+1 one-token passes,
keeping every row's recurrent states after each (`engines/ops/recurrent.py`), so that a rejection can be
rolled back to any position. This times, after a prefill of B rows of `--context` tokens (median CPU
milliseconds of 15 repeats, float32): one one-token pass; the k+1 tokens as the engines run them; and
the same k+1 tokens in one pass of the model, which keeps no per-position state.

    python scripts/recurrent_pass_cost.py tiny-qwen3-next tiny-lfm2 tiny-bamba
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.ops.hf_call import cached_forward
from specaudit.engines.models.zoo import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=24)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, k = args.batch_size, args.draft_tokens
    for name in args.pairs:
        pair = load_pair(name, dtype="float32")
        model = pair.target
        tokens, lengths = ragged.left_pad([[5 + i] * args.context for i in range(rows)], pad_id=pair.pad_token_id)
        prefilled, _ = batch_ops.prefill(model, tokens, lengths)
        inputs = torch.randint(0, 256, (rows, k + 1), generator=torch.Generator().manual_seed(0))

        def timed(q: int, per_position: bool) -> float:
            cache = copy.deepcopy(prefilled)
            started = time.process_time()
            if per_position:
                batch_ops.forward(model, cache, inputs[:, :q], lengths)
            else:
                width = ragged.cache_width(cache)
                cached_forward(model, cache, input_ids=inputs[:, :q], attention_mask=ragged.attention_mask(lengths, width, q),
                               position_ids=ragged.position_ids(lengths, q))
            return time.process_time() - started

        with torch.no_grad():
            ms = {key: statistics.median(timed(q, per) for _ in range(15)) * 1000
                  for key, (q, per) in {"one": (1, False), "engines": (k + 1, True), "single": (k + 1, False)}.items()}
        print(f"{name}: B={rows}, context {args.context}, k={k}, CPU ms: one token {ms['one']:.1f}; "
              f"k+1 tokens as the engines run them {ms['engines']:.1f} ({ms['engines'] / ms['one']:.1f}x); "
              f"k+1 tokens in one pass {ms['single']:.1f} ({ms['single'] / ms['one']:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
