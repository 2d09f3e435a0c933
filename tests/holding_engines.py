"""An engine written elsewhere whose `generate` waits on a worker thread of its own, not a daemon, that never ends:
the audit abandons it past `--timeout`, and the process must still end (tests/test_process_exit.py)."""

from __future__ import annotations

import threading
import time


class HoldsAWorker:
    def generate(self, prompts, max_new_tokens, eos_token_id):
        # not a daemon (a thread started from a daemon thread is one unless told otherwise): it holds the interpreter
        worker = threading.Thread(target=time.sleep, args=(3600,), daemon=False)
        worker.start()
        worker.join()
        return [[] for _ in prompts]


def make(target, draft, **_):
    return HoldsAWorker()
