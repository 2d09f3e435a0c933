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
from pathlib import Path

import pytest

from transformers_venv import ROOT, run_there, venv_python

OLDEST = os.environ.get("TRANSFORMERS_OLDEST", "5.17.0")
PAIRS = ["tiny-llama", "tiny-gpt2", "tiny-opt", "tiny-qwen3-next", "tiny-lfm2", "tiny-bamba", "tiny-gemma3",
         "tiny-qwen3-moe"]


@pytest.fixture(scope="module")
def oldest_python() -> str:
    """The cached venv's python (built on the first run); the test fails when it cannot be built."""
    return venv_python(OLDEST)


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
                       "--batch-size", "4", "--dtype", "float64", "--max-new-tokens", "12", "--num-prompts", "4",
                       # the adversarial prompts (2,100 tokens among them) on 24 runs took 470 s of the suite;
                       # they run on the newest transformers in tests/test_adversarial.py
                       "--no-adversarial", "--no-progress", "--out", str(tmp_path), warnings=("error::FutureWarning",))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    audit = json.loads((tmp_path / "audit.json").read_text())
    assert audit["machine"]["transformers"] == OLDEST
    runs = audit["runs"]
    assert len(runs) == 3 * len(PAIRS)
    for run in runs:
        assert not run.get("error") and run["exact_matches"] == run["num_prompts"], (run["engine"], run["pair"])
        assert run["max_logit_error"] is not None and run["max_logit_error"] < 1e-9
