"""Checks on a user's local Hugging Face model folder, made before anything is loaded.

`check_model_folder` raises `ModelFolderError` (a `ValueError`) with one line that names the folder,
the problem and the fix:

- the folder is missing, or has no `config.json`: nothing is ever downloaded;
- it holds no weights;
- it holds only pickle weights (`*.bin`, `*.pt`, `*.pth`, `*.ckpt`), which can run code when loaded:
  refused unless `allow_pickle_weights`;
- its `config.json` asks for custom code (`auto_map`, or a `model_type` this transformers does not
  know): refused unless `trust_remote_code`.

`check_same_vocabulary` compares two folders' vocabularies. Their `config.json` sizes may differ (a
padded vocabulary: Qwen2.5-0.5B has 151936 ids, Qwen2.5-7B 152064, one tokenizer) when both folders
hold tokenizers that agree entry for entry and name no id outside the range both models have; the
models are then compared over that shared range (`shared_vocab_size`). Equal sizes need agreeing
tokenizers only where both folders have one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelFolderError(ValueError):
    """A model folder that cannot (or may not) be loaded; the message names the fix."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's `config.json` as a dict (`check_model_folder` first)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{config_path}: not a readable JSON config ({type(exc).__name__}); "
                               "give a folder written by save_pretrained") from exc
    if not isinstance(config, dict):
        raise ModelFolderError(f"{config_path}: expected a JSON object; give a folder written by save_pretrained")
    return config


def declared_eos_ids(path: str | Path) -> list[int] | None:
    """The EOS ids a model folder's `generation_config.json` declares (every one of a list), else its
    `config.json`'s; None when neither names one or neither can be read."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(path) / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return list(dict.fromkeys(ids))
    return None


def weight_files(path: str | Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickle files) directly in the folder."""
    files = [f for f in Path(path).iterdir() if f.is_file()]
    safe = sorted(f for f in files if f.name.endswith(SAFETENSORS_SUFFIXES))
    pickled = sorted(f for f in files if f.name.endswith(PICKLE_SUFFIXES) and not f.name.startswith("training_args"))
    return safe, pickled


def needs_remote_code(config: dict[str, Any]) -> str | None:
    """Why the config needs custom code (a reason to print), or None."""
    if config.get("auto_map"):
        return f"its config.json has auto_map ({', '.join(sorted(config['auto_map']))})"
    model_type = config.get("model_type")
    if model_type is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return f"its model_type {model_type!r} is not built into this transformers"
    return None


def check_model_folder(path: str | Path, role: str = "model", *, allow_pickle_weights: bool = False,
                       trust_remote_code: bool = False) -> bool:
    """Raise `ModelFolderError` unless `path` is a loadable local model folder. Returns whether its
    weights are safetensors (False: pickle weights the caller allowed)."""
    folder = Path(path)
    if not folder.exists():
        raise ModelFolderError(f"{role} folder {str(path)!r} does not exist (it is not a local folder; nothing is "
                               "downloaded): give the path of a folder written by save_pretrained")
    if not folder.is_dir():
        raise ModelFolderError(f"{role} {str(path)!r} is not a local folder: give the folder that holds "
                               "config.json and the weights")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"{role} folder {str(path)!r} has no config.json: give a folder written by "
                               "save_pretrained")
    config = read_config(folder)
    safe, pickled = weight_files(folder)
    if not safe and not pickled:
        raise ModelFolderError(f"{role} folder {str(path)!r} has no weights (no *.safetensors): save the model "
                               "there with save_pretrained")
    if not safe and not allow_pickle_weights:
        raise ModelFolderError(
            f"{role} folder {str(path)!r} holds only pickle weights ({pickled[0].name}), which can run code "
            "when loaded: convert them to safetensors, or pass --allow-pickle-weights if you trust them")
    reason = needs_remote_code(config)
    if reason and not trust_remote_code:
        raise ModelFolderError(f"{role} folder {str(path)!r} needs custom model code ({reason}): pass "
                               "--trust-remote-code if you trust that code")
    return bool(safe)


def _vocab_size(config: dict[str, Any]) -> int | None:
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("vocab_size")
    return size


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether a model folder holds a tokenizer. (transformers 5.23's AutoTokenizer builds an empty
    tokenizer of the config's family from a folder without one; it encodes every text as [].)"""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer_vocab(path: str | Path, trust_remote_code: bool) -> dict[str, int] | None:
    if not has_tokenizer_files(path):
        return None
    try:
        from transformers import AutoTokenizer

        return dict(AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code).get_vocab())
    except Exception:  # an unloadable tokenizer: the pair is still auditable on token ids
        return None


def check_same_vocabulary(target_path: str | Path, draft_path: str | Path, *,
                          trust_remote_code: bool = False) -> int | None:
    """Raise `ModelFolderError` when target and draft disagree on their tokenizer, or differ in
    vocabulary size without tokenizers that show they agree on the shared ids (module docstring).
    Returns the shared vocabulary size (the smaller of the two), when the configs say."""
    target_vocab, draft_vocab = _vocab_size(read_config(target_path)), _vocab_size(read_config(draft_path))
    target_tokens = _tokenizer_vocab(target_path, trust_remote_code)
    draft_tokens = _tokenizer_vocab(draft_path, trust_remote_code)
    if target_tokens is not None and draft_tokens is not None and target_tokens != draft_tokens:
        differing = sorted(set(target_tokens.items()) ^ set(draft_tokens.items()), key=lambda item: (item[1], item[0]))
        example = f"; e.g. token {differing[0][0]!r}" if differing else ""
        raise ModelFolderError(
            f"target {str(target_path)!r} and draft {str(draft_path)!r} have different tokenizers "
            f"({len(target_tokens)} vs {len(draft_tokens)} entries{example}): give a draft that shares the "
            "target's tokenizer")
    if target_vocab is None or draft_vocab is None:
        return None
    shared = min(target_vocab, draft_vocab)
    if target_vocab != draft_vocab:
        if target_tokens is None or draft_tokens is None:
            raise ModelFolderError(
                f"target {str(target_path)!r} and draft {str(draft_path)!r} have different vocabularies "
                f"({target_vocab} vs {draft_vocab} tokens) and no tokenizer files to show that they agree on the "
                f"{shared} ids both have: give both folders the target's tokenizer (a padded vocabulary is fine "
                "when the tokenizers agree)")
        beyond = sorted((token_id, token) for token, token_id in target_tokens.items() if token_id >= shared)
        if beyond:
            raise ModelFolderError(
                f"target {str(target_path)!r} and draft {str(draft_path)!r} have {target_vocab} and {draft_vocab} "
                f"ids, but their tokenizer names id {beyond[0][0]} ({beyond[0][1]!r}), which only the larger one "
                "has: give a draft whose vocabulary covers every token of the target's tokenizer")
    return shared
