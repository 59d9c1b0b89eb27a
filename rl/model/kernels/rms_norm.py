"""RMSNorm in torch, the reference of rl/model/kernels/rms_norm_triton.py: the engine's CPU forward runs it, and
the batch-invariant trainer differentiates it in backward.

As HF's Llama / Qwen2 RMSNorm: normalised in float32, rounded to the activation dtype, then scaled by the
weight in the weight's dtype. With `plus_one`, Gemma's: scaled by (1 + weight) in float32 and rounded once.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)
