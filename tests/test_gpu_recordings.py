"""Outputs recorded on a GPU in bfloat16, audited on the CPU: correct engines get no structural ruling,
buggy ones are still structural and named (equivalence/precision.py).

Each folder under tests/data/ with a `prompts_ids.jsonl` holds recordings named
`{pair}-{engine}-b{B}-{dtype}-{device}.jsonl` (`scripts/record_engines.py` makes them; see the
folder's README). Folders named in `SPECAUDIT_RECORDINGS` (separated by `:`) are audited too. Every
recording of a pair and dtype is audited in one run of the command a team would type:

    specaudit audit --engine recorded:FILE ... --pair P --dtype D --engine-dtype D \
        --prompts prompts_ids.jsonl --no-adversarial --max-new-tokens N

The reference, batched greedy decoding, EQSPEC, EXSPEC and INPLACE are correct: 0 structural. BSP
counts positions over padding and rejected slots: structural, named `position_ids`; DSD keeps the
first rejected draft token: structural, named `acceptance_rule` (as in float64, reports/adapters/).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from cli_run import audit, runs

DATA = Path(__file__).resolve().parent / "data"
NAME = re.compile(r"^(?P<pair>tiny-[a-z0-9-]+?)-(?P<engine>reference|batched|eqspec|exspec|inplace|bsp|dsd)"
                  r"-b(?P<batch>\d+)-(?P<dtype>bf16|fp16|fp32)-(?P<device>[a-z0-9]+)\.jsonl$")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CORRECT = {"reference", "batched", "eqspec", "exspec", "inplace"}
BUGGY_CLASS = {"bsp": "position_ids", "dsd": "acceptance_rule"}


def _folders() -> list[Path]:
    folders = [d for d in sorted(DATA.iterdir()) if (d / "prompts_ids.jsonl").is_file()] if DATA.is_dir() else []
    folders += [Path(p) for p in os.environ.get("SPECAUDIT_RECORDINGS", "").split(":") if p]
    return folders


def _groups() -> list[tuple[Path, str, str]]:
    """(folder, pair, dtype short name) for every group of recordings."""
    found = set()
    for folder in _folders():
        for path in folder.glob("*.jsonl"):
            match = NAME.match(path.name)
            if match:
                found.add((folder, match["pair"], match["dtype"]))
    return sorted(found)


def _new_tokens(path: Path) -> int:
    """The recordings' max_new_tokens: the longest output (every prompt ran to its budget or EOS)."""
    return max(len(json.loads(line)["output_ids"]) for line in path.read_text().splitlines() if line.strip())


@pytest.mark.parametrize("folder, pair, dtype", _groups(), ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_recordings_are_ruled_by_what_they_are(folder: Path, pair: str, dtype: str, tmp_path: Path) -> None:
    files = sorted(p for p in folder.glob(f"{pair}-*-{dtype}-*.jsonl") if NAME.match(p.name)
                   and NAME.match(p.name)["pair"] == pair)
    engines = [arg for path in files for arg in ("--engine", f"recorded:{path}")]
    result = audit(*engines, "--pair", pair, "--dtype", DTYPES[dtype], "--engine-dtype", DTYPES[dtype],
                   "--prompts", str(folder / "prompts_ids.jsonl"), "--no-adversarial",
                   "--max-new-tokens", str(max(_new_tokens(p) for p in files)), out=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    by_engine = {NAME.match(Path(run["engine"].partition(":")[2]).name)["engine"]: run for run in runs(tmp_path)}
    assert len(by_engine) == len(files)
    for engine, run in by_engine.items():
        assert not run.get("error"), run.get("error")
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        if engine in CORRECT:
            assert not structural, (engine, [(d["prompt_index"], d["position"], d["evidence"].get("reason"))
                                             for d in structural])
            continue
        # most of a buggy engine's flips are far from any tie (a quarter at least; BSP 37 of 38, DSD 24 of 38 here)
        assert structural and len(structural) >= len(run["divergences"]) / 4, (engine, run["numerical_divergences"])
        classes = Counter(d["diagnosis"]["class"] for d in structural)
        assert classes.most_common(1)[0][0] == BUGGY_CLASS[engine], (engine, classes)
        assert all(d["decided_by"] for d in run["divergences"])
