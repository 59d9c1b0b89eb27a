"""Triton GEMM kernels: the batch-invariant linear layer, and split-K partial sums that a later kernel reduces.

The torch reference of `linear` is `F.linear`, accumulated in float32 and rounded once. `linear` departs
from cuBLAS in one way only: one tile shape for every problem, so a row's result is the same bits in any
batch. `linear_split_k` is torch's batched GEMM; `load_gemm_result` is how the kernels that read its
partial sums (rl/model/kernels/rms_norm_triton.py, rl/model/kernels/rope_triton.py) reduce them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 engines must not silently drop to tf32




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
                         BLOCK_K=LINEAR_BLOCK_K, GROUP_M=LINEAR_GROUP_M, DOT_PRECISION=dot_precision(x.dtype),
                         num_warps=4, num_stages=4)
    return out



def linear_split_k(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T as `parts` float32 partial sums (parts, M, N) over slices of K, for
    `add_rms_norm` to reduce: one batched cuBLAS call, and the sum happens in the kernel that reads
    the result anyway instead of in a reduction kernel of its own."""
    xs = x.unflatten(1, (parts, -1)).transpose(0, 1)  # (parts, M, K/parts): a view, row- or column-major
    ws = weight.unflatten(1, (parts, -1)).permute(1, 2, 0)  # (parts, K/parts, N): a view
    return torch.bmm(xs, ws) if x.dtype == torch.float32 else torch.bmm(xs, ws, out_dtype=torch.float32)



@triton.jit
def load_gemm_result(ptr, part_stride, bias_ptr, col, mask, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
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

