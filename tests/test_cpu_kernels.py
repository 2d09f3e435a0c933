"""The precision-sensitive tests (marker `precision`) again under this CPU's other kernels.

Below float64 which way a near-tie rounds is the kernels' choice: ATen's vector kernels (picked at start from
the processor; `ATEN_CPU_CAPABILITY` picks another set this processor can run) and oneDNN's (capped by
`ONEDNN_MAX_CPU_ISA`; its bfloat16 matmuls differ most between processors). A test whose premise holds with
one set and not another passes where it was written and fails for a user on another CPU; run here under every
other set this processor can execute, such a premise fails here first. Each set runs the marked tests in a
child pytest process (the kernels are chosen when torch loads), with its own kept references and hunts
(`engines/reference_memo.py` names them by the kernels), so a warm cache serves each set.

Which tests carry the marker, and why: docs/development.md ("Tests under other CPU kernels").
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specaudit.engines import reference_memo

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MARKER = "precision"
TIMEOUT_S = 1800
# (ATen capability, oneDNN's instruction-set cap for the same width), lowest first
X86_SETS = [("default", "SSE41"), ("avx2", "AVX2"), ("avx512", "AVX512_CORE")]
# what ATen's avx512 kernels need (aten/src/ATen/native/DispatchStub.cpp); avx2 needs avx2 and fma
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def other_kernel_sets() -> list[tuple[str, str]]:
    """The kernel sets this processor runs, but for the one this process uses."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [("default", "")] if torch.backends.cpu.get_cpu_capability().lower() != "default" else []
    flags = set(reference_memo.cpu_description()[1])
    native = torch.backends.cpu.get_cpu_capability().lower()
    return [(aten, onednn) for aten, onednn in X86_SETS if NEEDS[aten] <= flags and aten != native]


def marked_files() -> list[Path]:
    """The test files that carry the marker (read, not imported: collecting every module costs minutes)."""
    pattern = re.compile(rf"pytest\.mark\.{MARKER}\b")
    return sorted(path for path in TESTS.rglob("test_*.py")
                  if path.name != Path(__file__).name and pattern.search(path.read_text()))


def _environment(aten: str, onednn: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}  # the child is a session of its own
    env["ATEN_CPU_CAPABILITY"] = aten
    if onednn:
        env["ONEDNN_MAX_CPU_ISA"] = onednn
    else:
        env.pop("ONEDNN_MAX_CPU_ISA", None)
    return env


def test_the_marked_files_are_the_precision_sensitive_ones() -> None:
    names = {path.name for path in marked_files()}
    assert {"test_attribution.py", "test_draft_choice_precision.py", "test_gpu_recordings.py",
            "test_faults.py", "test_recurrent.py"} <= names, names


@pytest.mark.skipif(not other_kernel_sets(), reason="this processor runs no other ATen kernel set")
@pytest.mark.parametrize("aten, onednn", other_kernel_sets(), ids=lambda value: value or "native")
def test_precision_tests_hold_under_other_cpu_kernels(aten: str, onednn: str) -> None:
    env = _environment(aten, onednn)
    chosen = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert chosen.stdout.strip().lower() == aten, (aten, chosen.stdout, chosen.stderr[-2000:])  # the set took
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rf",
               "--no-header", "-m", MARKER, *map(str, marked_files())]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"ATEN_CPU_CAPABILITY={aten} ONEDNN_MAX_CPU_ISA={onednn}:\n{tail}"
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, tail
