"""Sliding windows, mixtures of experts, attention sinks, cross-family drafts and hybrid recurrent models
(gated delta-net, short convolutions, Mamba-2; INPLACE audited on those too), as user pairs.

Each case builds a tiny target and draft from seeded configs, saves them as Hugging Face folders
(safetensors) and runs `specaudit audit --engine eqspec --engine exspec --target T --draft D
--batch-size 4 --dtype float64` on them: every prompt must be token-exact and every logit within
1e-9 of the reference (batch size 1, with the model's own cache, sliding layers included). Every
prompt plus its output is longer than the sliding window, so the window decides attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specaudit.engines.eqspec import EQSpec
from specaudit.engines.ops.layout import UnsupportedModel
from specaudit import cli

WINDOW = 6
PROMPT_LENGTHS = [3, 9, 1, 14, 6]
NEW_TOKENS = 10
COMMON = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=256, pad_token_id=256, bos_token_id=257, eos_token_id=258)

# name -> (target config, draft config); a draft config of None is the target's, perturbed
CASES: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "gemma2": (dict(model_type="gemma2", num_hidden_layers=2, sliding_window=WINDOW), None),
    "gemma3": (dict(model_type="gemma3_text", num_hidden_layers=3, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), None),
    "mistral": (dict(model_type="mistral", num_hidden_layers=2, sliding_window=WINDOW), None),
    "qwen3-moe": (dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, decoder_sparse_step=1), None),
    "gpt-oss": (dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), None),
    # hybrid recurrent models: gated delta-net with experts, short convolutions, Mamba-2
    "qwen3-next": (dict(model_type="qwen3_next", num_hidden_layers=3, num_experts=3, num_experts_per_tok=2,
                        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
                        mlp_only_layers=[], layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=3), None),
    "lfm2": (dict(model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "conv", "full_attention"],
                  conv_L_cache=4, block_auto_adjust_ff_dim=False), None),
    "bamba": (dict(model_type="bamba", num_hidden_layers=3, attn_layer_indices=[0], mamba_n_heads=2, mamba_d_head=16,
                   mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_expand=1, mamba_chunk_size=4), None),
    # a Mistral draft for a Llama target: other layer count, head count and head size, a window
    "llama-mistral": (dict(model_type="llama", num_hidden_layers=2),
                      dict(model_type="mistral", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=12, sliding_window=WINDOW)),
}


def build(config: dict[str, Any], seed: int, scale: float = 0.25) -> torch.nn.Module:
    """Every parameter seeded: matrices ~ N(0, scale^2) (embeddings N(0, 1)), norms 1 + noise."""
    kwargs = {**COMMON, **config}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs),
                                             dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # every parameter seeded (sinks and norms too)
            std = 1.0 if "embed" in name else scale if param.dim() >= 2 else 0.1
            base = 1.0 if param.dim() == 1 and "norm" in name else 0.0
            param.copy_(base + torch.randn(param.shape, generator=gen, dtype=torch.float64) * std)
    return model.eval()


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    copy = type(model)(model.config).to(torch.float64).eval()
    with torch.no_grad():
        for (_, source), (_, param) in zip(model.named_parameters(), copy.named_parameters()):
            param.copy_(source + 0.05 * source.std() * torch.randn(source.shape, generator=gen, dtype=torch.float64)
                        if source.numel() > 1 else source)
    return copy


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    gen = torch.Generator().manual_seed(7)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": torch.randint(0, 256, (n,), generator=gen).tolist()}) + "\n"
                            for n in PROMPT_LENGTHS))
    return path


def save_pair(root: Path, name: str) -> tuple[Path, Path]:
    target_config, draft_config = CASES[name]
    # a draft of another family shares no attention weights: weaker layers leave the shared
    # embeddings and output head room to agree
    scale = 0.25 if draft_config is None else 0.05
    target = build(target_config, seed=11, scale=scale)
    draft = build(draft_config, seed=12, scale=scale) if draft_config is not None else perturbed(target, seed=13)
    if draft_config is not None:  # share what the two families can share: embeddings, output head, final norm
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
            draft.model.norm.weight.copy_(target.model.norm.weight)
    paths = root / f"{name}-target", root / f"{name}-draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path)  # safetensors
    return paths


HYBRID = ("qwen3-next", "lfm2", "bamba")  # recurrent layers: INPLACE audited too


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_pair_is_exact_in_float64(name: str, tmp_path: Path, prompts_file: Path) -> None:
    target, draft = save_pair(tmp_path, name)
    out = tmp_path / "audit"
    engines = ["--engine", "eqspec", "--engine", "exspec"] + (["--engine", "inplace"] if name in HYBRID else [])
    status = cli.main(["audit", *engines, "--target", str(target),
                       "--draft", str(draft), "--batch-size", "4", "--dtype", "float64", "--prompts", str(prompts_file),
                       "--max-new-tokens", str(NEW_TOKENS), "--draft-tokens", "3", "--out", str(out)])
    audit = json.loads((out / "audit.json").read_text())
    assert status == 0, [run.get("error") for run in audit["runs"]]
    assert len(audit["runs"]) == len(engines) // 2
    for run in audit["runs"]:
        assert run["exact_matches"] == run["num_prompts"] >= len(PROMPT_LENGTHS)
        assert run["max_logit_error"] is not None and run["max_logit_error"] < 1e-9
        assert run["trace"]["acceptance_rate"] > 0, "no draft token accepted"
    window = getattr(AutoConfig.from_pretrained(target).get_text_config(), "sliding_window", None)
    if window is not None:  # the window decides attention: the longest prompt plus its output exceeds it
        assert max(PROMPT_LENGTHS) + NEW_TOKENS > window
    if name in ("qwen3-moe", "gpt-oss"):  # the float64 oracle runs the eager experts, and the report says so
        info = audit["runs"][0]["pair_info"]
        assert any("experts: eager" in note for note in info["float64_switches"]["target"])
        assert "eager" in (out / "report.md").read_text()
    if name in HYBRID:  # recurrent layers seen as such, their float64 switches recorded
        info = audit["runs"][0]["pair_info"]
        assert info["target_layout"]["recurrent_layers"] >= 1
        assert any("recurrent layers: float64" in note for note in info["float64_switches"]["target"])


def test_the_window_changes_the_logits() -> None:
    """The sliding window of the cases is short enough to matter: without it the logits move."""
    model = build(CASES["mistral"][0], seed=11)
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        windowed = model(input_ids=ids).logits
        model.config.sliding_window = None
        full = model(input_ids=ids).logits
    assert float((windowed - full).abs().max()) > 1e-3


def unsupported_config():
    """Falcon-H1: attention and a Mamba-2 mixer in the same layer (one cache layer holding both)."""
    return AutoConfig.for_model("falcon_h1", **{**COMMON, "num_hidden_layers": 2, "mamba_d_ssm": 32,
                                                "mamba_n_heads": 2, "mamba_d_head": 16, "mamba_d_state": 8,
                                                "mamba_chunk_size": 4})


def test_unsupported_cache_layers_are_refused_in_one_line() -> None:
    config = unsupported_config()
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModel) as caught:
        EQSpec(model, model, batch_size=2)
    message = str(caught.value)
    assert "\n" not in message and "FalconH1ForCausalLM" in message


def test_unsupported_user_pair_is_a_usage_error_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = unsupported_config()
    for name in ("target", "draft"):
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
    try:
        code = cli.main(["audit", "--no-progress", "--engine", "eqspec", "--target", str(tmp_path / "target"),
                         "--draft", str(tmp_path / "draft"), "--batch-size", "2", "--num-prompts", "2",
                         "--max-new-tokens", "4", "--no-adversarial", "--out", str(tmp_path / "out")])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "FalconH1ForCausalLM" in line]
    assert len(error_lines) == 1 and "not supported" in error_lines[0]
    audit_path = tmp_path / "out" / "audit.json"
    assert not audit_path.exists() or json.loads(audit_path.read_text())["runs"] == []
