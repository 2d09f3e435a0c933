"""The port of the paper's published EQSPEC and EXSPEC (`tests/paper_engines.py`) on the default prompts
(built-in and adversarial): each of its bugs named by its cause (a prompt cut to a limit, pad ids read as
padding, EOS anywhere in the row, the acceptance rule, the output order), never by a symptom (`unknown`,
`cross_row`, a length rule)."""

from __future__ import annotations

from pathlib import Path

from cli_run import audit, runs
from foreign.expect import classes, structural

CAUSES = {"prompt_truncated", "pad_as_content", "stop_eos", "acceptance_rule", "output_order"}


def test_published_code_on_default_prompts_is_named_by_cause(tmp_path: Path) -> None:
    result = audit("--engine", "paper_engines:make_eqspec", "--engine", "paper_engines:make_exspec",
                   "--pair", "tiny-llama", "--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12",
                   out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for run in runs(tmp_path):
        found = classes(run)
        assert structural(run), run["engine"]
        assert set(found) <= CAUSES, (run["engine"], found, [(d["prompt_index"], d["diagnosis"]["evidence"][:300])
                                                              for d in structural(run)
                                                              if d["diagnosis"]["class"] not in CAUSES])
        assert all(d["diagnosis"].get("named_by") for d in structural(run))
