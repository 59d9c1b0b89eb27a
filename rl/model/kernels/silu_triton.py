"""Triton kernel of SiLU(gate) * up, the MLP's activation in the engine and the batch-invariant trainer.

Its torch reference is `rl.model.kernels.silu.silu_mul_reference`: SiLU is rounded to the activation dtype
before the product, as `F.silu(gate) * up` rounds. With `gelu`, Gemma's GeGLU (`gelu_mul_reference`): the
tanh approximation of GELU in its place, rounded the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, row_stride, up_offset, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + up_offset + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        act = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu / F.gelu
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, transposed: bool = False, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up (gelu_tanh(gate) * up with `gelu`). `gate_up` is (T, 2I), gate columns then up columns;
    or, with `transposed`, (2I, T), the gate rows then the up rows, and the result is (I, T)."""
    block = 1024
    if transposed:  # gate and up are two contiguous halves: one long row each
        width, tokens = gate_up.shape
        out = gate_up.new_empty(width // 2, tokens)
        n = out.numel()
        _silu_mul_kernel[(1, triton.cdiv(n, block))](gate_up, out, n, 0, n, BLOCK=block, GELU=gelu, num_warps=4)
        return out
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, width, width // 2,
                                                             BLOCK=block, GELU=gelu, num_warps=4)
    return out
