"""Rotary position embeddings (RoPE) in torch: the one reference of rl/model/kernels/rope_triton.py, and the
engine's cos/sin tables.

HF's formula, `x * cos + rotate_half(x) * sin` on q and k, with full-width tables (the two halves of a
head's cos are equal in every HF rotary class, but `rl.model.rope.computes_rope` tells a rotation from other
functions with unequal ones). Computed in x's dtype it rounds every product and sum as HF's eager forward
does: the engine's CPU forward runs it so, and the batch-invariant trainer's backward runs its transpose
in float32. The engine keeps half tables (D/2 columns); `full_table` gives them HF's layout.
"""

from __future__ import annotations

import torch


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's), or with `inverse` the transposed rotation, with cos and sin
    full-width tables that broadcast against x (..., head_dim)."""
    half = x.shape[-1] // 2
    if inverse:
        y = x * sin
        return x * cos + torch.cat((y[..., half:], -y[..., :half]), dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def full_table(half: torch.Tensor) -> torch.Tensor:
    """A half table (..., D/2) in HF's full-width layout (..., D): the half repeated."""
    return torch.cat([half, half], dim=-1)


def rope_tables(reference: torch.nn.Module, max_positions: int, device: torch.device, dtype: torch.dtype,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin half tables (max_positions, D/2), computed in float32 by the HF rotary module of
    `reference` on the CPU (so every rope_type/rope_scaling the config names is honoured exactly) and
    rounded to the activation dtype as the HF forward rounds them; `layer_type` picks the RoPE of one kind
    of layer in a model with several (Gemma 3's sliding and full attention)."""
    rotary = type(reference.model.rotary_emb)(config=reference.config)
    extra = (layer_type,) if layer_type is not None else ()
    positions = torch.arange(max_positions)[None]  # (1, T)
    if hasattr(rotary, "mrope_section"):
        # Qwen3.5's multimodal RoPE: one row of positions per section (3, 1, T), all equal for text. transformers
        # 5.17's forward indexes them as 3-D and fails on (1, T); later versions broadcast either.
        positions = positions.expand(3, 1, -1)
    cos, sin = rotary(torch.zeros(1), positions, *extra)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].to(device, dtype).contiguous(), sin[0, :, :half].to(device, dtype).contiguous()
