"""What a server says beside its tokens, checked against the reference with request parameters.

One prompt's server answer (`Completion`: returned `token_ids` and its `report`: text, finish and stop
reasons, usage, per-token log-probabilities) against `RequestResult` (engines/requests/reference.py).
Each check that fails gives one finding, a divergence record whose `diagnosis.class` names the cause
and whose `diagnosis.named_by` names the check that named it (its `decided_by`, the ruling, the same check):

| class              | decided by                | the check                                                           |
|--------------------|---------------------------|---------------------------------------------------------------------|
| `stop_string`      | `stop-string-replay`      | a stop string completed before the last returned token (tokens kept after the stop), the output went on past the reference's stop string (and, where the server names a stop string that completes later, that it did not take the earliest), a stop string claimed that the tokens do not contain, or a stop honoured inside `min_tokens` |
| `logits_processor` | `processor-replay`        | at the first token that differs, the reference's processed logits with one processor left out (or all of them) choose the server's token, beyond the noise band; or the row ended on a stop id inside `min_tokens` |
| `logprob_report`   | `logprob-compare`         | a reported log-probability of a chosen token differs from the reference's (under the server's documented definition) by more than the tolerance, on the positions where the tokens agree; "p = 1 at every position" is said so |
| `finish_reason`    | `finish-compare`          | tokens agree but `finish_reason` / `stop_reason` differ from the reference's |
| `text_report`      | `detokenize`              | `text` is not the detokenized `token_ids` (cut before a stop string where there is one) |
| `usage_report`     | `usage-count`             | `usage` counts differ from the prompt's and the returned tokens' counts |

Relation of text and tokens (engines/requests/reference.py): the tokens end at the token that ended
the request; the text is those tokens decoded, without a final EOS / stop id's text, cut just before
a stop string. Decoding is compared both alone and after the prompt (a tokenizer whose first output
token decodes differently after the prompt, e.g. a sentencepiece leading space), and with or without
the final stop token's text, with the bytes that never form a character (U+FFFD) dropped, and as the tokens'
bytes decoded by UTF-8's own replacement rule (one U+FFFD per maximal invalid subpart: llama.cpp's text), where
the tokenizer's decoder renders invalid bytes otherwise (a byte-fallback decoder turns a whole run of byte tokens
that fails to decode into one U+FFFD per token, the valid bytes in the run too), and without special tokens'
text (llama.cpp renders no control token): any of these is accepted. A token that ends the request under two
rules at once (a stop id completing a stop string) may be reported under either.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from specaudit.engines.limits import eos_ids
from specaudit.engines.constraints.matcher import mask
from specaudit.engines.requests.reference import RequestResult, decode_text, find_stop
from specaudit.equivalence.blackbox.constraints import CONSTRAINT_CLASSES, CONSTRAINT_FIXES
from specaudit.engines.requests import PROCESSOR_NAMES, RequestParams, process
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.rulings.noise import dtype_noise
from specaudit.equivalence.rulings.thresholds import REPORT_FLOOR
from specaudit.equivalence.rulings.record import finding

REQUEST_CLASSES = ("stop_string", "logits_processor", "logprob_report", "finish_reason", "text_report", "usage_report",
                   "seeded_sampling", *CONSTRAINT_CLASSES)  # seeded_sampling: equivalence/search/seeds.py  # structured outputs: equivalence/blackbox/constraints.py
REQUEST_FIXES = {
    "stop_string": "Check stop strings on each token as it is accepted, end the request at the token that completes "
                   "one (drop the accepted tokens after it from token_ids, logprobs and usage), and never before "
                   "min_tokens.",
    "logits_processor": "Apply every request's logits processors (penalties, logit_bias, bad_words, min_tokens) to "
                        "every verified position with that position's own history, drafts accepted so far included.",
    "logprob_report": "Report each accepted token's log-probability from the target's logits at its own position "
                      "(for drafts too), under the documented distribution; never a placeholder such as 0.0.",
    "finish_reason": "Report finish_reason and stop_reason from the condition that actually ended the request "
                     "(EOS, stop token id, stop string, or max_tokens).",
    "text_report": "Build text from exactly the returned token_ids, cut only before a stop string.",
    "usage_report": "Count usage from the tokens actually returned (prompt and completion).",
    "seeded_sampling": "Give each request its own random stream from its own seed (a fresh one when unseeded), "
                       "advanced only by that request's own samples, whatever its neighbours and its drafts.",
    **CONSTRAINT_FIXES,
}
# servers compute and serialise log-probabilities in float32 at best: the smallest difference a report check
# takes for a misreport (with the run's noise band on top), in units of float32's noise at the top logit
FLOAT32 = "float32"


def _stop_ids(params: RequestParams, eos_token_id: Any) -> list[int]:
    return sorted(set(eos_ids(eos_token_id)) | set(params.stop_token_ids))


def first_stop_completion(tokenizer: Any, tokens: Sequence[int], params: RequestParams,
                          only: str | None = None) -> tuple[int, str, int] | None:
    """Where the reference's rule ends `tokens` on a stop string: (tokens up to and including the one
    that completes it, the string, its start in the text), or None. `only` looks for one string."""
    stops = (only,) if only is not None else params.stop
    previous = ""
    for n in range(1, len(tokens) + 1):
        text = decode_text(tokenizer, list(tokens[:n])).rstrip("\ufffd")
        if n > params.min_tokens:
            found = find_stop(text, len(previous), stops)
            if found is not None:
                return n, found[0], found[1]
        previous = text
    return None


def _texts(tokenizer: Any, prompt: Sequence[int], tokens: Sequence[int]) -> list[str]:
    """The accepted decodings of `tokens`: alone, as the text after the prompt, and without special tokens."""
    alone = decode_text(tokenizer, list(tokens))
    after = decode_text(tokenizer, list(prompt) + list(tokens))
    head = decode_text(tokenizer, list(prompt))
    texts = [alone] + ([after[len(head):]] if after.startswith(head) else [])
    try:  # a special token's text left out (llama.cpp renders no control token: BOS sampled is "")
        texts.append(tokenizer.decode(list(tokens), skip_special_tokens=True))
    except TypeError:  # a tokenizer without the keyword: it has no specials to leave out
        pass
    return list(dict.fromkeys(texts))


def _byte_text(tokenizer: Any, tokens: Sequence[int]) -> str | None:
    """`tokens` as bytes (the grammar engine's decoded vocabulary: a byte token is its byte) decoded under
    UTF-8's replacement rule, or None without a grammar engine to read the vocabulary."""
    from specaudit.engines.constraints import ConstraintError
    from specaudit.engines.constraints.check import output_bytes
    try:
        raw, _ = output_bytes(tokens, tokenizer, [])
    except ConstraintError:  # no xgrammar (the optional `structured` extra)
        return None
    return raw.decode("utf-8", errors="replace")


def _streamed_text(tokenizer: Any, prompt: Sequence[int], tokens: Sequence[int]) -> str | None:
    """`tokens` as an incremental detokenizer reports them: the chunks of tokenizers' `DecodeStream` (primed with
    the prompt, specials kept) joined, the stream started afresh where a prefix stops being one (a byte run that
    turns invalid re-renders earlier bytes: vLLM's `FastIncrementalDetokenizer`, its #17448). A chunk is emitted
    only once it holds no unfinished character, so bytes shown early stay while a later invalid run is never
    shown. None without a fast tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if backend is None:
        return None
    try:
        stream = DecodeStream(ids=list(prompt), skip_special_tokens=False)
    except TypeError:  # a tokenizers release without priming
        stream = DecodeStream(skip_special_tokens=False)
    chunks = []
    for token in tokens:
        try:
            chunk = stream.step(backend, int(token))
        except Exception as exc:  # "Invalid prefix encountered": start again from this token
            if "prefix" not in str(exc).lower():
                return None
            stream = DecodeStream(skip_special_tokens=False)
            chunk = stream.step(backend, int(token))
        if chunk is not None:
            chunks.append(chunk)
    return "".join(chunks)


def _cut_at(texts: list[str], stop: str, start: int) -> list[str]:
    """Each decoding cut before the stop string found at `start` of the first (the one decoded alone);
    another decoding is shifted by its length difference (a leading space after the prompt)."""
    out = []
    for text in texts:
        at = start + len(text) - len(texts[0])
        if at >= 0 and text[at:].startswith(stop):
            out.append(text[:at])
    return out


def token_cause(index: int, prompt: list[int], params: RequestParams, reference: RequestResult,
                returned: list[int], eos_token_id: Any, tokenizer: Any, penalty_scope: str,
                band_at: Callable[[float], float], reported_stop: Any = None) -> Divergence | None:
    """The cause of a token divergence that request parameters explain, or None (left to the noise-band
    ruling). `returned` is the server's token_ids as it returned them; `reported_stop` its stop_reason."""
    ref = reference.tokens
    agree = next((i for i, (a, b) in enumerate(zip(ref, returned)) if a != b), min(len(ref), len(returned)))
    if agree == len(ref) == len(returned):
        return None
    stop_ids = _stop_ids(params, eos_token_id)
    if agree == len(ref):  # the server went on where the reference ended
        if reference.stop_reason is not None and isinstance(reference.stop_reason, str):
            reason = (f"the reference stops at stop string {reference.stop_reason!r} completed by token "
                      f"{agree - 1}; the server returned {len(returned) - agree} token(s) after it")
            evidence: dict[str, Any] = {"stop": reference.stop_reason, "tokens_after_stop": len(returned) - agree}
            later = (first_stop_completion(tokenizer, returned, params, only=reported_stop)
                     if isinstance(reported_stop, str) and reported_stop != reference.stop_reason
                     and reported_stop in params.stop and tokenizer is not None else None)
            if later is not None and later[0] > agree:
                # two stop strings completed in one step and the server took the later one (its place in
                # the list, not where it completes in the text)
                reason += (f", and names stop string {reported_stop!r}, completed later by token {later[0] - 1}: "
                           f"of the stop strings completed in one step it did not take the earliest")
                evidence.update(server_stop=reported_stop, server_stop_completed_by=later[0] - 1,
                                earliest_stop_not_taken=True)
            return finding(index, agree, "stop_string", "stop-string-replay", reason, evidence,
                            None, returned[agree])
        return None  # EOS / length: the usual stop rulings
    if agree == len(returned):  # the server ended where the reference went on
        last = returned[-1] if returned else None
        if last in stop_ids and len(returned) <= params.min_tokens:
            return finding(index, agree - 1, "logits_processor", "processor-replay",
                            f"the server ended on stop id {last} after {len(returned)} token(s), inside min_tokens "
                            f"= {params.min_tokens}: min_tokens was not applied there", {"processor": "min_tokens"},
                            ref[agree - 1] if agree else None, last)
        if params.stop and tokenizer is not None:
            found = first_stop_completion(tokenizer, returned, params)
            if found is None:
                early = first_stop_completion(tokenizer, returned, RequestParams(stop=params.stop))
                if early is not None and early[0] == len(returned):
                    return finding(index, agree, "stop_string", "stop-string-replay",
                                    f"the server ended on stop string {early[1]!r} after {len(returned)} token(s), "
                                    f"inside min_tokens = {params.min_tokens} (or outside the new text)",
                                    {"stop": early[1]}, ref[agree], None)
        return None
    # both have a token at `agree`: which processor, left out, makes the server's token?
    if reference.logits is None or agree >= reference.logits.shape[0]:
        return None
    raw = reference.logits[agree].to(torch.float64)
    output = ref[:agree]
    engine_token, reference_token = returned[agree], ref[agree]
    allowed = reference.allowed_at(agree)  # [V] a grammar stays applied: its own faults are constraints.py's
    full = process(raw, prompt, output, params, stop_ids, penalty_scope, allowed=allowed)
    gap = float(full.greedy[reference_token] - full.greedy[engine_token])
    if not gap > band_at(float(full.greedy.max())):
        return None  # a near-tie under the processed logits: the noise band rules it
    candidates = [(name, process(raw, prompt, output, params, stop_ids, penalty_scope, skip=name,
                                 allowed=allowed).greedy)
                  for name in PROCESSOR_NAMES if name in full.applied]
    candidates.append(("all", raw if allowed is None else mask(raw, allowed)))
    nothing = "no processor applied (the raw logits' argmax)" if allowed is None else "no processor but the grammar applied"
    for name, row in candidates:
        if int(row.argmax()) == engine_token:
            what = nothing if name == "all" else f"{name} not applied"
            return finding(index, agree, "logits_processor", "processor-replay",
                            f"at new token {agree} the server's token {engine_token} is the reference's choice with "
                            f"{what}; with every processor the reference chooses {reference_token}, {gap:.3g} above",
                            {"processor": name, "processed_gap": gap, "applied": full.applied},
                            reference_token, engine_token)
    if params.min_tokens and "min_tokens" not in full.applied:
        # the opposite fault: the stop ids masked at a position min_tokens no longer covers (a server that
        # counts only its committed output, not the drafts accepted in the same step)
        stretched = process(raw, prompt, output, replace(params, min_tokens=agree + 1), stop_ids, penalty_scope,
                            allowed=allowed)
        if "min_tokens" in stretched.applied and int(stretched.greedy.argmax()) == engine_token:
            return finding(index, agree, "logits_processor", "processor-replay",
                            f"at new token {agree} the server's token {engine_token} is the reference's choice with "
                            f"the stop ids masked: min_tokens = {params.min_tokens} was applied past its end "
                            f"({agree} tokens generated); the reference chooses {reference_token}, {gap:.3g} above",
                            {"processor": "min_tokens", "applied_past_end": True, "processed_gap": gap,
                             "applied": full.applied}, reference_token, engine_token)
    return None


def check_report(index: int, prompt: list[int], params: RequestParams, reference: RequestResult,
                 returned: list[int], report: dict[str, Any], eos_token_id: Any, tokenizer: Any,
                 definition: str = "raw", band_at: Callable[[float], float] = lambda top: 0.0) -> list[Divergence]:
    """The report checks of one prompt (module table): finish, text, usage, log-probabilities."""
    findings: list[Divergence] = []
    stop_ids = _stop_ids(params, eos_token_id)
    ref = reference.tokens
    # llama.cpp does not return the EOS it stopped on: the tokens before it are the same tokens
    same_tokens = returned == ref or (bool(ref) and returned == ref[:-1] and ref[-1] in stop_ids)
    # finish_reason / stop_reason
    finish, stop_reason = report.get("finish_reason"), report.get("stop_reason")
    if same_tokens and finish is not None:
        expected = (reference.finish_reason, reference.stop_reason)
        ok = finish == reference.finish_reason and (
            stop_reason == reference.stop_reason
            or (reference.stop_reason is None and reference.finish_reason == "stop" and stop_reason in (None, *eos_ids(eos_token_id))))
        if reference.finish_ambiguous and finish == "stop" and (stop_reason is None or stop_reason in stop_ids):
            ok = True
        if not ok and finish == reference.finish_reason == "stop" and returned:
            # one token that ends the request under two rules at once (a stop id that also completes a stop
            # string, two stop strings that it completes together): a server may name either; vLLM checks the
            # stop ids first
            ending = {reference.stop_reason}
            if returned[-1] in stop_ids:
                ending.add(returned[-1])
            for stop in params.stop if tokenizer is not None else ():  # each stop string the last token completes
                found = first_stop_completion(tokenizer, returned, params, only=stop)
                if found is not None and found[0] == len(returned):
                    ending.add(stop)
            ok = stop_reason in ending
        if not ok:
            findings.append(finding(index, len(returned) - 1 if returned else None, "finish_reason", "finish-compare",
                                     f"the tokens equal the reference's, which ends with finish_reason "
                                     f"{expected[0]!r} (stop_reason {expected[1]!r}); the server says {finish!r} "
                                     f"(stop_reason {stop_reason!r})",
                                     {"expected": list(expected), "reported": [finish, stop_reason]},
                                     detected_by="finish_reason"))
    # text against the detokenized token_ids
    text = report.get("text")
    if text is not None and tokenizer is not None:
        findings += _text_findings(index, prompt, params, returned, text, stop_reason, stop_ids, tokenizer)
    # usage
    usage = report.get("usage") or {}
    counts = {"prompt_tokens": [len(prompt)], "completion_tokens": [len(returned)]}
    if len(ref) > len(returned) and ref[len(returned)] in stop_ids:
        counts["completion_tokens"].append(len(returned) + 1)  # the stop token counted but not returned
    wrong = {k: v for k, v in usage.items() if k in counts and v not in counts[k]}
    if wrong:
        findings.append(finding(index, None, "usage_report", "usage-count",
                                 "usage says " + ", ".join(f"{k} {v}" for k, v in wrong.items()) + f" for a "
                                 f"{len(prompt)}-token prompt and {len(returned)} returned token(s)",
                                 {"usage": usage, "prompt_tokens": len(prompt), "returned_tokens": len(returned)},
                                 detected_by="usage"))
    # log-probabilities of the chosen tokens
    chosen = report.get("chosen_logprobs")
    if chosen:
        findings += _logprob_findings(index, reference, returned, chosen, definition, band_at)
    return findings


def _text_findings(index: int, prompt: list[int], params: RequestParams, returned: list[int], text: str,
                   stop_reason: Any, stop_ids: list[int], tokenizer: Any) -> list[Divergence]:
    if isinstance(stop_reason, str) and stop_reason:
        found = first_stop_completion(tokenizer, returned, params, only=stop_reason)
        if found is None:
            return [finding(index, len(returned) - 1 if returned else None, "stop_string", "stop-string-replay",
                             f"the server says it stopped at stop string {stop_reason!r}, which the returned tokens "
                             "do not complete (after min_tokens)", {"stop": stop_reason}, detected_by="text")]
        completes_at, _, start = found
        if completes_at < len(returned):
            return [finding(index, completes_at, "stop_string", "stop-string-replay",
                             f"stop string {stop_reason!r} is completed by token {completes_at - 1}, but token_ids "
                             f"keep {len(returned) - completes_at} token(s) after it (text cut at the stop)",
                             {"stop": stop_reason, "completed_by": completes_at - 1,
                              "tokens_after_stop": len(returned) - completes_at, "text": text},
                             engine_token=returned[completes_at], detected_by="text")]
        wanted = _cut_at(_texts(tokenizer, prompt, returned), stop_reason, start)
        wanted += [w + stop_reason for w in wanted]  # include_stop_str_in_output
    else:
        wanted = _texts(tokenizer, prompt, returned)
        if returned and returned[-1] in stop_ids:
            wanted += _texts(tokenizer, prompt, returned[:-1])
        # bytes that never form a character (U+FFFD in the decoded text): a detokenizer may drop them (vLLM does)
        dropped = [w.replace("\ufffd", "") for w in wanted if "\ufffd" in w]
        if wanted and wanted[0].endswith("\ufffd"):  # an unfinished character last: a detokenizer holds its bytes
            # back, or (llama.cpp) shows them as one replacement character after the finished text
            held_back = [t for held in (1, 2, 3) if len(returned) > held for t in _texts(tokenizer, prompt, returned[:-held])]
            wanted += held_back + [t + "\ufffd" for t in held_back]
        wanted += dropped
        if wanted and "\ufffd" in wanted[0]:  # invalid bytes: their rendering is the decoder's choice
            bodies = [returned, returned[:-1]] if returned and returned[-1] in stop_ids else [returned]
            rendered = ([_byte_text(tokenizer, tokens) for tokens in bodies]
                        + [_streamed_text(tokenizer, prompt, tokens) for tokens in bodies])
            wanted += [t for t in rendered if t is not None]
        if params.stop:  # a stop string the server did not name: text cut before it while tokens went on
            cut = first_stop_completion(tokenizer, returned, params)
            if cut is not None and cut[0] < len(returned):
                return [finding(index, cut[0], "stop_string", "stop-string-replay",
                                 f"stop string {cut[1]!r} is completed by token {cut[0] - 1}, but token_ids keep "
                                 f"{len(returned) - cut[0]} token(s) after it", {"stop": cut[1], "text": text},
                                 engine_token=returned[cut[0]], detected_by="text")]
            if cut is not None:  # it ended on a stop string without naming it: the finish check says so
                wanted += _cut_at(_texts(tokenizer, prompt, returned), cut[1], cut[2])
    if text in wanted:
        return []
    return [finding(index, None, "text_report", "detokenize",
                     f"text {text[:60]!r} is not the detokenized token_ids {wanted[0][:60]!r}",
                     {"text": text, "detokenized": wanted[0]}, detected_by="text")]


def _logprob_findings(index: int, reference: RequestResult, returned: list[int], chosen: list[float | None],
                      definition: str, band_at: Callable[[float], float]) -> list[Divergence]:
    ref_lps = reference.logprobs.get(definition) or []
    agree = next((i for i, (a, b) in enumerate(zip(reference.tokens, returned)) if a != b),
                 min(len(reference.tokens), len(returned)))
    off: list[tuple[int, float, float, float]] = []
    for position in range(min(agree, len(chosen), len(ref_lps))):
        reported = chosen[position]
        if reported is None:
            continue
        top = float(reference.logits[position].max()) if reference.logits is not None else 0.0
        # the run's band, float32's noise at the top logit, and at least the floor of a misreport: two correct
        # float32 log-softmaxes by other kernels differ by more than rounding (thresholds.REPORT_FLOOR)
        tolerance = max(2 * max(band_at(top), dtype_noise(FLOAT32, top)),
                        REPORT_FLOOR * max(1.0, abs(ref_lps[position])))
        if abs(reported - ref_lps[position]) > tolerance:
            off.append((position, reported, ref_lps[position], tolerance))
    if not off:
        return []
    compared = min(agree, len(chosen), len(ref_lps))
    all_zero = all(v == 0.0 for v in chosen[:compared] if v is not None)
    position, reported, expected, tolerance = off[0]
    pattern = "every reported log-probability is 0.0 (p = 1)" if all_zero else f"{len(off)} of {compared} positions off"
    reason = (f"{pattern}: at new token {position} the server reports {reported:.6g} for token {returned[position]}, "
              f"the reference's {definition} log-probability is {expected:.6g} (tolerance {tolerance:.3g})")
    return [finding(index, position, "logprob_report", "logprob-compare", reason,
                     {"definition": definition, "positions_off": [p for p, *_ in off], "compared": compared,
                      "all_zero": all_zero, "reported": reported, "expected": expected, "tolerance": tolerance},
                     reference.tokens[position], returned[position], detected_by="logprobs")]
