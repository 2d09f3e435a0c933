"""Every deciding constant lives in equivalence/rulings/thresholds.py, with its reason: no other library module
defines one of its names (they import it), and the thresholds a verdict is known to turn on are there."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = ROOT / "equivalence" / "rulings" / "thresholds.py"
LIBRARY = ("specaudit", "engines", "equivalence", "bench", "property_tests", "fixtures")
# the thresholds a ruling, a diagnosis, a gate or a statistical test decides by (each once, in thresholds.py)
DECIDING = ("FLOAT64_LOGIT_TOLERANCE", "NOISE_FACTOR", "REPORT_FLOOR", "OTHER_REFERENCE_TOKENS", "EXPLAIN_RATIO",
            "NOISY_EXPLAIN_RATIO", "MASKED_REPLAY_AGREEMENT", "HIDDEN_MASK_FRACTION",
            "RERUN_BUDGET", "PAD_RERUN_BUDGET", "MASKED_WINDOW", "TOKEN_WINDOW", "ALPHA", "POWER", "PIT_BINS",
            "SERVED_PIT_BINS", "MIN_EXPECTED_PER_BIN", "ROUNDING", "ROUNDING_FACTOR", "MEAN_TOLERANCE")


def _module_constants(path: Path) -> dict[str, int]:
    """UPPER_CASE names given a value at a module's top level -> line (an alias of another name is no value)."""
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if isinstance(getattr(node, "value", None), ast.Name):
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper():
                found[target.id] = node.lineno
    return found


def test_the_deciding_constants_are_in_thresholds_each_with_a_comment() -> None:
    text = THRESHOLDS.read_text(encoding="utf-8").splitlines()
    defined = _module_constants(THRESHOLDS)
    missing = [name for name in DECIDING if name not in defined]
    assert not missing, f"not defined in equivalence/rulings/thresholds.py: {missing}"
    bare = [name for name, line in defined.items() if not text[line - 2].lstrip().startswith("#")
            and "#" not in text[line - 1]]
    assert not bare, f"thresholds without their reason (a comment above or beside): {bare}"


def test_no_other_module_defines_a_deciding_constant() -> None:
    names = set(_module_constants(THRESHOLDS)) | set(DECIDING)
    twice = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == THRESHOLDS:
                continue
            twice += [f"{path.relative_to(ROOT)}:{line} {name}" for name, line in _module_constants(path).items()
                      if name in names]
    assert not twice, ("deciding constants defined outside equivalence/rulings/thresholds.py (import them from "
                       f"there): {twice}")
