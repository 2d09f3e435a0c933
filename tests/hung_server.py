"""A server that is up but never answers a completion: the hung server of the `--timeout` tests
(tests/test_every_door.py).

`HungServer` is a `FakeServer` (tests/fake_server.py: a free port of 127.0.0.1, one thread per connection)
whose every `POST` (a completion, a teacher-forcing request) is read and then held without an answer until the
server is stopped: far longer than any test. Stopping it (the context manager's exit, however the test ends)
releases every held request and closes the socket. `held` counts the POSTs it has held, so a test can tell
"asked and hung" from "never asked".
"""

from __future__ import annotations

import threading
from typing import Any

from fake_server import FakeServer

HOLD_S = 3600.0  # how long a held request waits at most when nobody stops the server


class HungServer(FakeServer):
    def __init__(self) -> None:
        self._release = threading.Event()
        super().__init__(self._hold)

    @property
    def held(self) -> int:
        return len(self.requests)

    def _hold(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self._release.wait(HOLD_S)  # answered only once the server stops, to a client that gave up long before
        return 503, {"object": "error", "message": "the hung server stopped"}

    def _stop(self) -> None:
        self._release.set()
        super()._stop()
