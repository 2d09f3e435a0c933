"""`--device auto`: the target (and draft) placed by accelerate's device_map="auto" over the machine's devices.

On this CPU-only machine accelerate maps every module to the CPU: the audit must run as with `--device cpu`
and record the map; without accelerate the option is refused in one line (exit 2).
"""

from __future__ import annotations

import importlib.util

import pytest

from cli_run import audit, runs, usage_error

ARGS = ("--engine", "eqspec", "--pair", "tiny-llama", "--num-prompts", "2", "--no-adversarial", "--batch-size", "2",
        "--max-new-tokens", "8")


def test_device_auto_without_accelerate_is_refused_in_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    usage_error(audit(*ARGS, "--device", "auto", out=tmp_path), "--device auto", "accelerate is not installed",
                "pip install accelerate")


def test_device_auto_places_the_pair_with_accelerate_and_audits_as_on_the_cpu(tmp_path):
    pytest.importorskip("accelerate")
    auto = audit(*ARGS, "--device", "auto", out=tmp_path / "auto")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    cpu = audit(*ARGS, "--device", "cpu", out=tmp_path / "cpu")
    assert cpu.returncode == 0
    [run] = runs(tmp_path / "auto")
    assert run["pair_info"]["device_map"]["target"] and set(run["pair_info"]["device_map"]["target"].values()) == {"cpu"}
    on_cpu = runs(tmp_path / "cpu")[0]
    assert (run["exact_matches"], run["tokens_generated"]) == (on_cpu["exact_matches"], on_cpu["tokens_generated"]) == (2, 16)
