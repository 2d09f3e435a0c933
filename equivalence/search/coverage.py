"""What a search reached, in words: `OUT/search.md`, one section per searched engine and batch size.

Read from the run's `search` record (equivalence/search/run.py): the budget and seed, examples judged and their
rate with the reference's share of the time, each finding (what told it apart, its shrunk size, its bundle), the
parameter families and pairs of them drawn within one request, the prompt shapes and wave sizes, how the
reference's outputs ended, the parameters the engine refused, the server's counters the search moved (vLLM's
prefix-cache hits and preemptions, where its `/metrics` has them), and what was not reached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPORT = "search.md"


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def search_lines(run: dict[str, Any]) -> list[str]:
    """The section of one run (markdown lines)."""
    search = run.get("search") or {}
    coverage = search.get("coverage") or {}
    budget = search.get("budget") or {}
    lines = [f"## {run.get('engine')} on {run.get('pair')}, batch size {run.get('batch_size')}, {run.get('dtype')}", ""]
    rate = search.get("examples_per_minute")
    seconds = search.get("seconds") or 0.0
    share = (search.get("reference_seconds") or 0.0) / seconds if seconds else None
    lines.append(f"- seed {search.get('seed')}, budget "
                 + (f"{budget.get('examples')} examples" if budget.get("examples") is not None
                    else f"{budget.get('minutes'):g} minutes")
                 + f"; {search.get('examples')} examples judged in {seconds:.1f} s"
                 + (f" ({rate:.1f} a minute" if rate else "")
                 + (f", the reference {share:.0%} of the time)" if share is not None and rate else ")" if rate else ""))
    alone = search.get("speed_of_engine_alone")
    if alone:
        lines.append(f"- the engine answered the judged requests in {search.get('answer_seconds', 0.0):.1f} s: the search "
                     f"ran at {alone:.0%} of the speed of the engine answering the same requests alone")
    findings = search.get("findings") or ([search["finding"]] if search.get("finding") else [])
    offsets = [f.get("prompt_offset", 0) for f in findings] + [float("inf")]
    for number, finding in enumerate(findings, 1):
        told = "; ".join(" ".join(x for x in sig if x) for sig in finding.get("signatures") or [])
        lines.append(f"- finding {number} after {finding.get('found_after', search.get('found_after'))} examples"
                     + (f" ({told})" if told else "") + f", shrunk to {finding.get('requests')} request(s) in waves "
                     f"{finding.get('waves')}; bundle {finding.get('bundle')}"
                     + ("" if finding.get("reproducible", True) else "; the failure did not always reproduce"))
        start, stop = offsets[number - 1], offsets[number]
        for d in run.get("divergences") or []:
            if not start <= (d.get("prompt_index") or 0) < stop:
                continue
            diagnosis = d.get("diagnosis") or {}
            lines.append(f"  - request {d.get('prompt_index') - start} at position "
                         f"{d.get('position')}: {d.get('kind')} {diagnosis.get('class')}: {diagnosis.get('evidence')}")
    if not findings and run.get("error"):
        lines.append(f"- failed: {run.get('error')}")
    elif not findings:
        lines.append("- no finding: every judged example was equivalent")
    lines += [f"- requests: {coverage.get('requests', 0)}; parameter families: {_counts(coverage.get('families') or {})}",
              f"- families together in one request: {_counts(coverage.get('pairs') or {})}",
              f"- prompt shapes: {_counts(coverage.get('shapes') or {})}",
              f"- requests in one wave: {_counts(coverage.get('wave_sizes') or {})}",
              f"- structured outputs: {_counts(coverage.get('constraints') or {})}",
              f"- the reference's endings: {_counts(coverage.get('reference_endings') or {})}",
              f"- sampled probes with seeds: {coverage.get('seed_probes', 0)}"]
    if coverage.get("refused"):
        lines.append(f"- refused by the engine: {_counts(coverage['refused'])}")
    events = search.get("server_events")
    lines.append(f"- server counters moved: {_counts(events)}" if events else
                 "- server counters: none read (no /metrics counters of prefix caching or preemption)")
    missing = list(coverage.get("not_reached") or [])
    if events is not None and not any(v for k, v in (events or {}).items() if "prefix_cache_hits" in k):
        missing.append("no prefix-cache hit counted by the server")
    lines.append("- not reached: " + ("; ".join(missing) if missing else "nothing listed"))
    return lines + [""]


def write_search_report(out_dir: Path, run: dict[str, Any]) -> Path:
    """Add the run's section to `OUT/search.md` (started afresh by `start_search_report`)."""
    path = out_dir / REPORT
    if not path.is_file():
        path.write_text("# What the search reached\n\n")
    with path.open("a") as handle:
        handle.write("\n".join(search_lines(run)) + "\n")
    return path


def start_search_report(out_dir: Path) -> None:
    path = out_dir / REPORT
    if path.is_file():
        path.unlink()
