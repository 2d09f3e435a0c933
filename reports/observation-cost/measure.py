"""Time each engine's own generate call with and without the observation's hooks (interleaved repeats), and the
hooks' own time inside the watched call (`Watch.hook_seconds`). Usage: measure.py PAIRS ENGINES [REPEATS]."""
import sys, time, statistics, torch
from specaudit.engines.models.zoo import load_pair, builtin_prompts
from specaudit.engines.models.bench_pair import load_bench_pair
from specaudit.engines.registry import make_engine
from specaudit.equivalence.diagnosis.observe import watch_for
torch.set_num_threads(1)
pairs = sys.argv[1].split(",")
engines = sys.argv[2].split(",")
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
for pair_name in pairs:
    pair = load_bench_pair("float32") if pair_name == "bench" else load_pair(pair_name, dtype="float64")
    prompts = (builtin_prompts(pair.tokenizer) * 4)[:16] if pair_name != "bench" else [list(range(3, 3 + 20 + 7 * i)) for i in range(16)]
    for spec in engines:
        plain, watched = [], []
        for r in range(repeats):
            for kind in ("plain", "watched") if r % 2 == 0 else ("watched", "plain"):
                engine = make_engine(spec, pair.target, pair.draft, batch_size=4, draft_tokens=4)
                watch = watch_for(pair.target, pair.pad_token_id) if kind == "watched" else None
                started = time.perf_counter()
                if watch is None:
                    engine.generate(prompts, 32, None)
                else:
                    with watch:
                        engine.generate(prompts, 32, None)
                (plain if kind == "plain" else watched).append(time.perf_counter() - started)
        p, w = statistics.median(plain), statistics.median(watched)
        hooks = watch.hook_seconds
        print(f"   hooks {hooks:.3f}s of the watched call {watched[-1] if repeats % 2 else watched[-1]:.3f}s = {hooks / watched[-1]:.1%}")
        calls = len(watch.hooks.log.calls) if watch else 0
        print(f"{pair_name:12s} {spec:10s} plain {p:.3f}s watched {w:.3f}s overhead {w / p - 1:+.1%} ({calls} target calls kept)", flush=True)
