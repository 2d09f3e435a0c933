"""The model zoo: deterministic tiny pairs, ragged acceptance, local user pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.cli import main
from specaudit.testing.models import pair, prompts


def test_builtin_pairs_are_the_twelve_families() -> None:
    assert zoo.builtin_pair_names() == sorted(
        ["tiny-llama", "tiny-qwen3", "tiny-glm4", "tiny-gpt2", "tiny-opt", "tiny-gpt-neox",
         "tiny-gemma3", "tiny-qwen3-moe", "tiny-llama-mistral", "tiny-qwen3-next", "tiny-lfm2", "tiny-bamba"])


def test_pairs_are_deterministic() -> None:
    first, second = zoo.build_builtin_pair("tiny-qwen3"), zoo.build_builtin_pair("tiny-qwen3")
    for a, b in zip(first[:2], second[:2]):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name


def test_acceptance_is_naturally_ragged(pair_name: str) -> None:
    rate = zoo.measure_acceptance(pair(pair_name), [list(p) for p in prompts()[::2]], 24)
    assert 0.4 <= rate <= 0.9, f"{pair_name}: per-token acceptance {rate:.1%}"


def test_prompt_set_spans_lengths() -> None:
    lengths = [len(p) for p in prompts()]
    assert len(lengths) >= 24 and min(lengths) == 1 and max(lengths) >= 300


def test_byte_tokenizer_round_trip() -> None:
    tok = zoo.ByteTokenizer()
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([72, tok.eos_token_id]) == "H<eos>"


def test_unknown_pair_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="built-in pairs"):
        zoo.load_pair("tiny-nothing")


def test_user_pair_from_local_folders_is_audited(tmp_path: Path) -> None:
    target, draft, _ = zoo.build_builtin_pair("tiny-gpt-neox")
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    draft.save_pretrained(tmp_path / "draft", safe_serialization=True)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [7]}\n{"input_ids": [9, 9, 9, 9, 9]}\n')
    code = main(["audit", "--no-progress", "--engine", "eqspec", "--target", str(tmp_path / "target"),
                 "--draft", str(tmp_path / "draft"), "--prompts", str(prompts_file), "--batch-size", "3",
                 "--max-new-tokens", "8", "--out", str(tmp_path / "out")])
    assert code == 0
    with pytest.raises(ValueError, match="not a local folder"):
        zoo.load_pair(target_path=str(tmp_path / "missing"), draft_path=str(tmp_path / "draft"))
