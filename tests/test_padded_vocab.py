"""Padded vocabularies: a target and draft whose `vocab_size` differ while their tokenizers agree
(Qwen2.5-0.5B has 151936 ids, Qwen2.5-7B 152064, one tokenizer).

A tiny pair is built that way from tiny-llama: the target's embedding and output matrices get 13
padding rows of zeros (so padding ids never win, as in the real models), the draft keeps 259 ids,
both folders hold the same byte tokenizer. The built-in engines must audit it exactly in float64.
A draft whose padding row wins proposes an id the target does not share: a draft error, named so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_run import audit, usage_error
from llamacpp_models import byte_tokenizer_files

from specaudit.engines.models import model_files, zoo
from specaudit.engines.drafters import DraftVocabularyError, check_proposals

REAL, PADDED = 259, 272


def _pad(model: torch.nn.Module, size: int, rows: torch.Tensor | None = None) -> None:
    """Grow `model`'s vocabulary to `size` ids; the new output rows are `rows` (default zeros)."""
    old = model.config.vocab_size
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:] = 0.0
        model.get_output_embeddings().weight[old:] = 0.0 if rows is None else rows
    assert model.config.vocab_size == size


def _save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    for name, text in byte_tokenizer_files().items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def padded_target_pair(tmp_path_factory):
    target, draft, _ = zoo.build_builtin_pair("tiny-llama")
    _pad(target, PADDED)
    root = tmp_path_factory.mktemp("padded")
    return _save(target, root / "target"), _save(draft, root / "draft")


def test_a_padded_target_is_audited_exactly_by_every_builtin_engine(tmp_path, padded_target_pair):
    target, draft = padded_target_pair
    result = audit("--engine", "eqspec", "--engine", "exspec", "--engine", "inplace", "--target", str(target),
                   "--draft", str(draft), "--dtype", "float64", "--batch-size", "3", "--num-prompts", "6",
                   "--max-new-tokens", "12", "--no-adversarial", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "audit.json").read_text())
    assert len(report["runs"]) == 3
    for run in report["runs"]:
        assert not run.get("error") and run["exact_matches"] == run["num_prompts"] == 6, run.get("error")
        assert run["divergences"] == [] and run["max_logit_error"] < 1e-9
        assert run["pair_info"]["vocab_sizes"] == {"target": PADDED, "draft": REAL, "shared": REAL}


def test_a_draft_proposal_outside_the_shared_ids_is_a_draft_error(tmp_path):
    target, draft, _ = zoo.build_builtin_pair("tiny-llama")
    prompt = zoo.ByteTokenizer().encode("The capital of France")
    with torch.no_grad():
        logits = draft(torch.tensor([prompt])).logits[0, -1]
    chosen = int(logits.argmax())
    assert float(logits[chosen]) > 0
    # the draft's first padding row doubles its favourite's: it wins wherever that token would
    rows = torch.zeros(PADDED - REAL, draft.config.hidden_size, dtype=draft.dtype)
    rows[0] = 2 * draft.get_output_embeddings().weight[chosen].detach()
    _pad(draft, PADDED, rows)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": prompt}) + "\n")
    result = audit("--engine", "eqspec", "--engine", "inplace", "--target", str(_save(target, tmp_path / "t")),
                   "--draft", str(_save(draft, tmp_path / "d")), "--prompts", str(prompts), "--no-adversarial",
                   "--batch-size", "1", "--max-new-tokens", "4", out=tmp_path / "out")
    assert result.returncode == 1
    for run in json.loads((tmp_path / "out" / "audit.json").read_text())["runs"]:
        assert run["failed"] and "DraftVocabularyError" in run["error"], run["error"]
        assert f"token {REAL}" in run["error"] and f"0..{REAL - 1}" in run["error"]


def test_proposals_are_checked_against_the_shared_range():
    check_proposals(torch.tensor([[0, REAL - 1]]), REAL)
    with pytest.raises(DraftVocabularyError):
        check_proposals(torch.tensor([[3, REAL]]), REAL)


def test_sizes_may_differ_only_with_tokenizers_that_fit_the_shared_ids(tmp_path, padded_target_pair):
    target, draft = padded_target_pair
    assert model_files.check_same_vocabulary(target, draft) == REAL
    bare = tmp_path / "bare"  # the draft without its tokenizer files: nothing shows the ids agree
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((draft / name).read_bytes())
    with pytest.raises(model_files.ModelFolderError):
        model_files.check_same_vocabulary(target, bare)
    small = tmp_path / "small"  # a draft of 200 ids whose tokenizer names ids up to 258
    small.mkdir()
    config = json.loads((draft / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    (small / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes())
    for name, text in byte_tokenizer_files().items():
        (small / name).write_text(text)
    usage_error(audit("--engine", "eqspec", "--target", str(target), "--draft", str(small), out=tmp_path / "out"),
                "id 200")
