"""Batch-invariant training forward: the trainer computes every token with the native engine's kernels.

Two bf16 forwards of the same model that differ only in kernel choice (cuBLAS picking another
tile shape at another batch size, another attention kernel) disagree by ~1e-2 in the logprobs of
sampled tokens, because a flipped bf16 rounding in one layer is carried through the rest. With
`model.batch_invariant = true` the engine and the trainer run one implementation whose result for
a token does not depend on what else is in the batch:

- every linear layer is `rl.model.kernels.linear_triton.linear` (one tile shape for all problem sizes, no split-K);
- attention is the engine's decode kernel with fixed 512-token splits, run with one row per token
  over the sequence's own keys (`invariant_attention`), in the engine's prefill, its decode steps
  and here alike;
- RMSNorm, SiLU * up and RoPE (with QK-norm in front of it) are the engine's Triton kernels (rl/model/kernels/) with
  its rounded cos/sin tables (HF's torch RoPE differs from the engine's by one bf16 ulp in places on the GPU),
  and residual adds are plain bf16 adds (the engine's fused add rounds the same way).

So the rollout logprobs and the trainer's logprobs of the same tokens agree to the last bit of the
network (the final log-softmax differs only in float32 summation order). Backward passes use plain
torch: each custom op differentiates its torch reference from rl/model/kernels/ (or SDPA for attention).

`make_batch_invariant(model, max_positions)` patches a `transformers` Llama / Qwen2 / Qwen3 / Gemma 3 causal LM in
place (before FSDP2 wraps it) and returns it; the patched forward imports the Triton kernels as it
first runs (Triton is needed only once the mode is on). It assumes what `rl.train.step.collate` builds: one
sequence per row, right-padded, positions 0, 1, 2, ... Padded positions compute garbage that the
loss mask drops.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from rl.model.decoder import Shape
from rl.model.kernels.attention import INVARIANT_PAGE, causal_attention
from rl.model.kernels.rms_norm import rms_norm_reference
from rl.model.kernels.rope import full_table, rope_reference, rope_tables
from rl.model.kernels.silu import gelu_mul_reference, silu_mul_reference


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        from rl.model.kernels.linear_triton import linear

        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _recompute_grads(ctx, fn, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Gradients of fn(*saved tensors), the op's torch definition, for the inputs that want one."""
    needs = ctx.needs_input_grad[: len(ctx.saved_tensors)]
    with torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs))
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(fn(*leaves), wanted, grad) if wanted else ())
    return tuple(next(grads) if t.requires_grad else None for t in leaves)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm by weight, or by (1 + weight) with `plus_one` (Gemma's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool):
        from rl.model.kernels.rms_norm_triton import add_rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.plus_one = eps, plus_one
        out, _ = add_rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), None, weight, eps, plus_one)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return *_recompute_grads(ctx, lambda x, w: rms_norm_reference(x, w, ctx.eps, ctx.plus_one), grad), None, None


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, or Gemma's gelu_tanh(gate) * up with `gelu`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, gelu: bool):
        from rl.model.kernels.silu_triton import silu_mul

        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        gate_up = torch.cat([gate, up], dim=-1).reshape(-1, 2 * gate.shape[-1])
        return silu_mul(gate_up, gelu=gelu).view(gate.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return *_recompute_grads(ctx, gelu_mul_reference if ctx.gelu else silu_mul_reference, grad), None


class _Rope(torch.autograd.Function):
    """x (T, heads, D) rotated by cos, sin (T, D/2) with the engine's RoPE arithmetic; with a QK-norm weight
    (Qwen3, Gemma 3 with `plus_one`) each head is RMS-normalised first, in the same kernel, as the engine does it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float,
                plus_one: bool):
        from rl.model.kernels.rope_triton import rope_rounded

        ctx.save_for_backward(cos, sin, x if weight is not None else None, weight)
        ctx.eps, ctx.plus_one = eps, plus_one
        return rope_rounded(x, cos, sin, None if weight is None else (weight, eps), plus_one)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin, x, weight = ctx.saved_tensors
        cos, sin = (full_table(t).float()[:, None, :] for t in (cos, sin))
        # The rotation's transpose (rotate back by the same angle), in float32.
        grad = rope_reference(grad.float(), cos, sin, inverse=True).to(grad.dtype)
        if weight is None:
            return grad, None, None, None, None, None
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            normed = rms_norm_reference(x, weight, ctx.eps, ctx.plus_one)
            grad_x, grad_w = torch.autograd.grad(normed, (x, weight), grad)
        return grad_x, None, None, grad_w, None, None


def _norm_of(module: torch.nn.Module) -> tuple[float, bool]:
    """An HF RMSNorm's (eps, plus_one): its eps (Gemma's name it `eps`, the others `variance_epsilon`), and the
    scale by (1 + weight) that make_batch_invariant read from the model's shape."""
    return getattr(module, "variance_epsilon", getattr(module, "eps", None)), module.invariant_plus_one


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
    if norm is None:
        return _Rope.apply(x, cos, sin, None, 0.0, False)
    return _Rope.apply(x, cos, sin, norm.weight, *_norm_of(norm))


class _Attention(torch.autograd.Function):
    """Causal GQA attention, q (B, T, H, D), k and v (B, T, KV, D) -> (B, T, H, D)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int):
        from rl.model.kernels.attention_triton import invariant_attention

        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.window = scale, window
        b, t, h, d = q.shape
        kv_heads, pages = k.shape[2], -(-t // INVARIANT_PAGE)
        pad = pages * INVARIANT_PAGE - t
        # Each sequence's keys and values as its own run of cache pages; every token is a query row.
        k_cache = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(b * pages * INVARIANT_PAGE, kv_heads, d)
        v_cache = F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b * pages * INVARIANT_PAGE, kv_heads, d)
        tables = torch.arange(b * pages, dtype=torch.int32, device=q.device).view(b, pages).repeat_interleave(t, 0)
        context_lens = torch.arange(1, t + 1, dtype=torch.int32, device=q.device).repeat(b)
        out = invariant_attention(q.reshape(b * t, h, d), k_cache, v_cache, tables, context_lens, INVARIANT_PAGE, t,
                                  scale=scale, window=window)
        return out.view(b, t, h, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        def attend(q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            return causal_attention(q, k, v, ctx.scale, ctx.window, enable_gqa=True).transpose(1, 2)

        return *_recompute_grads(ctx, attend, grad), None, None


def _attention_forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """The HF attention block with the engine's RoPE and attention (causal: right padding needs no mask), at the
    module's own scale and sliding window (Gemma 3's local layers)."""
    if self.training and getattr(self, "attention_dropout", 0.0):
        raise ValueError("batch-invariant attention has no dropout; set the model's attention_dropout to 0")
    b, t = hidden_states.shape[:2]
    d = self.head_dim
    cos, sin = (x.expand(b, t, d // 2).reshape(b * t, d // 2) for x in position_embeddings)
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)  # QK-norm (Qwen3, Gemma 3)
    q = _rope(self.q_proj(hidden_states).view(b * t, -1, d), cos, sin, q_norm).view(b, t, -1, d)
    k = _rope(self.k_proj(hidden_states).view(b * t, -1, d), cos, sin, k_norm).view(b, t, -1, d)
    v = self.v_proj(hidden_states).view(b, t, -1, d)
    window = getattr(self, "sliding_window", None) or 0
    return self.o_proj(_Attention.apply(q, k, v, self.scaling, window).reshape(b, t, -1)), None


def _linear_forward(self, x):
    return _Linear.apply(x, self.weight, self.bias)


def _rms_norm_forward(self, x):
    return _RMSNorm.apply(x, self.weight, *_norm_of(self))


def _mlp_forward(self, x):
    return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x), self.invariant_gelu))


def make_batch_invariant(model: torch.nn.Module, max_positions: int) -> torch.nn.Module:
    """Patches a Llama / Qwen2 / Qwen3 / Gemma 3 `transformers` causal LM to compute its forward with the engine's
    batch-invariant kernels (see the module docstring); returns the same model."""
    shape = Shape.from_hf(model.config)  # the native engine's architecture checks: the two must compute alike
    for module in model.modules():
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            module.forward = types.MethodType(_attention_forward, module)
        elif isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
        elif type(module).__name__.endswith("RMSNorm"):  # the layers' norms and the heads' (QK-norm)
            module.invariant_plus_one = shape.norm_plus_one  # Gemma's (1 + w)
            module.forward = types.MethodType(_rms_norm_forward, module)
        elif all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            module.invariant_gelu = shape.activation == "gelu_tanh"  # Gemma's GeGLU
            module.forward = types.MethodType(_mlp_forward, module)
    # Plain attributes, not buffers: buffers would travel with the weights the trainer pushes.
    # One pair of tables per RoPE (Gemma 3 asks for its sliding and its global layers' by layer type).
    rotary = model.model.rotary_emb
    rotary.invariant_tables = {kind: rope_tables(model, max_positions, torch.device("cpu"), torch.float32, kind)
                               for kind in set(shape.rope_kinds) or {None}}

    def rotary_forward(self, x, position_ids, layer_type=None):
        cos, sin = self.invariant_tables[layer_type]
        if cos.device != x.device:  # the model moved (FSDP2, offload): follow it once
            self.invariant_tables[layer_type] = cos, sin = cos.to(x.device), sin.to(x.device)
        if int(position_ids.max()) >= cos.shape[0]:
            raise ValueError(f"position {int(position_ids.max())} is past the batch-invariant RoPE tables "
                             f"({cos.shape[0]} positions, rollout.max_context_len)")
        # The engine's half tables (B, T, D/2), rounded from float32 to the activation dtype as it rounds
        # them; only the patched attention reads them.
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    rotary.forward = types.MethodType(rotary_forward, rotary)
    return model
