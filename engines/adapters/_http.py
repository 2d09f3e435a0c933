"""HTTP for the live-server engines: one JSON POST with a timeout and retries, and N at once.

Standard library only (urllib). Contract of `post_json`:
- a connection that cannot be made (refused, unknown host, reset) is retried `retries` times with a
  growing pause, then raised as `ServerUnreachable`, one line naming the URL and the fix;
- HTTP 429 and 5xx are retried the same way, then raised as `ServerError` with the server's answer;
- any other HTTP error (a 4xx: the server refused this request) is raised at once as `ServerError`;
- a request that has no answer within `timeout` seconds is raised as `ServerTimeout` and not retried
  (a generation that timed out once would only time out again, doubling the wait).

`post_json(..., observe=f)` calls `f(answered, what)` after every try: `answered` True when the
server gave an HTTP answer (`what`: its status and, for an error, the start of its body), False for a
connection that failed (`what`: the error). A client uses it to tell a server that died during a
run (it answered before) from one that was never there. `get_text` reads a GET endpoint once.

`map_concurrently` runs one call per prompt on `workers` threads and keeps the prompts' order:
with `workers=N` the server sees N requests in flight and can batch them.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RETRIES = 2
RETRY_PAUSE_S = 0.5  # doubled after every failed try
ERROR_BODY_CHARS = 300


class ServerError(RuntimeError):
    """The server answered, but not with a usable completion."""


class ServerUnreachable(ServerError):
    """No connection could be made to the server."""


class ServerTimeout(ServerError):
    """The server did not answer within the per-request timeout."""


class ServerDied(ServerUnreachable):
    """The server answered earlier in the run, then stopped accepting connections."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.details = details


def join_url(base: str, path: str) -> str:
    """`base` (with or without a trailing slash) followed by `path`."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def post_json(url: str, body: dict[str, Any], *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
              what: str = "server", headers: dict[str, str] | None = None,
              observe: Callable[[bool, str], None] | None = None) -> Any:
    """POST `body` as JSON to `url` and return the decoded JSON answer (see the module docstring)."""
    data = json.dumps(body).encode()
    request_headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    pause = RETRY_PAUSE_S
    for attempt in range(retries + 1):
        last = attempt == retries
        request = urllib.request.Request(url, data=data, headers=request_headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                if observe is not None:
                    observe(True, f"HTTP {response.status}")
        except urllib.error.HTTPError as exc:
            detail = _body_excerpt(exc)
            if observe is not None:
                observe(True, f"HTTP {exc.code}: {detail}")
            if (exc.code == 429 or exc.code >= 500) and not last:
                time.sleep(pause)
                pause *= 2
                continue
            raise ServerError(f"{what} at {url} answered HTTP {exc.code}: {detail}") from None
        except (TimeoutError, socket.timeout) as exc:
            raise ServerTimeout(f"{what} at {url} gave no answer within {timeout:g} s: raise the per-request "
                                f"timeout (engine option timeout=SECONDS) or lower --batch-size") from exc
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if observe is not None and not isinstance(reason, (TimeoutError, socket.timeout)):
                observe(False, f"{type(reason).__name__}: {reason}")
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise ServerTimeout(f"{what} at {url} gave no answer within {timeout:g} s: raise the per-request "
                                    f"timeout (engine option timeout=SECONDS) or lower --batch-size") from exc
            if not last:
                time.sleep(pause)
                pause *= 2
                continue
            raise ServerUnreachable(f"cannot reach {what} at {url} ({reason}) after {retries + 1} tries: start "
                                    f"the server or fix the URL in the engine name") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(f"{what} at {url} answered with something that is not JSON: "
                              f"{raw[:ERROR_BODY_CHARS]!r}") from None
    raise AssertionError("unreachable")  # the loop returns or raises


def get_text(url: str, *, timeout: float = DEFAULT_TIMEOUT_S, what: str = "server") -> tuple[int, str]:
    """GET `url` once: (HTTP status, body text). An HTTP error is an answer (its status and body);
    a connection that cannot be made raises `ServerUnreachable`, no answer in time `ServerTimeout`."""
    request = urllib.request.Request(url, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, _body_excerpt(exc)
    except (TimeoutError, socket.timeout):
        raise ServerTimeout(f"{what} at {url} gave no answer within {timeout:g} s") from None
    except (urllib.error.URLError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise ServerTimeout(f"{what} at {url} gave no answer within {timeout:g} s") from None
        raise ServerUnreachable(f"cannot reach {what} at {url} ({reason})") from None


def _body_excerpt(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read().decode(errors="replace")
    except Exception:  # a body that cannot be read: the status alone says enough
        text = ""
    text = " ".join(text.split())
    return (text[:ERROR_BODY_CHARS] + "...") if len(text) > ERROR_BODY_CHARS else (text or exc.reason or "")


def map_concurrently(call: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """`[call(item) for item in items]` with up to `workers` calls in flight; results in input order.
    The first exception raised by any call is raised here; calls not yet started are dropped. The workers
    are daemon threads: a caller that gives up on this call (the audit's time limit) leaves nothing that
    holds the process at exit."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers == 1 or len(items) <= 1:
        return [call(item) for item in items]
    pending = queue.SimpleQueue()  # (index, item) not yet started
    for numbered in enumerate(items):
        pending.put(numbered)
    results: list[Any] = [None] * len(items)
    finished = queue.SimpleQueue()  # (index, error or None), one per call made
    stop = threading.Event()  # set at the first error: calls not yet started are dropped

    def work() -> None:
        while not stop.is_set():
            try:
                index, item = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = call(item)
                finished.put((index, None))
            except BaseException as exc:  # handed to the caller
                stop.set()
                finished.put((index, exc))
                return

    threads = [threading.Thread(target=work, name="specaudit-http", daemon=True)
               for _ in range(min(workers, len(items)))]
    for thread in threads:
        thread.start()
    for _ in range(len(items)):
        _, error = finished.get()
        if error is not None:
            for thread in threads:  # the calls in flight finish (each has its own timeout); none starts
                thread.join()
            raise error
    return results
