"""A Triton kernel for rotary position embeddings (RoPE) in the trainer's compiled decoder blocks.

HF models apply RoPE as `x * cos + rotate_half(x) * sin` to q and k of shape (rows, heads, length, head_dim),
views of the projections' (rows, length, heads, head_dim) outputs. Compiled with dynamic shapes, Inductor
turned that into a kernel running at ~0.3 TB/s on an H200 (0.37 ms forward, 0.31 ms backward for q of a
32k-token micro-batch at the 0.5B shape; the memory floor is ~0.03 ms). Here one program per token reads
each head's two halves once, rotates them in float32 and writes them in the layout they came in:

    out1 = x1 c1 - x2 s1,   out2 = x2 c2 + x1 s2       (x1, x2: the halves of a head; c, s: of cos, sin)

The backward is the transposed rotation, the same kernel with `inverse`:

    dx1 = g1 c1 + g2 s2,    dx2 = g2 c2 - g1 s1

The op `rl.rope.rope` calls `apply` on CUDA; tests/test_rope.py runs it on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, length, heads, half,
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


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE of x (rows, heads, length, head_dim; head_dim contiguous) by cos and sin (rows or 1, length,
    head_dim; the same strides), or its transpose with `inverse`. The output has x's strides."""
    rows, heads, length, dim = x.shape
    assert x.stride(3) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride() and dim % 2 == 0
    out = torch.empty_like(x)
    half = dim // 2
    _rope_kernel[(rows * length,)](
        x, out, cos, sin, length, heads, half, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        INVERSE=inverse, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
        num_warps=NUM_WARPS)
    return out
