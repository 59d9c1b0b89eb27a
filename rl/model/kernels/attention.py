"""Paged decode and prefill attention in torch, the references of rl/model/kernels/attention_triton.py, and the fixed
split length of batch-invariant mode.

In batch-invariant mode every context is cut into attention splits of `INVARIANT_SPLIT_TOKENS` tokens
wherever its tokens sit in a batch (engine prefill, engine decode, the trainer's forward), so a token's
attention output does not depend on the rest of the batch. Read at call time: tests shorten the splits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INVARIANT_SPLIT_TOKENS = 512
INVARIANT_PAGE = 64  # the trainer's page size for its one-sequence-per-row "cache"


def invariant_num_splits(max_context: int) -> int:
    return -(-max_context // INVARIANT_SPLIT_TOKENS)


def cached_slots(block_tables: torch.Tensor, lengths: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots of each sequence's first lengths[n] tokens, (N, longest), and which of them it holds: past a
    sequence's end a position reads slot 0 (the zeroed scratch page), never uninitialised memory."""
    t = torch.arange(int(lengths.max()), device=block_tables.device)
    held = t[None, :] < lengths[:, None].long()
    return torch.where(held, block_tables[:, t // page_size].long() * page_size + t % page_size, 0), held


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                     enable_gqa: bool = False) -> torch.Tensor:
    """SDPA of q, k, v (B, H, T, D), each token over itself and the tokens before it (only the window - 1 before
    it with a sliding `window`)."""
    if not window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    i = torch.arange(q.shape[2], device=q.device)
    seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale, enable_gqa=enable_gqa)


def cached(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The keys or values of `slots` from a cache (slots, KV, D): an FP8 cache's dequantized to `dtype` by its
    heads' `scale` (KV,) (rl/model/fp8.py), a cache in the engine dtype's as they are."""
    x = cache[slots]
    return x if scale is None else (x.float() * scale[:, None]).to(dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                              scale: float | None = None, window: int = 0, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention in plain torch: q (B, H, D) over each sequence's first context_lens cached tokens (its
    last `window` of them with a sliding window), scaled by `scale` (head_dim ** -0.5 by default). `k_scale`,
    `v_scale` (KV,): an FP8 cache's scales."""
    batch, heads, dim = q.shape
    slots, valid = cached_slots(block_tables, context_lens, page_size)  # (B, T)
    group = heads // k_cache.shape[1]
    k = cached(k_cache, slots, k_scale, q.dtype).repeat_interleave(group, dim=2).transpose(1, 2)  # (B, H, T, D)
    v = cached(v_cache, slots, v_scale, q.dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    if window:
        t = torch.arange(valid.shape[1], device=q.device)
        valid = valid & (t[None, :] >= context_lens[:, None].long() - window)
    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale or dim ** -0.5)
    return out.reshape(batch, heads * dim)


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            starts: torch.Tensor, contexts: torch.Tensor, length: int, page_size: int,
                            scale: float | None = None, window: int = 0, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention in plain torch over sequences that continue from cached tokens: q (N * length, H, D) of
    right-padded new tokens, the n-th sequence's first at position starts[n], its context ending at contexts[n];
    every key and value, the new tokens' too, is read from the cache; with a sliding `window` a token sees itself
    and the window - 1 before it; `k_scale`, `v_scale` (KV,): an FP8 cache's scales. Returns (N * length, H * D)."""
    rows, heads, dim = q.shape
    n = rows // length
    offsets = torch.arange(length, device=q.device)
    new = offsets[None, :] < (contexts - starts)[:, None]
    positions = torch.where(new, starts[:, None] + offsets, offsets)  # a pad sits at its offset
    slots, held = cached_slots(block_tables, contexts, page_size)  # (N, W)
    t = torch.arange(slots.shape[1], device=q.device)
    seen = t[None, None, :] <= positions[:, :, None]
    if window:
        seen = seen & (t[None, None, :] > positions[:, :, None] - window)
    mask = (seen & held[:, None, :])[:, None]  # (N, 1, L, W)
    group = heads // k_cache.shape[1]
    k, v = (cached(cache, slots, sc, q.dtype).transpose(1, 2).repeat_interleave(group, dim=1)
            for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
    out = F.scaled_dot_product_attention(q.view(n, length, heads, dim).transpose(1, 2), k, v, attn_mask=mask,
                                         scale=scale or dim ** -0.5)
    return out.transpose(1, 2).reshape(rows, heads * dim)
