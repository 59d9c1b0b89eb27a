"""Triton kernel of residual add + RMSNorm, the engine's and the batch-invariant trainer's.

Its torch reference is `rl.model.kernels.rms_norm.rms_norm_reference` after `x + residual`: the sum is rounded
to the activation dtype and the normalised value rounded before the weight multiplies it, as HF's forward
rounds. One program per row; the input may also be a GEMM's float32 split-K partial sums, reduced here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl.model.kernels.linear_triton import load_gemm_result


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, n_cols, part_stride,
                         HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, PLUS_ONE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = load_gemm_result(x_ptr + row * n_cols, part_stride, x_ptr, cols, mask, PARTS, False, out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before normalising, as the HF forward does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:  # Gemma: (1 + w) in float32, one rounding
        y = xf * rstd * (1.0 + w)
    else:
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 plus_one: bool = False, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); `residual` is updated in place. `plus_one`: Gemma's
    scale (1 + weight), as `rms_norm_reference(..., plus_one=True)`.

    `x` may also be (parts, rows, cols) float32 partial sums of a GEMM split over its inner dimension
    (see `linear_split_k`): they are summed in order and rounded to the residual's dtype (or `dtype`) first."""
    parts = x.shape[0] if x.dim() == 3 else 1
    rows, cols = x.shape[-2:]
    out = torch.empty(rows, cols, dtype=x.dtype if parts == 1 else dtype or residual.dtype, device=x.device)
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, eps, cols, rows * cols,
                                  HAS_RESIDUAL=residual is not None, PARTS=parts,
                                  BLOCK=triton.next_power_of_2(cols), PLUS_ONE=plus_one, num_warps=4)
    return out, (x if residual is None else residual)

