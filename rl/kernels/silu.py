"""SiLU(gate) * up in torch, the reference of rl/kernels/silu_triton.py: the engine's CPU forward runs it,
and the batch-invariant trainer differentiates it in backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
