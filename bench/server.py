"""`specaudit bench` on a live server: `--engine vllm:URL` (also `llamacpp:URL`, `sglang:URL`, `trtllm:URL`).

A server engine is timed on the bench's own requests (the same prompts, `--num-prompts`,
`--max-new-tokens` and per-request budgets from `--output-lengths` as the built-in engines get),
with at most B requests in flight at batch size B: B client threads each send the next request as
soon as their previous one is answered, so the server always has B requests to batch until the
queue runs dry. Requests are greedy, stop at the pair's EOS and ask for no log-probabilities
(`engines/adapters/servers.py` builds them; `timing_request` drops what only an audit needs).

Clock: the client's wall clock (`time.perf_counter` in this process), from the first request sent
to the last answer read; so `tokens_per_second` = new tokens returned / those seconds, whatever
`--clock` says (the server's CPU time is another process's: this process's CPU clock would count
only the HTTP client). The run records it as `clock: "client wall"`, and also the client's own CPU
seconds and each request's latency (send to answer).

Speculation: `/metrics` is read just before and just after each timed repeat
(`engines/adapters/server_metrics.py`): drafted and accepted tokens, acceptance rate, preemptions.
For vLLM also `vllm:spec_decode_num_drafts_total` (speculative steps over all requests), which gives
`mean_tokens_per_step` = 1 + accepted / drafts, vLLM's "mean acceptance length" (for the built-in
engines, 1 + `mean_accepted_per_step`). Nothing else may use the server during a bench.

Plain against speculative (`--plain-engine SERVER`): SERVER is a server of the same model without
speculation. Every other server engine of the same kind (`vllm`, `llamacpp`, ...) gets
`ratio_to_plain` = its tokens/s / SERVER's at the same batch size, as the built-in speculative
engines get theirs against `batched` (`reference` at batch size 1). `speculative_over_plain(bench)`
puts each system's ratio side by side, with its measured acceptance as both count it: accepted /
drafted tokens, and 1 + accepted tokens per speculative step of one request (a row).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from specaudit.engines.adapters._http import get_text, join_url, map_concurrently
from specaudit.engines.adapters.server_base import ServerEngine, finish_output
from specaudit.engines.adapters.server_metrics import (
    COUNTERS, METRICS_PATH, parse_prometheus, speculation_between,
)
from specaudit.engines.registry import black_box_prefix, make_engine

SERVER_CLOCK = "client wall"
CLOCK_NOTE = ("client wall clock: time.perf_counter in the bench process, from the first request sent to the last "
              "answer read (a server's CPU time is another process's, so --clock cpu does not apply to it)")
STEP_COUNTERS = {"vllm": ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts")}
INFO_PATHS = ("/version", "/v1/models")  # read once per server, kept when they answer JSON


def is_server(engine: str) -> bool:
    """Whether `engine` names a live server (`llamacpp:URL`, `vllm:URL`, `sglang:URL`, `trtllm:URL`)."""
    prefix = black_box_prefix(engine)
    return prefix is not None and prefix != "recorded"


def dialect(engine: str) -> str:
    return engine.partition(":")[0]


def check_plain_engines(engines: list[str], plain_engines: list[str]) -> str | None:
    """Why `--plain-engine` cannot pair these engines, or None when it can."""
    seen: dict[str, str] = {}
    for plain in plain_engines:
        if not is_server(plain):
            return (f"--plain-engine {plain}: name a server (vllm:URL, llamacpp:URL, ...); the built-in engines' "
                    "plain run is `batched` (`reference` at batch size 1)")
        if dialect(plain) in seen and seen[dialect(plain)] != plain:
            return (f"--plain-engine: two plain {dialect(plain)} servers ({seen[dialect(plain)]}, {plain}); give "
                    "one per server kind and bench the other pairing in its own run")
        seen[dialect(plain)] = plain
    return None


def make_server(engine: str, batch_size: int, options: dict[str, Any]) -> ServerEngine:
    """The server engine with `batch_size` requests in flight, asking for no log-probabilities."""
    server = make_engine(engine, None, None, batch_size=batch_size, draft_tokens=1, **{"top_logprobs": 0, **options})
    if not isinstance(server, ServerEngine):
        raise TypeError(f"{engine}: not a live-server engine")
    return server


def timing_request(server: ServerEngine, prompt: list[int], budget: int, eos_token_id: int | None) -> dict[str, Any]:
    """The dialect's greedy request for one prompt, without log-probabilities (vLLM computes the chosen
    token's log-probability for `logprobs: 0`)."""
    body = server.request(prompt, budget, eos_token_id)
    if server.dialect == "vllm" and not server.top_logprobs:
        body.pop("logprobs", None)
    return body


def _step_count(url: str, engine: str, timeout: float) -> float | None:
    names = STEP_COUNTERS.get(dialect(engine))
    if not names:
        return None
    try:
        status, text = get_text(join_url(url, METRICS_PATH), timeout=timeout, what="server metrics endpoint")
    except Exception:  # metrics are evidence, never a reason to fail a run
        return None
    totals = parse_prometheus(text) if status == 200 else {}
    return next((totals[name] for name in names if name in totals), None)


def server_info(engine: str, timeout: float = 10.0) -> dict[str, Any]:
    """What the server says about itself (`/version`, `/v1/models`), for bench.json."""
    import json

    url = engine.partition(":")[2]
    info: dict[str, Any] = {"dialect": dialect(engine), "url": url}
    for path in INFO_PATHS:
        try:
            status, text = get_text(join_url(url, path), timeout=timeout, what="server")
            if status == 200:
                info[path.strip("/")] = json.loads(text)
        except Exception:  # optional: not every server has these endpoints
            continue
    return info


def send_all(server: ServerEngine, prompts: list[list[int]], budgets: list[int],
             eos_token_id: int | None) -> tuple[list[list[int]], list[float]]:
    """Every request, at most `server.batch_size` in flight: (new tokens per request, latency per request)."""
    from specaudit.engines.adapters._http import ServerDied, ServerUnreachable, post_json

    def one(index: int) -> tuple[list[int], float]:
        body = timing_request(server, [int(t) for t in prompts[index]], budgets[index], eos_token_id)
        start = time.perf_counter()
        try:
            answer = post_json(join_url(server.url, server.path), body, timeout=server.timeout,
                               retries=server.retries, what=f"{server.server_name} server", observe=server._observe)
        except ServerUnreachable as exc:  # one that answered before died: say so, with its last answer
            if server._answers and not isinstance(exc, ServerDied):
                raise server._died(exc, index, len(prompts[index])) from None
            raise
        latency = time.perf_counter() - start
        tokens, _, _ = finish_output(server.parse(answer), budgets[index], eos_token_id)
        return tokens, latency

    done = map_concurrently(one, list(range(len(prompts))), server.batch_size)
    return [tokens for tokens, _ in done], [latency for _, latency in done]


def server_warm_up(engine: str, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
                   eos_token_id: int | None, warmup: int, options: dict[str, Any]) -> None:
    """Untimed requests first: the first batch's prompts, at most 8 new tokens each."""
    server = make_server(engine, batch_size, options)
    first = prompts[:batch_size]
    for _ in range(warmup):
        send_all(server, first, [min(8, max_new_tokens)] * len(first), eos_token_id)


def timed_server_call(engine: str, prompts: list[list[int]], batch_size: int, budgets: list[int],
                      eos_token_id: int | None, options: dict[str, Any]) -> dict[str, Any]:
    """One timed pass of every request through the server: one repeat's record."""
    server = make_server(engine, batch_size, options)
    iterations = bool(COUNTERS.get(server.dialect) and COUNTERS[server.dialect].json_iterations)
    before, _ = server._metrics()  # an answer here counts: a server that then refuses has died
    steps_before = _step_count(server.url, engine, server.timeout)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    outputs, latencies = send_all(server, prompts, budgets, eos_token_id)
    wall, client_cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    after, failure = server._metrics()
    steps_after = _step_count(server.url, engine, server.timeout)
    speculation = speculation_between(before, after, server.url, iterations=iterations)
    if speculation is not None and steps_before is not None and steps_after is not None:
        speculation["speculative_steps"] = int(round(steps_after - steps_before))
    tokens = sum(len(o) for o in outputs)
    ordered = sorted(latencies)
    return {
        "wall_seconds": wall, "client_cpu_seconds": client_cpu, "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "latency_seconds": {"mean": statistics.fmean(latencies), "p50": ordered[len(ordered) // 2],
                            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]},
        "speculation": speculation,
        "metrics_note": failure or (after.note if after is not None else None),
        "load_average_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def combine_server(engine: str, batch_size: int, repeats: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    """One run record from a server's repeats: the median rate, its repeat's details."""
    rates = [r["tokens_per_second"] for r in repeats]
    chosen = repeats[sorted(range(len(repeats)), key=lambda i: rates[i])[len(repeats) // 2]]
    speculation = chosen["speculation"]
    drafted = [r["speculation"]["drafted_tokens"] for r in repeats if r["speculation"]]
    steps = (speculation or {}).get("speculative_steps")
    accepted = (speculation or {}).get("accepted_tokens")
    return {
        "engine": engine, "batch_size": batch_size, "draft_tokens": None, "clock": SERVER_CLOCK,
        "server": {"dialect": dialect(engine), "url": engine.partition(":")[2], "requests_in_flight": batch_size},
        "tokens_per_second": statistics.median(rates), "tokens_per_second_repeats": rates,
        "spread": {"min": min(rates), "max": max(rates),
                   "relative_range": (max(rates) - min(rates)) / statistics.median(rates)},
        "wall_seconds": chosen["wall_seconds"], "cpu_seconds": None, "client_cpu_seconds": chosen["client_cpu_seconds"],
        "tokens": chosen["tokens"], "requests": requests, "latency_seconds": chosen["latency_seconds"],
        "speculation": speculation, "metrics_note": chosen["metrics_note"],
        "drafted_tokens_repeats": drafted,
        "acceptance_rate": (speculation or {}).get("acceptance_rate"),
        "mean_tokens_per_step": 1 + accepted / steps if steps and accepted is not None else None,
        "stage_seconds": None, "stage_shares": None, "peak_memory_bytes": None,
        "load_average_after": chosen["load_average_after"],
    }


# ---- the report side ------------------------------------------------------------------------------

def _speculated(run: dict[str, Any]) -> bool | None:
    drafted = (run.get("speculation") or {}).get("drafted_tokens")
    return None if drafted is None else drafted > 0


def summarise_servers(bench: dict[str, Any]) -> None:
    """Ratios of the server runs (in place): to the paired plain server and to the same server at B = 1."""
    runs = [r for r in bench.get("runs") or [] if r.get("server") and "tokens_per_second" in r]
    plain_engines = (bench.get("config") or {}).get("plain_engines") or []
    plain_of = {dialect(p): p for p in plain_engines}
    for run in runs:
        b = run["batch_size"]
        one = next((r for r in runs if r["engine"] == run["engine"] and r["batch_size"] == 1), None)
        run["ratio_to_batch_size_1"] = run["tokens_per_second"] / one["tokens_per_second"] if one else None
        if run["engine"] in plain_engines:
            run["role"] = "plain"
            run["plain_engine"] = run["ratio_to_plain"] = None
            if _speculated(run):
                run["warning"] = f"the plain server drafted {run['speculation']['drafted_tokens']} tokens: it speculates"
            continue
        plain_name = plain_of.get(run["server"]["dialect"])
        plain = next((r for r in runs if r["engine"] == plain_name and r["batch_size"] == b), None)
        run["role"] = "speculative" if plain_name else "server"
        run["plain_engine"] = plain_name
        run["ratio_to_plain"] = run["tokens_per_second"] / plain["tokens_per_second"] if plain else None
        if plain_name and _speculated(run) is False:
            run["warning"] = "speculation not observed: the server drafted nothing"
    bench["server_clock"] = CLOCK_NOTE if runs else None
    bench["speculative_over_plain"] = speculative_over_plain(bench)


def speculative_over_plain(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Each system's speculative / plain tokens/s per batch size, with the acceptance it ran at:
    the built-in speculative engines against `batched` (their configured or measured acceptance), and
    each speculative server against its plain server (acceptance from its `/metrics`)."""
    rows = []
    for run in bench.get("runs") or []:
        if "tokens_per_second" not in run or not run.get("ratio_to_plain"):
            continue
        if run.get("server"):
            speculation = run.get("speculation") or {}
            rows.append({"system": run["server"]["dialect"], "batch_size": run["batch_size"], "speculative": run["engine"],
                         "plain": run["plain_engine"], "ratio": run["ratio_to_plain"], "clock": SERVER_CLOCK,
                         "acceptance_rate": run.get("acceptance_rate"), "tokens_per_step": run.get("mean_tokens_per_step"),
                         "acceptance_source": "measured: the server's /metrics (accepted / drafted tokens)",
                         "drafted_tokens": speculation.get("drafted_tokens"),
                         "accepted_tokens": speculation.get("accepted_tokens")})
            continue
        k = run.get("draft_tokens")
        if k is None:
            continue
        measured = run.get("mean_accepted_per_step")
        calibrated = run.get("calibrated_drafter") and bench.get("acceptance") is not None
        rows.append({"system": "specaudit", "batch_size": run["batch_size"], "speculative": f"{run['engine']} k={k}",
                     "plain": (run.get("plain_engine") or "").split(" (")[0] or None, "ratio": run["ratio_to_plain"],
                     "clock": bench.get("clock", "wall"),
                     "acceptance_rate": measured / k if measured is not None else None,  # accepted / drafted
                     "tokens_per_step": 1 + measured if measured is not None else None,  # as vLLM counts it
                     "acceptance_source": (f"set: calibrated drafter, acceptance {bench['acceptance']} (measured shown)"
                                           if calibrated else "measured: the draft model's own proposals")})
    return rows


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def server_markdown(bench: dict[str, Any]) -> list[str]:
    """The servers' table and the speculative / plain table (empty when the bench timed no server)."""
    runs = [r for r in bench.get("runs") or [] if r.get("server") or (r.get("error") and is_server(r["engine"]))]
    if not runs:
        return []
    lines = ["", f"Servers ({bench.get('server_clock') or CLOCK_NOTE}; B = requests in flight; drafted / accepted "
                 "from the server's /metrics before and after each repeat, the median repeat shown):", "",
             "| engine | role | B | tokens/s | spread | x plain server | x B=1 | mean latency s | drafted | accepted "
             "| acceptance | tokens/step | preemptions |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if "tokens_per_second" not in run:
            lines.append(f"| {run['engine']} | - | {run['batch_size']} | failed: "
                         f"{(run.get('error') or '').splitlines()[0] if run.get('error') else ''} |")
            continue
        spec = run.get("speculation") or {}
        lines.append(
            f"| {run['engine']} | {run.get('role', '-')} | {run['batch_size']} | {run['tokens_per_second']:.2f} "
            f"| {_fmt((run.get('spread') or {}).get('relative_range'), '.0%')} | {_fmt(run.get('ratio_to_plain'))} "
            f"| {_fmt(run.get('ratio_to_batch_size_1'))} | {_fmt((run.get('latency_seconds') or {}).get('mean'))} "
            f"| {_fmt(spec.get('drafted_tokens'), 'd')} | {_fmt(spec.get('accepted_tokens'), 'd')} "
            f"| {_fmt(spec.get('acceptance_rate'), '.1%')} | {_fmt(run.get('mean_tokens_per_step'))} "
            f"| {_fmt(spec.get('preemptions'), 'd')} |")
    warnings = [f"{r['engine']} at B={r['batch_size']}: {r['warning']}" for r in runs if r.get("warning")]
    lines += [f"\nWarning: {w}." for w in warnings]
    rows = bench.get("speculative_over_plain") or []
    if rows:
        lines += ["", "Speculative / plain, each system at each batch size (each ratio on its own system's clock):", "",
                  "| system | B | speculative | plain | speculative / plain | clock | accepted / drafted "
                  "| 1 + accepted per step | acceptance from |", "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['system']} | {row['batch_size']} | {row['speculative']} | {row['plain']} "
                         f"| **{row['ratio']:.2f}** | {row['clock']} | {_fmt(row['acceptance_rate'], '.1%')} "
                         f"| {_fmt(row['tokens_per_step'])} | {row['acceptance_source']} |")
    return lines
