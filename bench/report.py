"""What a bench run says: ratios, ceilings, EXSPEC against EQSPEC, and the markdown table.

`summarise(bench)` adds to each run of a bench dict (in place): `ratio_to_batch_size_1` (the same
engine and k at batch size 1), `ratio_to_plain` (plain decoding at the same batch size: `reference`
at 1, `batched` above), `ratio_to_reference`, and two ceilings, each the best speedup over plain
decoding that speculation could reach at that batch size with the configured acceptance (a run
with the draft model's own proposals: its measured tokens per step):

- `ceiling`: on this workload, prefill included (`bench.costs.workload_ceiling`): ideal plain time
  / ideal speculative time, where both pay every request's prefill (measured: one prompt of the
  mean length, alone) and then run every pass with all B rows busy; the speculative side also
  prefills the draft. The prefill every engine pays lowers it below the pass-only figure.
- `decode_ceiling`: passes only, `E x target(1) / (target(k+1) + k x draft(1))`.

`fraction_of_ceiling` = `ratio_to_plain / ceiling` (`fraction_of_decode_ceiling` likewise), and
`fraction_of_ideal_time` (every run, plain ones too) = the perfect engine's time on this workload /
the run's time: below 1 by what idle rows, padding, cache movement and overhead cost.
`ceiling_at_measured_acceptance` is `ceiling` with the run's own tokens per step. It also sets `exspec_vs_eqspec` (per
batch size and k: EXSPEC's group rate and what its pool gains and loses against EQSPEC, from the
traces) and `findings` (the figures the README reports). `markdown(bench)` renders it all.
"""

from __future__ import annotations

from typing import Any

from specaudit.engines.models.bench_pair import expected_tokens_per_step
from specaudit.bench.costs import ideal_seconds, workload_ceiling
from specaudit.bench.server import is_server, server_markdown, summarise_servers

SPECULATIVE_STAGE = "realign"


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


def summarise(bench: dict[str, Any]) -> None:
    runs = _finished(bench)
    costs = {c["batch_size"]: c for c in bench.get("pass_costs") or []}
    prefill = bench.get("prefill_costs")
    requests = (bench.get("workload") or {}).get("requests") or bench.get("num_prompts")
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
        cost = costs.get(b)
        if cost is None or (k is not None and str(k) not in cost["target_k1"]):
            continue
        measured = run.get("mean_tokens_per_step")
        if acceptance is not None and run.get("calibrated_drafter"):
            per_step = expected_tokens_per_step(acceptance, k) if k is not None else 1.0
        else:  # the engine drafts with the draft model: its own acceptance is the only one it has
            per_step = measured if k is not None else 1.0
        if prefill and requests and per_step:
            ideal = ideal_seconds(cost, prefill, requests, run["tokens"], k, per_step)
            run["ideal_seconds"] = ideal
            run["fraction_of_ideal_time"] = ideal * run["tokens_per_second"] / run["tokens"]
        if k is None:
            continue
        if measured:
            run["decode_ceiling_at_measured_acceptance"] = _ceiling(cost, k, measured)
        run["decode_ceiling"] = _ceiling(cost, k, per_step) if per_step else None
        if prefill and requests:
            if measured:
                run["ceiling_at_measured_acceptance"] = workload_ceiling(cost, prefill, requests, run["tokens"], k, measured)
            run["ceiling"] = workload_ceiling(cost, prefill, requests, run["tokens"], k, per_step) if per_step else None
        else:  # a bench.json from before the prefill was measured: the pass-only figure
            run["ceiling"] = run["decode_ceiling"]
            run["ceiling_at_measured_acceptance"] = run.get("decode_ceiling_at_measured_acceptance")
        if run.get("ratio_to_plain"):
            if run.get("ceiling"):
                run["fraction_of_ceiling"] = run["ratio_to_plain"] / run["ceiling"]
            if run.get("decode_ceiling"):
                run["fraction_of_decode_ceiling"] = run["ratio_to_plain"] / run["decode_ceiling"]
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
    for name in ("eqspec", "exspec", "inplace"):
        run = _find(runs, name, largest, k)
        if run and run.get("stage_shares"):
            out[f"{name}_realign_share_b{largest}"] = run["stage_shares"]["realign"]
    speculative = [r for r in runs if r["batch_size"] == largest and r["draft_tokens"] == k
                   and r["engine"] in ("eqspec", "exspec", "inplace")]
    batched = _find(runs, "batched", largest)
    if speculative and batched:
        best = max(speculative, key=lambda r: r["tokens_per_second"])
        cost = next((c for c in bench.get("pass_costs") or [] if c["batch_size"] == largest), None)
        out["best_speculative"] = best["engine"]
        out["best_over_batched"] = best["tokens_per_second"] / batched["tokens_per_second"]
        if cost is not None:
            verify_ratio = cost["target_k1"][str(k)] / cost["target_1"]
            out["verify_over_plain_pass"] = verify_ratio
            out["ceiling_largest"] = best.get("ceiling")
            out["decode_ceiling_largest"] = best.get("decode_ceiling")
            out["best_fraction_of_ceiling"] = best.get("fraction_of_ceiling")
            out["reason"] = (
                f"at batch size {largest} a target pass over k+1 = {k + 1} tokens per row costs {verify_ratio:.2f}x a "
                f"1-token pass and the k draft passes add {k * cost['draft_1'] / cost['target_1']:.2f}x, so the "
                f"pass-only ceiling is {best.get('decode_ceiling') or float('nan'):.2f}x; with every request's prefill "
                f"counted the ceiling on this workload is {best.get('ceiling') or float('nan'):.2f}x, and "
                f"{best['engine']} reaches {best.get('fraction_of_ceiling') or float('nan'):.0%} of it "
                f"(row utilisation {best.get('row_utilisation') or float('nan'):.0%})")
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
    prefill = bench.get("prefill_costs")
    if prefill:
        lines += [f"Ceiling: ideal plain time / ideal speculative time on this workload, every request's prefill "
                  f"included (one {prefill['prompt_length']}-token prompt: target {prefill['target_prefill'] * 1000:.1f} ms, "
                  f"draft {prefill['draft_prefill'] * 1000:.1f} ms), all B rows busy in every pass. Decode ceiling: "
                  "the passes alone. Of ideal: the perfect engine's time / the run's time.", ""]
    lines += [
        "| engine | B | k | tokens/s | spread | x B=1 | x plain | ceiling | of ceiling | decode ceiling | of ideal "
        "| row util | accepted/step | draft | verify | realign | other | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {_fmt(run.get('decode_ceiling'))} | {_fmt(run.get('fraction_of_ideal_time'), '.0%')} "
            f"| {_fmt(run.get('row_utilisation'), '.0%')} | {_fmt(run.get('mean_accepted_per_step'))} | "
            + " | ".join(_fmt(shares.get(s), ".1%") for s in ("draft", "verify", "realign", "other"))
            + f" | {run['peak_memory_bytes'] / 2**20:.0f} |")
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
    lines += server_markdown(bench)
    found = bench.get("findings") or {}
    if found.get("reason"):
        lines += ["", f"Best speculative engine at batch size {found['largest_batch_size']}: {found['best_speculative']}, "
                      f"{found['best_over_batched']:.2f}x `batched`; {found['reason']}."]
    return "\n".join(lines) + "\n"
