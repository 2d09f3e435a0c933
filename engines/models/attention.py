"""SDPA attention that hands grouped-query heads to the kernel as they are.

transformers' SDPA attention repeats every key and value head `num_key_value_groups` times
(`repeat_kv`, a copy of the whole cache) before the kernel whenever the pass has an attention mask,
and the batched engines always pass one (left padding, holes). On the CPU that copy is most of the
pass at long contexts: measured on the bench target at batch size 8, a 5-token pass after 1000
cached tokens took 1.42 s with the copies and 1.04 s without them (one thread), with the same logits.
`sdpa_gqa_attention` calls `scaled_dot_product_attention(..., enable_gqa=True)` instead (torch >= 2.5),
whose CPU kernels index the shared key/value head of each query head. On CUDA a mask sends
`enable_gqa` to the math kernel, so `use_sdpa_gqa` keeps transformers' own path there.

A batch of ragged rows also pays attention over the longest row's columns in every row: a row of
200 tokens beside one of 1000 attends over 1000 columns, 800 of them masked. When the rows' visible
columns differ by more than `ROW_SPLIT_COLUMNS`, each row attends over its own columns only
(a view of the cache from its first to its last visible column: no copy), one kernel call per row;
masked columns have weight zero either way. The same holds for rows that end at different columns
(`layout.RowEndsLayer`: left-aligned rows).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

SDPA_GQA = "specaudit_sdpa_gqa"
ROW_SPLIT_COLUMNS = 64  # rows whose visible columns differ by more attend over their own columns


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, q, D]
    key: torch.Tensor,  # [B, Hkv, S, D]
    value: torch.Tensor,  # [B, Hkv, S, Dv]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention without repeating key/value heads; anything it does besides (soft-capping,
    position bias, paged caches) goes to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
            or query.shape[1] == key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    spans = _visible_spans(attention_mask)
    if spans is None or _spread(spans) <= ROW_SPLIT_COLUMNS:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
            enable_gqa=True)  # [B, Hq, q, Dv]
    else:
        assert attention_mask is not None
        out = query.new_empty(*query.shape[:3], value.shape[-1])  # [B, Hq, q, Dv]
        for b, (start, end) in enumerate(spans):  # each row over its own columns: views, no copy
            out[b:b + 1] = torch.nn.functional.scaled_dot_product_attention(
                query[b:b + 1], key[b:b + 1, :, start:end], value[b:b + 1, :, start:end],
                attn_mask=attention_mask[b:b + 1, :, :, start:end], dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, q, Hq, Dv]


def _visible_spans(mask: torch.Tensor | None) -> list[tuple[int, int]] | None:
    """Per row, the columns from the first to past the last that any of its queries may see (a boolean
    mask [B, 1, q, S]); None for no mask, another kind of mask, or one row."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] < 2:
        return None
    visible = mask.any(dim=2).any(dim=1).to(torch.uint8)  # [B, S]; a row sees at least its own tokens
    firsts = visible.argmax(dim=1)  # the first True
    ends = visible.shape[1] - visible.flip(1).argmax(dim=1)  # past the last True
    return list(zip(firsts.tolist(), ends.tolist()))


def _spread(spans: list[tuple[int, int]]) -> int:
    """Columns that one call over the union of the rows' spans would attend to in vain, at most, per row."""
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    return max(starts) - min(starts) + max(ends) - min(ends)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
    AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)


def use_sdpa_gqa(model: PreTrainedModel) -> bool:
    """Switch a model on the CPU that uses SDPA to `sdpa_gqa_attention`; True when switched."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 5) or model.device.type != "cpu":
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(SDPA_GQA)
    return True
