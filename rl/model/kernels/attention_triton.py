"""Triton kernels of paged decode attention, for the engine's decode steps and, with fixed-length splits,
for every token of the batch-invariant mode (engine prefill and the trainer's forward alike).

Its torch reference is `rl.model.kernels.attention.paged_attention_reference`. The kernels follow the split-KV
design: stage 1 runs one program per (sequence, kv head, split of the context), reads keys and values
through the sequence's block table, and writes a partial output with its log-sum-exp; stage 2 merges the
splits. All the query heads of a GQA group share one program, so each key/value byte is read once per
sequence. Lengths come from device memory, so the launch has a fixed shape and can live inside a CUDA graph.
With a sliding window (Gemma 3's local layers) a query sees only the last `window` keys up to itself: the loops
start at the block holding the window's first key, so what the window masks is never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl.model.kernels import attention
from rl.model.kernels.linear_triton import dot_precision


@triton.jit
def _split_range(context_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr):
    """Tokens [start, end) of a sequence's context that one split reads; splits start on block bounds.

    SPLIT_TOKENS > 0 fixes every split's length, so where a context is cut depends on its length
    alone and not on how many splits the launch has (batch-invariant mode); splits past the end
    read nothing and weigh nothing in the merge."""
    ctx = tl.load(context_lens_ptr + seq)
    if SPLIT_TOKENS > 0:
        per_split = SPLIT_TOKENS
    else:
        per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, ctx)


@triton.jit
def _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, smask, m, l, acc, scale_log2, k_scale, v_scale,
                  DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Folds one block of cached keys and values (at `offs`, rows masked by `tmask`) into the running
    max `m`, sum `l` and output `acc` of an online softmax over the query rows of `q`, in log2 units;
    `smask` (query rows, keys) says which keys each query row sees. FP8: the cache holds e4m3 keys and values,
    dequantized in float32 by their head's `k_scale`, `v_scale` and rounded to q's dtype before the products."""
    k = tl.load(k_cache_ptr + offs, mask=tmask[:, None], other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (rows, block)
    s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row that has seen no key yet (a sliding window that starts in a later block) keeps m = -inf and adds 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offs, mask=tmask[:, None], other=0.0)
    if FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _split_result(m, l, acc):
    """A split's normalised output and its log-sum-exp (log2 units; -inf for rows that saw no key)."""
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr,
                         part_lse_ptr, k_scale_ptr, v_scale_ptr, scale_log2, q_row_stride, bt_row_stride, num_splits,
                         window, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT_TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_scale, v_scale = 1.0, 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    start, end = _split_range(context_lens_ptr, seq, split, num_splits, BLOCK_N, SPLIT_TOKENS)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + h
    hmask = h < GROUP
    q = tl.load(q_ptr + seq * q_row_stride + head[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # The first key the query (at the context's end) sees: 0 without a window.
    lo = tl.where(window > 0, tl.maximum(tl.load(context_lens_ptr + seq) - window, 0), 0)
    for t0 in range(tl.maximum(start, lo // BLOCK_N * BLOCK_N), end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = (t < end) & (t >= lo)
        if PAGE % BLOCK_N == 0:  # the block lies inside one page (splits start on block bounds): one lookup
            page = tl.load(block_tables_ptr + seq * bt_row_stride + t0 // PAGE).to(tl.int64)
            first = (page * PAGE + t0 % PAGE) * NUM_KV_HEADS + kv_head
            offs = (first + tl.arange(0, BLOCK_N) * NUM_KV_HEADS)[:, None] * HEAD_DIM + d[None, :]
        else:
            page = tl.load(block_tables_ptr + seq * bt_row_stride + t // PAGE, mask=tmask, other=0).to(tl.int64)
            offs = ((page * PAGE + t % PAGE) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        m, l, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, tmask[None, :], m, l, acc, scale_log2,
                                  k_scale, v_scale, DOT_PRECISION, FP8)
    out, lse = _split_result(m, l, acc)
    part = (seq * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEADS: tl.constexpr):
    """One program per sequence and HEADS of its heads merges their splits, weighting each by its share of the
    mass. The split loops unroll (NUM_SPLITS is a constant), so every split's loads are in flight at once and
    only the float32 sums run in order: split by split, whatever the split count, as batch-invariant mode needs."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < NUM_HEADS
    rows = seq * NUM_HEADS + h
    m = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_lse_ptr + rows * NUM_SPLITS + s, mask=hmask, other=float("-inf")))
    m = tl.where(m > float("-inf"), m, 0.0)
    acc = tl.zeros([HEADS, HEAD_DIM], tl.float32)
    den = tl.zeros([HEADS], tl.float32)
    for s in tl.static_range(NUM_SPLITS):  # an empty split has lse -inf: weight 0
        w = tl.exp2(tl.load(part_lse_ptr + rows * NUM_SPLITS + s, mask=hmask, other=float("-inf")) - m)
        den += w
        part = tl.load(part_out_ptr + (rows * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
                       mask=hmask[:, None], other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def merge_heads(num_heads: int, num_splits: int) -> int:
    """Heads a merge program takes, a power of 2: few rows come with many splits and want many small programs (one
    head of 16 splits), many rows with few splits want fewer, larger ones (8 heads of 2, every head of 1).
    Graph-timed on an H200 (0.5B heads, 768-token contexts), split + merge against the former one-program-a-row
    merge: 8.8 -> 4.6 us at 8 rows, 12.0 -> 9.9 at 64, 18.2 -> 17.5 at 192, 37.6 either way at 512
    (benchmarks/RESULTS.md, "The decode step's fixed part, and prefill over cached tokens")."""
    return min(triton.next_power_of_2(num_heads), 1 << (max(1, 16 // num_splits).bit_length() - 1))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, page_size: int, scale: float, num_splits: int,
                     block_n: int = 64, num_warps: int = 4, num_stages: int = 2, split_tokens: int = 0,
                     window: int = 0, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """q (B, H, D) with unit stride over heads and dims; caches (slots, KV, D); returns (B, H * D). A sliding
    `window` > 0 lets each row see only its context's last `window` keys. `k_scale`, `v_scale` (KV,): an FP8
    cache's scales (rl/model/fp8.py).

    `split_tokens` > 0 cuts every context into splits of that many tokens (a multiple of `block_n`;
    `num_splits` must cover the longest context): each row's result then depends on its own
    context alone, whatever the batch (see `invariant_attention`)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    part_out = q.new_empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(batch, num_heads, num_splits, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        part_lse if k_scale is None else k_scale, part_lse if v_scale is None else v_scale, scale * 1.4426950408889634,
        q.stride(0), block_tables.stride(0), num_splits, window, GROUP=group, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, PAGE=page_size, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        SPLIT_TOKENS=split_tokens, DOT_PRECISION=dot_precision(q.dtype), FP8=k_scale is not None,
        num_warps=num_warps, num_stages=num_stages)
    out = q.new_empty(batch, num_heads * head_dim)
    heads = merge_heads(num_heads, num_splits)
    _decode_merge_kernel[(batch, triton.cdiv(num_heads, heads))](
        part_out, part_lse, out, NUM_SPLITS=num_splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS=heads,
        num_warps=max(1, min(4, heads // 2)))
    return out



def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, page_size: int, max_context: int, rows_per_call: int = 8192,
                        scale: float | None = None, window: int = 0) -> torch.Tensor:
    """Batch-invariant attention of query rows q (R, H, D), each over its own first context_lens
    cached tokens: the decode kernel with fixed-length splits, so a token's output is the same bits
    whether it is decoded in a batch of 256, prefilled with its prompt or recomputed by the trainer.
    Rows go `rows_per_call` at a time to bound the float32 partial outputs."""
    splits = attention.invariant_num_splits(max_context)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for r in range(0, q.shape[0], rows_per_call):
        out[r : r + rows_per_call] = decode_attention(
            q[r : r + rows_per_call], k_cache, v_cache, block_tables[r : r + rows_per_call],
            context_lens[r : r + rows_per_call], page_size, scale or q.shape[-1] ** -0.5, splits,
            split_tokens=attention.INVARIANT_SPLIT_TOKENS, window=window)
    return out


@triton.jit
def _prefill_paged_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, starts_ptr, contexts_ptr, out_ptr,
                          k_scale_ptr, v_scale_ptr, scale_log2, q_row_stride, out_row_stride, bt_row_stride, length,
                          window, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One program per BLOCK_M new tokens of a sequence and one query head: causal attention over the
    sequence's cache, read through its block table, the new tokens' own keys and values included."""
    seq = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    k_scale, v_scale = 1.0, 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + head // GROUP)
        v_scale = tl.load(v_scale_ptr + head // GROUP)
    start = tl.load(starts_ptr + seq)
    ctx = tl.load(contexts_ptr + seq)
    j = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # A pad (past the sequence's new tokens) sees the whole context: finite, and never read.
    last = tl.minimum(start + j, ctx - 1)
    rows = seq.to(tl.int64) * length + j
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * q_row_stride + head * HEAD_DIM + d[None, :], mask=(j < length)[:, None],
                other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(start + (tl.program_id(0) + 1) * BLOCK_M, ctx)  # past the block's last row's last key
    # With a window, the block's first row's first key: earlier keys are outside every row's window (pads included).
    first_last = tl.minimum(start + tl.program_id(0) * BLOCK_M, ctx - 1)  # the block's first row's last key
    first = tl.where(window > 0, tl.maximum(first_last - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    for t0 in range(first, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(block_tables_ptr + seq * bt_row_stride + t // PAGE, mask=tmask, other=0).to(tl.int64)
        offs = ((page * PAGE + t % PAGE) * NUM_KV_HEADS + head // GROUP)[:, None] * HEAD_DIM + d[None, :]
        seen = t[None, :] <= last[:, None]
        if window > 0:
            seen = seen & (t[None, :] > last[:, None] - window)
        m, l, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, seen, m, l, acc, scale_log2,
                                  k_scale, v_scale, DOT_PRECISION, FP8)
    out = acc / l[:, None]  # every row sees key 0
    tl.store(out_ptr + rows[:, None] * out_row_stride + head * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(j < length)[:, None])


def prefill_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            starts: torch.Tensor, contexts: torch.Tensor, length: int, page_size: int, scale: float,
                            block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                            window: int = 0, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a prefill whose sequences may continue from tokens already in the cache.

    q (N * length, H, D), unit stride over heads and dims: `length` right-padded new tokens a sequence, the n-th's
    first at position starts[n]; their keys and values are in the caches (slots, KV, D) already, on the pages of
    block_tables (N, P), and sequence n's context ends at contexts[n] (starts[n] + its new tokens). Each new token
    attends to its sequence's tokens up to itself (the window - 1 before it and itself, with a sliding `window`).
    Returns (N * length, H * D); a pad's row is finite and meaningless. Its torch reference is
    `rl.model.kernels.attention.paged_prefill_reference`. `k_scale`, `v_scale` (KV,): an FP8 cache's scales.

    One query head a program: a tile of all the heads of a GQA group (each key read once for them, 16 tokens x 8
    heads) was slower on an H200 (benchmarks/RESULTS.md, "The decode step's fixed part, and prefill over cached
    tokens")."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    out = q.new_empty(rows, num_heads * head_dim)
    _prefill_paged_kernel[(triton.cdiv(length, block_m), rows // length * num_heads)](
        q, k_cache, v_cache, block_tables, starts, contexts, out, out if k_scale is None else k_scale,
        out if v_scale is None else v_scale, scale * 1.4426950408889634, q.stride(0),
        out.stride(0), block_tables.stride(0), length, window, NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), FP8=k_scale is not None, num_warps=num_warps, num_stages=num_stages)
    return out
