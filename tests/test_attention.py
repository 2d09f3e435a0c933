"""`engines/models/attention.py`: SDPA with grouped-query heads not repeated gives SDPA's own results."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from specaudit.engines import batch as batch_ops
from specaudit.engines.ops import ragged
from specaudit.engines.models.attention import SDPA_GQA, use_sdpa_gqa


def _gqa_model(seed: int) -> torch.nn.Module:
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def test_sdpa_gqa_gives_sdpa_logits_on_a_ragged_batch() -> None:
    plain, switched = _gqa_model(0), _gqa_model(0)
    assert use_sdpa_gqa(switched) and switched.config._attn_implementation == SDPA_GQA
    assert plain.config._attn_implementation == "sdpa"
    prompts = [[5, 9, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [100, 3, 100, 3, 100]]
    tokens, lengths = ragged.left_pad(prompts, pad_id=256)
    with torch.no_grad():
        results = []
        for model in (plain, switched):
            cache, last = batch_ops.prefill(model, tokens, lengths)
            step = batch_ops.forward(model, cache, torch.tensor([[1, 2, 3]] * 4), lengths)  # [B, 3, V], masked
            results.append((last, step))
    for mine, theirs in zip(results[1], results[0]):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-12)


def test_sdpa_gqa_is_left_off_where_it_does_not_apply() -> None:
    eager = _gqa_model(1)
    eager.set_attn_implementation("eager")
    assert not use_sdpa_gqa(eager) and eager.config._attn_implementation == "eager"


def test_rows_of_very_different_lengths_attend_over_their_own_columns() -> None:
    """Rows of 3 and 150 tokens (first visible columns far apart): one kernel call per row over its own
    columns, the same logits as SDPA over the whole masked width."""
    from specaudit.engines.models import attention

    plain, switched = _gqa_model(3), _gqa_model(3)
    use_sdpa_gqa(switched)
    prompts = [[5, 9, 13], list(range(150)), [7, 8], list(range(100, 230))]
    tokens, lengths = ragged.left_pad(prompts, pad_id=256)
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape[2])
        return original(*args, **kwargs)

    with torch.no_grad():
        results = []
        for model in (plain, switched):
            cache, _ = batch_ops.prefill(model, tokens, lengths)
            calls.clear()
            torch.nn.functional.scaled_dot_product_attention = counted
            try:
                results.append(batch_ops.forward(model, cache, torch.tensor([[1, 2]] * 4), lengths))
            finally:
                torch.nn.functional.scaled_dot_product_attention = original
    assert torch.allclose(results[1], results[0], rtol=0, atol=1e-12)
    # the switched model's pass: per layer, one call per row over its cached tokens and the 2 new ones
    assert calls == [3 + 2, 150 + 2, 2 + 2, 130 + 2] * 2
    assert attention.ROW_SPLIT_COLUMNS < 130 - 3


def test_left_aligned_rows_that_end_far_apart_attend_over_their_own_columns() -> None:
    """Rows of a row-ends cache (`layout.RowEndsLayer`) all start at column 0 and end apart: one kernel
    call per row over its own columns, the same logits as the right-aligned batch."""
    from specaudit.engines.exspec_cache import stack_cache, unstack_cache

    model = _gqa_model(4)
    use_sdpa_gqa(model)
    prompts = [[5, 9, 13], list(range(150)), [7, 8], list(range(100, 230))]
    with torch.no_grad():
        rows = []
        for prompt in prompts:
            tokens, lengths = ragged.left_pad([prompt], pad_id=256)
            cache, _ = batch_ops.prefill(model, tokens, lengths)
            rows.append(unstack_cache(cache, [0], [0], [len(prompt)])[0])
        lengths = torch.tensor([len(p) for p in prompts])
        inputs = torch.tensor([[1, 2]] * 4)
        expected = batch_ops.forward(model, stack_cache(model, rows), inputs, lengths)
        calls = []
        original = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            calls.append(args[1].shape[2])
            return original(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = counted
        try:
            got = batch_ops.forward(model, stack_cache(model, rows, row_ends=True, rows=4), inputs, lengths)
        finally:
            torch.nn.functional.scaled_dot_product_attention = original
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert calls == [3 + 2, 150 + 2, 2 + 2, 130 + 2] * 2
