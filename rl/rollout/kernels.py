"""Triton kernels for the native engine's GPU path, and for the batch-invariant mode of the engine
and the trainer's forward (`rl/invariant.py`). Imported on first use: by the engine on CUDA or in
batch-invariant mode, by the patched trainer forward, and by the tests, which on a machine without
a GPU run them through Triton's interpreter (chosen when the kernels are decorated, at import).

Each kernel replaces a short chain of torch ops whose launches and memory passes dominate a
decode step at a few hundred rows: residual add + RMSNorm, RoPE + KV-cache write, SiLU * up,
paged decode attention, sampling, and the step's bookkeeping (record the token, apply the stop
rules, advance each row). Their torch equivalents live in rl/rollout/model.py and
rl/rollout/native.py and define the semantics; tests/test_native_gpu.py holds the two together.

Decode attention follows the split-KV design: stage 1 runs one program per (sequence, kv head,
split of the context), reads keys and values through the sequence's block table, and writes a
partial output with its log-sum-exp; stage 2 merges the splits. All the query heads of a GQA
group share one program, so each key/value byte is read once per sequence. Lengths come from
device memory, so the launch has a fixed shape and can live inside a CUDA graph.

Sampling is exact inverse-CDF: every program takes a slice of the vocabulary and writes its max and
sum of exponentials (one exp2 per logit); a second kernel per row draws one uniform (Philox, keyed
by a seed held on the device and bumped after each use, so graph replays draw fresh numbers), finds
the slice the draw lands in from the slice masses, and walks that slice's prefix sums to the token.
Its logprob is under the full tempered softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 engines must not silently drop to tf32


# ----------------------------------------------------------------------------- batch-invariant GEMM

# One tile configuration for every shape: a row's result then depends on that row and the weight
# alone (the K loop runs in the same order over the same blocks whatever M and N are), never on how
# many rows share the call. cuBLAS picks kernels, tile shapes and split-K by problem size, so the
# same token rounds differently in a 256-row decode step and a 16k-token training forward.
LINEAR_BLOCK_M, LINEAR_BLOCK_N, LINEAR_BLOCK_K, LINEAR_GROUP_M = 64, 64, 64, 8


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_row_stride, w_row_stride, out_row_stride,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)  # GROUP_M row tiles walk the columns together (weight reuse in L2)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * x_row_stride + (k0 + rk)[None, :], mask=(rm < M)[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * w_row_stride + (k0 + rk)[None, :], mask=(rn < N)[:, None] & kmask[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * out_row_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias, accumulated in float32 and rounded once; batch-invariant."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = x.new_empty(m, n)
    grid = (triton.cdiv(m, LINEAR_BLOCK_M) * triton.cdiv(n, LINEAR_BLOCK_N),)
    _linear_kernel[grid](x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=LINEAR_BLOCK_M, BLOCK_N=LINEAR_BLOCK_N,
                         BLOCK_K=LINEAR_BLOCK_K, GROUP_M=LINEAR_GROUP_M, DOT_PRECISION=_dot_precision(x.dtype),
                         num_warps=4, num_stages=4)
    return out


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _load_gemm_result(ptr, part_stride, bias_ptr, col, mask, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      DT: tl.constexpr):
    """Columns `col` of one row of a GEMM's result, in float32: its value, or the sum in order of its
    float32 split-K partial sums (`linear_split_k`) plus the bias, rounded once to DT as the GEMM's
    epilogue would round it."""
    x = tl.load(ptr + col, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:
        for p in tl.static_range(1, PARTS):
            x += tl.load(ptr + p * part_stride + col, mask=mask, other=0.0)
        if HAS_BIAS:
            x += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
        x = x.to(DT).to(tl.float32)
    return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, n_cols, part_stride,
                         HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_gemm_result(x_ptr + row * n_cols, part_stride, x_ptr, cols, mask, PARTS, False, out_ptr.dtype.element_ty)
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
    """(rms_norm(x + residual) * weight, x + residual); `residual` is updated in place.

    `x` may also be (parts, rows, cols) float32 partial sums of a GEMM split over its inner dimension
    (see `linear_split_k`): they are summed in order and rounded to the residual's dtype first."""
    parts = x.shape[0] if x.dim() == 3 else 1
    rows, cols = x.shape[-2:]
    out = torch.empty(rows, cols, dtype=x.dtype if parts == 1 else residual.dtype, device=x.device)
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, eps, cols, rows * cols,
                                  HAS_RESIDUAL=residual is not None, PARTS=parts,
                                  BLOCK=triton.next_power_of_2(cols), num_warps=4)
    return out, (x if residual is None else residual)


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T as `parts` float32 partial sums (parts, M, N) over slices of K, for
    `add_rms_norm` to reduce: one batched cuBLAS call, and the sum happens in the kernel that reads
    the result anyway instead of in a reduction kernel of its own."""
    xs = x.unflatten(1, (parts, -1)).transpose(0, 1)  # (parts, M, K/parts): a view, row- or column-major
    ws = weight.unflatten(1, (parts, -1)).permute(1, 2, 0)  # (parts, K/parts, N): a view
    return torch.bmm(xs, ws) if x.dtype == torch.float32 else torch.bmm(xs, ws, out_dtype=torch.float32)


# ----------------------------------------------------------------------------- RoPE + KV cache write


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """RoPE on the two halves with every product and sum rounded to the activation dtype, as the HF
    forward computes it (q * cos + rotate_half(q) * sin in that dtype), so engine and trainer agree."""
    a = (x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)
    b = (x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)
    return a.to(DT), b.to(DT)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr, bias_ptr,
                       row_stride, part_stride, q_out_stride,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dt: tl.constexpr = k_cache_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, half)
    c = tl.load(cos_ptr + pos * half + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * half + i).to(tl.float32)[None, :]
    base = qkv_ptr + tok * row_stride

    h = tl.arange(0, BLOCK_H)[:, None]
    col = h * HEAD_DIM + i[None, :]
    mask = h < NUM_HEADS
    q1, q2 = _rotate(_load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt),
                     _load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt), c, s, dt)
    tl.store(q_out_ptr + tok * q_out_stride + col, q1, mask=mask)
    tl.store(q_out_ptr + tok * q_out_stride + col + half, q2, mask=mask)

    kh = tl.arange(0, BLOCK_KV)[:, None]
    mask = kh < NUM_KV_HEADS
    col = NUM_HEADS * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    k1, k2 = _rotate(_load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt),
                     _load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt), c, s, dt)
    if PARTS == 1:  # the rotated k stays in qkv too, where prefill's attention reads it
        tl.store(base + col, k1, mask=mask)
        tl.store(base + col + half, k2, mask=mask)
    cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kh * HEAD_DIM + i[None, :]
    tl.store(k_cache_ptr + cache, k1, mask=mask)
    tl.store(k_cache_ptr + cache + half, k2, mask=mask)
    col = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    v1 = _load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt)
    v2 = _load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt)
    tl.store(v_cache_ptr + cache, v1.to(dt), mask=mask)
    tl.store(v_cache_ptr + cache + half, v2.to(dt), mask=mask)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rotates q and k of `qkv` (T, (H + 2 KV) * D), writes k, v to their cache slots, returns the
    rotated q (T, H * D). `qkv` is rotated in place and q is a view of it; or `qkv` is (parts, T, W)
    float32 split-K partial sums (`linear_split_k`), summed here with `bias`, and q is a new tensor."""
    parts = qkv.shape[0] if qkv.dim() == 3 else 1
    tokens = qkv.shape[-2]
    q = qkv[:, : num_heads * head_dim] if parts == 1 else qkv.new_empty(tokens, num_heads * head_dim,
                                                                         dtype=k_cache.dtype)
    _rope_store_kernel[(tokens,)](qkv, cos, sin, positions, slots, k_cache, v_cache, q, k_cache if bias is None else bias,
                                  qkv.stride(-2), tokens * qkv.shape[-1], q.stride(0), NUM_HEADS=num_heads,
                                  NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                  BLOCK_H=triton.next_power_of_2(num_heads),
                                  BLOCK_KV=triton.next_power_of_2(num_kv_heads), PARTS=parts,
                                  HAS_BIAS=bias is not None and parts > 1, num_warps=2)
    return q


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, half)
    c = tl.load(cos_ptr + tok * half + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * half + i).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = h < HEADS
    offs = tok * HEADS * HEAD_DIM + h * HEAD_DIM + i[None, :]
    x1, x2 = _rotate(tl.load(x_ptr + offs, mask=mask).to(tl.float32),
                     tl.load(x_ptr + offs + half, mask=mask).to(tl.float32), c, s, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, x1, mask=mask)
    tl.store(out_ptr + offs + half, x2, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (T, heads, D) by the rows cos, sin (T, D/2), rounded as `rope_and_store` rounds."""
    tokens, heads, head_dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(tokens,)](x, cos.contiguous(), sin.contiguous(), out, HEADS=heads, HEAD_DIM=head_dim,
                            BLOCK_H=triton.next_power_of_2(heads), num_warps=2)
    return out


# ----------------------------------------------------------------------------- SiLU * up


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, row_stride, up_offset, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + up_offset + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """silu(gate) * up. `gate_up` is (T, 2I), gate columns then up columns; or, with `transposed`,
    (2I, T), the gate rows then the up rows, and the result is (I, T)."""
    block = 1024
    if transposed:  # gate and up are two contiguous halves: one long row each
        width, tokens = gate_up.shape
        out = gate_up.new_empty(width // 2, tokens)
        n = out.numel()
        _silu_mul_kernel[(1, triton.cdiv(n, block))](gate_up, out, n, 0, n, BLOCK=block, num_warps=4)
        return out
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, width, width // 2,
                                                             BLOCK=block, num_warps=4)
    return out


# ----------------------------------------------------------------------------- paged decode attention


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
def _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, m, l, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """Folds one block of cached keys and values (at `offs`, rows masked by `tmask`) into the running
    max `m`, sum `l` and output `acc` of an online softmax over the query rows of `q`, in log2 units."""
    k = tl.load(k_cache_ptr + offs, mask=tmask[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # (rows, block)
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offs, mask=tmask[:, None], other=0.0)
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
                         part_lse_ptr, scale_log2, q_row_stride, bt_row_stride, num_splits,
                         GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT_TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_range(context_lens_ptr, seq, split, num_splits, BLOCK_N, SPLIT_TOKENS)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + h
    hmask = h < GROUP
    q = tl.load(q_ptr + seq * q_row_stride + head[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        if PAGE % BLOCK_N == 0:  # the block lies inside one page (splits start on block bounds): one lookup
            page = tl.load(block_tables_ptr + seq * bt_row_stride + t0 // PAGE).to(tl.int64)
            first = (page * PAGE + t0 % PAGE) * NUM_KV_HEADS + kv_head
            offs = (first + tl.arange(0, BLOCK_N) * NUM_KV_HEADS)[:, None] * HEAD_DIM + d[None, :]
        else:
            page = tl.load(block_tables_ptr + seq * bt_row_stride + t // PAGE, mask=tmask, other=0).to(tl.int64)
            offs = ((page * PAGE + t % PAGE) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        m, l, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, m, l, acc, scale_log2, DOT_PRECISION)
    out, lse = _split_result(m, l, acc)
    part = (seq * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=hmask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    """One program per sequence merges every head's splits, weighting each by its share of the mass."""
    seq = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, HEAD_DIM)
    hmask = h < NUM_HEADS
    rows = seq * NUM_HEADS + h
    m = tl.full([BLOCK_HEADS], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + rows * num_splits + s, mask=hmask, other=float("-inf")))
    m = tl.where(m > float("-inf"), m, 0.0)
    acc = tl.zeros([BLOCK_HEADS, HEAD_DIM], tl.float32)
    den = tl.zeros([BLOCK_HEADS], tl.float32)
    for s in range(num_splits):  # an empty split has lse -inf: weight 0
        w = tl.exp2(tl.load(part_lse_ptr + rows * num_splits + s, mask=hmask, other=float("-inf")) - m)
        den += w
        part = tl.load(part_out_ptr + (rows * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                       mask=hmask[:, None], other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, page_size: int, scale: float, num_splits: int,
                     block_n: int = 64, num_warps: int = 4, num_stages: int = 2, split_tokens: int = 0
                     ) -> torch.Tensor:
    """q (B, H, D) with unit stride over heads and dims; caches (slots, KV, D); returns (B, H * D).

    `split_tokens` > 0 cuts every context into splits of that many tokens (a multiple of `block_n`;
    `num_splits` must cover the longest context): each row's result then depends on its own
    context alone, whatever the batch (see `invariant_attention` in rl/rollout/model.py)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    part_out = q.new_empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(batch, num_heads, num_splits, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale * 1.4426950408889634,
        q.stride(0), block_tables.stride(0), num_splits, GROUP=group, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, PAGE=page_size, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        SPLIT_TOKENS=split_tokens, DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
    out = q.new_empty(batch, num_heads * head_dim)
    _decode_merge_kernel[(batch,)](part_out, part_lse, out, num_splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                                   BLOCK_HEADS=triton.next_power_of_2(num_heads), num_warps=4)
    return out


# ----------------------------------------------------------------------------- sampling

SAMPLE_SPLITS = 16  # vocabulary slices per row: enough programs to fill the GPU at small batches


@triton.jit
def _sample_split_kernel(logits_ptr, inv_temp_ptr, part_ptr, vocab, row_stride, chunk,
                         SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of x = logits * inv_temp over one slice of one row, in log2 units."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    scale = tl.load(inv_temp_ptr) * 1.4426950408889634
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row * row_stride
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(start, end, BLOCK):
        c = off + tl.arange(0, BLOCK)
        run_max = tl.maximum(run_max, tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale)
    m = tl.max(run_max, axis=0)
    safe = tl.where(m > float("-inf"), m, 0.0)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for off in range(start, end, BLOCK):  # the slice is in L2 now: the second read is cheap
        c = off + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale
        run_sum += tl.exp2(x - safe)
    out = part_ptr + (row * SPLITS + split) * 2
    tl.store(out, m)
    tl.store(out + 1, tl.sum(run_sum, axis=0))


@triton.jit
def _sample_pick_kernel(logits_ptr, inv_temp_ptr, seed_ptr, part_ptr, tokens_ptr, logprobs_ptr, vocab, row_stride,
                        chunk, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse-CDF draw: one uniform picks the slice by its mass, then the token inside that slice."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(inv_temp_ptr) * 1.4426950408889634
    s = tl.arange(0, SPLITS)
    m = tl.load(part_ptr + (row * SPLITS + s) * 2)
    gm = tl.max(m, axis=0)
    mass = tl.where(m > float("-inf"), tl.load(part_ptr + (row * SPLITS + s) * 2 + 1) * tl.exp2(m - gm), 0.0)
    total = tl.sum(mass, axis=0)
    u = tl.rand(tl.load(seed_ptr), row.to(tl.int32))
    target = (1.0 - u) * total  # in (0, total]: the crossing always lands on a token of nonzero mass
    below = tl.cumsum(mass, axis=0) < target
    pick = tl.minimum(tl.sum(below.to(tl.int32), axis=0), SPLITS - 1)
    # Rounding can carry the draw past the last slice with mass: step back to the nearest one.
    pick = tl.max(tl.where((mass > 0) & (s <= pick), s, 0), axis=0)
    remaining = target - tl.sum(tl.where(s < pick, mass, 0.0), axis=0)
    start = pick * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row * row_stride
    token = -1
    last = start
    off = start
    while (off < end) & (token < 0):
        c = off + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale
        p = tl.exp2(x - gm)
        hit = (tl.cumsum(p, axis=0) >= remaining) & (p > 0)
        first = tl.min(tl.where(hit, c, 2147483647), axis=0)
        token = tl.where(first < 2147483647, first, -1)
        last = tl.maximum(last, tl.max(tl.where(p > 0, c, -1), axis=0))
        remaining -= tl.sum(p, axis=0)
        off += BLOCK
    token = tl.where(token < 0, last, token)  # rounding left a sliver of mass unclaimed: last live token
    x = tl.load(base + token).to(tl.float32) * scale
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, (x - gm - tl.log2(total)) / 1.4426950408889634)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V) from softmax(logits * inv_temperature), and its logprob.

    Exact inverse-CDF sampling in two launches: per (row, slice) the max and the sum of exponentials
    (one exp2 per logit), then per row one Philox uniform walks the slices' masses and the chosen
    slice's prefix sums. `inv_temperature` (1,) float32 and `seed` (1,) int64 live on the device;
    the seed is bumped in place so the next call (or graph replay) draws a fresh uniform.
    """
    rows, vocab = logits.shape
    block = 1024
    chunk = triton.cdiv(triton.cdiv(vocab, SAMPLE_SPLITS), block) * block
    parts = logits.new_empty(rows, SAMPLE_SPLITS, 2, dtype=torch.float32)
    _sample_split_kernel[(rows, SAMPLE_SPLITS)](logits, inv_temperature, parts, vocab, logits.stride(0), chunk,
                                                SPLITS=SAMPLE_SPLITS, BLOCK=block, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(rows,)](logits, inv_temperature, seed, parts, tokens, logprobs, vocab, logits.stride(0),
                                 chunk, SPLITS=SAMPLE_SPLITS, BLOCK=block, num_warps=4)
    seed.add_(1)
    return tokens, logprobs


# ----------------------------------------------------------------------------- end of a decode step


@triton.jit
def _advance_kernel(tokens_ptr, logprobs_ptr, done_ptr, n_gen_ptr, out_tokens_ptr, out_logprobs_ptr, out_width,
                    input_ids_ptr, positions_ptr, context_lens_ptr, slots_ptr, block_tables_ptr, bt_row_stride,
                    stop_ids_ptr, max_new_ptr, rows, page_size, NUM_STOP: tl.constexpr, BLOCK: tl.constexpr):
    """Records each row's sampled token and advances its state; see NativeEngine._advance for the torch form."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < rows
    r64 = r.to(tl.int64)
    token = tl.load(tokens_ptr + r64, mask=live, other=0)
    active = (tl.load(done_ptr + r64, mask=live, other=1) == 0) & live
    n = tl.load(n_gen_ptr + r64, mask=live, other=0)
    column = tl.where(active, n, out_width - 1)
    tl.store(out_tokens_ptr + r64 * out_width + column, token, mask=live)
    tl.store(out_logprobs_ptr + r64 * out_width + column, tl.load(logprobs_ptr + r64, mask=live, other=0.0),
             mask=live)
    n += active.to(tl.int64)
    tl.store(n_gen_ptr + r64, n, mask=live)
    hit = tl.zeros([BLOCK], tl.int1)
    for j in tl.static_range(NUM_STOP):
        hit = hit | (token == tl.load(stop_ids_ptr + j))
    done = ~active | hit | (n >= tl.load(max_new_ptr))
    tl.store(done_ptr + r64, done.to(tl.int8), mask=live)
    advance = ~done
    old = tl.load(input_ids_ptr + r64, mask=live, other=0)
    tl.store(input_ids_ptr + r64, tl.where(advance, token, old), mask=live)
    pos = tl.load(positions_ptr + r64, mask=live, other=0) + advance.to(tl.int64)
    tl.store(positions_ptr + r64, pos, mask=live)
    ctx = tl.load(context_lens_ptr + r64, mask=live, other=0) + advance.to(tl.int32)
    tl.store(context_lens_ptr + r64, ctx, mask=live)
    page = tl.load(block_tables_ptr + r64 * bt_row_stride + pos // page_size, mask=live, other=0).to(tl.int64)
    tl.store(slots_ptr + r64, page * page_size + pos % page_size, mask=live)


def advance(tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor, n_gen: torch.Tensor,
            out_tokens: torch.Tensor, out_logprobs: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
            context_lens: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, stop_ids: torch.Tensor,
            max_new_tokens: torch.Tensor, page_size: int) -> None:
    """All of a decode step's bookkeeping in one launch instead of ~25 small torch kernels."""
    rows = tokens.shape[0]
    block = 128
    _advance_kernel[(triton.cdiv(rows, block),)](
        tokens, logprobs, done.view(torch.int8), n_gen, out_tokens, out_logprobs, out_tokens.shape[1], input_ids,
        positions, context_lens, slots, block_tables, block_tables.stride(0), stop_ids, max_new_tokens, rows,
        page_size, NUM_STOP=stop_ids.shape[0], BLOCK=block, num_warps=4)
