"""`specaudit audit` ends its process when the audit ends, even where an abandoned engine left a thread behind
that the interpreter would wait for at exit (a non-daemon worker of the engine's own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_an_engine_thread_left_behind_does_not_hold_the_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "specaudit", "audit", "--engine", "holding_engines:make", "--pair", "tiny-llama",
               "--timeout", "3", "--no-progress", "--no-adversarial", "--num-prompts", "2", "--max-new-tokens", "2",
               "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {time.monotonic() - started:.0f} s: the thread held the process")
    assert process.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr
    [run] = json.loads((tmp_path / "out" / "audit.json").read_text())["runs"]
    assert run["failed"] and "--timeout" in run["error"]
