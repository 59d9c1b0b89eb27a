"""Triton kernels of RoPE: the engine's fused RoPE + KV-cache write, and RoPE on its own for the trainer.

All of them compute `rl.model.kernels.rope.rope_reference` on the two halves of each head,

    out1 = x1 c1 - x2 s1,   out2 = x2 c2 + x1 s2       (x1, x2: the halves of a head; c, s: of cos, sin)

one program per token over all its heads, in one of two roundings, kept apart on purpose:

- rounded (`rope_and_store`, `rope_rounded`): every product and sum rounded to the activation dtype, as
  HF's eager forward computes it (`_rotate`). The engine rotates so, and the batch-invariant trainer's
  forward (rl/model/invariant.py) must give the engine's bits, so it calls `rope_rounded`.
- float32 (`rope_float32`): the rotation in float32, rounded once, as Inductor computes HF's formula in
  the trainer's compiled decoder blocks, and with `inverse` its transpose, which is the backward:

      dx1 = g1 c1 + g2 s2,    dx2 = g2 c2 - g1 s1

  Inductor's own kernel for it ran at ~0.3 TB/s on an H200 (0.37 ms forward, 0.31 ms backward for q of a
  32k-token micro-batch at the 0.5B shape; the memory floor is ~0.03 ms). The op `rl.model.rope.rope` calls it.

The rounded kernels compile without fused multiply-adds (`ROUNDED_OPTIONS`). With them (Triton's default through
3.9) the compiler turns `(x1 c).to(DT) - (x2 s).to(DT)` into one fma.rn.bf16 that skips the rounding of x1 c (the
PTX for sm_90 shows it): the rotation is then not the torch path's bits, and where it cancels (x1 c close to x2 s)
a bfloat16 key lands more than one e4m3 step from the torch path's in an FP8 cache (seen on an H100).

The engine's tables are half tables (D/2 columns, c1 = c2); the trainer's op gets HF's full-width ones.
With QK-norm weights (Qwen3) the rounded kernels first normalise each q and k head as
`rl.model.kernels.rms_norm.rms_norm_reference` does (`_head_norm`), so the engine and the batch-invariant trainer
run the same arithmetic there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl.model.kernels.linear_triton import load_gemm_result

NUM_WARPS = 4  # of the float32 kernel
# Launch options of the rounded kernels: every product and sum rounded as written, none fused into a multiply-add.
ROUNDED_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """RoPE on the two halves with every product and sum rounded to the activation dtype, as the HF
    forward computes it (q * cos + rotate_half(q) * sin in that dtype), so engine and trainer agree."""
    a = (x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)
    b = (x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)
    return a.to(DT), b.to(DT)


@triton.jit
def _head_norm(x1, x2, w_ptr, i, eps, HEAD_DIM: tl.constexpr, DT: tl.constexpr, PLUS_ONE: tl.constexpr):
    """RMSNorm of each head (a row of the halves x1, x2, float32 values of DT) by its weight (HEAD_DIM,):
    normalised in float32, rounded to DT, scaled by the weight and rounded again, as the reference rounds
    (with PLUS_ONE, Gemma's: scaled by 1 + weight in float32 and rounded once)."""
    half: tl.constexpr = HEAD_DIM // 2
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + i).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + i).to(tl.float32)[None, :]
    if PLUS_ONE:
        return (x1 * rstd * (1.0 + w1)).to(DT).to(tl.float32), (x2 * rstd * (1.0 + w2)).to(DT).to(tl.float32)
    y1 = ((x1 * rstd).to(DT).to(tl.float32) * w1).to(DT).to(tl.float32)
    y2 = ((x2 * rstd).to(DT).to(tl.float32) * w2).to(DT).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr, bias_ptr,
                       q_norm_ptr, k_norm_ptr, k_scale_ptr, v_scale_ptr, eps, row_stride, part_stride, q_out_stride,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr, FP8: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dt: tl.constexpr = q_out_ptr.dtype.element_ty  # the activation dtype
    cdt: tl.constexpr = k_cache_ptr.dtype.element_ty  # the cache's: dt, or e4m3 (FP8)
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, half)
    c = tl.load(cos_ptr + pos * half + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * half + i).to(tl.float32)[None, :]
    base = qkv_ptr + tok * row_stride

    h = tl.arange(0, BLOCK_H)[:, None]
    col = h * HEAD_DIM + i[None, :]
    mask = h < NUM_HEADS
    q1 = load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt)
    q2 = load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt)
    if QK_NORM:
        q1, q2 = _head_norm(q1, q2, q_norm_ptr, i, eps, HEAD_DIM, dt, PLUS_ONE)
    q1, q2 = _rotate(q1, q2, c, s, dt)
    tl.store(q_out_ptr + tok * q_out_stride + col, q1, mask=mask)
    tl.store(q_out_ptr + tok * q_out_stride + col + half, q2, mask=mask)

    kh = tl.arange(0, BLOCK_KV)[:, None]
    mask = kh < NUM_KV_HEADS
    col = NUM_HEADS * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    k1 = load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt)
    k2 = load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt)
    if QK_NORM:
        k1, k2 = _head_norm(k1, k2, k_norm_ptr, i, eps, HEAD_DIM, dt, PLUS_ONE)
    k1, k2 = _rotate(k1, k2, c, s, dt)
    if PARTS == 1:  # the rotated k stays in qkv too, where prefill's attention reads it
        tl.store(base + col, k1, mask=mask)
        tl.store(base + col + half, k2, mask=mask)
    cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kh * HEAD_DIM + i[None, :]
    col = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kh * HEAD_DIM + i[None, :]
    v1 = load_gemm_result(base, part_stride, bias_ptr, col, mask, PARTS, HAS_BIAS, dt)
    v2 = load_gemm_result(base, part_stride, bias_ptr, col + half, mask, PARTS, HAS_BIAS, dt)
    if FP8:  # x / its head's scale, clamped to e4m3's largest value, rounded to e4m3 (rl/model/fp8.py's quantize_kv)
        ks = tl.load(k_scale_ptr + kh, mask=mask, other=1.0)
        vs = tl.load(v_scale_ptr + kh, mask=mask, other=1.0)
        k1 = tl.clamp(k1.to(tl.float32) / ks, -448.0, 448.0).to(cdt, fp_downcast_rounding="rtne")
        k2 = tl.clamp(k2.to(tl.float32) / ks, -448.0, 448.0).to(cdt, fp_downcast_rounding="rtne")
        v1 = tl.clamp(v1.to(dt).to(tl.float32) / vs, -448.0, 448.0).to(cdt, fp_downcast_rounding="rtne")
        v2 = tl.clamp(v2.to(dt).to(tl.float32) / vs, -448.0, 448.0).to(cdt, fp_downcast_rounding="rtne")
    tl.store(k_cache_ptr + cache, k1.to(cdt), mask=mask)
    tl.store(k_cache_ptr + cache + half, k2.to(cdt), mask=mask)
    tl.store(v_cache_ptr + cache, v1.to(dt).to(cdt), mask=mask)
    tl.store(v_cache_ptr + cache + half, v2.to(dt).to(cdt), mask=mask)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, plus_one: bool = False,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotates q and k of `qkv` (T, (H + 2 KV) * D), writes k, v to their cache slots, returns the
    rotated q (T, H * D). `qkv` is rotated in place and q is a view of it; or `qkv` is (parts, T, W)
    float32 split-K partial sums (`linear_split_k`), summed here with `bias`, and q is a new tensor.
    `qk_norm` (q weight, k weight, eps) normalises each q and k head before the rotation (by 1 + weight with
    `plus_one`, Gemma's). `k_scale`, `v_scale` (KV,): an FP8 cache's scales, k and v stored as x / scale in e4m3;
    `dtype`: the activation dtype (the cache's by default)."""
    parts = qkv.shape[0] if qkv.dim() == 3 else 1
    tokens = qkv.shape[-2]
    q = qkv[:, : num_heads * head_dim] if parts == 1 else qkv.new_empty(tokens, num_heads * head_dim,
                                                                         dtype=dtype or k_cache.dtype)
    q_norm, k_norm, eps = qk_norm or (q, q, 0.0)
    fp8 = k_scale is not None
    _rope_store_kernel[(tokens,)](qkv, cos, sin, positions, slots, k_cache, v_cache, q, q if bias is None else bias,
                                  q_norm, k_norm, k_scale if fp8 else q, v_scale if fp8 else q, eps, qkv.stride(-2),
                                  tokens * qkv.shape[-1], q.stride(0),
                                  NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                  BLOCK_H=triton.next_power_of_2(num_heads),
                                  BLOCK_KV=triton.next_power_of_2(num_kv_heads), PARTS=parts,
                                  HAS_BIAS=bias is not None and parts > 1, QK_NORM=qk_norm is not None,
                                  PLUS_ONE=plus_one, FP8=fp8, num_warps=2, **ROUNDED_OPTIONS)
    return q


@triton.jit
def _rope_rounded_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, norm_ptr, eps, HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, half)
    c = tl.load(cos_ptr + tok * half + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * half + i).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = h < HEADS
    offs = tok * HEADS * HEAD_DIM + h * HEAD_DIM + i[None, :]
    dt: tl.constexpr = out_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, norm_ptr, i, eps, HEAD_DIM, dt, PLUS_ONE)
    x1, x2 = _rotate(x1, x2, c, s, dt)
    tl.store(out_ptr + offs, x1, mask=mask)
    tl.store(out_ptr + offs + half, x2, mask=mask)


def rope_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 norm: tuple[torch.Tensor, float] | None = None, plus_one: bool = False) -> torch.Tensor:
    """RoPE of x (T, heads, D) by the rows cos, sin (T, D/2), rounded as `rope_and_store` rounds; with
    `norm` (weight, eps) each head is RMS-normalised first, as `rope_and_store` does with `qk_norm`."""
    tokens, heads, head_dim = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    weight, eps = norm or (x, 0.0)
    _rope_rounded_kernel[(tokens,)](x, cos.contiguous(), sin.contiguous(), out, weight, eps, HEADS=heads,
                                    HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
                                    QK_NORM=norm is not None, PLUS_ONE=plus_one, num_warps=2, **ROUNDED_OPTIONS)
    return out


@triton.jit
def _rope_float32_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, length, heads, half,
                         xb, xh, xt, ob, oh, ot, cb, ct,
                         INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    b = (token // length).to(tl.int64)
    t = (token % length).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    x = x_ptr + b * xb + t * xt + h * xh + d
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + half, mask=mask, other=0.0).to(tl.float32)
    lane_mask = d < half
    c = b * cb + t * ct + d
    c1 = tl.load(cos_ptr + c, mask=lane_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c + half, mask=lane_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c, mask=lane_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c + half, mask=lane_mask, other=0.0).to(tl.float32)
    if INVERSE:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    out = out_ptr + b * ob + t * ot + h * oh + d
    tl.store(out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


def rope_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE of x (rows, heads, length, head_dim; head_dim contiguous) by full-width cos and sin (rows or 1,
    length, head_dim; the same strides) in float32, rounded once, or its transpose with `inverse`. The
    output has x's strides."""
    rows, heads, length, dim = x.shape
    assert x.stride(3) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride() and dim % 2 == 0
    out = torch.empty_like(x)
    half = dim // 2
    _rope_float32_kernel[(rows * length,)](
        x, out, cos, sin, length, heads, half, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        INVERSE=inverse, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
        num_warps=NUM_WARPS)
    return out
