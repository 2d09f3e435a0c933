"""A live server's own speculation counters, read before and after a run.

An audit that passes on a server that never speculated proves nothing about speculation. So every
server run reads the server's metrics endpoint just before and just after `generate`, and keeps the
difference of its counters:

    {"drafted_tokens", "accepted_tokens", "acceptance_rate", "preemptions", "source"}

(`None` for a count the server does not expose; the whole record is `None` when it exposes none).

Where each server keeps them (first name found wins; a Prometheus counter `x` is exposed as `x_total`
by current clients and as `x` by older ones):

- vLLM (`GET /metrics`, Prometheus text): `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`, `vllm:num_preemptions_total`;
- llama.cpp (`GET /metrics`, Prometheus text, with `--metrics`): `llamacpp:spec_decode_num_draft_tokens_total`,
  `llamacpp:spec_decode_num_accepted_tokens_total` (no preemption counter);
- SGLang (`GET /metrics`, Prometheus text): no draft counters, only the gauge `sglang:spec_accept_rate`
  (a recent window's acceptance, not this run's): kept as `acceptance_rate` with no counts;
- TensorRT-LLM (`GET /metrics`, JSON: the iteration statistics since the last read, drained by each
  read): `specDecodingStats.numDraftTokens` and `.numAcceptedTokens`, summed over the iterations.

Prometheus text is parsed line by line (`name{labels} value [timestamp]`), comments skipped, and
each metric summed over its label sets (one per model, engine or rank). Other clients of the same
server between the two reads are counted too: audit a server nothing else is using.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from specaudit.engines.adapters._http import ServerError, get_text, join_url


@dataclass(frozen=True)
class CounterNames:
    """Where one dialect keeps its counters (candidates in order) and how its endpoint speaks."""

    drafted: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    acceptance_gauge: tuple[str, ...] = ()
    json_iterations: bool = False  # TensorRT-LLM: a JSON list of per-iteration statistics


def _counter(name: str) -> tuple[str, str]:
    return f"{name}_total", name


COUNTERS: dict[str, CounterNames] = {
    "vllm": CounterNames(drafted=_counter("vllm:spec_decode_num_draft_tokens"),
                         accepted=_counter("vllm:spec_decode_num_accepted_tokens"),
                         preemptions=_counter("vllm:num_preemptions")),
    "llamacpp": CounterNames(drafted=_counter("llamacpp:spec_decode_num_draft_tokens"),
                             accepted=_counter("llamacpp:spec_decode_num_accepted_tokens")),
    "sglang": CounterNames(acceptance_gauge=("sglang:spec_accept_rate",)),
    "trtllm": CounterNames(json_iterations=True),
}
METRICS_PATH = "/metrics"
METRICS_TIMEOUT_S = 10.0


def _split_sample(line: str) -> tuple[str, str] | None:
    """(`name`, the text after the name and its labels) of one sample line, or None."""
    brace = line.find("{")
    space = min((i for i in (line.find(" "), line.find("\t")) if i >= 0), default=-1)
    if brace >= 0 and (space < 0 or brace < space):
        # skip the label set, honouring quoted values (which may hold braces, spaces, escaped quotes)
        quoted, escaped = False, False
        for position in range(brace + 1, len(line)):
            char = line[position]
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = not quoted
            elif char == "}" and not quoted:
                return line[:brace].strip(), line[position + 1:]
        return None  # an unclosed label set
    if space < 0:
        return None
    return line[:space], line[space:]


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition as {metric name: value summed over its label sets}. Comments,
    blank lines and lines that are not samples are skipped; NaN samples are left out."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _split_sample(line)
        if sample is None:
            continue
        name, rest = sample
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])  # the value; a timestamp may follow
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def _first(totals: dict[str, float], names: tuple[str, ...]) -> tuple[str | None, float | None]:
    for name in names:
        if name in totals:
            return name, totals[name]
    return None, None


def _iteration_totals(answer: Any) -> dict[str, float] | None:
    """TensorRT-LLM's JSON iteration statistics summed: None when they are not that shape."""
    if not isinstance(answer, list):
        return None
    drafted = accepted = 0.0
    seen = False
    for row in answer:
        spec = row.get("specDecodingStats") if isinstance(row, dict) else None
        if isinstance(spec, dict):
            seen = True
            drafted += float(spec.get("numDraftTokens") or 0)
            accepted += float(spec.get("numAcceptedTokens") or 0)
    return {"drafted": drafted, "accepted": accepted} if seen else {}


@dataclass
class Snapshot:
    """One read of the endpoint: the counters found, by role, and their names."""

    values: dict[str, float]  # role ("drafted", "accepted", "preemptions", "acceptance_gauge") -> value
    names: dict[str, str]  # role -> the metric it came from
    note: str | None = None  # why nothing usable was read


def read_snapshot(base_url: str, dialect: str, timeout: float = METRICS_TIMEOUT_S) -> Snapshot:
    """Read the server's metrics endpoint once. Raises `ServerUnreachable` when no connection can
    be made (the caller decides what that means); any answer that holds no counters gives an empty
    snapshot with a note."""
    names = COUNTERS.get(dialect, CounterNames())
    url = join_url(base_url, METRICS_PATH)
    status, text = get_text(url, timeout=timeout, what="server metrics endpoint")
    if status != 200:
        return Snapshot({}, {}, f"GET {url} answered HTTP {status}")
    if names.json_iterations:
        try:
            totals = _iteration_totals(json.loads(text))
        except json.JSONDecodeError:
            totals = None
        if not totals:
            return Snapshot({}, {}, f"GET {url} gave no TensorRT-LLM speculative-decoding statistics")
        return Snapshot(totals, {role: f"specDecodingStats.num{'DraftTokens' if role == 'drafted' else 'AcceptedTokens'}"
                                 for role in totals})
    totals = parse_prometheus(text)
    values, found = {}, {}
    for role in ("drafted", "accepted", "preemptions", "acceptance_gauge"):
        name, value = _first(totals, getattr(names, role))
        if name is not None:
            values[role], found[role] = value, name
    return Snapshot(values, found, None if values else f"GET {url} exposes none of the {dialect} counters")


def speculation_between(before: Snapshot | None, after: Snapshot | None, url: str,
                        iterations: bool = False) -> dict[str, Any] | None:
    """The run's speculation record from two snapshots (see the module docstring); None when the
    server exposes nothing. `iterations`: the second read alone holds the run (TensorRT-LLM)."""
    if after is None or not after.values:
        return None
    counts: dict[str, int | None] = {}
    notes = []
    for role in ("drafted", "accepted", "preemptions"):
        if role not in after.values:
            counts[role] = None
            continue
        if iterations:
            counts[role] = int(round(after.values[role]))
            continue
        start = before.values.get(role) if before is not None else None
        if start is None:
            counts[role] = None
            notes.append(f"{after.names[role]} was not read before the run")
        elif after.values[role] < start:
            counts[role] = None
            notes.append(f"{after.names[role]} went down during the run (the server restarted?)")
        else:
            counts[role] = int(round(after.values[role] - start))
    drafted, accepted = counts["drafted"], counts["accepted"]
    rate = (accepted / drafted) if drafted and accepted is not None else None
    used = [after.names[role] for role in ("drafted", "accepted", "preemptions") if role in after.values]
    how = "summed over the iterations read after the run" if iterations else \
        "difference between reads before and after the run, summed over label sets"
    source = f"GET {join_url(url, METRICS_PATH)}: {', '.join(used)} ({how})" if used else ""
    if "acceptance_gauge" in after.values:
        rate = after.values["acceptance_gauge"] if rate is None else rate
        source += ("; " if source else f"GET {join_url(url, METRICS_PATH)}: ") + \
            f"{after.names['acceptance_gauge']} (a gauge over the server's recent window, not this run alone)"
    return {"drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": rate,
            "preemptions": counts["preemptions"], "source": source, "notes": notes}


def safe_snapshot(base_url: str, dialect: str, timeout: float) -> tuple[Snapshot | None, str | None]:
    """`read_snapshot`, with any failure kept as a note rather than raised (metrics are evidence,
    never a reason to fail a run)."""
    try:
        return read_snapshot(base_url, dialect, min(timeout, METRICS_TIMEOUT_S)), None
    except ServerError as exc:
        return None, str(exc)
