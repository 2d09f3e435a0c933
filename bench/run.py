"""`specaudit bench`: tokens per second of engines over batch sizes and draft lengths, in one run.

Contract: `run_bench(config, out_dir)` writes `out_dir/bench.json` (rewritten after every timed call, so
an interrupted bench keeps what it measured) and returns the same dict. Per run (engine, batch size, k):
`tokens_per_second` (median over `repeats` timed calls on all prompts after `warmup` untimed ones on the
first batch, round robin over a batch size's runs so that load hits every engine alike), its spread,
`mean_accepted_per_step`, `stage_seconds`, `peak_memory_bytes`, the ratios to the same engine at batch
size 1 and to plain decoding at the same batch size.

Acceptance: with `acceptance` set, every engine that takes a `drafter` gets a calibrated one
(`engines.models.bench_pair`): the draft model runs for its real cost and each proposal is the target's
greedy token with that probability, read by row position from the target's continuations (computed once
before any timing, on the device). Engines without a `drafter` parameter draft with the draft model.

Stages (the trace's, summed over steps, prefill included): `draft`, `verify` (target passes), `realign`
(whatever moves cache rows or columns: EQSPEC's realignment, EXSPEC's and stacking, INPLACE's row selection
and compaction; the draft's fill pass is moved to `draft`), `other` = wall time minus the three.

Clock: `wall` (elapsed time, the figure a user sees) or `cpu` (this process's CPU time, for a CPU shared
with other work; use one torch thread, since idle OpenMP threads spin). Both are recorded per run;
`tokens_per_second`, the ratios and the pass costs use the chosen clock. Stage seconds are the engines'
own laps (CUDA events on the fixed-shape path); stage shares are fractions of the run's wall time.

Workload (`bench/workload.py`): `num_prompts` requests (default 4 x the largest batch size) through each
batch size, each with `max_new_tokens` or its own budget from `output_lengths`; runs report row utilisation.

Servers (`--engine vllm:URL`, ...): timed by `bench/server.py` on the same requests, at most B in flight,
on the client's wall clock; `--plain-engine` names the plain server their `ratio_to_plain` divides by.

Ceiling: before the runs at each batch size B, the target's pass over 1 and k + 1 tokens and the draft's
over 1 are timed at B rows on a context of the prompts' mean length plus half the new tokens, and the
prefill of one prompt of the mean length alone and of B in one pass. From these `bench/report.py` builds
a lower bound on any engine's time (`ideal_seconds`) and the ceilings: `ceiling` (plain run's time /
ideal speculative time: the best ratio to plain any engine could show), `speculation_ceiling` (ideal
plain / ideal speculative), `decode_ceiling = E x target(1) / (target(k+1) + k x draft(1))`,
`E = (1 - A^(k+1)) / (1 - A)` expected tokens per step.

Recurrent state (hybrid models): `state_seconds` = {snapshot, rollback}, keeping each row's per-position
states and rolling them back (`ops/recurrent.py`'s `STATE_CLOCK`), inside draft, verify and realign.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` above the allocation before the call; on the CPU
the resident set's high-water mark (`VmHWM` reset through `/proc/self/clear_refs`, else `getrusage`'s
lifetime mark) above the resident set before it. `memory_method` says which.

Dispatch: each run's `dispatch` counts the aten ops and host syncs of one untimed call on the first batch
(after the first timed call), per step of its trace (`costs.dispatch_per_step`), on every device alike.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specaudit.engines.models import bench_pair, zoo
from specaudit.engines.ops import recurrent
from specaudit.engines.inplace import InplaceDrafter, InplaceEngine
from specaudit.engines.registry import make_engine, resolve
from specaudit.bench.costs import (KeptMemory, PeakMemory, dispatch_per_step, fixed_shape_pass_costs, pass_costs,
                                   prefill_costs, sync as _sync)
from specaudit.bench import server as servers
from specaudit.bench.workload import draw_output_lengths, row_utilisation, serving_prompts, workload_record
from specaudit.equivalence.prompts import load_prompts
from specaudit.equivalence.pipeline.runner import machine_info, write_json

from specaudit import __version__ as VERSION
from specaudit.engines.contract import capability
from specaudit.engines.trace import Trace

PLAIN_ENGINES = ("reference", "batched", "hf-batched", "hf-continuous")  # no draft: k does not apply
PER_REQUEST_BUDGET_ENGINES = ("reference", "batched", "eqspec", "exspec", "inplace", "fixedshape")  # take max_new_tokens per prompt
BATCH_ONE_ENGINES = ("reference", "hf-assisted")  # one prompt at a time by construction
FIXED_SHAPE_ENGINE = "fixedshape"  # its passes are prepared once and replayed: the bench times them so too
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
    num_prompts: int | None = None  # requests; None: 4 x the largest batch size (bench/workload.py)
    max_new_tokens: int = 64
    output_lengths: str | None = None  # per-request budgets: uniform:LO:HI or geometric:MEAN (seeded); None: all max_new_tokens
    repeats: int = 3
    warmup: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    pass_repeats: int = 5
    clock: str = "wall"  # "wall": elapsed time; "cpu": this process's CPU time (a shared CPU; one torch thread)
    threads: int | None = None  # torch threads (None: torch's default)
    engine_options: dict[str, Any] = field(default_factory=dict)
    plain_engines: list[str] = field(default_factory=list)  # plain servers, one per server kind (bench/server.py)


def run_plan(config: BenchConfig) -> list[tuple[str, int, int | None]]:
    """(engine, batch size, k) of every run, in order; plain engines have no k."""
    plan = []
    for batch_size in config.batch_sizes:
        for engine in config.engines:
            if engine in BATCH_ONE_ENGINES and batch_size != 1:
                continue
            for k in ([None] if engine in PLAIN_ENGINES or servers.is_server(engine) else config.draft_tokens):
                plan.append((engine, batch_size, k))
    if any(e in BATCH_ONE_ENGINES for e in config.engines) and 1 not in config.batch_sizes:
        plan = [(e, 1, None if e in PLAIN_ENGINES else k) for e in config.engines if e in BATCH_ONE_ENGINES
                for k in ([None] if e in PLAIN_ENGINES else config.draft_tokens)] + plan
    return plan


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


def stage_seconds(trace: Trace | None, wall: float, fill_seconds: float) -> tuple[dict[str, float] | None, dict[str, float]]:
    """(draft, verify, realign, other) from a trace's per-step seconds, and the raw per-stage sums."""
    steps = trace.steps if trace is not None else []
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


def step_statistics(trace: Trace | None, batch_size: int) -> dict[str, Any]:
    every = trace.steps if trace is not None else []
    steps = [s for s in every if s.kind != "prefill"]
    row_steps = sum(len(s.rows) for s in steps)
    kinds: dict[str, int] = {}
    for s in steps:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "steps": len(steps),
        "prefills": sum(1 for s in every if s.kind == "prefill"),
        "step_kinds": kinds,
        "mean_rows_per_step": row_steps / len(steps) if steps else None,
        "mean_accepted_per_step": sum(sum(s.accepted_counts) for s in steps) / row_steps if row_steps else None,
        "mean_tokens_per_step": sum(sum(s.emitted_counts) for s in steps) / row_steps if row_steps else None,
        "row_utilisation": row_utilisation(trace, batch_size),
    }


def _engine(engine_name: str, pair: zoo.ModelPair, batch_size: int, k: int | None, config: BenchConfig,
            continuations: list[list[int]] | None, kept: dict[Any, Any] | None = None) -> tuple[Any, Any, Any]:
    """A fresh engine (and its calibrated drafter and chooser, seeded alike every time). An engine that keeps
    prepared passes for its lifetime (the fixed-shape engine's `captures`) is kept in `kept` after its first
    call and reused with the fresh drafter, so its warm-up captures and its timed calls only replay."""
    chooser = None
    if continuations is not None and config.acceptance is not None and k is not None:
        chooser = bench_pair.CalibratedChooser(continuations, config.acceptance, pair.target.config.vocab_size,
                                               seed=config.seed, device=pair.target.device)
    drafter = _drafter_for(engine_name, pair, chooser)
    options = {"pad_token_id": pair.pad_token_id, **config.engine_options}
    if drafter is not None:
        options["drafter"] = drafter
    key = (engine_name, batch_size, k)
    if kept is not None and key in kept:
        engine = kept[key]
        engine.set_drafter(drafter)
    else:
        engine = make_engine(engine_name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=k or 1, **options)
        if kept is not None and hasattr(engine, "captures"):
            kept[key] = engine
    return engine, drafter, chooser if drafter is not None else None


def warm_up(engine_name: str, pair: zoo.ModelPair, prompts: list[list[int]], batch_size: int, k: int | None,
            config: BenchConfig, continuations: list[list[int]] | None, kept: dict[Any, Any] | None = None,
            budgets: list[int] | None = None) -> None:
    """Untimed calls on the first batch: at most 8 new tokens each on the CPU, the whole budget on a GPU (an
    eager engine's first call at each new shape there was 1.3 to 3.2 times slower than its second on an H200,
    after an 8-token warm-up: reports/gpu-h200/); an engine kept for its prepared passes warms up on the timed
    call itself (all prompts, their budgets), so that every shape is captured here."""
    new_tokens = config.max_new_tokens if config.device.startswith("cuda") else min(8, config.max_new_tokens)
    for _ in range(config.warmup):
        engine, _, _ = _engine(engine_name, pair, batch_size, k, config, continuations, kept)
        if kept is not None and engine in kept.values():
            engine.generate(prompts, budgets if budgets is not None else config.max_new_tokens, pair.eos_token_id)
        else:
            engine.generate(prompts[:batch_size], new_tokens, pair.eos_token_id)


def timed_call(engine_name: str, pair: zoo.ModelPair, prompts: list[list[int]], batch_size: int, k: int | None,
               config: BenchConfig, continuations: list[list[int]] | None, memory: PeakMemory,
               budgets: list[int] | None = None, kept: dict[Any, Any] | None = None) -> dict[str, Any]:
    """One timed `generate` on all prompts (with their own budgets when given): one repeat's record."""
    engine, drafter, chooser = _engine(engine_name, pair, batch_size, k, config, continuations, kept)
    captured = sum(engine.captures.values()) if hasattr(engine, "captures") else None
    memory.start()
    _sync(config.device)
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    recurrent.STATE_CLOCK.start()
    outputs = engine.generate(prompts, budgets if budgets is not None else config.max_new_tokens, pair.eos_token_id)
    state = recurrent.STATE_CLOCK.stop()
    _sync(config.device)
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    trace = capability(engine, "last_trace")
    stages, raw = stage_seconds(trace, wall, drafter.fill_seconds if drafter is not None else 0.0)
    tokens = sum(len(o) for o in outputs)
    return {"wall_seconds": wall, "cpu_seconds": cpu, "tokens": tokens, "request_tokens": [len(o) for o in outputs],
            "tokens_per_second": tokens / (cpu if config.clock == "cpu" else wall),
            "stage_seconds": stages, "stage_seconds_raw": raw, "peak_memory_bytes": memory.peak_bytes(),
            "statistics": step_statistics(trace, batch_size), "compactions": capability(engine, "compactions"),
            "calibrated_drafter": drafter is not None,
            "diverged_rows": chooser.diverged_rows if chooser is not None else None,
            "state_seconds": state if any(state.values()) else None,
            # passes captured inside the timed call (the fixed-shape engine: 0 once warmed up)
            "captures_in_timed_call": sum(engine.captures.values()) - captured if captured is not None else None}


def combine(engine_name: str, batch_size: int, k: int | None, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One run record from its repeats: the median rate, the spread, and the median repeat's details."""
    rates = [r["tokens_per_second"] for r in repeats]
    chosen = repeats[sorted(range(len(repeats)), key=lambda i: rates[i])[len(repeats) // 2]]
    stages = chosen["stage_seconds"]
    run: dict[str, Any] = {
        "engine": engine_name, "batch_size": batch_size, "draft_tokens": k,
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_repeats": rates,
        "spread": {"min": min(rates), "max": max(rates), "relative_range": (max(rates) - min(rates)) / statistics.median(rates)},
        "wall_seconds": chosen["wall_seconds"],
        "cpu_seconds": chosen["cpu_seconds"],
        "tokens": chosen["tokens"],
        "request_tokens": chosen["request_tokens"],
        "stage_seconds": stages,
        "stage_shares": {s: v / chosen["wall_seconds"] for s, v in stages.items()} if stages else None,
        "stage_seconds_raw": chosen["stage_seconds_raw"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in repeats),
        "calibrated_drafter": chosen["calibrated_drafter"],
        "diverged_rows": chosen["diverged_rows"],
        "compactions": chosen["compactions"],
        # recurrent state bookkeeping (snapshot, rollback), inside the stages above; None without recurrent layers
        "state_seconds": chosen.get("state_seconds"),
        "captures_in_timed_calls": (sum(r["captures_in_timed_call"] for r in repeats)
                                    if chosen.get("captures_in_timed_call") is not None else None),
        **chosen["statistics"],
    }
    if k is None:  # plain decoding: nothing is drafted or accepted
        run["mean_accepted_per_step"] = None
    return run


# ---- the bench -------------------------------------------------------------------------------------

def _load_pair(config: BenchConfig) -> zoo.ModelPair:
    if config.target:
        return zoo.load_pair(target_path=config.target, draft_path=config.draft, dtype=config.dtype, device=config.device)
    if config.pair == "bench":  # the shape-realistic pair of `specaudit bench`
        return bench_pair.load_bench_pair(config.dtype, config.device)
    return zoo.load_pair(config.pair, dtype=config.dtype, device=config.device)


def run_bench(config: BenchConfig, out_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run of `run_plan(config)`, with the pass costs of each batch size; writes bench.json."""
    from specaudit.bench.report import summarise

    say = log or (lambda message: None)
    if config.clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be wall or cpu, got {config.clock!r}")
    if config.clock == "cpu" and config.device.startswith("cuda"):
        raise ValueError("the cpu clock does not see GPU work: use the wall clock with --device cuda")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    pair = _load_pair(config)
    plan = run_plan(config)
    requests = config.num_prompts or 4 * max(config.batch_sizes)
    prompt_set = load_prompts(config.prompts, pair.tokenizer, requests)
    prompts = serving_prompts(prompt_set, requests)
    budgets = (draw_output_lengths(config.output_lengths, requests, config.max_new_tokens, config.seed)
               if config.output_lengths else None)
    if budgets is not None:
        fixed = sorted({e for e, _, _ in plan if e not in PER_REQUEST_BUDGET_ENGINES and not servers.is_server(e)})
        if fixed:
            raise ValueError(f"{', '.join(fixed)} take one max_new_tokens for all prompts: drop --output-lengths "
                             f"or time only {', '.join(PER_REQUEST_BUDGET_ENGINES)}")
    bench: dict[str, Any] = {
        "specaudit_version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine_info(config.device), "torch_threads": torch.get_num_threads(),
                    "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "config": asdict(config),
        "pair": {"name": pair.name, **pair.info},
        "num_prompts": len(prompts),
        "mean_prompt_length": sum(map(len, prompts)) / len(prompts),
        "workload": workload_record(prompts, budgets, config.output_lengths, config.max_new_tokens,
                                    repeated=len(prompt_set) < requests),
        "clock": config.clock,
        "acceptance": config.acceptance,
        "expected_tokens_per_step": {str(k): bench_pair.expected_tokens_per_step(config.acceptance, k)
                                     for k in config.draft_tokens} if config.acceptance is not None else None,
        "memory_method": None,
        "pass_costs": [],
        "prefill_costs": [],
        "runs": [],
        "complete": False,
    }
    json_path = out_dir / "bench.json"
    write_json(json_path, bench)
    continuations = None
    if config.acceptance is not None and any(k is not None for _, _, k in plan):
        say(f"computing the target's greedy continuations of {len(prompts)} prompts (untimed)")
        start = time.perf_counter()
        unique = list(dict.fromkeys(tuple(p) for p in prompts))  # a repeated prompt is decoded once
        table = dict(zip(unique, bench_pair.continuations(pair.target, [list(p) for p in unique],
                                                          config.max_new_tokens + max(config.draft_tokens),
                                                          pair.eos_token_id)))
        continuations = [table[tuple(p)] for p in prompts]
        bench["continuation_seconds"] = time.perf_counter() - start
    memory = PeakMemory(config.device, KeptMemory(config.device))  # glibc's settings restored at the end
    bench["memory_method"], bench["allocator"] = memory.method, memory.kept.method
    context = round(bench["mean_prompt_length"] + config.max_new_tokens / 2)
    local = any(not servers.is_server(e) for e, _, _ in plan)  # a server-only bench times no pass of its own
    bench["servers"] = [servers.server_info(e) for e in dict.fromkeys(e for e, _, _ in plan) if servers.is_server(e)]
    for batch_size in sorted({b for _, b, _ in plan}):
        if local:
            say(f"pass costs at batch size {batch_size} (context {context}; prefill of {batch_size} prompts of "
                f"{round(bench['mean_prompt_length'])} tokens)")
            bench["pass_costs"].append(pass_costs(pair, batch_size, config.draft_tokens, context, config.pass_repeats,
                                                  config.device, use_cpu_clock=config.clock == "cpu"))
            if any(e == FIXED_SHAPE_ENGINE and b == batch_size for e, b, _ in plan):  # its passes, as it runs them
                bench["pass_costs"][-1]["fixed_shape"] = fixed_shape_pass_costs(
                    pair, batch_size, config.draft_tokens, context, config.pass_repeats, config.device,
                    cuda_graphs=bool(config.engine_options.get("cuda_graphs", True)),
                    use_cpu_clock=config.clock == "cpu")
            bench["prefill_costs"].append(prefill_costs(pair, max(1, round(bench["mean_prompt_length"])), batch_size,
                                                        config.pass_repeats, config.device,
                                                        use_cpu_clock=config.clock == "cpu"))
        write_json(json_path, bench)
        here = [(e, b, k) for e, b, k in plan if b == batch_size]
        kept: dict[Any, Any] = {}  # engines kept for their prepared passes, from warm-up to the last timed call
        errors: dict[tuple[str, int, int | None], str] = {}
        dispatched: dict[tuple[str, int, int | None], dict[str, Any]] = {}
        for spec in here:
            try:
                if servers.is_server(spec[0]):
                    servers.server_warm_up(spec[0], prompts, spec[1], config.max_new_tokens, pair.eos_token_id,
                                           config.warmup, config.engine_options)
                else:
                    warm_up(spec[0], pair, prompts, spec[1], spec[2], config, continuations, kept, budgets)
            except Exception as exc:  # one engine failing keeps the others' runs
                errors[spec] = f"{type(exc).__name__}: {exc}"
        repeats: dict[tuple[str, int, int | None], list[dict[str, Any]]] = {spec: [] for spec in here}
        first = len(bench["runs"])

        def keep_finished() -> None:
            """bench.json with every timed call so far (after each round, and on Ctrl-C mid-round)."""
            del bench["runs"][first:]
            for name, b, k in here:
                if (name, b, k) in errors:
                    bench["runs"].append({"engine": name, "batch_size": b, "draft_tokens": k, "error": errors[(name, b, k)]})
                elif repeats[(name, b, k)] and servers.is_server(name):
                    bench["runs"].append(servers.combine_server(name, b, repeats[(name, b, k)], len(prompts)))
                elif repeats[(name, b, k)]:
                    bench["runs"].append({**combine(name, b, k, repeats[(name, b, k)]),
                                          "dispatch": dispatched.get((name, b, k))})
            summarise(bench)
            write_json(json_path, bench)

        for repeat in range(config.repeats):  # round robin: a change in the machine's load hits every engine alike
            for spec in here:
                if spec in errors:
                    continue
                name, b, k = spec
                say(f"repeat {repeat + 1}/{config.repeats}: {name} batch {b}" + (f" k={k}" if k is not None else ""))
                try:
                    if servers.is_server(name):
                        repeats[spec].append(servers.timed_server_call(
                            name, prompts, b, budgets or [config.max_new_tokens] * len(prompts), pair.eos_token_id,
                            config.engine_options))
                    else:
                        repeats[spec].append(timed_call(name, pair, prompts, b, k, config, continuations, memory,
                                                        budgets, kept))
                        if spec not in dispatched:  # untimed, on the first batch, 16 new tokens at most
                            counted = _engine(name, pair, b, k, config, continuations)[0]
                            dispatched[spec] = dispatch_per_step(counted, prompts[:b], min(16, config.max_new_tokens),
                                                                 pair.eos_token_id)
                    clock = servers.SERVER_CLOCK if servers.is_server(name) else config.clock
                    say(f"  {repeats[spec][-1]['tokens_per_second']:.2f} tokens per {clock} second")
                    keep_finished()  # every timed call is kept at once: a slow machine may not finish the round
                except KeyboardInterrupt:
                    keep_finished()
                    raise
                except Exception as exc:
                    errors[spec] = f"{type(exc).__name__}: {exc}"
                    say(f"  failed: {errors[spec]}")
            keep_finished()
    bench["complete"] = True
    memory.kept.close()
    summarise(bench)
    write_json(json_path, bench)
    return bench
