"""Built-in tiny model pairs and the loader for a user's Hugging Face pair.

A built-in pair `tiny-<family>` is made from `fixtures/pairs/tiny-<family>.json`, nothing is
downloaded: the target is built from its config and initialised from a seeded `torch.Generator`
(never torch's global RNG); the draft is the target truncated to its first `draft_layers` layers,
its weights copied from the target and perturbed by `draft_noise` (a fraction of each tensor's own
standard deviation) so that acceptance is naturally ragged. A fixture with a `draft` config builds
the draft in another family (same vocabulary, e.g. a Mistral draft with a sliding window and more
key/value heads for a Llama target) and copies the target's weights where they fit, key/value heads
repeated where the draft has more (`_as_draft_weight`). Both speak bytes: token ids 0..255 are
UTF-8 bytes, then `<pad>`, `<bos>`, `<eos>`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specaudit.engines.limits import eos_ids
from specaudit.engines.models.float64 import prepare_float64
from specaudit.engines.models.float64_recurrent import prepare_half_convolutions
from specaudit.engines.ops.layout import check_supported, layout_info
from specaudit.engines.models.model_files import check_model_folder, check_same_vocabulary, has_tokenizer_files
from specaudit.engines.models.pair import DTYPES, ByteTokenizer, ModelPair, prepare_model

# the package data of `specaudit.fixtures` (the repository's `fixtures/`), wherever it is installed
FIXTURES = resources.files("specaudit.fixtures")
PAIR_DIR = FIXTURES / "pairs"

def builtin_pair_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in PAIR_DIR.iterdir()
                  if p.name.startswith("tiny-") and p.name.endswith(".json"))


def _layer_key(model_type: str) -> str:
    return "n_layer" if model_type == "gpt2" else "num_hidden_layers"


def _config(spec: dict[str, Any], layers: int, role: str = "target"):
    kwargs = dict(spec[role])
    model_type = kwargs.pop("model_type")
    tok = ByteTokenizer
    kwargs[_layer_key(model_type)] = layers
    kwargs.update(
        vocab_size=tok.vocab_size,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return AutoConfig.for_model(model_type, **kwargs)


def _seeded_init(model: PreTrainedModel, std: float, seed: int) -> None:
    """Every matrix (and stack of expert matrices) ~ N(0, std^2), every vector left at its default
    (norm weights 1, biases 0), except the state-space decays `A_log`, which transformers draws from
    torch's global RNG for gated delta-net: log A ~ log U(1, 16) from the same generator."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * std)
            elif name.endswith("A_log"):
                param.copy_((1 + 15 * torch.rand(param.shape, generator=gen, dtype=torch.float64)).log())


def build_builtin_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel, dict[str, Any]]:
    """Build the float64 CPU target and draft of a built-in pair from its fixture."""
    path = PAIR_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown pair {name!r}; built-in pairs: {', '.join(builtin_pair_names())}")
    return build_pair(json.loads(path.read_text()))


def build_pair(spec: dict[str, Any]) -> tuple[PreTrainedModel, PreTrainedModel, dict[str, Any]]:
    """Build the float64 CPU target and draft that a pair spec (the fixture format: `target`
    config, `target_layers`, `draft_layers`, `draft_noise`, `init_std`, `seed`, optional `draft`
    config) describes."""
    target = AutoModelForCausalLM.from_config(_config(spec, spec["target_layers"]), dtype=torch.float64)
    _seeded_init(target, spec["init_std"], spec["seed"])
    draft_role = "draft" if "draft" in spec else "target"  # "draft": another family (same vocabulary)
    draft = AutoModelForCausalLM.from_config(_config(spec, spec["draft_layers"], draft_role), dtype=torch.float64)
    target_state = target.state_dict()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for key, param in sorted(draft.state_dict().items()):
            source = _as_draft_weight(key, target_state.get(key), param.shape, target.config)
            noise = torch.randn(source.shape, generator=gen, dtype=torch.float64)
            scale = source.std() if source.numel() > 1 else source.abs()
            param.copy_(source + spec["draft_noise"] * scale * noise)
    return target, draft, spec


def _as_draft_weight(key: str, source: torch.Tensor | None, shape: torch.Size, target_config) -> torch.Tensor:
    """The target weight a draft weight copies: the same tensor, or for a draft with more key/value
    heads (grouped-query attention expanded), the target's key/value heads repeated, which computes
    the same attention."""
    if source is None:
        raise ValueError(f"the draft's weight {key} has no counterpart in the target")
    if source.shape == shape:
        return source
    kv_heads = getattr(target_config, "num_key_value_heads", None)
    if (key.endswith(("k_proj.weight", "v_proj.weight")) and kv_heads and source.dim() == 2
            and shape[1] == source.shape[1] and shape[0] % source.shape[0] == 0):
        repeats = shape[0] // source.shape[0]
        heads = source.view(kv_heads, source.shape[0] // kv_heads, source.shape[1])  # [Hkv, D, hidden]
        return heads.repeat_interleave(repeats, dim=0).reshape(shape)
    raise ValueError(f"the draft's weight {key} {tuple(shape)} cannot copy the target's {tuple(source.shape)}")


def float64_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A float64 copy of `model` that computes in float64 throughout (the oracle of a pair loaded
    below float64 when no float64 load of its weights is at hand: exact arithmetic on its weights)."""
    import copy

    twin = prepare_model(copy.deepcopy(model), torch.float64, str(model.device))
    prepare_float64(twin)
    return twin


def _architecture_info(target: PreTrainedModel, draft: PreTrainedModel, dtype: torch.dtype) -> dict[str, Any]:
    """Refuse what the batched engines cannot run (`UnsupportedModel`, one line); in float64 make
    both models compute in float64 throughout (`engines/models/float64.py`); say what the engines see."""
    if draft is not None:  # a target alone serves only the reference decoder, which runs any model
        check_supported(target, "target")
        check_supported(draft, "draft")
    notes = {}
    if dtype == torch.float64:
        for role, model in (("target", target), ("draft", draft)):
            switched = prepare_float64(model) if model is not None else None
            if switched:
                notes[role] = switched
    else:  # bfloat16/float16 on the CPU: torch's depthwise conv1d costs ~200 ms a call there
        for role, model in (("target", target), ("draft", draft)):
            switched = prepare_half_convolutions(model) if model is not None else None
            if switched:
                notes[role] = switched
    info: dict[str, Any] = {"target_layout": layout_info(target), "draft_layout": layout_info(draft) if draft is not None else None}
    if notes:
        info["float64_switches" if dtype == torch.float64 else "cpu_switches"] = notes
    return info


def load_pair(
    name: str | None = None,
    *,
    target_path: str | None = None,
    draft_path: str | None = None,
    dtype: str | torch.dtype = "float64",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle_weights: bool = False,
) -> ModelPair:
    """Load a built-in pair by name, or a user's pair from two local Hugging Face folders
    (`model_files.check_model_folder` first: safetensors only unless `allow_pickle_weights`, no
    custom code unless `trust_remote_code`; `ModelFolderError`, a ValueError, otherwise)."""
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if name is not None:
        target, draft, spec = build_builtin_pair(name)
        tok = ByteTokenizer()
        pair_target, pair_draft = prepare_model(target, torch_dtype, device), prepare_model(draft, torch_dtype, device)
        return ModelPair(
            name=name,
            target=pair_target,
            draft=pair_draft,
            tokenizer=tok,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            info={"family": spec["target"]["model_type"], "seed": spec["seed"],
                  **({"draft_family": spec["draft"]["model_type"]} if "draft" in spec else {}),
                  **_architecture_info(pair_target, pair_draft, torch_dtype),
                  **_device_map_info(device, pair_target, pair_draft)},
        )
    if not target_path:
        raise ValueError("give a built-in pair name, or a target path (and a draft path for engines that draft)")
    models = []
    # a target alone (no draft_path) is enough for black-box engines: recordings and live servers
    for role, path in (("target", target_path), ("draft", draft_path)) if draft_path else (("target", target_path),):
        safetensors = check_model_folder(path, role, allow_pickle_weights=allow_pickle_weights,
                                         trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, use_safetensors=safetensors, trust_remote_code=trust_remote_code,
            local_files_only=True, **({"device_map": "auto"} if device == "auto" else {}),
        )
        models.append(prepare_model(model, torch_dtype, device))
    target, draft = models if len(models) == 2 else (models[0], None)
    if draft is not None and target.config.vocab_size != draft.config.vocab_size:
        # a padded vocabulary: allowed when the tokenizers agree on the shared ids (compared over that range)
        check_same_vocabulary(target_path, draft_path, trust_remote_code=trust_remote_code)
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        if has_tokenizer_files(target_path):
            tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    except Exception:  # a pair without a tokenizer is still auditable on token ids
        tokenizer = None
    eos = declared_eos(target)
    pad = target.config.pad_token_id
    if pad is None:  # no pad id declared: the (first) EOS id pads, as transformers' generate does
        pad = eos_ids(eos)[0] if eos_ids(eos) else 0
    return ModelPair(
        name=f"{Path(target_path).name}+{Path(draft_path).name}" if draft_path else Path(target_path).name,
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        eos_token_id=eos,
        pad_token_id=int(pad),
        info={"target_path": str(target_path), "draft_path": str(draft_path),
              **({"vocab_sizes": {"target": target.config.vocab_size, "draft": draft.config.vocab_size,
                                  "shared": min(target.config.vocab_size, draft.config.vocab_size)}}
                 if draft is not None and target.config.vocab_size != draft.config.vocab_size else {}),
              **_architecture_info(target, draft, torch_dtype), **_device_map_info(device, target, draft)},
    )


def _device_map_info(device: str, target: Any, draft: Any) -> dict[str, Any]:
    """`--device auto`: where accelerate placed each model's modules ({module: device}), for the run record."""
    if device != "auto":
        return {}
    return {"device_map": {role: {name: str(where) for name, where in (getattr(model, "hf_device_map", None) or {}).items()}
                           for role, model in (("target", target), ("draft", draft)) if model is not None}}


def declared_eos(model: PreTrainedModel) -> int | tuple[int, ...] | None:
    """The EOS ids a model's generation config declares: one id as an int, several as a tuple, every one
    kept (Llama 3, Qwen and Gemma declare a list: stopping at any of them ends a row)."""
    generation = getattr(model, "generation_config", None)
    ids = eos_ids(getattr(generation, "eos_token_id", None) if generation is not None else None)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


# the built-in pair with two EOS ids (`two_eos_pair`): tiny-llama's `<eos>` and byte 157, at which its
# reference stops within 32 new tokens on 23 of the 32 built-in prompts (at once on prompt 6)
TWO_EOS_BASE = "tiny-llama"
TWO_EOS_IDS = (ByteTokenizer.eos_token_id, 157)


def two_eos_pair(dtype: str | torch.dtype = "float64", device: str = "cpu") -> ModelPair:
    """tiny-llama whose target (and draft) declare two EOS ids, `TWO_EOS_IDS`, in their generation
    configs, as Llama 3, Qwen and Gemma do: the set-up for auditing EOS sets. The second id is an ordinary
    byte the target emits often, so the reference stops at it on several built-in prompts."""
    pair = load_pair(TWO_EOS_BASE, dtype=dtype, device=device)
    for model in (pair.target, pair.draft):
        model.generation_config.eos_token_id = list(TWO_EOS_IDS)
    pair.name = f"{TWO_EOS_BASE}-eos2"
    pair.eos_token_id = declared_eos(pair.target)
    pair.info["eos_token_ids"] = list(TWO_EOS_IDS)
    return pair


def builtin_prompt_texts() -> list[str]:
    lines = (FIXTURES / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def builtin_prompts(tokenizer: ByteTokenizer | None = None) -> list[list[int]]:
    """The built-in prompt set as token ids (bytes)."""
    tok = tokenizer or ByteTokenizer()
    return [tok.encode(text) for text in builtin_prompt_texts()]


@torch.no_grad()
def measure_acceptance(pair: ModelPair, prompts: list[list[int]], max_new_tokens: int = 32) -> float:
    """Per-token acceptance: how often the draft's greedy choice equals the target's, along the
    target's own greedy continuation of each prompt (teacher forcing, batch size 1)."""
    from specaudit.engines.reference import greedy_decode

    agree = total = 0
    for prompt in prompts:
        continuation, target_logits = greedy_decode(pair.target, prompt, max_new_tokens, None, record_logits=True)
        ids = torch.tensor([prompt + continuation[:-1]], device=pair.draft.device)
        draft_logits = pair.draft(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 :]
        agree += int((draft_logits.argmax(-1) == target_logits.argmax(-1)).sum())
        total += len(continuation)
    return agree / total if total else float("nan")
