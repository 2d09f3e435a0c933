"""The bonus token drawn from q (bonus_from_draft) without a cut: the TV it causes at the bonus positions,
what 20 PIT bins keep of it under the target's order and under the draft's q/p order, and the N each
needs (power 0.8), on the contexts a correct sampled-spec run reaches (tiny-llama, one prompt):

    python reports/sampling/bonus_power.py N K NEW_TOKENS TEMPERATURE
"""
import sys

import torch

from specaudit.engines.models.zoo import builtin_prompts, load_pair
from specaudit.engines.sampling.engine import SampledSpeculative
from specaudit.engines.sampling.process import SamplingParams
from specaudit.equivalence.sampling import stats
from specaudit.equivalence.sampling.teacher import target_distributions
torch.set_num_threads(1)
N, K, NEW, T = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
pair = load_pair("tiny-llama"); params = SamplingParams(T)
prompt = builtin_prompts()[0]
e = SampledSpeculative(pair.target, pair.draft, temperature=T, seed=3, draft_tokens=K)  # correct: the contexts
outs = e.generate([prompt] * N, NEW, pair.eos_token_id)
samples = [(prompt, o) for o in outs]
P = target_distributions(pair.target, samples, params); Q = target_distributions(pair.draft, samples, params)
edges = torch.linspace(0, 1, 21, dtype=torch.float64)
def binned(p, q, key):
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ps, qs = p.gather(-1, order), q.gather(-1, order)
    hi = ps.cumsum(-1); lo = hi - ps
    mass = [(qs * (torch.minimum(hi, b) - torch.maximum(lo, a)).clamp_min(0) / ps.clamp_min(1e-300)).sum(-1)
            for a, b in zip(edges[:-1], edges[1:])]
    return torch.stack(mass, -1)  # [n, 20]: the bins' mass when the token is drawn from q
rows = [(p[i], q[i]) for (pr, o), p, q, off in zip(samples, P, Q, e.last_step_offsets) for i in range(len(o)) if off[i] == K]
p = torch.stack([r[0] for r in rows]); q = torch.stack([r[1] for r in rows])
tv = 0.5 * (p - q).abs().sum(-1)
share = len(rows) / sum(len(o) for o in outs)
print(f"bonus tokens: {len(rows)} of {sum(len(o) for o in outs)} ({share:.2f}); TV(q, p) at them: mean {float(tv.mean()):.3f}, median {float(tv.median()):.3f}, max {float(tv.max()):.3f}")
tests = 14  # the family's size in these runs (Holm's first step)
for name, key in (("target's order", p), ("draft's q/p order", stats.draft_ratio_order(p, q))):
    per_context = 0.5 * (binned(p, q, key) - 0.05).abs().sum(-1)
    pooled = 0.5 * float((binned(p, q, key).mean(0) - 0.05).abs().sum())
    # N needed: the smallest n whose detectable TV (20 bins, alpha 0.01 / tests, power 0.8) reaches `pooled`
    d1000 = stats.detectable_tv(1000, 19, 0.01 / tests)
    need_bonus = 1000 * (d1000 / pooled) ** 2
    print(f"{name}: binned TV per context {float(per_context.mean()):.3f}, pooled over the bonus contexts {pooled:.4f}; "
          f"bonus tokens needed ~{need_bonus:.0f} (samples ~{need_bonus / (len(rows) / N):.0f}); "
          f"pooled over all tokens {pooled * share:.4f} needs ~{1000 * (d1000 / (pooled * share)) ** 2 / (sum(len(o) for o in outs) / N):.0f} samples")
