"""Observed acceptance from a server's or a recording's own counters, and whether those counters agree.

A server run's speculation record (engines/adapters/server_metrics.py) holds what the server counted
over the run: its metrics endpoint's difference before and after (drafts, draft tokens, accepted tokens,
accepted tokens per draft position) and each answer's own counters (`per_request`, `RequestCounters`
as JSON) beside the tokens each answer returned. A recording carries the per-request counters on its
lines. `from_server` maps them into one `ObservedAcceptance`, each field from the first source that has it:

- verify_steps: the endpoint's drafts (vLLM `num_drafts`: one per request per step that carried a draft),
  else the requests' verify steps summed; TensorRT-LLM, which says only tokens per iteration, gives
  round(returned / tokens per iteration) per request;
- drafted_tokens, accepted_tokens: the endpoint's, else the requests' summed (TensorRT-LLM: returned
  tokens less iterations accepted, nothing drafted known);
- accepted_per_position [K]: the endpoint's per-position counter, else the requests' per-step accepted
  counts, else their histograms (steps that accepted more than k draft tokens);
- drafts_per_position [K]: the requests' per-step drafted counts, else, where drafted tokens equal
  verify steps x K, every step drafted K (each step drafts at most K, so no other split adds up);
- emitted_tokens: known only where every decode step is counted (TensorRT-LLM's iterations); a server
  that skips drafting on some steps (vLLM's n-gram proposer finding no match) emits tokens in steps no
  counter sees.

A sum over requests is used only when every answered request carried its counters.

`inconsistencies` lists every identity the counters break, one sentence each naming it; the run's
acceptance finding "acceptance counters inconsistent" (equivalence/acceptance/findings.py) quotes them
(`with_server_problems` adds the server's to it). Beyond `observed.consistency` (accepted <= drafted, the
per-position counts summing to the totals and never rising with k, the emitted-token bounds):

- endpoint against responses: the requests' summed drafts, draft tokens and accepted tokens equal the
  endpoint's difference over the run (nothing else used the server between the two reads);
- within a response: its histogram sums to its verify steps and its sum of j x count_j to its accepted
  tokens; its per-step arrays have one entry per verify step, sum to its totals, never accept more than
  drafted; its mean tokens per step (vLLM `mean_acceptance_length`, SGLang `spec_accept_length`) equals
  1 + accepted / steps, or returned / steps for SGLang;
- against the output: a request returns at least one token per verify step and one from its prefill, and as
  many tokens as the server says it generated (llama.cpp `timings.predicted_n`, SGLang `completion_tokens`).
"""

from __future__ import annotations

import math
from typing import Any

from specaudit.engines.adapters.server_metrics import RequestCounters
from specaudit.engines.contract import capability
from specaudit.engines.trace import Trace
from specaudit.equivalence.acceptance import observed as observed_module
from specaudit.equivalence.acceptance.observed import ObservedAcceptance, consistency

from specaudit.equivalence.rulings.thresholds import MEAN_TOLERANCE  # relative: a server's mean against its counts


def _requests(speculation: dict[str, Any]) -> tuple[list[RequestCounters], list[int], bool]:
    """The answered requests' counters, their returned tokens, and whether every answered request had counters."""
    per_request = speculation.get("per_request") or []
    returned = speculation.get("returned_tokens") or [None] * len(per_request)
    answered = [(record, tokens) for record, tokens in zip(per_request, returned) if tokens is not None]
    counters = [(RequestCounters.from_json(record), int(tokens)) for record, tokens in answered if record is not None]
    complete = bool(answered) and len(counters) == len(answered)
    return [c for c, _ in counters], [t for _, t in counters], complete


def _summed(requests: list[RequestCounters], name: str, complete: bool) -> int | None:
    values = [getattr(r, name) for r in requests]
    return sum(values) if complete and values and all(v is not None for v in values) else None


def _positions_from_requests(requests: list[RequestCounters], complete: bool
                             ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(accepted per position, drafts per position) [K] from per-step arrays, else histograms (accepted only)."""
    if not complete or not requests:
        return None, None
    # a request with no verify step has empty per-step arrays (vLLM leaves them out then)
    stepped = [r for r in requests if r.verify_steps != 0]
    if stepped and all(r.per_step_accepted is not None and r.per_step_drafted is not None for r in stepped):
        requests = stepped
        width = max([r.draft_positions or 0 for r in requests]
                    + [max(r.per_step_drafted or (0,)) for r in requests] + [max(r.per_step_accepted or (0,)) for r in requests])
        accepted, drafts = [0] * width, [0] * width
        for r in requests:
            for count in r.per_step_accepted or ():
                for k in range(count):
                    accepted[k] += 1
            for count in r.per_step_drafted or ():
                for k in range(count):
                    drafts[k] += 1
        return tuple(accepted), tuple(drafts)
    if stepped and all(r.accepted_histogram is not None for r in stepped):
        requests = stepped
        width = max(len(r.accepted_histogram or ()) for r in requests) - 1
        accepted = [sum(sum(r.accepted_histogram[k + 1:]) for r in requests if r.accepted_histogram)
                    for k in range(max(width, 0))]
        return tuple(accepted), None
    return None, None


def from_server(speculation: dict[str, Any] | None) -> ObservedAcceptance | None:
    """A server run's (or a recording's) observed acceptance from its speculation record; None when it
    counted nothing usable."""
    if not speculation:
        return None
    requests, returned, complete = _requests(speculation)
    verify_steps = speculation.get("drafts")
    drafted, accepted = speculation.get("drafted_tokens"), speculation.get("accepted_tokens")
    per_position = speculation.get("accepted_per_position")
    accepted_at = tuple(int(c) for c in per_position) if per_position is not None else None
    from_requests_accepted, drafts_at = _positions_from_requests(requests, complete)
    sources = [speculation.get("source") or ""]
    emitted = None
    if requests and complete and all(r.tokens_per_step is not None and r.verify_steps is None
                                     and r.drafted_tokens is None for r in requests):
        # TensorRT-LLM: tokens per iteration alone; every decode iteration is counted, the bonus in it
        iterations = [max(1, round(tokens / r.tokens_per_step)) if r.tokens_per_step else 0
                      for r, tokens in zip(requests, returned)]
        verify_steps = sum(iterations) if verify_steps is None else verify_steps
        accepted = sum(max(0, t - n) for t, n in zip(returned, iterations)) if accepted is None else accepted
        emitted = sum(returned)
        sources.append("verify steps as round(returned tokens / tokens per iteration) per request, accepted "
                       "tokens as returned tokens less those steps")
    else:
        verify_steps = _summed(requests, "verify_steps", complete) if verify_steps is None else verify_steps
        drafted = _summed(requests, "drafted_tokens", complete) if drafted is None else drafted
        accepted = _summed(requests, "accepted_tokens", complete) if accepted is None else accepted
    if accepted_at is None:
        accepted_at = from_requests_accepted
    width = len(accepted_at) if accepted_at else max([r.draft_positions or 0 for r in requests] + [0]) or None
    if drafts_at is None and width and verify_steps is not None and drafted == verify_steps * width:
        drafts_at = (verify_steps,) * width
        sources.append(f"every verify step drafted K={width} (drafted tokens = verify steps x K)")
    if requests and not speculation.get("drafts") and verify_steps is not None:
        sources.append("verify steps summed over the responses")
    if all(value is None for value in (verify_steps, drafted, accepted, accepted_at)):
        return None
    return ObservedAcceptance(source="; ".join(s for s in sources if s), verify_steps=verify_steps,
                              drafted_tokens=drafted, accepted_tokens=accepted, accepted_per_position=accepted_at,
                              drafts_per_position=drafts_at, emitted_tokens=emitted)


def _request_identities(index: int, r: RequestCounters, returned: int) -> list[str]:
    where = f"request {index} ({r.fields})"
    problems = []
    steps, accepted, drafted = r.verify_steps, r.accepted_tokens, r.drafted_tokens
    if accepted is not None and drafted is not None and accepted > drafted:
        problems.append(f"{where}: more tokens accepted ({accepted}) than drafted ({drafted})")
    if r.accepted_histogram is not None:
        if steps is not None and sum(r.accepted_histogram) != steps:
            problems.append(f"{where}: its acceptance histogram counts {sum(r.accepted_histogram)} verify steps, "
                            f"its verify steps are {steps}")
        weighted = sum(j * count for j, count in enumerate(r.accepted_histogram))
        if accepted is not None and weighted != accepted:
            problems.append(f"{where}: its acceptance histogram holds {weighted} accepted tokens (sum of j x steps "
                            f"that accepted j), its accepted tokens are {accepted}")
    for name, per_step, total in (("accepted", r.per_step_accepted, accepted), ("drafted", r.per_step_drafted, drafted)):
        if per_step is None:
            continue
        if steps is not None and len(per_step) != steps:
            problems.append(f"{where}: {len(per_step)} per-step {name} entries for {steps} verify steps")
        if total is not None and sum(per_step) != total:
            problems.append(f"{where}: per-step {name} counts sum to {sum(per_step)}, its {name} tokens are {total}")
    if r.per_step_accepted is not None and r.per_step_drafted is not None:
        over = [i for i, (a, d) in enumerate(zip(r.per_step_accepted, r.per_step_drafted)) if a > d]
        if over:
            i = over[0]
            problems.append(f"{where}: step {i} accepted {r.per_step_accepted[i]} of {r.per_step_drafted[i]} draft tokens")
    if r.tokens_per_step is not None and steps:
        said = r.tokens_per_step
        ratio, what = ((returned / steps, "returned tokens / verify steps") if r.fields == "meta_info.spec_*"
                       else (1 + accepted / steps, "1 + accepted / verify steps") if accepted is not None
                       else (None, ""))
        if ratio is not None and not math.isclose(said, ratio, rel_tol=MEAN_TOLERANCE):
            problems.append(f"{where}: it says {said:.6g} tokens per verify step, its counts give {ratio:.6g} ({what})")
    if r.generated_tokens is not None and r.generated_tokens != returned:
        problems.append(f"{where}: the server counts {r.generated_tokens} tokens generated, its answer returned "
                        f"{returned}")
    if steps is not None and returned < steps + 1:
        problems.append(f"{where}: {returned} tokens returned for {steps} verify steps; each verify step emits at "
                        "least one token and the prefill one more")
    return problems


def server_problems(speculation: dict[str, Any] | None) -> list[str]:
    """The identities a server's (or recording's) counters break beyond `observed.consistency`: within each
    response, and the responses against the metrics endpoint (see the module docstring)."""
    if not speculation:
        return []
    problems: list[str] = []
    per_request = speculation.get("per_request") or []
    returned = speculation.get("returned_tokens") or [None] * len(per_request)
    for index, (record, tokens) in enumerate(zip(per_request, returned)):
        if record is not None and tokens is not None:
            problems += _request_identities(index, RequestCounters.from_json(record), int(tokens))
    requests, _, complete = _requests(speculation)
    if complete and requests and not str(speculation.get("source") or "").startswith("each response"):
        for role, name, what in (("drafts", "verify_steps", "verify steps with a draft"),
                                 ("drafted_tokens", "drafted_tokens", "draft tokens"),
                                 ("accepted_tokens", "accepted_tokens", "accepted tokens")):
            total, summed = speculation.get(role), _summed(requests, name, True)
            if total is not None and summed is not None and total != summed:
                problems.append(f"the responses' {what} sum to {summed}, the metrics endpoint counted {total} "
                                "over the run")
        widths = {r.draft_positions for r in requests if r.draft_positions is not None}
        positions = speculation.get("accepted_per_position")
        if positions is not None and widths and widths != {len(positions)}:
            problems.append(f"the metrics endpoint counts {len(positions)} draft positions, the responses say "
                            f"K={sorted(widths)}")
    return problems


def inconsistencies(speculation: dict[str, Any] | None, observed: ObservedAcceptance | None) -> list[str]:
    """Every identity the run's counters break: `observed.consistency` and `server_problems`."""
    return (list(consistency(observed)) if observed is not None else []) + server_problems(speculation)


def of_run(engine: Any, trace: Trace | None, speculation: dict[str, Any] | None) -> ObservedAcceptance | None:
    """The observed acceptance of one run: a black-box engine's (server, recording) from its counters, any
    other engine's through `observed.of_run` (its own `last_acceptance`, else its trace)."""
    if capability(engine, "black_box"):
        return from_server(speculation)
    return observed_module.of_run(engine, trace, speculation)


def with_server_problems(record: dict[str, Any], engine: Any, speculation: dict[str, Any] | None) -> dict[str, Any]:
    """A run's acceptance record (findings.AcceptanceRecord as JSON) with the server identities its counters
    break added to its "acceptance counters inconsistent" finding (made when there is none)."""
    problems = server_problems(speculation) if capability(engine, "black_box") else []
    if not problems:
        return record
    findings = list(record.get("findings") or [])
    kind = "acceptance counters inconsistent"
    found = next((i for i, f in enumerate(findings) if f.get("kind") == kind), None)
    text = "; ".join(problems)
    if found is None:
        findings.append({"kind": kind, "positions": [], "text": text})
    else:
        findings[found] = {**findings[found], "text": f"{findings[found]['text']}; {text}"}
    return {**record, "findings": findings}


SERVED_REFERENCE = "audited against a served reference: no weights in the process to replay the proposer"


def served_record(engine: Any, speculation: dict[str, Any] | None, required: float | None) -> dict[str, Any]:
    """The acceptance record of a run audited against a served reference: the observed counters and their
    inconsistencies, no expectation (the replay needs the target's weights)."""
    from specaudit.equivalence.acceptance.findings import compare

    record = compare(of_run(engine, None, speculation), None, required=required, unavailable=SERVED_REFERENCE)
    return with_server_problems(record.to_json(), engine, speculation)
