"""Failures during an audit: each is a failed run in audit.json (one-line `error`, full `traceback`),
the other runs complete, the reports are written, and the exit status is 1. Ctrl-C keeps every
finished run. Nothing here may end an audit with a traceback."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

import failing_engines
from cli_run import audit, runs
from specaudit.equivalence.pipeline import weights

SMALL = ("--num-prompts", "2", "--max-new-tokens", "4")


def _failed(run: dict, *fragments: str) -> None:
    assert run["failed"] and not run["equivalent"], run
    assert "\n" not in run["error"] and "Traceback" in run["traceback"]
    for fragment in fragments:
        assert fragment in run["error"], run["error"]


def _completed(run: dict) -> None:
    assert not run.get("error") and run["exact_matches"] == run["num_prompts"] >= 2, run


def test_broken_engines_are_failed_runs_and_the_others_complete(tmp_path: Path) -> None:
    engines = ["make_raising", "make_one_output_short", "make_float_tokens", "make_negative_token"]
    args = [arg for name in engines for arg in ("--engine", f"failing_engines:{name}")]
    result = audit(*args, "--engine", "eqspec", "--pair", "tiny-gpt2", "--batch-size", "2", *SMALL, out=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    by_engine = {run["engine"].split(":")[-1]: run for run in runs(tmp_path)}
    _failed(by_engine["make_raising"], "raised RuntimeError", "planted failure inside generate")
    _failed(by_engine["make_one_output_short"], "outputs for", "one output per prompt")
    _failed(by_engine["make_float_tokens"], "output 0, position 0", "not an integer token id")
    _failed(by_engine["make_negative_token"], "token id -1", "outside the vocabulary (0..258)")
    _completed(by_engine["eqspec"])
    assert result.stdout.count("ERROR") == 4 and "4 run(s) failed" in result.stdout
    assert "failed: failing_engines:make_raising" in result.stderr  # each failure's one line, on stderr too
    report = (tmp_path / "report.md").read_text()
    assert "planted failure inside generate" in report and (tmp_path / "report.html").exists()


def test_factory_that_fails_at_a_later_batch_size_is_a_failed_run(tmp_path: Path) -> None:
    result = audit("--engine", "failing_engines:factory_raises_for_large_batches", "--pair", "tiny-gpt2",
                   "--batch-size", "2", "4", *SMALL, out=tmp_path)
    assert result.returncode == 1
    fits, refused = runs(tmp_path)
    _completed(fits)
    _failed(refused, "outside generate()", "planted: batch sizes above 2 are not supported")


def test_hanging_engine_times_out_and_the_audit_goes_on(tmp_path: Path) -> None:
    failing_engines.RELEASE.clear()
    started = time.perf_counter()
    try:
        result = audit("--engine", "failing_engines:make_hanging", "--engine", "eqspec", "--pair", "tiny-gpt2",
                       "--batch-size", "2", "--timeout", "5", *SMALL, out=tmp_path)
    finally:
        failing_engines.RELEASE.set()  # let the abandoned thread end
    assert result.returncode == 1
    assert time.perf_counter() - started < 60
    hung, finished = runs(tmp_path)
    _failed(hung, "did not return within 5 s", "--timeout")
    _completed(finished)


def test_diagnosis_reruns_honour_the_timeout(tmp_path: Path) -> None:
    failing_engines.RELEASE.clear()
    failing_engines._WrongThenHangs.calls = 0
    started = time.perf_counter()
    try:
        result = audit("--engine", "failing_engines:make_wrong_then_hangs", "--pair", "tiny-gpt2", "--batch-size",
                       "2", "--timeout", "3", "--no-adversarial", *SMALL, out=tmp_path)
    finally:
        failing_engines.RELEASE.set()
    elapsed = time.perf_counter() - started
    assert result.returncode == 1
    (run,) = runs(tmp_path)
    assert not run.get("error") and run["structural_divergences"] == 1
    tried = " ".join(run["divergences"][0]["diagnosis"]["tried"])
    assert "RunTimeout" in tried  # the hanging re-runs were cut, and the diagnosis says so
    assert failing_engines._WrongThenHangs.calls >= 2  # a re-run was really tried
    assert elapsed < 30  # one shared limit of 3 s for all re-runs, not 120 s for each


def test_out_of_memory_names_the_batch_size(tmp_path: Path) -> None:
    result = audit("--engine", "failing_engines:make_out_of_memory", "--pair", "tiny-gpt2", "--batch-size", "4", "2",
                   *SMALL, out=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    too_big, fits = runs(tmp_path)
    _failed(too_big, "out of memory at batch size 4 on cpu", "smaller --batch-size")
    _completed(fits)


def test_host_memory_error_is_a_failed_run(tmp_path: Path) -> None:
    result = audit("--engine", "failing_engines:make_host_memory_error", "--engine", "eqspec", "--pair", "tiny-gpt2",
                   "--batch-size", "3", *SMALL, out=tmp_path)
    assert result.returncode == 1
    failed, finished = runs(tmp_path)
    _failed(failed, "out of memory at batch size 3")
    _completed(finished)


def test_reference_failure_is_recorded_per_run_and_other_pairs_go_on(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # stands for a model that fails in its own forward pass (as an MoE did in float64): planted on tiny-gpt2
    real_reference = weights.Reference

    def reference(pair, *args, **kwargs):
        if pair.name == "tiny-gpt2":
            raise RuntimeError("planted: this model cannot run in float64")
        return real_reference(pair, *args, **kwargs)

    monkeypatch.setattr(weights, "Reference", reference)
    result = audit("--engine", "eqspec", "--engine", "reference", "--pair", "tiny-gpt2", "--pair", "tiny-llama",
                   "--batch-size", "2", *SMALL, out=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    recorded = runs(tmp_path)
    assert [(r["engine"], r["pair"]) for r in recorded] == [
        ("eqspec", "tiny-gpt2"), ("reference", "tiny-gpt2"), ("eqspec", "tiny-llama"), ("reference", "tiny-llama")]
    for run in recorded[:2]:
        _failed(run, "pair tiny-gpt2 in float64", "the reference", "planted: this model cannot run in float64")
    for run in recorded[2:]:
        _completed(run)
    assert json.loads((tmp_path / "audit.json").read_text())["complete"]


class _DroppingServer:
    """Answers its first /completion like llama.cpp, then closes every connection without a word."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection:
                if not connection.recv(65536):
                    continue  # a bare connect (the reachability check)
                self.requests += 1
                if self.requests == 1:
                    body = json.dumps({"tokens": [72, 105], "stop_type": "limit"}).encode()
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                       + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    def close(self) -> None:
        self.listener.close()


def test_server_that_drops_the_connection_mid_run(tmp_path: Path) -> None:
    server = _DroppingServer()
    try:
        result = audit("--engine", f"llamacpp:{server.url}", "--engine", "eqspec", "--pair", "tiny-gpt2",
                       "--batch-size", "1", *SMALL, out=tmp_path)
    finally:
        server.close()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    dropped, finished = runs(tmp_path)
    assert server.requests >= 2  # one answered, then the dropped one (and its retries)
    _failed(dropped, "llamacpp", server.url)
    _completed(finished)


def test_ctrl_c_before_the_first_run_leaves_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(weights.validate, "preflight", interrupted)
    result = audit("--engine", "eqspec", "--pair", "tiny-gpt2", out=tmp_path)
    assert result.returncode == 130 and "nothing was written" in result.stderr


def test_ctrl_c_during_a_bench_keeps_the_finished_runs(tmp_path: Path) -> None:
    from cli_run import cli

    result = cli("bench", "--engine", "eqspec", "--engine", "sample_engines:make_interrupting", "--engine", "exspec",
                 "--pair", "tiny-gpt2", "--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "4",
                 "--repeats", "1", "--warmup", "0", "--out", str(tmp_path))
    assert result.returncode == 130 and "interrupted" in result.stderr
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert [run["engine"] for run in bench["runs"]] == ["eqspec"] and not bench["complete"]
    assert bench["runs"][0]["tokens_per_second"] > 0
    assert "eqspec" in (tmp_path / "bench.md").read_text()


def test_real_ctrl_c_while_an_engine_runs_keeps_the_finished_runs(tmp_path: Path) -> None:
    """SIGINT, as a terminal sends it, while the audit waits on an engine's worker thread."""
    import os
    import signal
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "specaudit.cli", "audit", "--no-progress", "--engine", "eqspec",
         "--engine", "failing_engines:make_hanging", "--pair", "tiny-gpt2", "--batch-size", "2", *SMALL,
         "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as a terminal's shell starts it: SIGINT at its default, whatever this process inherited (a job started
        # with `&` by a non-interactive shell ignores SIGINT, and so would the audit: Python then installs no
        # KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            audit_json = tmp_path / "audit.json"
            if audit_json.exists() and json.loads(audit_json.read_text())["runs"]:
                break  # eqspec is done: the hanging engine is running now
            time.sleep(0.2)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert [run["engine"] for run in runs(tmp_path)] == ["eqspec"]
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()
