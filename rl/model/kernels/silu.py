"""SiLU(gate) * up (and Gemma's GeGLU, gelu_tanh(gate) * up) in torch, the references of
rl/model/kernels/silu_triton.py: the engine's CPU forward runs them, and the batch-invariant trainer differentiates
SiLU's in backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up
