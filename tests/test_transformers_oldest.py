"""The oldest transformers pyproject allows (5.17.0, what GPU images ship): the reference equals
`model.generate` on every family, pure state-space models included, and the engines are exact.

CI installs the newest transformers the range allows; this test runs the same code on the oldest, in
its own cached venv (`scripts/transformers_oldest.sh`): the venv's python with this environment's
site-packages appended, so its transformers comes first and torch and the checkout's specaudit come
from here. Warnings that specaudit's own calls raise fail here as everywhere (pyproject's filters), and
the audit runs with every FutureWarning an error.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
OLDEST = os.environ.get("TRANSFORMERS_OLDEST", "5.17.0")
# this environment's site-packages (a venv's own, where specaudit is installed, and the one torch comes from)
SITES = [d for d in (*site.getsitepackages(), str(Path(torch.__file__).resolve().parents[1])) if Path(d).is_dir()]
PAIRS = ["tiny-llama", "tiny-gpt2", "tiny-opt", "tiny-qwen3-next", "tiny-lfm2", "tiny-bamba", "tiny-gemma3",
         "tiny-qwen3-moe"]


@pytest.fixture(scope="module")
def oldest_python() -> str:
    """The cached venv's python (built on the first run); the test fails when it cannot be built."""
    built = subprocess.run(["bash", str(ROOT / "scripts" / "transformers_oldest.sh")], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable, "TRANSFORMERS_OLDEST": OLDEST})
    assert built.returncode == 0, f"could not build the transformers {OLDEST} venv:\n{built.stderr[-3000:]}"
    return built.stdout.strip().splitlines()[-1]


def run_there(python: str, code: str, *args: str, warnings: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    prelude = f"import site, sys; [site.addsitedir(d) for d in {SITES!r}]; "
    return subprocess.run([python, *[f"-W{w}" for w in warnings], "-c", prelude + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")})


def test_the_oldest_transformers_is_the_one_that_runs(oldest_python: str) -> None:
    result = run_there(oldest_python, "import transformers, specaudit.engines.eqspec as e; "
                                      "print(transformers.__version__, e.__file__)")
    assert result.returncode == 0, result.stderr
    version, where = result.stdout.split()
    assert version == OLDEST and Path(where).resolve() == (ROOT / "engines" / "eqspec.py").resolve()


def test_the_reference_equals_generate_on_every_family(oldest_python: str) -> None:
    result = run_there(oldest_python, "import pytest; sys.exit(pytest.main(sys.argv[1:]))",
                       "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "tests/test_reference.py")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_the_engines_are_exact(oldest_python: str, tmp_path: Path) -> None:
    pairs = [arg for pair in PAIRS for arg in ("--pair", pair)]
    result = run_there(oldest_python, "from specaudit.cli import main; sys.exit(main(sys.argv[1:]))",
                       "audit", "--engine", "eqspec", "--engine", "exspec", "--engine", "inplace", *pairs,
                       "--batch-size", "4", "--dtype", "float64", "--max-new-tokens", "12", "--num-prompts", "6",
                       "--no-progress", "--out", str(tmp_path), warnings=("error::FutureWarning",))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["machine"]["transformers"] == OLDEST
    runs = audit["runs"]
    assert len(runs) == 3 * len(PAIRS)
    for run in runs:
        assert not run.get("error") and run["exact_matches"] == run["num_prompts"], (run["engine"], run["pair"])
        assert run["max_logit_error"] is not None and run["max_logit_error"] < 1e-9
