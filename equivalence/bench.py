"""`specaudit bench`: tokens per second of engines over batch sizes and draft lengths, in one run.

Contract: `run_bench(config, out_dir)` writes `out_dir/bench.json` (rewritten after every run, so
an interrupted bench keeps what it measured) and returns the same dict. Per run (engine, batch
size, k): `tokens_per_second` (median over `repeats` timed `generate` calls on all prompts, after
`warmup` untimed calls on the first batch), its spread, `mean_accepted_per_step` (per row and
speculative step), `stage_seconds` (draft, verify, realign, other; see below), `peak_memory_bytes`,
and the ratios to the same engine at batch size 1 and to plain decoding at the same batch size.

Acceptance: with `acceptance` set, every engine that takes a `drafter` gets a calibrated one
(`engines.bench_pair`): the draft model runs for its real cost and each proposal is the target's
greedy token with that probability. The target's greedy continuations are computed once, before
any timing, with the reference decoder; the drafter reads them by row position, so no target
pass is spent on proposals inside a timed region. Engines without a `drafter` parameter
(`hf-assisted`, `bsp`, `dsd`, user engines) draft with the draft model itself.

Stages (from the engine's trace, summed over steps, prefill included): `draft`, `verify` (target
passes), `realign` (everything that moves cache rows or columns: EQSPEC's realignment, EXSPEC's
realignment plus stacking and unstacking, INPLACE's row selection and compaction; the fill pass
of the draft, which the ragged engines time inside their realign stage, is moved to `draft`), and
`other` = wall time minus the three. The acceptance rule is in EQSPEC's realign stage (a few small
tensor operations per step) and in `other` for INPLACE and BATCHED.

Ceiling: before the runs at each batch size, the target's pass over 1 and k + 1 tokens and the
draft's pass over 1 token are timed on a context of the prompts' mean length plus half the new
tokens. The best speedup speculation can reach over plain decoding at that batch size is
`E x target(1) / (target(k+1) + k x draft(1))` with `E = (1 - A^(k+1)) / (1 - A)` expected
tokens per step; each speculative run reports its speedup over plain decoding as a fraction of it.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` above what was allocated before the call;
on the CPU, the process's resident-set high-water mark (`VmHWM`, reset through
`/proc/self/clear_refs`) above its resident set before the call (`getrusage` where that reset is
unavailable: then the figure is a process-lifetime high-water mark). `memory_method` says which.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specaudit.engines import bench_pair, zoo
from specaudit.engines import batch as batch_ops
from specaudit.engines import ragged
from specaudit.engines.inplace import InplaceDrafter, InplaceEngine
from specaudit.engines.registry import BUILTIN_ENGINES, make_engine, resolve
from specaudit.equivalence.prompts import load_prompts
from specaudit.equivalence.runner import machine_info, write_json

from specaudit import __version__ as VERSION

PLAIN_ENGINES = ("reference", "batched", "hf-batched", "hf-continuous")  # no draft: k does not apply
BATCH_ONE_ENGINES = ("reference", "hf-assisted")  # one prompt at a time by construction
STAGES = ("draft", "verify", "realign", "other")
CACHE_MOVEMENT_STAGES = ("realign", "stack", "unstack")


@dataclass
class BenchConfig:
    engines: list[str]
    pair: str = "bench"
    target: str | None = None
    draft: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    draft_tokens: list[int] = field(default_factory=lambda: [4])
    acceptance: float | None = bench_pair.DEFAULT_ACCEPTANCE  # None: the draft model's own proposals
    prompts: str = "builtin"
    num_prompts: int | None = 16
    max_new_tokens: int = 64
    repeats: int = 3
    warmup: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    pass_repeats: int = 5
    engine_options: dict[str, Any] = field(default_factory=dict)


def available_engines() -> list[str]:
    return list(BUILTIN_ENGINES)


def run_plan(config: BenchConfig) -> list[tuple[str, int, int | None]]:
    """(engine, batch size, k) of every run, in order; plain engines have no k."""
    plan = []
    for batch_size in config.batch_sizes:
        for engine in config.engines:
            if engine in BATCH_ONE_ENGINES and batch_size != 1:
                continue
            for k in ([None] if engine in PLAIN_ENGINES else config.draft_tokens):
                plan.append((engine, batch_size, k))
    if any(e in BATCH_ONE_ENGINES for e in config.engines) and 1 not in config.batch_sizes:
        plan = [(e, 1, None if e in PLAIN_ENGINES else k) for e in config.engines if e in BATCH_ONE_ENGINES
                for k in ([None] if e in PLAIN_ENGINES else config.draft_tokens)] + plan
    return plan


# ---- memory ------------------------------------------------------------------------------------

def _proc_status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of one call above the memory in use when it started (see the module docstring)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated above the allocation before the call"
        elif _proc_status_kib("VmHWM") is not None and self._reset_hwm():
            self.method = "CPU resident set: VmHWM (reset via /proc/self/clear_refs) above VmRSS before the call"
        else:
            self.method = "CPU resident set: getrusage ru_maxrss (process lifetime) above VmRSS before the call"
        self._base = 0

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return
        if self.method.startswith("CPU resident set: VmHWM"):
            self._reset_hwm()
        self._base = (_proc_status_kib("VmRSS") or 0) * 1024

    def peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self._base)
        if self.method.startswith("CPU resident set: VmHWM"):
            high = (_proc_status_kib("VmHWM") or 0) * 1024
        else:
            high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, int(high - self._base))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- pass costs and the ceiling ----------------------------------------------------------------

@torch.no_grad()
def pass_costs(pair: zoo.ModelPair, batch_size: int, ks: list[int], context_length: int, repeats: int,
               device: str) -> dict[str, Any]:
    """Median seconds of one cached pass: target over 1 and k + 1 tokens, draft over 1, at `batch_size`."""
    tokens = (torch.arange(context_length) % 256).unsqueeze(0).repeat(batch_size, 1).to(device)  # [B, L]
    lengths = torch.full((batch_size,), context_length, dtype=torch.long, device=device)

    def timed(model, q: int) -> float:
        cache, _ = batch_ops.prefill(model, tokens, lengths)
        saved = [(layer.keys, layer.values) for layer in ragged.cache_layers(cache)]
        inputs = torch.zeros(batch_size, q, dtype=torch.long, device=device)
        seconds = []
        for _ in range(repeats + 1):  # the first call warms up
            _sync(device)
            start = time.perf_counter()
            batch_ops.forward(model, cache, inputs, lengths)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            for layer, (keys, values) in zip(ragged.cache_layers(cache), saved):
                layer.keys, layer.values = keys, values
        return statistics.median(seconds[1:])

    costs: dict[str, Any] = {"batch_size": batch_size, "context_length": context_length,
                             "target_1": timed(pair.target, 1), "draft_1": timed(pair.draft, 1), "target_k1": {}}
    for k in ks:
        costs["target_k1"][str(k)] = timed(pair.target, k + 1)
    return costs


def ceiling(costs: dict[str, Any], k: int, tokens_per_step: float) -> float:
    """Best speedup over plain decoding: tokens per step x plain pass / (verify pass + k draft passes)."""
    return tokens_per_step * costs["target_1"] / (costs["target_k1"][str(k)] + k * costs["draft_1"])


# ---- one run -------------------------------------------------------------------------------------

def _drafter_for(engine_name: str, pair: zoo.ModelPair, chooser: bench_pair.CalibratedChooser | None) -> Any:
    """The calibrated drafter this engine takes, or None when it takes none (or none is asked for)."""
    if chooser is None:
        return None
    factory = resolve(engine_name)
    try:
        takes = "drafter" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return None
    if isinstance(factory, type) and issubclass(factory, InplaceEngine):
        return InplaceDrafter(pair.draft, chooser)
    return bench_pair.CalibratedDrafter(pair.draft, chooser)


def stage_seconds(trace: Any, wall: float, fill_seconds: float) -> tuple[dict[str, float] | None, dict[str, float]]:
    """(draft, verify, realign, other) from a trace's per-step seconds, and the raw per-stage sums."""
    steps = getattr(trace, "steps", None) or []
    raw: dict[str, float] = {}
    for step in steps:
        for stage, value in step.seconds.items():
            raw[stage] = raw.get(stage, 0.0) + value
    if not raw:
        return None, raw
    movement = sum(raw.get(stage, 0.0) for stage in CACHE_MOVEMENT_STAGES) - fill_seconds
    stages = {"draft": raw.get("draft", 0.0) + fill_seconds, "verify": raw.get("verify", 0.0), "realign": movement}
    stages["other"] = max(0.0, wall - sum(stages.values()))
    return stages, raw


def step_statistics(trace: Any) -> dict[str, Any]:
    steps = [s for s in (getattr(trace, "steps", None) or []) if s.kind != "prefill"]
    row_steps = sum(len(s.rows) for s in steps)
    kinds: dict[str, int] = {}
    for s in steps:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "steps": len(steps),
        "prefills": sum(1 for s in (getattr(trace, "steps", None) or []) if s.kind == "prefill"),
        "step_kinds": kinds,
        "mean_rows_per_step": row_steps / len(steps) if steps else None,
        "mean_accepted_per_step": sum(sum(s.accepted_counts) for s in steps) / row_steps if row_steps else None,
        "mean_tokens_per_step": sum(sum(s.emitted_counts) for s in steps) / row_steps if row_steps else None,
    }


def measure_run(engine_name: str, pair: zoo.ModelPair, prompts: list[list[int]], batch_size: int, k: int | None,
                config: BenchConfig, continuations: list[list[int]] | None, memory: PeakMemory) -> dict[str, Any]:
    """Warm up, then time `repeats` calls of `generate` on all prompts; one run record."""
    eos = pair.eos_token_id
    repeats = []
    calibrated = False
    run: dict[str, Any] = {"engine": engine_name, "batch_size": batch_size, "draft_tokens": k}
    for attempt in range(config.warmup + config.repeats):
        chooser = None
        if continuations is not None and config.acceptance is not None and k is not None:
            chooser = bench_pair.CalibratedChooser(continuations, config.acceptance, pair.target.config.vocab_size,
                                                   seed=config.seed)
        drafter = _drafter_for(engine_name, pair, chooser)
        calibrated = drafter is not None
        options = {"pad_token_id": pair.pad_token_id, **config.engine_options}
        if drafter is not None:
            options["drafter"] = drafter
        engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=k or 1, **options)
        if attempt < config.warmup:  # untimed: the first batch, a few tokens
            engine.generate(prompts[:batch_size], min(8, config.max_new_tokens), eos)
            continue
        memory.start()
        _sync(config.device)
        start = time.perf_counter()
        outputs = engine.generate(prompts, config.max_new_tokens, eos)
        _sync(config.device)
        wall = time.perf_counter() - start
        trace = getattr(engine, "last_trace", None)
        fill = getattr(drafter, "fill_seconds", 0.0) if drafter is not None else 0.0
        stages, raw = stage_seconds(trace, wall, fill)
        tokens = sum(len(o) for o in outputs)
        repeats.append({"seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall,
                        "stage_seconds": stages, "stage_seconds_raw": raw,
                        "peak_memory_bytes": memory.peak_bytes(), "statistics": step_statistics(trace),
                        "compactions": getattr(engine, "compactions", None),
                        "diverged_rows": chooser.diverged_rows if chooser is not None and drafter is not None else None})
    rates = [r["tokens_per_second"] for r in repeats]
    middle = sorted(range(len(repeats)), key=lambda i: rates[i])[len(repeats) // 2]  # the median repeat
    chosen = repeats[middle]
    stages = chosen["stage_seconds"]
    run.update({
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_repeats": rates,
        "spread": {"min": min(rates), "max": max(rates),
                   "relative_range": (max(rates) - min(rates)) / statistics.median(rates) if rates else None},
        "seconds": chosen["seconds"],
        "tokens": chosen["tokens"],
        "stage_seconds": stages,
        "stage_shares": {s: v / chosen["seconds"] for s, v in stages.items()} if stages else None,
        "stage_seconds_raw": chosen["stage_seconds_raw"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in repeats),
        "calibrated_drafter": calibrated,
        "diverged_rows": chosen["diverged_rows"],
        "compactions": chosen["compactions"],
        **chosen["statistics"],
    })
    if k is None:  # plain decoding: nothing is drafted or accepted
        run["mean_accepted_per_step"] = None
    return run


# ---- the bench -------------------------------------------------------------------------------------

def _load_pair(config: BenchConfig) -> zoo.ModelPair:
    if config.target:
        return zoo.load_pair(target_path=config.target, draft_path=config.draft, dtype=config.dtype, device=config.device)
    return zoo.load_pair(config.pair, dtype=config.dtype, device=config.device)


def run_bench(config: BenchConfig, out_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run of `run_plan(config)`, with the pass costs of each batch size; writes bench.json."""
    from specaudit.equivalence.bench_report import summarise

    say = log or (lambda message: None)
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = _load_pair(config)
    prompts = load_prompts(config.prompts, pair.tokenizer, config.num_prompts)
    plan = run_plan(config)
    bench: dict[str, Any] = {
        "specaudit_version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(config.device), "torch_threads": torch.get_num_threads(),
                    "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "config": asdict(config),
        "pair": {"name": pair.name, **pair.info},
        "num_prompts": len(prompts),
        "mean_prompt_length": sum(map(len, prompts)) / len(prompts),
        "acceptance": config.acceptance,
        "expected_tokens_per_step": {str(k): bench_pair.expected_tokens_per_step(config.acceptance, k)
                                     for k in config.draft_tokens} if config.acceptance is not None else None,
        "memory_method": None,
        "pass_costs": [],
        "runs": [],
        "complete": False,
    }
    json_path = out_dir / "bench.json"
    write_json(json_path, bench)
    continuations = None
    if config.acceptance is not None and any(k is not None for _, _, k in plan):
        say(f"computing the target's greedy continuations of {len(prompts)} prompts (untimed)")
        start = time.perf_counter()
        continuations = bench_pair.continuations(pair.target, prompts, config.max_new_tokens + max(config.draft_tokens),
                                                 pair.eos_token_id)
        bench["continuation_seconds"] = time.perf_counter() - start
    memory = PeakMemory(config.device)
    bench["memory_method"] = memory.method
    context = round(bench["mean_prompt_length"] + config.max_new_tokens / 2)
    for batch_size in sorted({b for _, b, _ in plan}):
        say(f"pass costs at batch size {batch_size} (context {context})")
        bench["pass_costs"].append(pass_costs(pair, batch_size, config.draft_tokens, context, config.pass_repeats,
                                              config.device))
        write_json(json_path, bench)
        for engine_name, b, k in plan:
            if b != batch_size:
                continue
            say(f"{engine_name} batch {b}" + (f" k={k}" if k is not None else ""))
            try:
                run = measure_run(engine_name, pair, prompts, b, k, config, continuations, memory)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # one engine failing keeps the others' runs
                run = {"engine": engine_name, "batch_size": b, "draft_tokens": k, "error": f"{type(exc).__name__}: {exc}"}
            bench["runs"].append(run)
            summarise(bench)
            write_json(json_path, bench)
            if "tokens_per_second" in run:
                say(f"  {run['tokens_per_second']:.2f} tokens/s")
            else:
                say(f"  failed: {run['error']}")
    bench["complete"] = True
    summarise(bench)
    write_json(json_path, bench)
    return bench
