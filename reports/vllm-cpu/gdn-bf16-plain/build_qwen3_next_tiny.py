"""Usage: python build_qwen3_next_tiny.py OUT_DIR. A tiny Qwen3-Next (gated delta-net + full attention every 4th layer, 4 experts) as an HF folder, seeded."""
import json, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # llamacpp_models
from llamacpp_models import byte_tokenizer_files
out = Path(sys.argv[1])
config = AutoConfig.for_model("qwen3_next", vocab_size=259, pad_token_id=256, bos_token_id=257, eos_token_id=258,
    hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    decoder_sparse_step=1, full_attention_interval=4, max_position_embeddings=4096, tie_word_embeddings=False)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
g = torch.Generator().manual_seed(1900)
with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
model.save_pretrained(out)
for n, t in byte_tokenizer_files().items():
    (out / n).write_text(t)
print(out, model.config.layer_types)
