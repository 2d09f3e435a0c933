"""Outputs recorded on a GPU in bfloat16, audited on the CPU: correct engines get no structural ruling,
buggy ones are still structural and named (equivalence/rulings/ruler.py).

Each folder under tests/data/ with a `prompts_ids.jsonl` holds recordings named
`{pair}-{engine}-b{B}-{dtype}-{device}.jsonl` (`scripts/record_engines.py` makes them; see the
folder's README). Folders named in `SPECAUDIT_RECORDINGS` (separated by `:`) are audited too. Each
recording is audited on its first `PROMPTS` prompts, a buggy engine's on its first `BUGGY_PROMPTS` (its every
divergence is diagnosed by float64 replays, seconds each: all 38 of the H100 folder take 3 minutes per buggy
engine) with the command a team would type:

    specaudit audit --engine recorded:FILE --pair P --dtype D --engine-dtype D \
        --prompts prompts_ids.jsonl --num-prompts 16 --no-adversarial --max-new-tokens N

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

pytestmark = pytest.mark.precision  # what it sees rounds below float64: run under other kernels too

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


PROMPTS = 16  # a correct engine's recording: its bfloat16 flips are what the rulings must not call structural
# a buggy engine's recording: 8 prompts (BSP and DSD diverge structurally on all 16 and on all 8; each divergence
# is diagnosed by about 80 float64 window replays: 16 prompts took 48 and 40 s, 8 take 11 and 13 s)
BUGGY_PROMPTS = 8


def _recordings() -> list[Path]:
    """Every recording of every folder."""
    return sorted(path for folder in _folders() for path in folder.glob("*.jsonl") if NAME.match(path.name))


def _new_tokens(path: Path) -> int:
    """The max_new_tokens the recordings of `path`'s folder, pair and dtype ran with: their longest output
    (every prompt ran to its budget or EOS)."""
    match = NAME.match(path.name)
    siblings = [p for p in path.parent.glob("*.jsonl") if (m := NAME.match(p.name))
                and (m["pair"], m["dtype"]) == (match["pair"], match["dtype"])]
    return max(len(json.loads(line)["output_ids"]) for p in siblings for line in p.read_text().splitlines()
               if line.strip())


@pytest.mark.parametrize("path", _recordings(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recordings_are_ruled_by_what_they_are(path: Path, tmp_path: Path) -> None:
    match = NAME.match(path.name)
    engine, dtype = match["engine"], DTYPES[match["dtype"]]
    result = audit("--engine", f"recorded:{path}", "--pair", match["pair"], "--dtype", dtype, "--engine-dtype", dtype,
                   "--prompts", str(path.parent / "prompts_ids.jsonl"),
                   "--num-prompts", str(PROMPTS if engine in CORRECT else BUGGY_PROMPTS),
                   "--no-adversarial", "--max-new-tokens", str(_new_tokens(path)), out=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    (run,) = runs(tmp_path)
    assert not run.get("error"), run.get("error")
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    if engine in CORRECT:
        assert result.returncode == 0 and not structural, \
            (engine, [(d["prompt_index"], d["position"], d["evidence"].get("reason")) for d in structural])
        return
    # most of a buggy engine's flips are far from any tie (a quarter at least; BSP 37 of 38, DSD 24 of 38 on all
    # 38 prompts of the H100 folder)
    assert structural and len(structural) >= len(run["divergences"]) / 4, (engine, run["numerical_divergences"])
    classes = Counter(d["diagnosis"]["class"] for d in structural)
    assert classes.most_common(1)[0][0] == BUGGY_CLASS[engine], (engine, classes)
    # no diagnosis broke off (one judged past a numerical flip once compared logits of two different paths)
    broken = [(d["prompt_index"], step) for d in structural for step in d["diagnosis"].get("tried", [])
              if step.startswith("diagnosis failed")]
    assert not broken, broken
    assert all(d["decided_by"] for d in run["divergences"])
