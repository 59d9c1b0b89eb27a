"""The gated delta rule and the short causal convolution of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), in
plain PyTorch, over packed rows.

A Gated DeltaNet layer keeps, per sequence, a matrix state S (heads, key_dim, value_dim) in place of a KV cache.
Each token decays it by exp(g) and then writes v into it along k, replacing what S already held there
(the delta rule):

    S_t = exp(g_t) * S_{t-1};   S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T;   o_t = S_t^T (q_t / sqrt(key_dim))

Before the rule, q, k and v pass a short depthwise causal convolution (kernel of a few tokens) whose state is the
last kernel-1 inputs of the sequence.

How this departs from the usual single-sequence reference:
- Every function takes rows of sequences packed end to end (`cu_seqlens`, as the trainer packs them); a batch
  (B, T) is the packed row of B sequences of length T. The convolution never reads across a boundary and the
  delta rule starts every sequence from its own initial state (zero unless given).
- The chunked form lays each sequence out on its own chunks (a sequence's last chunk is padded, never shared),
  so all chunks' intra-chunk work runs at once and only the carry of the state runs chunk by chunk.
- The rule accumulates in float32 and returns the state in float32 whatever the inputs' dtype.
- A conv state is the last W-1 inputs, all the next token reads (transformers' cache keeps W).

`gated_deltanet_forward` (prefill, training) and `gated_deltanet_step` (decode; `gated_deltanet_step_` on CUDA, its
delta rule one Triton kernel that updates the states in place) compute a whole layer from the weights of
transformers' Qwen3-Next or Qwen3.5 module (`weights_from_module`). `use_packed_linear_attention` points the
trainer's copy of those modules at `gated_deltanet_forward`, so a packed micro-batch's sequences never read each
other's state: transformers' own torch path runs a packed row as one sequence. In training the layer keeps only its
input and is computed again in its backward (`packed_linear_forward`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rl.config import ConfigError

CHUNK_SIZE = 64


def _as_packed(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """x (B, T, ...) as one packed row (B*T, ...) and its sequence starts [0, ..., B*T] as a list."""
    batch, length = x.shape[:2]
    if cu_seqlens is None:
        return x.reshape(batch * length, *x.shape[2:]), list(range(0, batch * length + 1, length))
    if batch != 1:
        raise ValueError(f"cu_seqlens needs one packed row, got a batch of {batch}")
    starts = [int(s) for s in cu_seqlens.tolist()]
    if starts[0] != 0 or starts[-1] != length or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the row's length {length}, got {starts}")
    return x[0], starts


# ---- short causal convolution -------------------------------------------------------------------------------


def _window_index(seq: torch.Tensor, end: torch.Tensor, width: int, starts: torch.Tensor, n_state: int,
                  n_seqs: int) -> torch.Tensor:
    """Rows of [conv states laid end to end; packed inputs] holding, per entry, the `width` inputs of sequence
    `seq` just before position `end` (oldest first). Positions before the sequence's start come from its own
    conv state, never from the sequence before it."""
    rel = end[:, None] - width + torch.arange(width, device=end.device)  # (M, width) positions in the sequence
    from_inputs = n_seqs * n_state + starts[seq][:, None] + rel
    from_state = seq[:, None] * n_state + n_state + rel
    return torch.where(rel >= 0, from_inputs, from_state)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                  conv_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal convolution of x (B, T, D) by weight (D, W), each sequence on its own.

    conv_state (N, D, W-1), one per sequence (N = B, or len(cu_seqlens) - 1), holds the inputs before each
    sequence (zero when None), so a sequence continues where an earlier call stopped. Returns the output
    (B, T, D) in x's dtype and the final conv state (N, D, W-1): each sequence's last W-1 inputs, reaching into
    its conv state when the sequence is shorter than that."""
    width = weight.shape[1]
    n_state = width - 1
    flat, starts_list = _as_packed(x, cu_seqlens)  # (T, D)
    n_seqs = len(starts_list) - 1
    starts = torch.tensor(starts_list, device=x.device)
    lengths = starts[1:] - starts[:-1]
    if conv_state is None:
        conv_state = x.new_zeros(n_seqs, x.shape[-1], n_state)
    states = conv_state.to(x.dtype).transpose(1, 2).reshape(n_seqs * n_state, -1)  # (N * (W-1), D)
    source = torch.cat([states, flat])
    seq = torch.repeat_interleave(torch.arange(n_seqs, device=x.device), lengths)  # (T,)
    position = torch.arange(flat.shape[0], device=x.device) - starts[seq]
    window = _window_index(seq, position + 1, width, starts, n_state, n_seqs)  # (T, W)
    out = sum(source[window[:, w]].float() * weight[:, w].float() for w in range(width))  # (T, D)
    final = _window_index(torch.arange(n_seqs, device=x.device), lengths, n_state, starts, n_state, n_seqs)
    final_state = source[final].transpose(1, 2)  # (N, D, W-1)
    return F.silu(out).to(x.dtype).reshape(x.shape), final_state.contiguous()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor,
                       conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x (N, D), conv_state (N, D, W-1). Returns the output (N, D) and the new
    conv state; the same numbers as `causal_conv1d` on (N, 1, D)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # (N, D, W)
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


# ---- gated delta rule ---------------------------------------------------------------------------------------


def _chunk_layout(starts: list[int], chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor, list, int]:
    """Where each packed token goes when every sequence starts a fresh chunk: its row in the padded layout
    (n_chunks * chunk_size), each sequence's first chunk, and for each step j of the carry the sequences that
    have a chunk j."""
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    n_chunks = [-(-length // chunk_size) for length in lengths]
    first = [sum(n_chunks[:i]) for i in range(len(n_chunks))]
    rows = torch.cat([first[i] * chunk_size + torch.arange(length) for i, length in enumerate(lengths)])
    steps = [torch.tensor([i for i, n in enumerate(n_chunks) if n > j], device=device)
             for j in range(max(n_chunks, default=0))]
    return rows.to(device), torch.tensor(first, device=device), steps, sum(n_chunks)


def _to_chunks(x: torch.Tensor, rows: torch.Tensor, n_chunks: int, chunk_size: int) -> torch.Tensor:
    """Packed (T, H, ...) to zero-padded chunks (n_chunks, H, chunk_size, ...)."""
    padded = x.new_zeros(n_chunks * chunk_size, *x.shape[1:]).index_copy(0, rows, x)
    padded = padded.reshape(n_chunks, chunk_size, *x.shape[1:])
    return padded.transpose(1, 2)


def _intra_chunk(q, k, v, g, beta):
    """Everything about a chunk that does not need the state entering it, for all chunks at once.

    q, k (C, H, L, K), v (C, H, L, V), g and beta (C, H, L), q already scaled. Within a chunk with entering state
    S0 and G_t the decay from the chunk's start through t, the corrections u_t = beta_t (v_t - read of the state
    just before t's write) solve a unit lower-triangular system (I + A) u = beta v - beta G k S0, with
    A[t, j] = beta_t (k_t . k_j) G_t / G_j for j < t. Returns (u0, w, attn, q_decayed, k_to_end, chunk_decay)
    such that u = u0 - w S0, o = q_decayed S0 + attn u, and the state leaving is chunk_decay S0 + k_to_end^T u."""
    length = q.shape[2]
    decay = g.cumsum(-1)  # (C, H, L): log G_t
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # G_t / G_j
    system = (k @ k.transpose(-1, -2)) * beta[..., None] * pairwise
    system = system.masked_fill(~lower.tril(-1), 0) + torch.eye(length, device=q.device)
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k * (beta * decay.exp())[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pairwise
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    return u0, w, attn, q * decay.exp()[..., None], k_to_end, decay[..., -1].exp()[..., None, None]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                           scale: float | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole sequences (prefill, training), chunk by chunk.

    q, k (B, T, H, K); v (B, T, H, V); g (B, T, H) the log decay (<= 0); beta (B, T, H) in (0, 1). Sequences are
    the B rows, or the spans of cu_seqlens in one packed row. initial_state (N, H, K, V) per sequence, zero when
    None. q is scaled by `scale` (1/sqrt(K) when None). Returns o (B, T, H, V) in v's dtype and the final states
    (N, H, K, V) in float32. The carry runs one chunk per sequence at a time, so its length is the longest
    sequence's chunk count."""
    out_dtype, n_heads, value_dim = v.dtype, v.shape[2], v.shape[3]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (q, starts), (k, _), (v, _), (g, _), (beta, _) = (_as_packed(x.float(), cu_seqlens) for x in (q, k, v, g, beta))
    q = q * scale
    rows, first, steps, n_chunks = _chunk_layout(starts, chunk_size, q.device)
    chunks = [_to_chunks(x, rows, n_chunks, chunk_size) for x in (q, k, v, g[..., None], beta[..., None])]
    u0, w, attn, q_decayed, k_to_end, chunk_decay = _intra_chunk(*chunks[:3], chunks[3][..., 0], chunks[4][..., 0])
    n_seqs = len(starts) - 1
    if initial_state is not None and initial_state.shape[0] != n_seqs:
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states for {n_seqs} sequences")
    state = (v.new_zeros(n_seqs, n_heads, k.shape[-1], value_dim) if initial_state is None
             else initial_state.float())
    o = v.new_zeros(n_chunks, n_heads, chunk_size, value_dim)
    for j, seqs in enumerate(steps):  # chunk j of every sequence that has one
        c = first[seqs] + j
        entering = state[seqs]  # (n, H, K, V)
        u = u0[c] - w[c] @ entering
        o = o.index_copy(0, c, q_decayed[c] @ entering + attn[c] @ u)
        state = state.index_copy(0, seqs, chunk_decay[c] * entering + k_to_end[c].transpose(-1, -2) @ u)
    o = o.transpose(1, 2).reshape(n_chunks * chunk_size, n_heads, value_dim)[rows]  # (T, H, V)
    batch = 1 if cu_seqlens is not None else n_seqs
    return o.reshape(batch, -1, n_heads, value_dim).to(out_dtype), state


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: q, k (N, H, K), v (N, H, V), g and beta (N, H), state (N, H, K, V).
    Returns o (N, H, V) in v's dtype and the new state in float32: the rule exactly as written at the top of this
    module, the reference the chunked form is checked against."""
    out_dtype = v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * scale
    state = state.float() * g.exp()[..., None, None]
    read = (state * k[..., None]).sum(-2)  # (N, H, V): S^T k
    state = state + k[..., None] * (beta[..., None] * (v - read))[..., None, :]
    return (state * q[..., None]).sum(-2).to(out_dtype), state


# ---- the layer ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedDeltaNetWeights:
    """One Gated DeltaNet layer's weights in Qwen3.5's layout: q, k and v from one projection (the convolution's
    channels, in that order), value heads grouped by the key head they share."""

    in_proj_qkv: torch.Tensor  # (2 * Hk * K + Hv * V, hidden)
    in_proj_z: torch.Tensor  # (Hv * V, hidden): the output gate
    in_proj_b: torch.Tensor  # (Hv, hidden): beta before its sigmoid
    in_proj_a: torch.Tensor  # (Hv, hidden): the decay's time step before dt_bias and softplus
    conv_weight: torch.Tensor  # (2 * Hk * K + Hv * V, W)
    dt_bias: torch.Tensor  # (Hv,)
    A_log: torch.Tensor  # (Hv,): the log of each head's decay rate
    norm_weight: torch.Tensor  # (V,)
    out_proj: torch.Tensor  # (hidden, Hv * V)
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int
    norm_eps: float


def weights_from_module(module: torch.nn.Module) -> GatedDeltaNetWeights:
    """The weights of a transformers Qwen3.5 or Qwen3-Next linear-attention module. Qwen3-Next projects q, k, v
    and z in one matrix (and b, a in another) interleaved per key head; they are cut apart here into Qwen3.5's
    layout, which is the same function of the input."""
    n_k, k_dim, v_dim = module.num_k_heads, module.head_k_dim, module.head_v_dim
    if module.activation != "silu":
        raise ValueError(f"the short convolution here applies SiLU, the module asks for {module.activation}")
    if hasattr(module, "in_proj_qkvz"):
        group = module.num_v_heads // n_k * v_dim  # value (and z) rows per key head
        q, k, v, z = module.in_proj_qkvz.weight.reshape(n_k, -1, module.hidden_size).split(
            [k_dim, k_dim, group, group], dim=1)
        qkv = torch.cat([x.reshape(-1, module.hidden_size) for x in (q, k, v)])
        b, a = module.in_proj_ba.weight.reshape(n_k, -1, module.hidden_size).chunk(2, dim=1)
        z, b, a = (x.reshape(-1, module.hidden_size) for x in (z, b, a))
    else:
        qkv, z, b, a = (getattr(module, f"in_proj_{n}").weight for n in ("qkv", "z", "b", "a"))
    return GatedDeltaNetWeights(
        in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a, conv_weight=module.conv1d.weight[:, 0],
        dt_bias=module.dt_bias, A_log=module.A_log, norm_weight=module.norm.weight, out_proj=module.out_proj.weight,
        num_k_heads=n_k, head_k_dim=k_dim, head_v_dim=v_dim, norm_eps=module.norm.variance_epsilon)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dim scaled to unit length, in float32, so the delta rule's updates stay contractions."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of each head's output (in float32, back to x's dtype before the weight), then the SiLU gate."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def _rule_inputs(qkv: torch.Tensor, hidden: torch.Tensor, weights: GatedDeltaNetWeights, normed: bool = True):
    """The delta rule's q, k (..., Hv, K), v (..., Hv, V), g and beta (..., Hv) from the convolved qkv and the
    layer's input, any leading dims. q and k are unit length, each key head repeated for its value heads; with
    `normed` False they are neither (..., Hk, K), as fla's kernels take them."""
    k_dim, v_dim, n_v = weights.head_k_dim, weights.head_v_dim, weights.in_proj_b.shape[0]
    key_width = weights.num_k_heads * k_dim
    q, k, v = qkv.split([key_width, key_width, n_v * v_dim], dim=-1)
    q, k = (x.unflatten(-1, (-1, k_dim)) for x in (q, k))
    if normed:
        repeat = n_v // weights.num_k_heads  # value heads sharing one key head
        q, k = (_l2norm(x).repeat_interleave(repeat, dim=-2) for x in (q, k))
    beta = torch.sigmoid(hidden @ weights.in_proj_b.T)
    g = -weights.A_log.float().exp() * F.softplus((hidden @ weights.in_proj_a.T).float() + weights.dt_bias)
    return q, k, v.unflatten(-1, (n_v, v_dim)), g, beta


def fla_delta_rule(x: torch.Tensor) -> Callable | None:
    """flash-linear-attention's chunked gated delta rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`:
    Triton kernels for the forward and the backward over packed sequences) where it serves x: with `USE_FLA` on, on
    CUDA, in bf16 or fp16, with the package installed. None elsewhere: this module's rule runs instead (float32
    activations keep it, so a float32 engine or trainer stays within float32 rounding of the torch forward)."""
    if not (USE_FLA and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
    except ImportError:
        return None
    return rule


# Off until fla's kernels have been checked against this module's rule on a GPU and timed there
# (tests/test_linear_attention.py's test_fla_kernels_against_the_torch_rule, benchmarks/train.py); the path is
# checked on the CPU against a stand-in of fla's documented contract only.
USE_FLA = False


def _fla_rule(rule: Callable, qkv: torch.Tensor, hidden: torch.Tensor, weights: GatedDeltaNetWeights,
              cu_seqlens: torch.Tensor | None,
              initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule through fla's kernels: q and k normed in the kernel, each key head serving its value heads
    as `repeat_interleave` lays them out (its grouped-value form), the state in float32. Returns o (B, T, Hv, V) in
    v's dtype and the final states (N, Hv, K, V) in float32, as `chunk_gated_delta_rule` does."""
    q, k, v, g, beta = (x.contiguous() for x in _rule_inputs(qkv, hidden, weights, normed=False))
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device, torch.long)
    if initial_state is not None:
        initial_state = initial_state.float()
    return rule(q, k, v, g, beta, scale=weights.head_k_dim ** -0.5, initial_state=initial_state,
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)


def _layer_output(o: torch.Tensor, hidden: torch.Tensor, weights: GatedDeltaNetWeights) -> torch.Tensor:
    """The rule's output o (..., Hv, V) normed per head, gated by the input's z projection, projected out."""
    z = (hidden @ weights.in_proj_z.T).unflatten(-1, o.shape[-2:])
    return _gated_rms_norm(o, z, weights.norm_weight, weights.norm_eps).flatten(-2) @ weights.out_proj.T


def gated_deltanet_forward(hidden: torch.Tensor, weights: GatedDeltaNetWeights, *,
                           cu_seqlens: torch.Tensor | None = None, conv_state: torch.Tensor | None = None,
                           recurrent_state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer over hidden (B, T, hidden), sequences being the rows or cu_seqlens' spans of one
    packed row, each continuing from its conv and recurrent state when given. Returns the output (B, T, hidden)
    and each sequence's final conv state (N, conv channels, W-1) and recurrent state (N, Hv, K, V)."""
    qkv, conv_state = causal_conv1d(hidden @ weights.in_proj_qkv.T, weights.conv_weight, cu_seqlens=cu_seqlens,
                                    conv_state=conv_state)
    if (rule := fla_delta_rule(qkv)) is not None and chunk_size == CHUNK_SIZE:
        o, recurrent_state = _fla_rule(rule, qkv, hidden, weights, cu_seqlens, recurrent_state)
    else:
        o, recurrent_state = chunk_gated_delta_rule(*_rule_inputs(qkv, hidden, weights), cu_seqlens=cu_seqlens,
                                                    initial_state=recurrent_state, chunk_size=chunk_size)
    return _layer_output(o, hidden, weights), conv_state, recurrent_state


def gated_deltanet_step(hidden: torch.Tensor, weights: GatedDeltaNetWeights, conv_state: torch.Tensor,
                        recurrent_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer for one decode token per sequence: hidden (N, hidden) and the states `gated_deltanet_forward`
    returned. Returns the output (N, hidden) and the new states."""
    qkv, conv_state = causal_conv1d_step(hidden @ weights.in_proj_qkv.T, weights.conv_weight, conv_state)
    o, recurrent_state = gated_delta_step(*_rule_inputs(qkv, hidden, weights), recurrent_state)
    return _layer_output(o, hidden, weights), conv_state, recurrent_state


def gated_deltanet_step_(hidden: torch.Tensor, weights: GatedDeltaNetWeights, conv_state: torch.Tensor,
                         recurrent_state: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """`gated_deltanet_step` on CUDA with the delta rule in one Triton kernel (rl/model/kernels/delta_rule_triton.py):
    advances the states of the `live` rows in place, leaves the others', and returns the output (N, hidden)."""
    from rl.model.kernels.delta_rule_triton import gated_delta_step_

    qkv, new_conv = causal_conv1d_step(hidden @ weights.in_proj_qkv.T, weights.conv_weight, conv_state)
    conv_state.copy_(torch.where(live[:, None, None], new_conv, conv_state))
    o = gated_delta_step_(*_rule_inputs(qkv, hidden, weights), recurrent_state, live)
    return _layer_output(o, hidden, weights)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Gated DeltaNet modules of a transformers model (Qwen3-Next, Qwen3.5), in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


_HOST_STARTS: list = [None, None]  # the last cu_seqlens a forward brought, and its host copy


def host_starts(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """cu_seqlens on the host, copied once per forward: every layer of a forward (and its recomputation) gets the
    same tensor, and the functions here read the starts on the host (a device sync for each read otherwise)."""
    if cu_seqlens is None or cu_seqlens.device.type == "cpu":
        return cu_seqlens
    if _HOST_STARTS[0] is not cu_seqlens:
        _HOST_STARTS[:] = [cu_seqlens, cu_seqlens.cpu()]
    return _HOST_STARTS[1]


@torch.compiler.disable  # its layout reads the sequences' starts on the host: compiled, each count of them recompiles
def packed_linear_forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs):
    """The module's forward for the trainer: without a cache, `gated_deltanet_forward` over the rows, or over the
    sequences of a packed row where `cu_seq_lens_q` marks them; with a cache (generation), transformers' own."""
    if cache_params is not None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                  **kwargs)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)  # padding reads as 0
    starts = host_starts(kwargs.get("cu_seq_lens_q"))

    def layer(hidden: torch.Tensor) -> torch.Tensor:  # the weights read at each call: FSDP2's, gathered again
        return gated_deltanet_forward(hidden, weights_from_module(self), cu_seqlens=starts)[0]

    if not torch.is_grad_enabled():
        return layer(hidden_states)
    # Keeps only the layer's input for backward and computes the layer again there: the chunked rule in plain
    # PyTorch saves ~450 KiB a token (Qwen3.5-1.5B's widths: the convolution's float32 windows, every chunk's
    # intermediates and the state entering each chunk), 18 such layers more than an 80 GB card holds at 8192
    # tokens; one layer's, during its own backward, is what the memory plan counts.
    return checkpoint(layer, hidden_states, use_reentrant=False)


def use_packed_linear_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Patches every Gated DeltaNet module of `model` to `packed_linear_forward`; returns them (none for a model
    without linear attention, which is left as it is). Works on a meta model: only forwards change. Called after
    LoRA: the forward reads the projections' weights, so an adapter on them would be skipped, and is refused."""
    modules = linear_attention_modules(model)
    for module in modules:
        if module.activation != "silu":
            raise ValueError(f"{type(module).__name__}: the short convolution here applies SiLU, the module asks for "
                             f"{module.activation}")
        if adapted := sorted(name for name, child in module.named_children() if hasattr(child, "lora_A")):
            raise ConfigError(f"lora.target_modules: the linear-attention layers' {', '.join(adapted)} take no "
                              f"adapters here; leave them out (the full-attention and MLP layers take them)")
        module.forward = types.MethodType(packed_linear_forward, module)
    model.packed_linear_attention = bool(modules)  # what train.packing asks (packed_linear_kinds)
    return modules
