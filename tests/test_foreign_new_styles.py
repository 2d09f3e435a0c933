"""Foreign engines written after the diagnosis of the others, in styles they lack (`tests/foreign/generate_chunks.py`,
a loop over `model.generate`; `tests/foreign/static_cache_spec.py`, speculation on static caches;
`tests/foreign/mask2d_spec.py`, speculation on dynamic caches with 2-D masks and holes): every
buggy variant named by its cause on at least 90% of its structural divergences, never `cross_row`, the
correct variants exact. One audit of all their variants on one batch of 4 prompts, 8 new tokens, to keep
it cheap; reports/foreign/README.md has them on the corpus's settings."""

from __future__ import annotations

from pathlib import Path

from cli_run import audit, runs
from foreign.expect import EXPECTED, problems

MODULES = ("generate_chunks", "static_cache_spec", "mask2d_spec")


def test_new_styles_are_named_by_their_cause(tmp_path: Path) -> None:
    engines = [f"foreign.{module}:{variant}" for module in MODULES for variant in EXPECTED[module]]
    result = audit(*[arg for engine in engines for arg in ("--engine", engine)], "--pair", "tiny-gpt2",
                   "--batch-size", "4", "--num-prompts", "4", "--max-new-tokens", "8", "--no-adversarial",
                   out=tmp_path)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    found = []
    for run in runs(tmp_path):
        module, variant = run["engine"].removeprefix("foreign.").split(":")
        found += problems(run, EXPECTED[module][variant])
    assert not found, "\n".join(found)
