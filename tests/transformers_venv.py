"""A cached venv of one transformers release (scripts/transformers_oldest.sh) that runs this checkout's
specaudit: the venv's python with this environment's site-packages appended, so its transformers comes
first and torch and specaudit come from here."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this environment's site-packages (a venv's own, where specaudit is installed, and the one torch comes from)
SITES = [d for d in (*site.getsitepackages(), str(Path(torch.__file__).resolve().parents[1])) if Path(d).is_dir()]
PRELUDE = f"import site, sys; [site.addsitedir(d) for d in {SITES!r}]; "


def venv_python(version: str) -> str:
    """The cached venv's python for transformers `version` (built on the first call); AssertionError when it
    cannot be built."""
    built = subprocess.run(["bash", str(ROOT / "scripts" / "transformers_oldest.sh")], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable, "TRANSFORMERS_OLDEST": version})
    assert built.returncode == 0, f"could not build the transformers {version} venv:\n{built.stderr[-3000:]}"
    return built.stdout.strip().splitlines()[-1]


def run_there(python: str, code: str, *args: str, warnings: tuple[str, ...] = (),
              timeout: float = 1800) -> subprocess.CompletedProcess:
    """`code` (after the prelude that appends this environment's site-packages) run by the venv's `python`
    in the checkout, without PYTHONPATH or PYTEST_ADDOPTS."""
    return subprocess.run([python, *[f"-W{w}" for w in warnings], "-c", PRELUDE + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")})
