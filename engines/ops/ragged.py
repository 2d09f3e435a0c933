"""Pure tensor operations on a ragged, left-padded batch.

Layout: every row is right-aligned. A row of real length `n` in a batch of width `W` holds its
tokens (or its keys and values) in columns `W - n .. W - 1`; columns before that are padding,
filled with a placeholder (`pad_id` for tokens, zeros for keys and values) that is never read
as content. Rows are told apart from padding by their lengths alone, never by token values, so a
pad id that is also a real token is harmless.

Token and mask operations are vectorised over rows (one gather per tensor). Realigning a cache
copies one contiguous slice per row instead (`realign_columns`): a gather reads an int64 index per
value and was about 10x slower on [8, 8, 1000, 64] float32 keys on one CPU thread.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align token lists in one tensor. Returns `tokens` [B, W] and `lengths` [B]."""
    if not seqs:
        raise ValueError("left_pad needs at least one sequence")
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):  # host-side build of the initial batch, once per run
        if s:
            tokens[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return tokens.to(device), lengths.to(device)


def unpad(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Inverse of `left_pad`: the real tokens of each row, as lists."""
    width = tokens.shape[1]
    rows = tokens.tolist()
    return [row[width - n:] if n else [] for row, n in zip(rows, lengths.tolist())]


def padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, width]` bool, True on each row's real (right-aligned) columns."""
    columns = torch.arange(width, device=lengths.device)
    return columns.unsqueeze(0) >= (width - lengths).unsqueeze(1)


def realign_index(keep_end: torch.Tensor, new_lengths: torch.Tensor,
                  width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather plan that right-aligns, for each row, the `new_lengths[b]` source columns ending
    (exclusively) at `keep_end[b]`.

    Returns `source` [B, W'] (column to read, clamped to be a valid index) and `valid` [B, W']
    (False on padding), with `W' = max(new_lengths)`: the batch never keeps more padding than
    its longest row needs. `width`: that longest length where the host knows it (no device read).
    """
    if width is None:
        width = int(new_lengths.max().item()) if new_lengths.numel() else 0
    columns = torch.arange(width, device=keep_end.device).unsqueeze(0)  # [1, W']
    source = columns + (keep_end - width).unsqueeze(1)  # [B, W']
    valid = columns >= (width - new_lengths).unsqueeze(1)
    return source.clamp(min=0), valid


def append_and_repad(
    tokens: torch.Tensor,  # [B, W]
    lengths: torch.Tensor,  # [B]
    new_tokens: torch.Tensor,  # [B, K]
    new_counts: torch.Tensor,  # [B], 0..K
    pad_id: int,
    new_width: int | None = None,  # the new longest row, where the host knows it (no device read)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpad, append each row's first `new_counts[b]` new tokens, and repad to the new longest row."""
    width = tokens.shape[1]
    combined = torch.cat([tokens, new_tokens], dim=1)  # [B, W + K]
    new_lengths = lengths + new_counts
    source, valid = realign_index(width + new_counts, new_lengths, new_width)
    out = torch.gather(combined, 1, source.clamp(max=combined.shape[1] - 1))
    return torch.where(valid, out, torch.full_like(out, pad_id)), new_lengths


def position_ids(cache_lengths: torch.Tensor, query_length: int) -> torch.Tensor:
    """`[B, q]`: the index in its own row's real sequence of each of the next `q` tokens."""
    return cache_lengths.unsqueeze(1) + torch.arange(query_length, device=cache_lengths.device)


def attention_mask(cache_lengths: torch.Tensor, cache_width: int, query_length: int) -> torch.Tensor:
    """`[B, cache_width + q]` 2D mask (1 = attend) for `q` real query tokens after a right-aligned cache."""
    real_cache = padding_mask(cache_lengths, cache_width)
    queries = torch.ones(cache_lengths.shape[0], query_length, dtype=torch.bool, device=cache_lengths.device)
    return torch.cat([real_cache, queries], dim=1).long()


def gather_columns(x: torch.Tensor, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Gather along dim -2 of `x` [B, H, S, D] with a per-row plan [B, W']; padding becomes zeros."""
    b, h, _, d = x.shape
    index = source.clamp(max=x.shape[-2] - 1)[:, None, :, None].expand(b, h, source.shape[1], d)
    out = torch.gather(x, 2, index)
    return out * valid[:, None, :, None].to(out.dtype)


def cache_layers(cache) -> list:
    """The per-layer key/value holders of a transformers 5.x cache (recurrent layers, which hold
    states and no columns, are left out: `engines/ops/recurrent.py` keeps them)."""
    return [layer for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)]


def realign_columns(x: torch.Tensor, keep_end: list[int], new_lengths: list[int],
                    rows: list[int] | None = None, spare: int = 0) -> torch.Tensor:
    """`[B', H, W' + spare, D]` from `x` [B, H, S, D]: row i holds source row `rows[i]`'s `new_lengths[i]`
    columns ending (exclusively) at `keep_end[i]`, right-aligned in the first `W' = max(new_lengths)`
    columns, zeros before them; the `spare` columns after them are left unwritten. One slice copy per
    row; `x` is not modified. A plan that reaches outside `x` (only a faulty engine makes one) reads
    clamped columns, as `gather_columns` does."""
    rows = rows if rows is not None else list(range(len(keep_end)))
    width = max(new_lengths, default=0)
    out = x.new_empty(len(rows), x.shape[1], width + spare, x.shape[3])  # [B', H, W' + spare, D]
    if any(end - n < 0 or end > x.shape[-2] for end, n in zip(keep_end, new_lengths)):
        source, valid = realign_index(torch.tensor(keep_end, device=x.device), torch.tensor(new_lengths, device=x.device))
        out[:, :, :width] = gather_columns(x.index_select(0, torch.tensor(rows, device=x.device)), source, valid)
        return out
    for i, (row, end, n) in enumerate(zip(rows, keep_end, new_lengths)):
        if n:
            out[i, :, width - n:width] = x[row, :, end - n:end]
        if n < width:
            out[i, :, : width - n].zero_()
    return out


def realign_cache(cache, keep_end: torch.Tensor | list[int], new_lengths: torch.Tensor | list[int],
                  rows: torch.Tensor | list[int] | None = None, spare: int = 0, hold=None) -> None:
    """Keep, for each row, the `new_lengths[b]` cached positions ending (exclusively) at column
    `keep_end[b]`, right-aligned, padding zeroed; optionally first select the batch `rows`.

    One slice copy per row, layer and tensor (`realign_columns`), the same plan for every layer;
    modifies `cache` in place (new tensors per layer; the old ones are not written). With `spare`
    columns, `hold(layer, key_buffer, value_buffer, width)` hands each layer its new buffers
    (`layout.hold_columns`: the next pass writes into the room left instead of copying again). The plan
    is read to the host once, unless it comes as lists (an engine that keeps its lengths on the host)."""
    ends, lengths = _host_list(keep_end), _host_list(new_lengths)
    selected = _host_list(rows) if rows is not None else None
    width = max(lengths, default=0)
    for layer in cache_layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        keys = realign_columns(layer.keys, ends, lengths, selected, spare)
        values = realign_columns(layer.values, ends, lengths, selected, spare)
        if hold is not None:
            hold(layer, keys, values, width)
        else:
            layer.keys, layer.values = keys[:, :, :width], values[:, :, :width]


def _host_list(values: torch.Tensor | list[int]) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def widen_left(x: torch.Tensor, width: int, dim: int, fill: float | bool = 0) -> torch.Tensor:
    """`x` with columns of `fill` put before its own along `dim`, up to `width` columns."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([torch.full(shape, fill, dtype=x.dtype, device=x.device), x], dim=dim)


def right_aligned(blocks: list[torch.Tensor], width: int, spare: int = 0) -> torch.Tensor:
    """`[sum G_i, H, width + spare, D]` from row blocks `[G_i, H, S_i, D]` (`S_i <= width`), in order:
    each block's columns end at column `width`, zeros before them (left padding); the `spare`
    columns after `width` are left unwritten. One allocation, each block copied once."""
    first = blocks[0]
    out = first.new_empty(sum(b.shape[0] for b in blocks), first.shape[1], width + spare, first.shape[3])
    row = 0
    for block in blocks:
        rows, columns = block.shape[0], block.shape[2]
        out[row:row + rows, :, width - columns:width] = block
        if columns < width:
            out[row:row + rows, :, :width - columns].zero_()
        row += rows
    return out


def join_cache_rows(cache, other, width: int, spare: int = 0, hold=None) -> None:
    """Append `other`'s rows to `cache` (in place), both right-aligned to `width` columns, zero columns on
    the left of the narrower (exactly like left padding). `spare` and `hold` as in `realign_cache`."""
    for layer, extra in zip(cache_layers(cache), cache_layers(other)):
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        keys = right_aligned([layer.keys, extra.keys], width, spare)  # [B + B', H, W + spare, D]
        values = right_aligned([layer.values, extra.values], width, spare)
        if hold is not None:
            hold(layer, keys, values, width)
        else:
            layer.keys, layer.values = keys[:, :, :width], values[:, :, :width]


def cache_width(cache) -> int:
    """Number of columns (real and padding) held by the cache."""
    for layer in cache_layers(cache):
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel():
            return keys.shape[-2]
    return 0
