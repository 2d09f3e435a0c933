"""The oracle itself: greedy decoding with a KV cache equals transformers' own greedy generate."""

from __future__ import annotations

import pytest
import torch

from specaudit.engines.reference import ReferenceDecoder, greedy_decode
from specaudit.testing.models import pair, prompts

PROMPT_SUBSET = [0, 3, 12, 20]  # lengths 1, 4, ~90, ~180 bytes


@torch.no_grad()
def test_reference_equals_hf_generate(pair_name: str) -> None:
    p = pair(pair_name)
    for i in PROMPT_SUBSET:
        prompt = list(prompts()[i])
        ids = torch.tensor([prompt])
        expected = p.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
            eos_token_id=None, pad_token_id=p.pad_token_id,
        )[0, len(prompt):].tolist()
        tokens, _ = greedy_decode(p.target, prompt, 16, None)
        assert tokens == expected, f"prompt {i}"


def test_reference_stops_after_first_eos_and_keeps_it() -> None:
    p = pair("tiny-llama")
    prompt = list(prompts()[5])
    full, _ = greedy_decode(p.target, prompt, 16, None)
    eos = full[6]
    first = full.index(eos)
    tokens, logits = greedy_decode(p.target, prompt, 16, eos, record_logits=True)
    assert tokens == full[: first + 1]
    assert logits is not None and logits.shape[0] == len(tokens)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 5])
def test_reference_stops_at_exactly_max_new_tokens(max_new_tokens: int) -> None:
    p = pair("tiny-gpt2")
    out = ReferenceDecoder(p.target).generate([list(prompts()[1]), list(prompts()[0])], max_new_tokens, None)
    assert [len(o) for o in out] == [max_new_tokens, max_new_tokens]


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_reference_keeps_the_state_of_pure_state_space_models(family: str) -> None:
    """Mamba and Mamba-2 take their state as `cache_params`: the reference must hand it there."""
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    if family == "mamba":
        model = MambaForCausalLM(MambaConfig(vocab_size=259, hidden_size=64, num_hidden_layers=2, state_size=8))
    else:
        model = Mamba2ForCausalLM(Mamba2Config(vocab_size=259, hidden_size=64, num_hidden_layers=2, state_size=8,
                                               num_heads=8, head_dim=16, n_groups=1, expand=2))
    model = model.double().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    prompt = [5, 6, 7, 8, 9, 44, 12]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_decode(model, prompt, 8, None)[0] == expected
