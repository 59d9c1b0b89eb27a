"""Triton kernels for the native engine's GPU path (imported only when the engine runs on CUDA).

Each kernel replaces a short chain of torch ops whose launches and memory passes dominate a
decode step at a few hundred rows: residual add + RMSNorm, RoPE + KV-cache write, SiLU * up,
paged decode attention and sampling. Their torch equivalents live in rl/rollout/model.py and
rl/rollout/native.py and define the semantics; tests/test_native_gpu.py holds the two together.

Decode attention follows the split-KV design: stage 1 runs one program per (sequence, kv head,
split of the context), reads keys and values through the sequence's block table, and writes a
partial output with its log-sum-exp; stage 2 merges the splits. All the query heads of a GQA
group share one program, so each key/value byte is read once per sequence. Lengths come from
device memory, so the launch has a fixed shape and can live inside a CUDA graph.

Sampling is Gumbel-max in one pass over the logits: every program takes a slice of the vocabulary,
keeps a running log-sum-exp of logits / T and the arg-max of logits / T + Gumbel noise (Philox,
keyed by a seed held on the device and bumped after each use, so graph replays draw fresh noise),
and a tiny second kernel merges the slices into (token, logprob under the full tempered softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 engines must not silently drop to tf32


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, n_cols,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before normalising, as the HF forward does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); `residual` is updated in place."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, eps, cols,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                                  num_warps=4)
    return out, (x if residual is None else residual)


# ----------------------------------------------------------------------------- RoPE + KV cache write


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """RoPE on the two halves with every product and sum rounded to the activation dtype, as the HF
    forward computes it (q * cos + rotate_half(q) * sin in that dtype), so engine and trainer agree."""
    a = (x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)
    b = (x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)
    return a.to(DT), b.to(DT)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, row_stride,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dt: tl.constexpr = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, half)
    c = tl.load(cos_ptr + pos * half + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * half + i).to(tl.float32)[None, :]
    base = qkv_ptr + tok * row_stride

    h = tl.arange(0, BLOCK_H)[:, None]
    ptr = base + h * HEAD_DIM + i[None, :]
    mask = h < NUM_HEADS
    q1, q2 = _rotate(tl.load(ptr, mask=mask).to(tl.float32), tl.load(ptr + half, mask=mask).to(tl.float32), c, s, dt)
    tl.store(ptr, q1, mask=mask)
    tl.store(ptr + half, q2, mask=mask)

    kh = tl.arange(0, BLOCK_KV)[:, None]
    mask = kh < NUM_KV_HEADS
    ptr = base + NUM_HEADS * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    k1, k2 = _rotate(tl.load(ptr, mask=mask).to(tl.float32), tl.load(ptr + half, mask=mask).to(tl.float32), c, s, dt)
    tl.store(ptr, k1, mask=mask)
    tl.store(ptr + half, k2, mask=mask)
    cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kh * HEAD_DIM + i[None, :]
    tl.store(k_cache_ptr + cache, k1, mask=mask)
    tl.store(k_cache_ptr + cache + half, k2, mask=mask)
    v_ptr = base + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    tl.store(v_cache_ptr + cache, tl.load(v_ptr, mask=mask), mask=mask)
    tl.store(v_cache_ptr + cache + half, tl.load(v_ptr + half, mask=mask), mask=mask)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> None:
    """Rotates q and k inside `qkv` (T, (H + 2 KV) * D) in place and writes k, v to their cache slots."""
    _rope_store_kernel[(qkv.shape[0],)](qkv, cos, sin, positions, slots, k_cache, v_cache, qkv.stride(0),
                                        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                        BLOCK_H=triton.next_power_of_2(num_heads),
                                        BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=2)


# ----------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, BLOCK=block, num_warps=4)
    return out


# ----------------------------------------------------------------------------- paged decode attention


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, start, end, scale_log2,
            ROWS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of q (ROWS, D) over cached tokens [start, end) of one block table, one kv head.

    Returns (running max, sum, unnormalised output) with the max in log2 units."""
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(table_ptr + t // PAGE, mask=tmask, other=0).to(tl.int64)
        offs = ((page * PAGE + t % PAGE) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=tmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (ROWS, BLOCK_N)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offs, mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, part, mask, m, l, acc, HEAD_DIM: tl.constexpr):
    """Writes a normalised partial output and its log2-sum-exp (-inf where nothing was attended)."""
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    d = tl.arange(0, HEAD_DIM)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=mask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=mask)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, shared_lens_ptr,
                         part_out_ptr, part_lse_ptr, scale_log2, q_row_stride, bt_row_stride, num_splits,
                         GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """One (sequence, kv head, split) over the sequence's tokens [shared_len, context_len)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    lo = tl.load(shared_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)
    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    hmask = h < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_row_stride + head[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
    m, l, acc = _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * bt_row_stride, kv_head, start, end,
                        scale_log2, BLOCK_H, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, DOT_PRECISION)
    part = (seq * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
    _store_partial(part_out_ptr, part_lse_ptr, part, hmask, m, l, acc, HEAD_DIM)


@triton.jit
def _prefix_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, group_first_ptr, group_size_ptr,
                         group_len_ptr, part_out_ptr, part_lse_ptr, scale_log2, q_row_stride, bt_row_stride,
                         num_splits, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """One (group, kv head, split) over a shared prompt prefix: the query heads of every member
    sequence are stacked into one tile, so the prefix's keys and values are read once per group."""
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    size = tl.load(group_size_ptr + g)
    first = tl.load(group_first_ptr + g).to(tl.int64)
    length = tl.where(size > 0, tl.load(group_len_ptr + g), 0)  # unused group slots attend to nothing
    per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    r = tl.arange(0, BLOCK_M)
    member = r // GROUP
    head = kv_head * GROUP + r % GROUP
    rmask = member < size
    seq = first + member
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq[:, None] * q_row_stride + head[:, None] * HEAD_DIM + d[None, :], mask=rmask[:, None],
                other=0.0)
    m, l, acc = _attend(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + first * bt_row_stride, kv_head, start, end,
                        scale_log2, BLOCK_M, NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, DOT_PRECISION)
    part = (seq * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
    _store_partial(part_out_ptr, part_lse_ptr, part, rmask, m, l, acc, HEAD_DIM)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, prefix_out_ptr, prefix_lse_ptr, shared_lens_ptr, out_ptr,
                         num_splits, prefix_splits, num_heads, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    """Combines a (sequence, head)'s partials, from the prefix pass too when it has a shared prefix."""
    row = tl.program_id(0).to(tl.int64)  # (sequence, head) flattened
    has_prefix = tl.load(shared_lens_ptr + row // num_heads) > 0
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=smask, other=float("-inf"))
    parts = tl.load(part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None],
                    other=0.0)
    p = tl.arange(0, BLOCK_P)
    pmask = (p < prefix_splits) & has_prefix
    lse_p = tl.load(prefix_lse_ptr + row * prefix_splits + p, mask=pmask, other=float("-inf"))
    parts_p = tl.load(prefix_out_ptr + (row * prefix_splits + p)[:, None] * HEAD_DIM + d[None, :],
                      mask=pmask[:, None], other=0.0)
    top = tl.maximum(tl.max(lse, axis=0), tl.max(lse_p, axis=0))
    w = tl.exp2(lse - top)
    w_p = tl.exp2(lse_p - top)
    out = (tl.sum(parts * w[:, None], axis=0) + tl.sum(parts_p * w_p[:, None], axis=0))
    out = out / (tl.sum(w, axis=0) + tl.sum(w_p, axis=0))
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


PREFIX_SPLITS = 4  # splits of a shared prompt prefix: its groups are few, so each is cut for parallelism
PREFIX_ROWS = 64  # query rows per prefix tile: members x heads per kv head


def max_group_members(num_heads: int, num_kv_heads: int) -> int:
    """How many sequences one prefix tile holds (their query heads of one kv head stacked)."""
    return PREFIX_ROWS // (num_heads // num_kv_heads)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, page_size: int, scale: float, num_splits: int,
                     groups: tuple[torch.Tensor, ...] | None = None,
                     block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q (B, H, D) with unit stride over heads and dims; caches (slots, KV, D); returns (B, H * D).

    `groups` = (shared_lens (B,), group_first (G,), group_size (G,), group_len (G,)), all int32:
    sequences group_first .. + group_size share their first group_len tokens (the same pages), and
    shared_lens says per sequence how many leading tokens its group covers (0: none). Without it,
    every sequence reads its whole context.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    common = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page_size, BLOCK_N=block_n,
                  DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
    scale_log2 = scale * 1.4426950408889634
    if groups is None:
        shared_lens = torch.zeros(batch, dtype=torch.int32, device=q.device)
    else:
        shared_lens, group_first, group_size, group_len = groups
    part_out = q.new_empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(batch, num_heads, num_splits, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, shared_lens, part_out, part_lse, scale_log2, q.stride(0),
        block_tables.stride(0), num_splits, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), **common)
    prefix_splits = PREFIX_SPLITS if groups is not None else 1
    prefix_out = q.new_empty(batch, num_heads, prefix_splits, head_dim, dtype=torch.float32)
    prefix_lse = q.new_empty(batch, num_heads, prefix_splits, dtype=torch.float32)
    if groups is not None:
        _prefix_split_kernel[(group_first.shape[0], num_kv_heads, prefix_splits)](
            q, k_cache, v_cache, block_tables, group_first, group_size, group_len, prefix_out, prefix_lse, scale_log2,
            q.stride(0), block_tables.stride(0), prefix_splits, GROUP=group, BLOCK_M=PREFIX_ROWS, **common)
    out = q.new_empty(batch, num_heads * head_dim)
    _decode_merge_kernel[(batch * num_heads,)](
        part_out, part_lse, prefix_out, prefix_lse, shared_lens, out, num_splits, prefix_splits, num_heads,
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_P=max(2, triton.next_power_of_2(prefix_splits)), num_warps=1)
    return out


# ----------------------------------------------------------------------------- sampling

SAMPLE_SPLITS = 16  # vocabulary slices per row: enough programs to fill the GPU at small batches


@triton.jit
def _sample_update(x, u, cols, mask, run_max, run_sum, best, best_idx):
    """Folds one block of tempered logits into the running log-sum-exp and Gumbel arg-max."""
    new_max = tl.maximum(run_max, x)
    run_sum = tl.where(new_max > float("-inf"), run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max), 0.0)
    score = tl.where(mask, x - tl.log(-tl.log(u)), float("-inf"))
    take = score > best
    return new_max, run_sum, tl.where(take, score, best), tl.where(take, cols, best_idx)


@triton.jit
def _sample_split_kernel(logits_ptr, inv_temp_ptr, seed_ptr, part_ptr, vocab, row_stride, chunk,
                         SPLITS: tl.constexpr, SUB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr)
    seed = tl.load(seed_ptr)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    run_max = tl.full([SUB], float("-inf"), tl.float32)
    run_sum = tl.zeros([SUB], tl.float32)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_idx = tl.zeros([SUB], tl.int32)
    base = logits_ptr + row * row_stride
    for off in range(start, end, 4 * SUB):
        # One Philox call yields four uniforms: one per quarter of this block of 4 * SUB logits.
        u0, u1, u2, u3 = tl.rand4x(seed, (row * vocab + off + tl.arange(0, SUB)).to(tl.int32))
        c = off + tl.arange(0, SUB)
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * inv_temp
        run_max, run_sum, best, best_idx = _sample_update(x, u0, c, c < end, run_max, run_sum, best, best_idx)
        c += SUB
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * inv_temp
        run_max, run_sum, best, best_idx = _sample_update(x, u1, c, c < end, run_max, run_sum, best, best_idx)
        c += SUB
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * inv_temp
        run_max, run_sum, best, best_idx = _sample_update(x, u2, c, c < end, run_max, run_sum, best, best_idx)
        c += SUB
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * inv_temp
        run_max, run_sum, best, best_idx = _sample_update(x, u3, c, c < end, run_max, run_sum, best, best_idx)
    # Reduce the per-lane state to this split's (max, sum, best score, best index).
    m = tl.max(run_max, axis=0)
    total = tl.sum(tl.where(run_max > float("-inf"), run_sum * tl.exp(run_max - m), 0.0), axis=0)
    b = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == b, best_idx, 2147483647), axis=0)
    out = part_ptr + (row * SPLITS + split) * 4
    tl.store(out, m)
    tl.store(out + 1, total)
    tl.store(out + 2, b)
    tl.store(out + 3, idx.to(tl.float32))  # exact: vocabularies stay below 2**24


@triton.jit
def _sample_merge_kernel(logits_ptr, inv_temp_ptr, part_ptr, tokens_ptr, logprobs_ptr, row_stride,
                         SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    base = part_ptr + (row * SPLITS + s) * 4
    m = tl.load(base)
    total = tl.load(base + 1)
    score = tl.load(base + 2)
    idx = tl.load(base + 3)
    gm = tl.max(m, axis=0)
    lse = gm + tl.log(tl.sum(tl.where(m > float("-inf"), total * tl.exp(m - gm), 0.0), axis=0))
    best = tl.max(score, axis=0)
    token = tl.min(tl.where(score == best, idx, 3.0e38), axis=0).to(tl.int64)
    x = tl.load(logits_ptr + row * row_stride + token).to(tl.float32) * tl.load(inv_temp_ptr)
    tl.store(tokens_ptr + row, token)
    tl.store(logprobs_ptr + row, x - lse)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V) from softmax(logits * inv_temperature), and its logprob.

    `inv_temperature` (1,) float32 and `seed` (1,) int64 live on the device; the seed is bumped
    in place so the next call (or graph replay) draws new noise.
    """
    rows, vocab = logits.shape
    sub = 256
    chunk = triton.cdiv(triton.cdiv(vocab, SAMPLE_SPLITS), 4 * sub) * 4 * sub
    parts = logits.new_empty(rows, SAMPLE_SPLITS, 4, dtype=torch.float32)
    _sample_split_kernel[(rows, SAMPLE_SPLITS)](logits, inv_temperature, seed, parts, vocab, logits.stride(0), chunk,
                                                SPLITS=SAMPLE_SPLITS, SUB=sub, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_merge_kernel[(rows,)](logits, inv_temperature, parts, tokens, logprobs, logits.stride(0),
                                  SPLITS=SAMPLE_SPLITS, num_warps=1)
    seed.add_(1)
    return tokens, logprobs
