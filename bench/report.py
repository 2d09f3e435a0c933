"""What a bench run says: ratios, ceilings, EXSPEC against EQSPEC, and the markdown table.

`summarise(bench)` adds to each run of a bench dict (in place): `ratio_to_batch_size_1` (the same
engine and k at batch size 1), `ratio_to_plain` (plain decoding at the same batch size: `reference`
at 1, `batched` above), `ratio_to_reference`, and what a perfect engine would do (CEILING_TEXT):

- `ideal_seconds`: a lower bound on any engine's time on this workload at this batch size
  (`bench.costs.ideal_seconds`); `fraction_of_ideal_time` = ideal / the run's time (plain runs too).
- `ceiling` (speculative runs): the best `ratio_to_plain` any engine speculating with this draft, k
  and acceptance could show: the plain run's measured time / the ideal speculative time. So
  `fraction_of_ceiling` = `ratio_to_plain / ceiling` = the run's `fraction_of_ideal_time` <= 1, up
  to timing noise and the luck of the acceptance draws; `ceiling_at_measured_acceptance` is the
  same with the run's own row-steps instead of the expected ones.
- `speculation_ceiling`: ideal plain time / ideal speculative time, what speculation is worth
  against a perfect plain engine, prefill included (`ceiling` divided by how far the plain run is
  from its own ideal).
- `decode_ceiling`: passes only, `E x target(1) / (target(k+1) + k x draft(1))`, and
  `fraction_of_decode_ceiling`.

With the draft model's own proposals (no calibrated acceptance) the speculative ideal divides the
decoding tokens by the run's measured tokens per row-step. It also sets `exspec_vs_eqspec` (per
batch size and k: EXSPEC's group rate and what its pool gains and loses against EQSPEC, from the
traces) and `findings` (the figures the README reports). `markdown(bench)` renders it all.
"""

from __future__ import annotations

from typing import Any

from specaudit.engines.models.bench_pair import expected_tokens_per_step
from specaudit.bench.costs import expected_row_steps, ideal_seconds, speculation_ceiling
from specaudit.bench.server import is_server, server_markdown, summarise_servers

CEILING_TEXT = (
    "Ideal time: a lower bound on any engine's time on this workload at this batch size. Every prompt is "
    "prefilled once at the cheapest per-prompt cost measured for a prompt of the mean length ({prefill}; no "
    "padding, and a longer prompt costs more than its share), then every pass has all B rows busy and costs what "
    "the measured pass at B rows costs (context: mean prompt + half the new tokens): a plain pass per decoding "
    "token, or per speculative step a verify pass over k + 1 tokens and k draft passes, for the expected number "
    "of steps each request needs at this acceptance (its last step cut at its budget). Nothing else is counted: "
    "no padding, idle row, cache movement, fill pass or Python. "
    "Ceiling: the best x plain any engine speculating with this draft, k and acceptance could show = the plain "
    "run's time / the ideal speculative time; so of ceiling = the ideal time / the run's time, at most 100% up to "
    "timing noise and the luck of the acceptance draws. Spec. ceiling: ideal plain time / ideal speculative time, "
    "what speculation is worth against a perfect plain engine (ceiling = spec. ceiling x the plain run's time / "
    "its ideal time). Decode ceiling: the passes alone, E x target(1) / (target(k+1) + k x draft(1)). "
    "Of ideal: the ideal time / the run's time, plain runs too."
)


def _finished(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished runs of the built-in engines (servers are summarised by `bench/server.py`)."""
    return [run for run in bench.get("runs") or [] if "tokens_per_second" in run and not run.get("server")]


def _find(runs: list[dict[str, Any]], engine: str, batch_size: int, k: Any = "any") -> dict[str, Any] | None:
    for run in runs:
        if run["engine"] == engine and run["batch_size"] == batch_size and (k == "any" or run["draft_tokens"] == k):
            return run
    return None


def _ceiling(costs: dict[str, Any], k: int, tokens_per_step: float) -> float:
    return tokens_per_step * costs["target_1"] / (costs["target_k1"][str(k)] + k * costs["draft_1"])


def plain_run(runs: list[dict[str, Any]], batch_size: int) -> dict[str, Any] | None:
    """Plain decoding at this batch size: `reference` at 1 (else `batched`), `batched` above."""
    if batch_size == 1:
        return _find(runs, "reference", 1) or _find(runs, "batched", 1)
    return _find(runs, "batched", batch_size)


def _prefill_at(bench: dict[str, Any], batch_size: int) -> dict[str, Any] | None:
    """The measured prefill cost at this batch size (a bench.json from before it was measured per batch
    size holds one record, of one prompt alone)."""
    prefill = bench.get("prefill_costs")
    if isinstance(prefill, dict):
        return prefill
    return next((p for p in prefill or [] if p.get("batch_size") == batch_size), None)


def _run_seconds(run: dict[str, Any]) -> float:
    """The run's time on the bench's clock."""
    return run["tokens"] / run["tokens_per_second"]


def _request_tokens(run: dict[str, Any], requests: int) -> list[int]:
    """New tokens per request (an older bench.json without them: the mean for each)."""
    return run.get("request_tokens") or [round(run["tokens"] / requests)] * requests


def engine_pass_costs(run: dict[str, Any], cost: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pass costs the run's ideal engine pays: the fixed-shape engine's own prepared (on CUDA, captured)
    passes where they were timed, the eager passes for every other engine."""
    if cost is not None and run["engine"] == "fixedshape" and cost.get("fixed_shape"):
        return {**cost, **cost["fixed_shape"]}
    return cost


def summarise(bench: dict[str, Any]) -> None:
    runs = _finished(bench)
    costs = {c["batch_size"]: c for c in bench.get("pass_costs") or []}
    acceptance = bench.get("acceptance")
    reference = _find(runs, "reference", 1)
    for run in runs:
        b, k = run["batch_size"], run["draft_tokens"]
        one = _find(runs, run["engine"], 1, k)
        plain = plain_run(runs, b)
        run["ratio_to_batch_size_1"] = run["tokens_per_second"] / one["tokens_per_second"] if one else None
        run["plain_engine"] = f"{plain['engine']} (batch {b})" if plain else None
        run["ratio_to_plain"] = run["tokens_per_second"] / plain["tokens_per_second"] if plain else None
        run["ratio_to_reference"] = run["tokens_per_second"] / reference["tokens_per_second"] if reference else None
        cost, prefill = engine_pass_costs(run, costs.get(b)), _prefill_at(bench, b)
        if cost is None or (k is not None and str(k) not in cost["target_k1"]):
            continue
        measured = run.get("mean_tokens_per_step")
        calibrated = acceptance is not None and run.get("calibrated_drafter")
        if k is None:
            per_step = 1.0
        else:  # an engine drafting with the draft model: its own acceptance is the only one it has
            per_step = expected_tokens_per_step(acceptance, k) if calibrated else measured
        if k is not None and per_step:
            run["decode_ceiling"] = _ceiling(cost, k, per_step)
            if measured:
                run["decode_ceiling_at_measured_acceptance"] = _ceiling(cost, k, measured)
        if not prefill or not run.get("tokens"):
            continue
        requests = _request_tokens(run, (bench.get("workload") or {}).get("requests") or bench["num_prompts"])
        decode_tokens = [max(0, n - 1) for n in requests]
        if k is None:
            row_steps = float(sum(decode_tokens))
        elif calibrated:
            row_steps = sum(expected_row_steps(m, k, acceptance) for m in decode_tokens)
        elif per_step:
            row_steps = sum(decode_tokens) / per_step
        else:
            continue
        ideal = ideal_seconds(cost, prefill, len(requests), row_steps, k)
        run["ideal_seconds"] = ideal
        run["fraction_of_ideal_time"] = ideal / _run_seconds(run)
        if k is None:
            continue
        run["speculation_ceiling"] = speculation_ceiling(cost, prefill, requests, k, row_steps)
        if plain is None:
            continue
        # the best ratio to the measured plain run that any engine could show: plain tokens/s against
        # the ideal engine's (every prefill paid, every row busy, no other cost)
        run["ceiling"] = run["tokens"] / ideal / plain["tokens_per_second"]
        run["fraction_of_ceiling"] = run["ratio_to_plain"] / run["ceiling"]
        if run.get("decode_ceiling"):
            run["fraction_of_decode_ceiling"] = run["ratio_to_plain"] / run["decode_ceiling"]
        if run.get("steps") and run.get("mean_rows_per_step"):  # the same with this run's own row-steps (its luck)
            own = ideal_seconds(cost, prefill, len(requests), run["steps"] * run["mean_rows_per_step"], k)
            run["ceiling_at_measured_acceptance"] = run["tokens"] / own / plain["tokens_per_second"]
    bench["exspec_vs_eqspec"] = exspec_vs_eqspec(runs)
    bench["findings"] = findings(bench, runs)
    summarise_servers(bench)


def _movement(run: dict[str, Any]) -> float | None:
    stages = run.get("stage_seconds")
    return stages["realign"] if stages else None


def exspec_vs_eqspec(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch size, k) with both engines: EXSPEC's group rate, and steps, rows per step, cache
    movement (realign + stack + unstack) and tokens/s against EQSPEC's."""
    rows = []
    for ex in runs:
        if ex["engine"] != "exspec":
            continue
        eq = _find(runs, "eqspec", ex["batch_size"], ex["draft_tokens"])
        kinds = ex.get("step_kinds") or {}
        spec_steps = kinds.get("group", 0) + kinds.get("fallback", 0)
        entry: dict[str, Any] = {
            "batch_size": ex["batch_size"], "draft_tokens": ex["draft_tokens"],
            "group_steps": kinds.get("group", 0), "fallback_steps": kinds.get("fallback", 0),
            "group_rate": kinds.get("group", 0) / spec_steps if spec_steps else None,
            "exspec_steps": ex.get("steps"), "exspec_prefills": ex.get("prefills"),
            "exspec_rows_per_step": ex.get("mean_rows_per_step"),
            "exspec_cache_movement_seconds": _movement(ex),
            "exspec_tokens_per_second": ex["tokens_per_second"],
        }
        if eq is not None:
            entry.update({
                "eqspec_steps": eq.get("steps"), "eqspec_prefills": eq.get("prefills"),
                "eqspec_rows_per_step": eq.get("mean_rows_per_step"),
                "eqspec_cache_movement_seconds": _movement(eq),
                "eqspec_tokens_per_second": eq["tokens_per_second"],
                "tokens_per_second_ratio": ex["tokens_per_second"] / eq["tokens_per_second"],
            })
        rows.append(entry)
    return rows


def findings(bench: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ks = sorted({r["draft_tokens"] for r in runs if r["draft_tokens"] is not None})
    k = 4 if 4 in ks else (ks[0] if ks else None)
    eq1, ref = _find(runs, "eqspec", 1, k), _find(runs, "reference", 1)
    if eq1 and ref:
        out["eqspec_b1_over_reference"] = eq1["tokens_per_second"] / ref["tokens_per_second"]
        out["eqspec_b1_fraction_of_ceiling"] = eq1.get("fraction_of_ceiling")
        out["ceiling_b1"] = eq1.get("ceiling")
    sizes = sorted({r["batch_size"] for r in runs})
    largest = 8 if 8 in sizes else (sizes[-1] if sizes else None)
    if largest is None or k is None:
        return out
    out["draft_tokens"], out["largest_batch_size"] = k, largest
    for name in ("eqspec", "exspec", "inplace", "fixedshape"):
        run = _find(runs, name, largest, k)
        if run and run.get("stage_shares"):
            out[f"{name}_realign_share_b{largest}"] = run["stage_shares"]["realign"]
    speculative = [r for r in runs if r["batch_size"] == largest and r["draft_tokens"] == k
                   and r["engine"] in ("eqspec", "exspec", "inplace", "fixedshape")]
    batched = _find(runs, "batched", largest)
    if speculative and batched:
        best = max(speculative, key=lambda r: r["tokens_per_second"])
        cost = engine_pass_costs(best, next((c for c in bench.get("pass_costs") or [] if c["batch_size"] == largest),
                                            None))
        out["best_speculative"] = best["engine"]
        out["best_over_batched"] = best["tokens_per_second"] / batched["tokens_per_second"]
        if cost is not None:
            verify_ratio = cost["target_k1"][str(k)] / cost["target_1"]
            out["verify_over_plain_pass"] = verify_ratio
            out["ceiling_largest"] = best.get("ceiling")
            out["speculation_ceiling_largest"] = best.get("speculation_ceiling")
            out["decode_ceiling_largest"] = best.get("decode_ceiling")
            out["best_fraction_of_ceiling"] = best.get("fraction_of_ceiling")
            nan = float("nan")
            out["reason"] = (
                f"at batch size {largest} a target pass over k+1 = {k + 1} tokens per row costs {verify_ratio:.2f}x a "
                + ("(captured) " if cost.get("captured") else "") +
                f"1-token pass and the k draft passes add {k * cost['draft_1'] / cost['target_1']:.2f}x, so the "
                f"pass-only ceiling is {best.get('decode_ceiling') or nan:.2f}x; with every prompt's prefill counted a "
                f"perfect speculative engine would be {best.get('speculation_ceiling') or nan:.2f}x a perfect plain one, "
                f"and {best.get('ceiling') or nan:.2f}x the measured `batched` (whose time is "
                f"{batched.get('fraction_of_ideal_time') or nan:.0%} of ideal); {best['engine']} reaches "
                f"{best.get('fraction_of_ceiling') or nan:.0%} of that ceiling "
                f"(row utilisation {best.get('row_utilisation') or nan:.0%})")
    return out


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown(bench: dict[str, Any]) -> str:
    machine = bench.get("machine") or {}
    local = any(not is_server(run["engine"]) for run in bench.get("runs") or [])
    lines = [
        f"# bench: pair `{bench['pair']['name']}`, "
        + (f"acceptance {bench.get('acceptance')}" if local else "servers only"),
        "",
        f"{bench['num_prompts']} prompts (mean length {bench['mean_prompt_length']:.0f}), "
        f"{bench['config']['max_new_tokens']} new tokens each, {bench['config']['dtype']} on "
        f"{machine.get('device')} ({machine.get('device_name')}, {machine.get('cpu_count')} CPUs, "
        f"{machine.get('torch_threads')} torch threads); torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}; warm-up {bench['config']['warmup']}, repeats {bench['config']['repeats']} "
        f"(median shown, spread = (max - min) / median). Clock: {bench.get('clock', 'wall')} "
        f"(tokens/s, ratios and pass costs per {bench.get('clock', 'wall')} second; stage shares of wall time). "
        f"Peak memory: {bench.get('memory_method')}.",
        "",
    ]
    workload = bench.get("workload")
    if workload:
        lines += [f"Workload: {workload['requests']} requests"
                  + (" (the prompt set repeated)" if workload.get("prompts_repeated") else "")
                  + f", output budgets {workload['output_lengths']} (mean {workload['mean_budget']:.1f}). Engines "
                  "that refill (EXSPEC's pool, INPLACE, hf-continuous) take the next request into a freed row; the "
                  "others run batch after batch. Row util = rows that ran / (B x decoding steps).", ""]
    prefills = bench.get("prefill_costs") or []
    prefills = [prefills] if isinstance(prefills, dict) else prefills
    if prefills:
        measured = "; ".join(
            f"B = {p.get('batch_size', 1)}: {p['prompt_length']} tokens, target {p['target_prefill'] * 1000:.1f} ms, "
            f"draft {p['draft_prefill'] * 1000:.1f} ms per prompt" for p in prefills)
        lines += [CEILING_TEXT.format(prefill=measured), ""]
    lines += [
        "| engine | B | k | tokens/s | spread | x B=1 | x plain | ceiling | of ceiling | spec. ceiling | decode ceiling "
        "| of ideal | row util | accepted/step | draft | verify | realign | other | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ] if local else []
    for run in bench.get("runs") or []:
        if is_server(run["engine"]):
            continue  # the servers' own table, below
        if "tokens_per_second" not in run:
            lines.append(f"| {run['engine']} | {run['batch_size']} | {_fmt(run['draft_tokens'], 'd')} | failed: "
                         f"{run.get('error', '').splitlines()[0] if run.get('error') else ''} |")
            continue
        shares = run.get("stage_shares") or {}
        lines.append(
            f"| {run['engine']} | {run['batch_size']} | {_fmt(run['draft_tokens'], 'd')} | {run['tokens_per_second']:.2f} "
            f"| {_fmt((run.get('spread') or {}).get('relative_range'), '.0%')} | {_fmt(run.get('ratio_to_batch_size_1'))} "
            f"| {_fmt(run.get('ratio_to_plain'))} | {_fmt(run.get('ceiling'))} | {_fmt(run.get('fraction_of_ceiling'), '.0%')} "
            f"| {_fmt(run.get('speculation_ceiling'))} | {_fmt(run.get('decode_ceiling'))} "
            f"| {_fmt(run.get('fraction_of_ideal_time'), '.0%')} "
            f"| {_fmt(run.get('row_utilisation'), '.0%')} | {_fmt(run.get('mean_accepted_per_step'))} | "
            + " | ".join(_fmt(shares.get(s), ".1%") for s in ("draft", "verify", "realign", "other"))
            + f" | {run['peak_memory_bytes'] / 2**20:.0f} |")
    stateful = [run for run in bench.get("runs") or [] if run.get("state_seconds")]
    if stateful:
        lines += ["", "Recurrent state rollback (inside draft, verify and realign above): per-position states kept "
                  "after each one-token pass (snapshot) and each row given its state at a commit (rollback):", "",
                  "| engine | B | k | snapshot s | rollback s | share of wall |", "|---|---|---|---|---|---|"]
        for run in stateful:
            state = run["state_seconds"]
            lines.append(f"| {run['engine']} | {run['batch_size']} | {_fmt(run['draft_tokens'], 'd')} "
                         f"| {state['snapshot']:.3f} | {state['rollback']:.3f} "
                         f"| {_fmt(sum(state.values()) / run['wall_seconds'], '.1%')} |")
    pairs = bench.get("exspec_vs_eqspec") or []
    if pairs:
        lines += ["", "EXSPEC against EQSPEC (steps = speculative steps; cache movement = realign + stack + unstack):", "",
                  "| B | k | group steps | fallback steps | group rate | steps EX / EQ | rows per step EX / EQ "
                  "| cache movement s EX / EQ | tokens/s EX / EQ |", "|---|---|---|---|---|---|---|---|---|"]
        for e in pairs:
            lines.append(
                f"| {e['batch_size']} | {e['draft_tokens']} | {e['group_steps']} | {e['fallback_steps']} "
                f"| {_fmt(e['group_rate'], '.0%')} | {e['exspec_steps']} / {_fmt(e.get('eqspec_steps'), 'd')} "
                f"| {_fmt(e['exspec_rows_per_step'])} / {_fmt(e.get('eqspec_rows_per_step'))} "
                f"| {_fmt(e['exspec_cache_movement_seconds'])} / {_fmt(e.get('eqspec_cache_movement_seconds'))} "
                f"| {_fmt(e['exspec_tokens_per_second'])} / {_fmt(e.get('eqspec_tokens_per_second'))} |")
    costs = bench.get("pass_costs") or []
    if costs:
        lines += ["", "Pass costs (median ms; context = mean prompt length + half the new tokens):", "",
                  "| B | context | target, 1 token | target, k+1 tokens | draft, 1 token |", "|---|---|---|---|---|"]
        for c in costs:
            verify = ", ".join(f"k={k}: {v * 1000:.1f}" for k, v in c["target_k1"].items())
            lines.append(f"| {c['batch_size']} | {c['context_length']} | {c['target_1'] * 1000:.1f} | {verify} "
                         f"| {c['draft_1'] * 1000:.1f} |")
        fixed = [c for c in costs if c.get("fixed_shape")]
        if fixed:
            kind = "captured as CUDA graphs" if any(c["fixed_shape"]["captured"] for c in fixed) else "eager, on fixed shapes"
            lines += ["", f"The fixed-shape engine's passes ({kind}, slots of {fixed[0]['fixed_shape']['columns']} "
                          "columns; its ideal time and ceiling use these):", "",
                      "| B | context | target, 1 token | target, k+1 tokens | draft, 1 token |", "|---|---|---|---|---|"]
            for c in fixed:
                f = c["fixed_shape"]
                verify = ", ".join(f"k={k}: {v * 1000:.2f}" for k, v in f["target_k1"].items())
                lines.append(f"| {c['batch_size']} | {c['context_length']} | {f['target_1'] * 1000:.2f} | {verify} "
                             f"| {f['draft_1'] * 1000:.2f} |")
    lines += server_markdown(bench)
    found = bench.get("findings") or {}
    if found.get("reason"):
        lines += ["", f"Best speculative engine at batch size {found['largest_batch_size']}: {found['best_speculative']}, "
                      f"{found['best_over_batched']:.2f}x `batched`; {found['reason']}."]
    return "\n".join(lines) + "\n"
