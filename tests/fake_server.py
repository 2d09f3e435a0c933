"""A local HTTP server for the live-server client tests: 127.0.0.1, a free port, its own thread.

It records every request (path and JSON body), answers through a function the test gives
(`answer(path, body) -> (status, JSON-able body)`), and counts how many requests were in flight at
once, so a test can see that `--batch-size N` really means N concurrent requests.

Optional behaviour of a real server:
- `metrics=SpeculationMetrics(...)`: `GET /metrics` answers Prometheus text whose speculation
  counters move with every completion (or never move, with `drafts=False`: a server that was started
  without speculation);
- `die_after=N`: the server answers N completions, answers the next one with `dying_answer` (vLLM's
  HTTP 500 when its engine core died), then stops listening: later connections are refused.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]


DYING_ANSWER = (500, {"object": "error", "message": "planted: EngineCore encountered an issue", "type": "EngineDeadError"})


class SpeculationMetrics:
    """Prometheus counters for `GET /metrics`, in `dialect`'s names, split over two label sets (two
    engines), with `_created` samples and comments beside them as real exposition has. Each
    completion of `n` new tokens moves them: drafted += 4 * ceil(n / 2), accepted += n // 2, and
    every third request counts one preemption (vLLM only)."""

    def __init__(self, dialect: str = "vllm", drafts: bool = True) -> None:
        self.dialect, self.drafts = dialect, drafts
        self.drafted = [0, 0]
        self.accepted = [0, 0]
        self.preemptions = [0, 0]
        self.requests = 0
        self.reads = 0

    def count(self, new_tokens: int) -> None:
        side = self.requests % 2
        self.requests += 1
        if self.drafts:
            self.drafted[side] += 4 * ((new_tokens + 1) // 2)
            self.accepted[side] += new_tokens // 2
        if self.requests % 3 == 0:
            self.preemptions[side] += 1

    def totals(self) -> dict[str, int]:
        return {"drafted": sum(self.drafted), "accepted": sum(self.accepted), "preemptions": sum(self.preemptions)}

    def text(self) -> str:
        self.reads += 1
        prefix = "vllm" if self.dialect == "vllm" else "llamacpp"
        lines = [f"# HELP {prefix}:prompt_tokens_total Number of prefill tokens processed.",
                 f"# TYPE {prefix}:prompt_tokens_total counter",
                 f'{prefix}:prompt_tokens_total{{model_name="m",engine="0"}} 1234.0']
        counters = [("spec_decode_num_draft_tokens", self.drafted), ("spec_decode_num_accepted_tokens", self.accepted)]
        if self.dialect == "vllm":
            counters.append(("num_preemptions", self.preemptions))
        for name, values in counters:
            lines += [f"# HELP {prefix}:{name}_total a counter", f"# TYPE {prefix}:{name}_total counter"]
            for engine, value in enumerate(values):
                # a label value holding a brace, a space and an escaped quote: a parser must skip it whole
                labels = f'model_name="m {{x}} \\"q\\"",engine="{engine}"'
                lines.append(f"{prefix}:{name}_total{{{labels}}} {float(value)}")
                lines.append(f"{prefix}:{name}_created{{{labels}}} 1.7e9")
        return "\n".join(lines) + "\n"


def _new_tokens(body: dict[str, Any], payload: Any) -> int:
    """How many new tokens an answer holds, whatever the dialect (for the counters)."""
    if isinstance(payload, dict):
        if "tokens" in payload:
            return len(payload["tokens"])
        if "choices" in payload:
            return len(payload["choices"][0].get("token_ids") or [])
        if "meta_info" in payload:
            return len(payload["meta_info"].get("output_token_logprobs") or [])
    return int(body.get("max_tokens") or body.get("n_predict") or 0)


class FakeServer:
    def __init__(self, answer: Answer, delay_s: float = 0.0, metrics: SpeculationMetrics | None = None,
                 die_after: int | None = None, dying_answer: tuple[int, Any] = DYING_ANSWER) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.metrics = metrics
        self.die_after = die_after
        self.dying_answer = dying_answer
        self.completions = 0
        self.dead = False
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server._lock:
                    server.requests.append((self.path, body))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                dying = False
                try:
                    if server.delay_s:
                        time.sleep(server.delay_s)
                    with server._lock:
                        dying = server.die_after is not None and server.completions >= server.die_after
                        server.completions += 1
                    if dying:
                        status, payload = server.dying_answer
                    else:
                        status, payload = server.answer(self.path, body)
                        if server.metrics is not None and status == 200:
                            with server._lock:
                                server.metrics.count(_new_tokens(body, payload))
                finally:
                    with server._lock:
                        server.in_flight -= 1
                self._send(status, json.dumps(payload).encode(), "application/json")
                if dying and not server.dead:
                    server.dead = True
                    threading.Thread(target=server._stop, daemon=True).start()  # not from this handler's thread

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics" and server.metrics is not None:
                    with server._lock:
                        text = server.metrics.text()
                    self._send(200, text.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"detail": "Not Found"}', "application/json")

            def _send(self, status: int, data: bytes, content_type: str) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def _stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *exc: Any) -> None:
        self._stop()


def free_port_with_nothing_listening() -> int:
    """A port on 127.0.0.1 that was free a moment ago (bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
