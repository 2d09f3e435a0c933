"""Teacher-forced agreement of a scaled bench draft with the bench target's greedy continuation."""
import json, sys, torch
from specaudit.engines.models import bench_pair
from specaudit.engines.reference import greedy_decode
prompts = [json.loads(l) for l in open("reports/bench/short-prompts.jsonl")]
from specaudit.engines.models.pair import ByteTokenizer
from specaudit.equivalence.prompts import load_prompts
tok = ByteTokenizer()
ids = load_prompts("reports/bench/short-prompts.jsonl", tok, 16)
torch.set_num_threads(1)
target = bench_pair._seeded_model(bench_pair.TARGET_SHAPE, bench_pair.BENCH_SEED, torch.float32).eval()
conts = []
with torch.no_grad():
    for p in ids:
        out, _ = greedy_decode(target, p, 36, tok.eos_token_id)
        conts.append(out)
print("target repeats last token:", sum(all(t == p[-1] for t in c) for p, c in zip(ids, conts)), "of", len(ids), flush=True)
base = bench_pair._seeded_model(bench_pair.DRAFT_SHAPE, bench_pair.BENCH_SEED + 1, torch.float32).eval()
state = {k: v.clone() for k, v in base.state_dict().items()}
for scale in [float(s) for s in sys.argv[1:]]:
    draft = base
    draft.load_state_dict(state)
    with torch.no_grad():
        for layer in draft.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale); layer.mlp.down_proj.weight.mul_(scale)
        agree = total = 0; per = []
        for p, c in zip(ids, conts):
            seq = torch.tensor([p + c])
            logits = draft(seq).logits[0]
            pred = logits[len(p) - 1: len(p) + len(c) - 1].argmax(-1).tolist()
            a = sum(int(x == y) for x, y in zip(pred, c)); agree += a; total += len(c); per.append(round(a / len(c), 2))
    print(scale, round(agree / total, 3), per, flush=True)
