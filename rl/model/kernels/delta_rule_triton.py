"""Triton kernel of the gated delta rule's decode step: one token per sequence advances each head's state in place.

Its torch reference is `rl.model.linear_attention.gated_delta_step`, followed by what the engine's decode step does
with the new state: keep it for the rows that are live, leave a finished row's state as it was. That reference is
elementwise torch: the decay, the read S^T k, the outer-product write, the output S^T q, the select of live rows and
the copy back each pass over the (N, Hv, K, V) float32 state, some eighteen reads and writes of it a step. At batch
256 and Qwen3.5-1.5B's widths (16 heads of 128 x 128) the state is 256 MiB a layer, so its 18 linear layers moved
~80 GB a decode step, twenty times the weights. Here each (row, head, value block) program loads its K x BLOCK_V
tile of the state once, does the whole step on it in registers and stores it once (only where the row is live).

Every row's result depends on that row alone (one program per row and head, the same reduction order whatever the
batch), so the step is batch-invariant, as the reference is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, live_ptr, out_ptr, K, V, scale,
                             q_row, q_head, k_row, k_head, v_row, v_head, g_row, beta_row, s_row, s_head, s_k,
                             out_row, out_head, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < K, vs < V
    q = tl.load(q_ptr + row * q_row + head * q_head + ks, mask=k_mask, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + row * k_row + head * k_head + ks, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * v_row + head * v_head + vs, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * beta_row + head).to(tl.float32)
    live = tl.load(live_ptr + row + vs * 0) != 0  # the row's flag along the block (a scalar mask is not portable)
    tile = state_ptr + row * s_row + head * s_head + ks[:, None] * s_k + vs[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)  # S = exp(g) S
    read = tl.sum(state * k[:, None], axis=0)  # S^T k
    state = state + k[:, None] * (beta * (v - read))[None, :]  # S += k (beta (v - S^T k))^T
    out = tl.sum(state * q[:, None], axis=0)  # S^T q
    tl.store(out_ptr + row * out_row + head * out_head + vs, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(tile, state, mask=mask & live[None, :])


def gated_delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, live: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """One decode token per sequence through the gated delta rule: q, k (N, H, K), v (N, H, V), g and beta (N, H),
    state (N, H, K, V) float32 with unit stride along V (a view into the engine's rows is fine), live (N,) bool.
    Advances the live rows' states in place and returns o (N, H, V) in v's dtype, as `gated_delta_step` does."""
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if state.dtype != torch.float32 or state.shape != (rows, heads, key_dim, value_dim):
        raise ValueError(f"the state must be float32 {(rows, heads, key_dim, value_dim)}, got {state.dtype} "
                         f"{tuple(state.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, state)) or g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("the delta rule's step wants unit stride along its last dimension")
    out = v.new_empty(rows, heads, value_dim)
    block_v = min(32, triton.next_power_of_2(value_dim))
    _gated_delta_step_kernel[(rows, heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, state, live.view(torch.uint8), out, key_dim, value_dim,
        key_dim ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, num_warps=4)
    return out
