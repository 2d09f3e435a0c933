"""A live server's own speculation counters, read before and after a run.

An audit that passes on a server that never speculated proves nothing about speculation. So every
server run reads the server's metrics endpoint just before and just after `generate`, and keeps the
difference of its counters:

    {"drafted_tokens", "accepted_tokens", "acceptance_rate", "preemptions", "source",
     "drafts", "accepted_per_position"}

(`None` for a count the server does not expose; the whole record is `None` when it exposes none).
`drafts` is the number of verify steps that carried a draft (one per request per step: vLLM's
`num_drafts`), `accepted_per_position` [K] the verify steps whose draft token at position k (and so
every one before it) was accepted, in position order.

Where each server keeps them (first name found wins; a Prometheus counter `x` is exposed as `x_total`
by current clients and as `x` by older ones):

- vLLM (`GET /metrics`, Prometheus text): `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total`, `vllm:spec_decode_num_drafts_total`,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}`, `vllm:num_preemptions_total`
  (vllm/v1/spec_decode/metrics.py, the same names in 0.21.0 and 0.32.0);
- llama.cpp (`GET /metrics`, Prometheus text, with `--metrics`): `llamacpp:spec_decode_num_draft_tokens_total`,
  `llamacpp:spec_decode_num_accepted_tokens_total`, `llamacpp:spec_decode_num_drafts_total`,
  `llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="k"}` (b11549; b8672 exposes none of
  them: its counts are per response, below), no preemption counter;
- SGLang (`GET /metrics`, Prometheus text): no draft counters, only the gauge `sglang:spec_accept_rate`
  (a recent window's acceptance, not this run's): kept as `acceptance_rate` with no counts;
- TensorRT-LLM (`GET /metrics`, JSON: the iteration statistics since the last read, drained by each
  read): `specDecodingStats.numDraftTokens`, `.numAcceptedTokens` and `.numRequestsWithDraftTokens`
  (the drafts), summed over the iterations.

Per response (`request_counters`), where the server says it beside the tokens, normalized to one record
in vLLM's vocabulary, `RequestCounters`:

- vLLM 0.32.0 with `--per-request-spec-decode-metrics summary|detailed`: `metrics.speculative_decoding`
  (`num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`, `acceptance_histogram`,
  `num_spec_tokens`; `per_step_accepted` / `per_step_drafted` at `detailed`);
- llama.cpp: `timings.draft_n` (draft tokens), `timings.draft_n_accepted` (accepted) and `timings.predicted_n`
  (the tokens it says it generated);
- SGLang: `meta_info.spec_verify_ct` (verify steps), `spec_accept_length` (completion tokens per verify
  step), the accepted and proposed counts under whichever name the release uses
  (`spec_accept_token_num` / `spec_accepted_drafts` / `spec_num_correct_drafts`, `spec_draft_token_num` /
  `spec_proposed_drafts` / `spec_num_proposed_drafts`), `spec_accept_histogram`, `completion_tokens`;
- TensorRT-LLM: `choices[0].avg_decoded_tokens_per_iter` (tokens per iteration, the bonus included).

Prometheus text is parsed line by line (`name{labels} value [timestamp]`), comments skipped, and
each metric summed over its label sets (one per model, engine or rank). Other clients of the same
server between the two reads are counted too: audit a server nothing else is using.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from specaudit.engines.adapters._http import ServerError, get_text, join_url


@dataclass(frozen=True)
class CounterNames:
    """Where one dialect keeps its counters (candidates in order) and how its endpoint speaks."""

    drafted: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    drafts: tuple[str, ...] = ()
    accepted_per_position: tuple[str, ...] = ()  # a counter labelled `position`
    acceptance_gauge: tuple[str, ...] = ()
    json_iterations: bool = False  # TensorRT-LLM: a JSON list of per-iteration statistics


def _counter(name: str) -> tuple[str, str]:
    return f"{name}_total", name


COUNTERS: dict[str, CounterNames] = {
    "vllm": CounterNames(drafted=_counter("vllm:spec_decode_num_draft_tokens"),
                         accepted=_counter("vllm:spec_decode_num_accepted_tokens"),
                         preemptions=_counter("vllm:num_preemptions"),
                         drafts=_counter("vllm:spec_decode_num_drafts"),
                         accepted_per_position=_counter("vllm:spec_decode_num_accepted_tokens_per_pos")),
    "llamacpp": CounterNames(drafted=_counter("llamacpp:spec_decode_num_draft_tokens"),
                             accepted=_counter("llamacpp:spec_decode_num_accepted_tokens"),
                             drafts=_counter("llamacpp:spec_decode_num_drafts"),
                             accepted_per_position=_counter("llamacpp:spec_decode_num_accepted_tokens_per_pos")),
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




def labelled_values(text: str, names: tuple[str, ...], label: str) -> tuple[str | None, dict[str, float]]:
    """{value of `label`: sample summed over its other labels} of the first metric of `names` present in
    Prometheus `text` (its name, and {} when none is), e.g. vLLM's accepted tokens per draft position."""
    found: dict[str, dict[str, float]] = {}
    pattern = re.compile(r'(?:^|[{,])\s*' + re.escape(label) + r'\s*=\s*"((?:[^"\\]|\\.)*)"')
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "{" not in line:
            continue
        sample = _split_sample(line)
        if sample is None or sample[0] not in names:
            continue
        labels = line[line.find("{"): len(line) - len(sample[1])]
        match = pattern.search(labels)
        fields = sample[1].split()
        if match is None or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isnan(value):
            values = found.setdefault(sample[0], {})
            values[match.group(1)] = values.get(match.group(1), 0.0) + value
    for name in names:
        if name in found:
            return name, found[name]
    return None, {}


def _first(totals: dict[str, float], names: tuple[str, ...]) -> tuple[str | None, float | None]:
    for name in names:
        if name in totals:
            return name, totals[name]
    return None, None


def _iteration_totals(answer: Any) -> dict[str, float] | None:
    """TensorRT-LLM's JSON iteration statistics summed: None when they are not that shape."""
    if not isinstance(answer, list):
        return None
    drafted = accepted = drafts = 0.0
    seen = False
    for row in answer:
        spec = row.get("specDecodingStats") if isinstance(row, dict) else None
        if isinstance(spec, dict):
            seen = True
            drafted += float(spec.get("numDraftTokens") or 0)
            accepted += float(spec.get("numAcceptedTokens") or 0)
            drafts += float(spec.get("numRequestsWithDraftTokens") or 0)
    return {"drafted": drafted, "accepted": accepted, "drafts": drafts} if seen else {}


TRTLLM_FIELDS = {"drafted": "specDecodingStats.numDraftTokens", "accepted": "specDecodingStats.numAcceptedTokens",
                 "drafts": "specDecodingStats.numRequestsWithDraftTokens"}
ROLES = ("drafted", "accepted", "preemptions", "drafts")  # counters whose run is a difference of two reads


@dataclass
class Snapshot:
    """One read of the endpoint: the counters found, by role, and their names."""

    values: dict[str, float]  # role ("drafted", "accepted", "preemptions", "drafts", "acceptance_gauge") -> value
    names: dict[str, str]  # role -> the metric it came from
    note: str | None = None  # why nothing usable was read
    positions: dict[int, float] = field(default_factory=dict)  # draft position -> accepted tokens there
    positions_name: str | None = None  # the labelled metric `positions` came from


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
        return Snapshot(totals, {role: TRTLLM_FIELDS[role] for role in totals})
    totals = parse_prometheus(text)
    values, found = {}, {}
    for role in (*ROLES, "acceptance_gauge"):
        name, value = _first(totals, getattr(names, role))
        if name is not None:
            values[role], found[role] = value, name
    positions_name, by_label = labelled_values(text, names.accepted_per_position, "position")
    positions = {int(label): value for label, value in by_label.items() if label.isdigit()}
    return Snapshot(values, found, None if values else f"GET {url} exposes none of the {dialect} counters",
                    positions, positions_name if positions else None)


def _positions_between(before: Snapshot | None, after: Snapshot, iterations: bool) -> list[int] | None:
    """[K] accepted tokens per draft position over the run, or None when not exposed or not comparable."""
    if not after.positions:
        return None
    width = max(after.positions) + 1
    if iterations:
        return [int(round(after.positions.get(k, 0.0))) for k in range(width)]
    if before is None or not set(before.positions) <= set(after.positions):
        return None
    # a position not yet exposed before the run had counted nothing (llama.cpp creates them on first use)
    counts = [after.positions.get(k, 0.0) - before.positions.get(k, 0.0) for k in range(width)]
    return None if any(c < 0 for c in counts) else [int(round(c)) for c in counts]


def speculation_between(before: Snapshot | None, after: Snapshot | None, url: str,
                        iterations: bool = False) -> dict[str, Any] | None:
    """The run's speculation record from two snapshots (see the module docstring); None when the
    server exposes nothing. `iterations`: the second read alone holds the run (TensorRT-LLM)."""
    if after is None or not after.values:
        return None
    counts: dict[str, int | None] = {}
    notes = []
    for role in ROLES:
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
    positions = _positions_between(before, after, iterations)
    used = [after.names[role] for role in ROLES if role in after.values]
    if positions is not None and after.positions_name:
        used.append(f"{after.positions_name}{{position}}")
    how = "summed over the iterations read after the run" if iterations else \
        "difference between reads before and after the run, summed over label sets"
    source = f"GET {join_url(url, METRICS_PATH)}: {', '.join(used)} ({how})" if used else ""
    if "acceptance_gauge" in after.values:
        rate = after.values["acceptance_gauge"] if rate is None else rate
        source += ("; " if source else f"GET {join_url(url, METRICS_PATH)}: ") + \
            f"{after.names['acceptance_gauge']} (a gauge over the server's recent window, not this run alone)"
    return {"drafted_tokens": drafted, "accepted_tokens": accepted, "acceptance_rate": rate,
            "preemptions": counts["preemptions"], "drafts": counts["drafts"], "accepted_per_position": positions,
            "source": source, "notes": notes}


# ---- per response ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestCounters:
    """One response's own speculation counters, in vLLM's vocabulary (None: not said)."""

    fields: str  # where in the answer they were read
    verify_steps: int | None = None  # verify steps that carried a draft
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    accepted_histogram: tuple[int, ...] | None = None  # [K+1] verify steps that accepted exactly j draft tokens
    per_step_accepted: tuple[int, ...] | None = None  # [verify steps] accepted draft tokens, in step order
    per_step_drafted: tuple[int, ...] | None = None  # [verify steps] draft tokens, in step order
    draft_positions: int | None = None  # K, the most draft tokens a step may carry
    tokens_per_step: float | None = None  # the server's own mean of tokens per verify step (bonus included)
    generated_tokens: int | None = None  # the tokens the server says it generated (llama.cpp predicted_n, SGLang)

    def to_json(self) -> dict[str, Any]:
        return {name: (list(value) if isinstance(value, tuple) else value) for name, value in self.__dict__.items()}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RequestCounters:
        known = {name: record.get(name) for name in cls.__dataclass_fields__ if name in record}
        for name in ("accepted_histogram", "per_step_accepted", "per_step_drafted"):
            if known.get(name) is not None:
                known[name] = tuple(int(v) for v in known[name])
        known.setdefault("fields", "a recording's counters")
        return cls(**known)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def _counts(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    counts = tuple(_count(v) for v in value)
    return None if any(c is None for c in counts) else counts  # type: ignore[return-value]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _named(meta: dict[str, Any], names: tuple[str, ...]) -> int | None:
    return next((_count(meta[name]) for name in names if name in meta), None)


def _vllm_counters(answer: dict[str, Any]) -> RequestCounters | None:
    metrics = answer.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        return None
    return RequestCounters("metrics.speculative_decoding", verify_steps=_count(spec.get("num_spec_steps")),
                           drafted_tokens=_count(spec.get("num_draft_tokens")),
                           accepted_tokens=_count(spec.get("num_accepted_draft_tokens")),
                           accepted_histogram=_counts(spec.get("acceptance_histogram")),
                           per_step_accepted=_counts(spec.get("per_step_accepted")),
                           per_step_drafted=_counts(spec.get("per_step_drafted")),
                           draft_positions=_count(spec.get("num_spec_tokens")),
                           tokens_per_step=_number(spec.get("mean_acceptance_length")))


def _llamacpp_counters(answer: dict[str, Any]) -> RequestCounters | None:
    timings = answer.get("timings")
    if not isinstance(timings, dict) or "draft_n" not in timings:
        return None
    return RequestCounters("timings.draft_n, timings.draft_n_accepted", drafted_tokens=_count(timings.get("draft_n")),
                           accepted_tokens=_count(timings.get("draft_n_accepted")),
                           generated_tokens=_count(timings.get("predicted_n")))


def _sglang_counters(answer: Any) -> RequestCounters | None:
    if isinstance(answer, list):
        answer = answer[0] if answer else {}
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict) or "spec_verify_ct" not in meta:
        return None
    histogram = _counts(meta.get("spec_accept_histogram"))
    return RequestCounters("meta_info.spec_*", verify_steps=_count(meta.get("spec_verify_ct")),
                           drafted_tokens=_named(meta, ("spec_draft_token_num", "spec_proposed_drafts",
                                                        "spec_num_proposed_drafts")),
                           accepted_tokens=_named(meta, ("spec_accept_token_num", "spec_accepted_drafts",
                                                         "spec_num_correct_drafts")),
                           accepted_histogram=histogram,
                           draft_positions=len(histogram) - 1 if histogram else None,
                           tokens_per_step=_number(meta.get("spec_accept_length")),
                           generated_tokens=_count(meta.get("completion_tokens")))


def _trtllm_counters(answer: dict[str, Any]) -> RequestCounters | None:
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    per_iteration = _number(choice.get("avg_decoded_tokens_per_iter"))
    if per_iteration is None:
        return None
    return RequestCounters("choices[0].avg_decoded_tokens_per_iter", tokens_per_step=per_iteration)


REQUEST_COUNTERS = {"vllm": _vllm_counters, "llamacpp": _llamacpp_counters, "sglang": _sglang_counters,
                    "trtllm": _trtllm_counters}


def request_counters(dialect: str, answer: Any) -> RequestCounters | None:
    """The speculation counters one answer carries beside its tokens, or None where it carries none."""
    reader = REQUEST_COUNTERS.get(dialect)
    if reader is None or not isinstance(answer, (dict, list)):
        return None
    try:
        return reader(answer)
    except (AttributeError, IndexError, TypeError):
        return None


def with_requests(speculation: dict[str, Any] | None, per_request: list[RequestCounters | None],
                  returned_tokens: list[int | None]) -> dict[str, Any] | None:
    """The run's speculation record with each request's own counters (`per_request`, JSON, one per prompt in
    the order sent, None where the answer had none) and the tokens each answer returned. Without endpoint
    counters, the totals come from the responses, when every answered request carried them."""
    answered = [c for c, n in zip(per_request, returned_tokens) if n is not None]
    if not any(c is not None for c in answered):
        return speculation
    record = dict(speculation) if speculation is not None else None
    if record is None:
        complete = all(c is not None for c in answered)

        def total(name: str) -> int | None:
            values = [getattr(c, name) for c in answered]
            return sum(values) if complete and all(v is not None for v in values) else None

        drafted, accepted = total("drafted_tokens"), total("accepted_tokens")
        fields = ", ".join(dict.fromkeys(c.fields for c in answered if c is not None))
        record = {"drafted_tokens": drafted, "accepted_tokens": accepted,
                  "acceptance_rate": (accepted / drafted) if drafted and accepted is not None else None,
                  "preemptions": None, "drafts": total("verify_steps"), "accepted_per_position": None,
                  "source": f"each response's {fields}, summed over the requests", "notes": []}
    record["per_request"] = [c.to_json() if c is not None else None for c in per_request]
    record["returned_tokens"] = list(returned_tokens)
    return record


def safe_snapshot(base_url: str, dialect: str, timeout: float) -> tuple[Snapshot | None, str | None]:
    """`read_snapshot`, with any failure kept as a note rather than raised (metrics are evidence,
    never a reason to fail a run)."""
    try:
        return read_snapshot(base_url, dialect, min(timeout, METRICS_TIMEOUT_S)), None
    except ServerError as exc:
        return None, str(exc)
