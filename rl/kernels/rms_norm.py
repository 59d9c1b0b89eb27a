"""RMSNorm in torch, the reference of rl/kernels/rms_norm_triton.py: the engine's CPU forward runs it, and
the batch-invariant trainer differentiates it in backward.

As HF's Llama / Qwen2 RMSNorm: normalised in float32, rounded to the activation dtype, then scaled by the
weight in the weight's dtype.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
