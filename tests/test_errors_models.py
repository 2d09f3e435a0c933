"""A user's model pair that cannot be audited as given: exit 2, one line naming the folder and the fix.

Folders are checked before anything is loaded, so most folders here hold a config and an empty
weights file; the pickle opt-in is checked end to end with a real tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_run import audit, cli, usage_error
from specaudit.engines.models import model_files
from specaudit.engines.models import zoo


def _folder(path: Path, config: dict | None = None, weights: str | None = "model.safetensors") -> Path:
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / weights).write_bytes(b"")
    return path


LLAMA = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64, "max_position_embeddings": 512}


def _user_pair(*args: str, target: Path, draft: Path, out: Path):
    return audit("--engine", "eqspec", "--target", str(target), "--draft", str(draft), *args, out=out)


def test_missing_folders_exit_2_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the issue's own example: relative paths that do not exist
    result = audit("--engine", "eqspec", "--target", "MISSING", "--draft", "MISSING", "--batch-size", "2",
                   out=tmp_path / "out")
    usage_error(result, "target folder 'MISSING' does not exist", "nothing is downloaded", "save_pretrained")
    assert not (tmp_path / "out" / "audit.json").exists()


def test_missing_folders_in_a_bench(tmp_path: Path) -> None:
    result = cli("bench", "--engine", "eqspec", "--target", str(tmp_path / "MISSING"), "--draft",
                 str(tmp_path / "MISSING"), "--out", str(tmp_path / "out"))
    usage_error(result, "specaudit bench: error:", "target folder", "does not exist")


def test_draft_folder_missing(tmp_path: Path) -> None:
    target = _folder(tmp_path / "t", LLAMA)
    usage_error(_user_pair(target=target, draft=tmp_path / "d", out=tmp_path / "out"),
                f"draft folder '{tmp_path / 'd'}' does not exist")


def test_folder_without_config(tmp_path: Path) -> None:
    target, draft = _folder(tmp_path / "t"), _folder(tmp_path / "d", LLAMA)
    usage_error(_user_pair(target=target, draft=draft, out=tmp_path / "out"), str(target), "has no config.json")


def test_folder_without_weights(tmp_path: Path) -> None:
    target, draft = _folder(tmp_path / "t", LLAMA, weights=None), _folder(tmp_path / "d", LLAMA)
    usage_error(_user_pair(target=target, draft=draft, out=tmp_path / "out"), str(target), "has no weights")


def test_different_vocabulary_sizes(tmp_path: Path) -> None:
    target, draft = _folder(tmp_path / "t", LLAMA), _folder(tmp_path / "d", {**LLAMA, "vocab_size": 300})
    usage_error(_user_pair(target=target, draft=draft, out=tmp_path / "out"),
                "different vocabularies (259 vs 300 tokens)", "target's tokenizer")


def _save_tokenizer(folder: Path, vocab: dict[str, int]) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
                                   unk_token="<unk>")
    fast.save_pretrained(str(folder))


def test_different_tokenizers_of_one_size(tmp_path: Path) -> None:
    config = {**LLAMA, "vocab_size": 3}
    target, draft = _folder(tmp_path / "t", config), _folder(tmp_path / "d", config)
    _save_tokenizer(target, {"<unk>": 0, "yes": 1, "no": 2})
    _save_tokenizer(draft, {"<unk>": 0, "yes": 2, "no": 1})  # same size, ids swapped
    usage_error(_user_pair(target=target, draft=draft, out=tmp_path / "out"),
                "different tokenizers", "e.g. token 'no'", "shares the target's tokenizer")


def test_same_tokenizer_passes_the_check(tmp_path: Path) -> None:
    config = {**LLAMA, "vocab_size": 3}
    target, draft = _folder(tmp_path / "t", config), _folder(tmp_path / "d", config)
    for folder in (target, draft):
        _save_tokenizer(folder, {"<unk>": 0, "yes": 1, "no": 2})
    model_files.check_same_vocabulary(target, draft)  # raises if it wrongly refuses


@pytest.mark.parametrize("config, reason", [
    ({**LLAMA, "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyModel"}}, "auto_map"),
    ({**LLAMA, "model_type": "my-own-architecture"}, "'my-own-architecture' is not built into"),
])
def test_custom_code_is_refused_without_trust_remote_code(tmp_path: Path, config: dict, reason: str) -> None:
    target, draft = _folder(tmp_path / "t", config), _folder(tmp_path / "d", LLAMA)
    usage_error(_user_pair(target=target, draft=draft, out=tmp_path / "out"),
                str(target), "needs custom model code", reason, "--trust-remote-code")


def test_trust_remote_code_lets_the_folder_check_pass(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "t", {**LLAMA, "auto_map": {"AutoModelForCausalLM": "m.M"}})
    with pytest.raises(model_files.ModelFolderError, match="--trust-remote-code"):
        model_files.check_model_folder(folder, "target")
    assert model_files.check_model_folder(folder, "target", trust_remote_code=True) is True


def test_pickle_weights_refused_unless_allowed(tmp_path: Path) -> None:
    target, draft, _ = zoo.build_builtin_pair("tiny-gpt2")
    target.save_pretrained(tmp_path / "target")
    draft.config.save_pretrained(tmp_path / "draft")
    torch.save(draft.state_dict(), tmp_path / "draft" / "pytorch_model.bin")  # the old pickle format
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [72, 105]}\n{"input_ids": [7]}\n')
    args = ("--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "4")
    refused = _user_pair(*args, target=tmp_path / "target", draft=tmp_path / "draft", out=tmp_path / "out")
    usage_error(refused, str(tmp_path / "draft"), "pickle weights (pytorch_model.bin)", "--allow-pickle-weights")
    allowed = _user_pair(*args, "--allow-pickle-weights", target=tmp_path / "target", draft=tmp_path / "draft",
                         out=tmp_path / "out")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    loaded = zoo.load_pair(target_path=str(tmp_path / "target"), draft_path=str(tmp_path / "draft"),
                           allow_pickle_weights=True).draft.state_dict()
    for key, value in draft.state_dict().items():  # the pickled weights were really loaded
        assert torch.equal(loaded[key], value), key
    with pytest.raises(ValueError, match="--allow-pickle-weights"):  # the Python loader refuses it too
        zoo.load_pair(target_path=str(tmp_path / "target"), draft_path=str(tmp_path / "draft"))


def test_weights_that_fail_to_load_are_a_failed_run_and_other_pairs_go_on(tmp_path: Path) -> None:
    target, draft, _ = zoo.build_builtin_pair("tiny-gpt2")
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "model.safetensors").write_bytes(b"not a safetensors file" * 4)  # corrupt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [72, 105]}\n{"input_ids": [7]}\n')
    result = audit("--engine", "eqspec", "--pair", "tiny-gpt2", "--target", str(tmp_path / "target"), "--draft",
                   str(tmp_path / "draft"), "--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "4",
                   out=tmp_path / "out")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    builtin, broken = json.loads((tmp_path / "out" / "audit.json").read_text())["runs"]
    assert builtin["pair"] == "tiny-gpt2" and builtin["exact_matches"] == builtin["num_prompts"] and not builtin["error"]
    assert broken["pair"] == "target+draft" and "loading the pair failed" in broken["error"]
    assert "target+draft" in result.stdout  # the summary table lists the failed run


def test_prompt_beyond_the_drafts_positions(tmp_path: Path) -> None:
    # the target allows 512 positions, its draft only 64: a 60-token prompt + 8 new tokens fits only the target
    target, draft = _folder(tmp_path / "t", LLAMA), _folder(tmp_path / "d", {**LLAMA, "max_position_embeddings": 64})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5] * 60}) + "\n")
    usage_error(_user_pair("--prompts", str(prompts), "--max-new-tokens", "8", target=target, draft=draft,
                           out=tmp_path / "out"),
                f"{prompts}:1:", "60 prompt tokens + 8 new tokens exceed the model's 64 positions")
