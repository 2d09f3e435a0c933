"""The shared part of the live-server engines (engines/adapters/servers.py): one request per
prompt, `batch_size` of them in flight, and the output contract applied to each answer.

A dialect subclass of `ServerEngine` sets `dialect`, `server_name`, `path` and implements
`request(prompt, max_new_tokens, eos_token_id) -> dict` and `parse(answer) -> Completion`.

Around each `generate` the engine reads the server's metrics (engines/adapters/server_metrics.py)
and keeps the run's speculation counters in `last_speculation`, with each answer's own counters
(`per_request`, where the server puts them beside the tokens) and the tokens each answer returned. A server that answered during the
run (the metrics read included) and then refuses connections raises `ServerDied`, which names its
last answer (HTTP status and body, or the connection error), not "cannot reach".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from specaudit.engines.adapters._http import (
    DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, ServerDied, ServerError, ServerUnreachable, join_url, map_concurrently,
    post_json,
)
from specaudit.engines.adapters.request_fields import ParameterRefused, refused_in_answer
from specaudit.engines.limits import eos_ids
from specaudit.engines.adapters.server_metrics import (
    COUNTERS, RequestCounters, request_counters, safe_snapshot, speculation_between, with_requests,
)
from specaudit.engines.requests import RequestParams

DEFAULT_TOP_LOGPROBS = 2  # the top-2 margin is what a ruling needs


@dataclass
class Completion:
    """One server answer, read: the new token ids and, when real, per-token top log-probabilities."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish: str | None = None  # the server's own stop reason, as it spells it
    stopped_at_eos: bool = False  # the server says it stopped on an EOS token
    stop_token: int | None = None  # the id it says it stopped on, where it names one
    notes: list[str] = field(default_factory=list)
    # what the server says beside its tokens (engines/adapters/request_fields.py `read_*`): text,
    # finish_reason ("stop"/"length"), stop_reason, usage, chosen_logprobs (one per returned token)
    report: dict[str, Any] = field(default_factory=dict)
    acceptance: RequestCounters | None = None  # the speculation counters the answer carries (server_metrics.py)


class ServerEngine:
    """Base of the four dialects: concurrency, stopping and bookkeeping. A subclass sets `dialect`,
    `server_name`, `path` and implements `request` and `parse`."""

    dialect = ""
    server_name = "server"
    path = ""
    black_box = True  # takes no models; its prompts are the audit's

    def __init__(self, url: str, *, batch_size: int = 1, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, top_logprobs: int = DEFAULT_TOP_LOGPROBS,
                 model: str | None = None, **_: Any) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{self.dialect}: expected a URL such as http://127.0.0.1:8080 after "
                             f"'{self.dialect}:', got {url!r}")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.url = url.rstrip("/")
        self.batch_size = int(batch_size)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.top_logprobs = int(top_logprobs)
        self.model = model
        self.last_logprobs: list[list[dict[int, float]] | None] = []
        self.last_details: list[dict[str, Any]] = []
        self.last_speculation: dict[str, Any] | None = None
        self.metrics_note: str | None = None  # why no speculation counters were read, when none were
        # request parameters: None (plain greedy), one RequestParams for every prompt, or one (or None) per prompt
        self.request_params: RequestParams | list[RequestParams | None] | None = None
        self.last_completions: list[Completion | None] = []  # as the server answered, before the client's cuts
        self.last_refused: list[tuple[int, ParameterRefused]] = []  # (prompt index, refusal) of the last generate
        self.last_failures: list[tuple[int, ServerError]] = []  # (prompt index, error) of the last generate
        self._lock = threading.Lock()
        self._answers = 0  # HTTP answers this engine has had (any status), the metrics reads included
        self._last_answer: str | None = None  # the latest one: status and the start of its body
        self._failures: list[str] = []  # the connection errors since the latest answer (distinct, in order)

    def _observe(self, answered: bool, what: str) -> None:
        with self._lock:
            if answered:
                self._answers += 1
                self._last_answer = what
                self._failures = []
            elif what not in self._failures:
                self._failures.append(what)

    def _died(self, exc: ServerUnreachable, index: int, prompt_length: int) -> ServerDied:
        details = {"answers_before": self._answers, "last_answer": self._last_answer,
                   "connection_error": "; then ".join(self._failures) or str(exc)}
        return ServerDied(f"the {self.server_name} server at {self.url} died during the run: it had answered "
                          f"{self._answers} time(s), its last answer {self._last_answer}; then, at prompt {index} "
                          f"({prompt_length} tokens), no connection could be made ({details['connection_error']}): "
                          "see the server's log", details)

    def describe(self) -> dict[str, Any]:
        """What was audited, for reports and repro bundles; after `generate`, how often the client
        had to append an EOS or cut tokens, and which prompts gave usable log-probabilities."""
        notes: dict[str, int] = {}
        for details in self.last_details:
            for note in details.get("notes", []):
                notes[note] = notes.get(note, 0) + 1
        return {"kind": "server", "dialect": self.dialect, "url": self.url, "endpoint": self.path,
                "model": self.model, "concurrent_requests": self.batch_size, "timeout_s": self.timeout,
                "top_logprobs": self.top_logprobs, "client_notes": notes,
                "prompts_with_logprobs": sum(lp is not None for lp in self.last_logprobs),
                "speculation": self.last_speculation, "metrics_note": self.metrics_note}

    def _metrics(self):
        """One read of the metrics endpoint (a failure is a note, never an error); an answer counts
        as the server being alive."""
        snapshot, failure = safe_snapshot(self.url, self.dialect, self.timeout)
        if snapshot is not None:
            self._observe(True, "an answer to GET /metrics")
        return snapshot, failure

    def request(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                params: RequestParams | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, answer: Any) -> Completion:
        raise NotImplementedError

    def params_for(self, index: int) -> RequestParams | None:
        """The request parameters of prompt `index` (None: a plain greedy request)."""
        params = self.request_params
        if isinstance(params, list):
            params = params[index] if index < len(params) else None
        return None if params is None or (params.is_plain() and params.logprobs is None) else params

    def complete(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None,
                 params: RequestParams | None = None) -> Completion:
        """One prompt: the request, sent, and the answer, read. A parameter the dialect cannot carry, or
        an HTTP 400 naming one that was sent, raises `ParameterRefused`."""
        body = (self.request(prompt, max_new_tokens, eos_token_id) if params is None
                else self.request(prompt, max_new_tokens, eos_token_id, params))
        try:
            answer = post_json(join_url(self.url, self.path), body, timeout=self.timeout, retries=self.retries,
                               what=f"{self.server_name} server", observe=self._observe)
        except ServerError as exc:
            refused = (refused_in_answer(self.dialect, params, str(exc))
                       if params is not None and "HTTP 400" in str(exc) else None)
            if refused is not None:
                raise ParameterRefused(refused, f"the {self.server_name} server answered: {exc}") from None
            raise
        try:
            completion = self.parse(answer)
            completion.acceptance = request_counters(self.dialect, answer)
            return completion
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ServerError(f"{self.server_name} server at {self.url}: unexpected answer shape "
                              f"({type(exc).__name__}: {exc}); is this a {self.server_name} server?") from None

    def logprobs_at(self, prefix: list[int], token: int, eos_token_id: int | Sequence[int] | None,
                    top: int = 20) -> dict[int, float] | None:
        """Teacher forcing: {token id: log-probability} of the next token after `prefix`, `token` included
        where the server can say it (None where it answers nothing usable). Here: the server's top `top`
        at the prefix (one new token); a dialect that scores a given token (vLLM) overrides it."""
        saved = self.top_logprobs
        self.top_logprobs = top
        try:
            completion = self.complete(list(prefix), 1, eos_token_id)
        except ServerError:
            return None
        finally:
            self.top_logprobs = saved
        return completion.logprobs[0] if completion.logprobs else None

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.last_speculation = None
        if max_new_tokens <= 0:
            self.last_logprobs, self.last_details = [None] * len(prompts), [{} for _ in prompts]
            return [[] for _ in prompts]
        before, _ = self._metrics()

        def one(numbered: tuple[int, list[int]]) -> Completion | ServerError | ParameterRefused:
            index, prompt = numbered
            try:
                return self.complete([int(t) for t in prompt], max_new_tokens, eos_token_id, self.params_for(index))
            except ParameterRefused as exc:  # reported as such, never a divergence
                return exc
            except ServerDied:
                raise
            except ServerUnreachable as exc:
                if self._answers:
                    raise self._died(exc, index, len(prompt)) from None
                raise
            except ServerError as exc:
                # say which prompt: a server limit (context size) is often about one long prompt
                return type(exc)(f"prompt {index} ({len(prompt)} tokens): {exc}")

        completions = map_concurrently(one, list(enumerate(prompts)), self.batch_size)
        after, failure = self._metrics()
        names = COUNTERS.get(self.dialect)
        self.last_speculation = speculation_between(before, after, self.url,
                                                    iterations=bool(names and names.json_iterations))
        self.metrics_note = failure or (after.note if after is not None else None)
        answers = [c if isinstance(c, Completion) else None for c in completions]
        self.last_speculation = with_requests(self.last_speculation, [c.acceptance if c else None for c in answers],
                                              [len(c.token_ids) if c else None for c in answers])
        refused = [(index, c) for index, c in enumerate(completions) if isinstance(c, ServerError)]
        if refused and len(refused) == len(prompts):
            raise refused[0][1]
        # a request that errors is a finding for its prompt (an empty output here); the rest are judged
        self.last_failures = refused
        self.last_refused = [(index, c) for index, c in enumerate(completions) if isinstance(c, ParameterRefused)]
        outputs, self.last_logprobs, self.last_details, self.last_completions = [], [], [], []
        for index, completion in enumerate(completions):
            if isinstance(completion, (ServerError, ParameterRefused)):
                outputs.append([])
                self.last_logprobs.append(None)
                self.last_details.append({"refused": str(completion)} if isinstance(completion, ParameterRefused) else {})
                self.last_completions.append(None)
                continue
            self.last_completions.append(completion)
            params = self.params_for(index)
            budget = params.max_tokens if params is not None and params.max_tokens is not None else max_new_tokens
            if (params is not None and completion.stopped_at_eos and completion.token_ids
                    and completion.token_ids[-1] in params.stop_token_ids):
                completion = replace(completion, stopped_at_eos=False)  # it ended on a stop id it returned: no EOS to add
            tokens, logprobs, details = finish_output(completion, budget, eos_token_id)
            outputs.append(tokens)
            self.last_logprobs.append(logprobs)
            self.last_details.append(details)
        return outputs


def finish_output(completion: Completion, max_new_tokens: int,
                  eos_token_id: int | Sequence[int] | None
                  ) -> tuple[list[int], list[dict[int, float]] | None, dict[str, Any]]:
    """The contract's output from a server's answer: EOS appended when the server says it stopped on
    EOS without returning it (the id it names, else the only id of the set), then cut at the first EOS
    of the set (kept) and at `max_new_tokens`."""
    tokens = list(completion.token_ids)
    logprobs = completion.logprobs
    notes = list(completion.notes)
    ends = eos_ids(eos_token_id)
    missing = completion.stop_token if completion.stop_token in ends else ends[0] if len(ends) == 1 else None
    if (missing is not None and completion.stopped_at_eos and len(tokens) < max_new_tokens
            and not any(t in ends for t in tokens)):
        tokens.append(missing)
        notes.append("the server stopped on EOS without returning it; EOS appended")
        if logprobs is not None:
            logprobs = None  # no log-probability for the appended token: drop them rather than misalign
    returned = len(tokens)
    first_eos = next((i for i, t in enumerate(tokens) if t in ends), None)
    if first_eos is not None:
        tokens = tokens[: first_eos + 1]
    tokens = tokens[:max_new_tokens]
    if len(tokens) < returned:
        notes.append(f"{returned - len(tokens)} token(s) after EOS or past max_new_tokens cut by the client")
    if logprobs is not None:
        logprobs = logprobs[: len(tokens)]
    details = {"finish": completion.finish, "returned_tokens": returned, "notes": notes}
    return tokens, logprobs, details


def _top_dict(entries: list[tuple[int, float]]) -> dict[int, float]:
    return {int(token): float(logprob) for token, logprob in entries}
