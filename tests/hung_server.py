"""A server that is up but never answers a completion: the hung server of the `--timeout` tests
(tests/test_every_door.py).

`HungServer` listens on a free port of 127.0.0.1 (bound to port 0, so two tests never share one), in a thread
of the test's process, one thread per connection. It answers what a live vLLM answers before any work:
`GET /health`, `GET /metrics` (Prometheus text without speculation counters), `GET /v1/models` and
`GET /version`. Any `POST` (a completion, a teacher-forcing request) is read and then held without an
answer until the server is stopped: far longer than any test. Stopping it (the context manager's exit,
however the test ends) releases every held request, which is then closed unanswered, and closes the socket.

`held` counts the POSTs it has held, so a test can tell "asked and hung" from "never asked".
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOLD_S = 3600.0  # how long a held request waits at most when nobody stops the server

METRICS = ("# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
           "# TYPE vllm:prompt_tokens_total counter\n"
           'vllm:prompt_tokens_total{model_name="hung"} 0.0\n')


class HungServer:
    def __init__(self, model: str = "hung") -> None:
        self.model = model
        self.held = 0
        self.paths: list[str] = []
        self._release = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                with server._lock:
                    server.paths.append(f"GET {self.path}")
                path = self.path.split("?")[0]
                if path == "/health":
                    self._send(200, b"", "text/plain")
                elif path == "/metrics":
                    self._send(200, METRICS.encode(), "text/plain; version=0.0.4")
                elif path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": server.model, "object": "model", "max_model_len": 2048}]}).encode(), "application/json")
                elif path == "/version":
                    self._send(200, b'{"version": "0.0.0-hung"}', "application/json")
                else:
                    self._send(404, b'{"detail": "Not Found"}', "application/json")

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0) or 0)
                if length:
                    self.rfile.read(length)
                with server._lock:
                    server.paths.append(f"POST {self.path}")
                    server.held += 1
                server._release.wait(HOLD_S)  # never answered: the connection is closed when the server stops
                self.close_connection = True

            def _send(self, status: int, data: bytes, content_type: str) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HungServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
