"""RoPE as one custom op with its own backward, for the trainer's compiled decoder blocks (`model.compile`).

`fuse_rope(model)` swaps the `apply_rotary_pos_emb` of the model's modeling module (HF models look the
function up there on every call) for one that runs `rope` on q and k: on CUDA the float32 Triton kernel
`rl.model.kernels.rope_triton.rope_float32`, elsewhere HF's torch formula `rl.model.kernels.rope.rope_reference`. It
only swaps a function that computes what `rope` computes (checked on random inputs first), so a model with
another RoPE (partial rotary dims, interleaved pairs) keeps its own; calls with shapes the kernel does not
take fall back to the original.
"""

from __future__ import annotations

import sys

import torch

from rl.model.kernels.rope import rope_reference


def kernels(x: torch.Tensor):
    """The Triton kernels for x's device, or None for the torch formula."""
    if not x.is_cuda:
        return None
    import rl.model.kernels.rope_triton
    return rl.model.kernels.rope_triton


@torch.library.custom_op("rl::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """RoPE of x (rows, heads, length, head_dim) by cos and sin (rows or 1, length, head_dim), or its transpose."""
    k = kernels(x)
    if k is None or x.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1 or \
            cos.shape[0] not in (1, x.shape[0]) or cos.shape[1:] != (x.shape[2], x.shape[3]):
        return rope_reference(x, cos.unsqueeze(1), sin.unsqueeze(1), inverse)  # over x's heads
    return k.rope_float32(x, cos, sin, inverse)


@rope.register_fake
def _(x, cos, sin, inverse):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rope(grad, cos, sin, not ctx.inverse), None, None, None


rope.register_autograd(_backward, setup_context=_setup_context)


def fused(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim=1, **kwargs):
        if args or kwargs or unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
        return rope(q, cos, sin, False), rope(k, cos, sin, False)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def computes_rope(fn) -> bool:
    """Whether fn(q, k, cos, sin) is HF's standard RoPE, on random inputs (cos and sin with unequal halves)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 1, 5, 8, generator=g,
                                                                                   dtype=torch.float64)
    cos, sin = torch.randn(2, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 5, 8, generator=g,
                                                                                   dtype=torch.float64)
    try:
        got = fn(q, k, cos, sin)
    except Exception:
        return False
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
    return all(torch.allclose(a, rope_reference(x, cos, sin)) for a, x in zip(got, (q, k)))


SWAPPED: list = []  # the modeling modules whose apply_rotary_pos_emb runs the op


def fuse_rope(model: torch.nn.Module) -> bool:
    """Swap in the RoPE op for the modeling module of `model`'s classes; False where none was swapped."""
    for module in {sys.modules[type(m).__module__] for m in model.modules()} - set(SWAPPED):
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is not None and computes_rope(fn):
            module.apply_rotary_pos_emb = fused(fn)
            SWAPPED.append(module)
    return any(sys.modules[type(m).__module__] in SWAPPED for m in model.modules())


def unfuse_rope() -> None:
    """Every swapped module gets its own function back."""
    while SWAPPED:
        module = SWAPPED.pop()
        module.apply_rotary_pos_emb = module.apply_rotary_pos_emb.original
