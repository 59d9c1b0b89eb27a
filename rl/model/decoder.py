"""The native engine's own forward pass for decoder-only Llama / Qwen2 / Qwen3 / Gemma 3 models over a paged KV
cache.

At the boundary the weights keep the HF state-dict names (`load_weights` receives exactly what
the trainer pushes); inside they are stored fused, q/k/v rows in one matrix and gate/up in another,
so a decoder block runs four GEMMs instead of seven. Tokens move as one flat (T, hidden) batch:
prefill packs right-padded prompts and attends causally through SDPA (right padding needs no mask:
a real token never looks past itself), decode feeds one token per sequence and reads each context
through its block table. Qwen3's QK-norm (an RMSNorm over each q and k head) runs just before RoPE, inside
the same kernel on CUDA. Gemma 3 adds norms after attention and after the MLP, scales its norms by (1 + w),
its embedding by sqrt(hidden), runs GeGLU, and gives its sliding-window layers their own RoPE tables and
a window that every attention path (SDPA's mask, the paged kernels' loops) applies; the engine may keep those
layers' KV in a cache of their own (`set_window_layers`, `WindowCache`: each sequence's last window only, through
block tables of its own). RoPE tables come from the
HF model's own rotary class, so every rope_type/rope_scaling the config names is honoured exactly. Each op runs
its torch reference from rl/model/kernels/ on the CPU and its Triton kernel from there on CUDA and in batch-invariant
mode. With `precision="fp8"` the four matrices of each block (qkv, o, gate_up, down) are held in FP8 e4m3 with
per-channel or per-block scales (rl/model/fp8.py), quantized tensor by tensor as the trainer pushes them, and every
product with them goes through rl/model/fp8.py's linear; the embedding, the norms and the lm_head keep the engine dtype.
With `kv_precision="fp8"` the attention layers' KV cache is e4m3 with float32 scales per layer and KV head (`kv_scale`,
set by each layer's first write after `reset_kv_scales`, through the torch store): every store quantizes, every read
of the cache dequantizes (rl/model/fp8.py).

Qwen2-MoE and Qwen3-MoE run their sparse layers' MoE blocks through rl/model/moe.py's `route` and `grouped_mlp`, the
functions the trainer's grouped blocks call, with the experts held fused as transformers holds them
(`experts.gate_up` (E, 2 * I, H), `experts.down` (E, H, I), both in the engine dtype under FP8 too). Every forward
returns the top-k expert ids each token took in each MoE layer, which the engine records for routing replay.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM

from rl.model import fp8
from rl.model.kernels import attention
from rl.model.kernels.attention import causal_attention, paged_attention_reference, paged_prefill_reference
from rl.model.kernels.rms_norm import rms_norm_reference
from rl.model.kernels.rope import full_table, rope_reference, rope_tables
from rl.model.kernels.silu import gelu_mul_reference, silu_mul_reference
from rl.model.linear_attention import (GatedDeltaNetWeights, gated_deltanet_forward, gated_deltanet_step,
                                      gated_deltanet_step_)
from rl.model.moe import grouped_mlp, route
from rl.model.shape import ModelShape

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "qwen2_moe", "qwen3_moe", "qwen3_5_text",
                         "qwen3_next")
ACTIVATIONS = {"llama": "silu", "qwen2": "silu", "qwen3": "silu", "gemma3_text": "gelu_pytorch_tanh",
               "qwen2_moe": "silu", "qwen3_moe": "silu", "qwen3_5_text": "silu", "qwen3_next": "silu"}
# A Gated DeltaNet layer's HF tensors (under `linear_attn.`) -> the engine's (under `linear.`), kept as they are.
LINEAR_TENSORS = {"in_proj_qkv.weight": "in_proj_qkv", "in_proj_z.weight": "in_proj_z", "in_proj_b.weight": "in_proj_b",
                  "in_proj_a.weight": "in_proj_a", "conv1d.weight": "conv", "dt_bias": "dt_bias", "A_log": "A_log",
                  "norm.weight": "norm", "out_proj.weight": "out_proj"}
# Qwen3-Next's instead of the four projections: q, k, v, z and b, a fused per key head (cut apart in the forward)
INTERLEAVED_TENSORS = {"in_proj_qkvz.weight": "in_proj_qkvz", "in_proj_ba.weight": "in_proj_ba"}
# Decode steps on CUDA of at most this many rows run the qkv and MLP GEMMs in the layouts measured
# fastest for them (DecoderModel.qkv_and_rope and .mlp; benchmarks/ARCHIVE.md, "Decode GEMM layouts").
SMALL_BATCH_ROWS = 256
QKV_SPLITS = 2
DOWN_SPLITS = 2
# The prefill's attention kernels. Not cuDNN's: it builds a plan for every new shape, and every prefill comes in
# shapes of its own (a partial rollout's continued samples above all): 200k tokens of them took ~1.2 s through
# cuDNN against 0.41-0.46 s through FlashAttention on an H200 (benchmarks/RESULTS.md, "The prefill's attention, and
# partial rollouts after it").
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# The internal tensors (per layer) that `precision="fp8"` holds in FP8; the rest keep the engine dtype.
FP8_LINEARS = ("qkv.weight", "o.weight", "gate_up", "down")


class Shape(ModelShape):
    """A model shape the native engine runs: Llama, Qwen2, Qwen3, Qwen2-MoE or Qwen3-MoE (SwiGLU with silu, no MLP
    bias, no sliding window) or Gemma 3 text; anything else is refused with the reason
    (`check_native_architecture` turns it into one line)."""

    @classmethod
    def from_hf(cls, cfg) -> Shape:
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the native engine supports model_type {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act != ACTIVATIONS[model_type]:
            raise ValueError(f"{model_type}: the activation {act!r} is not supported ({ACTIVATIONS[model_type]} only)")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError(f"{model_type}: mlp_bias=True is not supported by the native engine")
        sliding = getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None)
                                                                                        or ())
        if sliding and model_type != "gemma3_text":
            raise ValueError(f"{model_type}: sliding-window attention is not supported by the native engine")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(cfg, key, None):
                raise ValueError(f"{model_type}: {key}={getattr(cfg, key)!r} is not supported by the native engine")
        return super().from_hf(cfg)


@dataclass
class WindowCache:
    """The KV cache of the layers `DecoderModel.set_window_layers` names (sliding-window layers) and the block tables
    into it, (N, pages) as the global cache's: a forward writes and reads those layers' keys and values there, the
    other layers' in the global cache. `slots`: in a decode step, each row's slot for its fed token (a prefill
    computes them from the tables)."""

    kv: torch.Tensor  # (2, window layers, slots, KV heads, D)
    tables: torch.Tensor
    slots: torch.Tensor | None = None


@dataclass
class LinearState:
    """The linear-attention layers' states of the sequences a forward runs, (N, linear layers, ...): the short
    convolution's (conv channels, kernel - 1) in the engine dtype and the delta rule's (value heads, K, V) in float32.
    A prefill starts each sequence from its rows and writes its final states back into them; a decode step advances
    the rows where `live` is set (a finished row feeds its last token again, which must not move its state)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    live: torch.Tensor | None = None


# HF name -> (internal tensor, first row, last row); rows None means the whole tensor.
Slot = tuple[str, int | None, int | None]


def hf_name_map(s: Shape) -> dict[str, Slot]:
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    names: dict[str, Slot] = {"model.embed_tokens.weight": ("embed", None, None),
                              "model.norm.weight": ("norm", None, None),
                              "lm_head.weight": ("embed" if s.tie_word_embeddings else "lm_head", None, None)}
    if s.attn_output_gate:  # q_proj holds each head's q and its output gate: one range, cut apart in the forward
        q *= 2
    for i in range(s.num_layers):
        hf, own = f"model.layers.{i}.", f"layers.{i}."
        names |= {f"{hf}input_layernorm.weight": (f"{own}input_norm", None, None),
                  f"{hf}post_attention_layernorm.weight": (f"{own}post_norm", None, None)}
        if s.is_linear(i):
            names |= {f"{hf}linear_attn.{name}": (f"{own}linear.{key}", None, None)
                      for name, key in linear_tensor_names(s).items()}
            names |= mlp_name_map(s, i, hf, own)
            continue
        for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
            names[f"{hf}self_attn.q_proj.{kind}"] = (f"{own}qkv.{kind}", 0, q)
            names[f"{hf}self_attn.k_proj.{kind}"] = (f"{own}qkv.{kind}", q, q + kv)
            names[f"{hf}self_attn.v_proj.{kind}"] = (f"{own}qkv.{kind}", q + kv, q + 2 * kv)
        if s.qk_norm:
            names[f"{hf}self_attn.q_norm.weight"] = (f"{own}q_norm", None, None)
            names[f"{hf}self_attn.k_norm.weight"] = (f"{own}k_norm", None, None)
        names[f"{hf}self_attn.o_proj.weight"] = (f"{own}o.weight", None, None)
        if s.o_bias:
            names[f"{hf}self_attn.o_proj.bias"] = (f"{own}o.bias", None, None)
        names |= mlp_name_map(s, i, hf, own)
        names[f"{hf}input_layernorm.weight"] = (f"{own}input_norm", None, None)
        if s.sandwich_norms:  # Gemma: post_attention_layernorm normalises attention's output, the MLP's input
            names[f"{hf}post_attention_layernorm.weight"] = (f"{own}attn_out_norm", None, None)
            names[f"{hf}pre_feedforward_layernorm.weight"] = (f"{own}post_norm", None, None)
            names[f"{hf}post_feedforward_layernorm.weight"] = (f"{own}mlp_out_norm", None, None)
        else:
            names[f"{hf}post_attention_layernorm.weight"] = (f"{own}post_norm", None, None)
    return names


def linear_tensor_names(s: Shape) -> dict[str, str]:
    """A linear-attention layer's HF tensor names (under `linear_attn.`) -> the engine's (under `linear.`)."""
    if not s.linear_interleaved:
        return LINEAR_TENSORS
    return {**{k: v for k, v in LINEAR_TENSORS.items() if not k.startswith("in_proj_")}, **INTERLEAVED_TENSORS}


def interleaved_row_order(s: Shape, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused projections, each key head's q, k, v, z rows (and b, a rows) side by side: the rows of the
    HF tensor in the order the engine holds them (each part's heads together: q, k, v, z; b, a), so that the forward
    takes each part as a view. Internal name -> the HF rows to take, in order, on `device` ({} for other models)."""
    if not s.linear_interleaved:
        return {}
    n_k, k_dim = s.linear_key_heads, s.linear_key_dim
    group = s.linear_value_heads // n_k
    qkvz = torch.arange(n_k * (2 * k_dim + 2 * group * s.linear_value_dim), device=device).reshape(n_k, -1)
    ba = torch.arange(n_k * 2 * group, device=device).reshape(n_k, -1)
    qkvz = torch.cat([part.reshape(-1) for part in qkvz.split([k_dim, k_dim, group * s.linear_value_dim,
                                                               group * s.linear_value_dim], dim=1)])
    ba = torch.cat([part.reshape(-1) for part in ba.chunk(2, dim=1)])
    return {f"layers.{i}.linear.{key}": order for i in s.linear_layers
            for key, order in (("in_proj_qkvz", qkvz), ("in_proj_ba", ba))}


def mlp_name_map(s: Shape, layer: int, hf: str, own: str) -> dict[str, Slot]:
    """Layer `layer`'s MLP: a MoE block's names, or the gated MLP's three matrices."""
    if s.is_moe(layer):
        return moe_name_map(s, hf, own)
    inter = s.intermediate_size
    return {f"{hf}mlp.gate_proj.weight": (f"{own}gate_up", 0, inter),
            f"{hf}mlp.up_proj.weight": (f"{own}gate_up", inter, 2 * inter),
            f"{hf}mlp.down_proj.weight": (f"{own}down", None, None)}


def moe_name_map(s: Shape, hf: str, own: str) -> dict[str, Slot]:
    """One MoE block's HF names: the router, the fused experts as they are, Qwen2-MoE's shared expert and its gate."""
    shared = s.shared_expert_intermediate_size
    names: dict[str, Slot] = {f"{hf}mlp.gate.weight": (f"{own}router", None, None),
                              f"{hf}mlp.experts.gate_up_proj": (f"{own}experts.gate_up", None, None),
                              f"{hf}mlp.experts.down_proj": (f"{own}experts.down", None, None)}
    if shared:
        names |= {f"{hf}mlp.shared_expert.gate_proj.weight": (f"{own}shared.gate_up", 0, shared),
                  f"{hf}mlp.shared_expert.up_proj.weight": (f"{own}shared.gate_up", shared, 2 * shared),
                  f"{hf}mlp.shared_expert.down_proj.weight": (f"{own}shared.down", None, None),
                  f"{hf}mlp.shared_expert_gate.weight": (f"{own}shared_gate", None, None)}
    return names


def mlp_shapes(s: Shape, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP tensors: the dense MLP's two, or a MoE block's router, experts and shared expert."""
    h, own = s.hidden_size, f"layers.{layer}."
    if not s.is_moe(layer):
        return {f"{own}gate_up": (2 * s.intermediate_size, h), f"{own}down": (h, s.intermediate_size)}
    inter, shared = s.moe_intermediate_size, s.shared_expert_intermediate_size
    shapes = {f"{own}router": (s.num_experts, h), f"{own}experts.gate_up": (s.num_experts, 2 * inter, h),
              f"{own}experts.down": (s.num_experts, h, inter)}
    if shared:
        shapes |= {f"{own}shared.gate_up": (2 * shared, h), f"{own}shared.down": (h, shared),
                   f"{own}shared_gate": (1, h)}
    return shapes


def linear_shapes(s: Shape, layer: int) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors, as transformers' Qwen3.5 module holds them."""
    h, own, value = s.hidden_size, f"layers.{layer}.linear.", s.linear_value_heads * s.linear_value_dim
    heads = s.linear_value_heads
    projections = ({f"{own}in_proj_qkvz": (s.linear_conv_channels + value, h), f"{own}in_proj_ba": (2 * heads, h)}
                   if s.linear_interleaved else
                   {f"{own}in_proj_qkv": (s.linear_conv_channels, h), f"{own}in_proj_z": (value, h),
                    f"{own}in_proj_b": (heads, h), f"{own}in_proj_a": (heads, h)})
    return {**projections, f"{own}conv": (s.linear_conv_channels, 1, s.linear_conv_kernel), f"{own}dt_bias": (heads,),
            f"{own}A_log": (heads,), f"{own}norm": (s.linear_value_dim,), f"{own}out_proj": (h, value)}


def internal_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    h = s.hidden_size
    qkv = ((2 if s.attn_output_gate else 1) * s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    shapes = {"embed": (s.vocab_size, h), "norm": (h,)}
    if not s.tie_word_embeddings:
        shapes["lm_head"] = (s.vocab_size, h)
    for i in range(s.num_layers):
        if s.is_linear(i):
            shapes |= {**linear_shapes(s, i), **mlp_shapes(s, i), f"layers.{i}.input_norm": (h,),
                       f"layers.{i}.post_norm": (h,)}
            continue
        shapes |= {f"layers.{i}.qkv.weight": (qkv, h), f"layers.{i}.o.weight": (h, s.num_heads * s.head_dim),
                   **mlp_shapes(s, i), f"layers.{i}.input_norm": (h,), f"layers.{i}.post_norm": (h,)}
        if s.qkv_bias:
            shapes[f"layers.{i}.qkv.bias"] = (qkv,)
        if s.o_bias:
            shapes[f"layers.{i}.o.bias"] = (h,)
        if s.qk_norm:
            shapes |= {f"layers.{i}.q_norm": (s.head_dim,), f"layers.{i}.k_norm": (s.head_dim,)}
        if s.sandwich_norms:
            shapes |= {f"layers.{i}.attn_out_norm": (h,), f"layers.{i}.mlp_out_norm": (h,)}
    return shapes


def fp8_row_ranges(s: Shape) -> dict[str, list[tuple[int, int]]]:
    """Each FP8 tensor (FP8_LINEARS) -> the row ranges of the HF tensors it is fused from, in order (q, k, v; gate,
    up; o and down are one range each): each range is quantized on its own as it arrives."""
    shapes = internal_shapes(s)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for key, start, end in hf_name_map(s).values():
        if key.split(".", 2)[-1] in FP8_LINEARS:
            ranges.setdefault(key, []).append((start or 0, shapes[key][0] if end is None else end))
    return {key: sorted(rows) for key, rows in ranges.items()}


def scale_rows(rows: list[tuple[int, int]], block: int) -> list[int]:
    """The first scale row of each row range of a per-block FP8 tensor: each range has its own grid of tiles (a
    tile never spans two of the HF tensors, so one can be pushed alone), cdiv(rows, block) scale rows each."""
    firsts, at = [], 0
    for start, end in rows:
        firsts.append(at)
        at += fp8.cdiv(end - start, block)
    return firsts + [at]


def internal_tensors(s: Shape, precision: str = "bf16", block: int = 0
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor the engine holds -> (shape, dtype; None: the engine dtype). With `precision="fp8"` each FP8
    tensor is e4m3 and has float32 scales beside it under `<name>.scale`: (rows, 1), or per block of `block`
    (`scale_rows`' count, cdiv(columns, block))."""
    shapes = internal_shapes(s)
    if precision != "fp8":
        return {key: (shape, None) for key, shape in shapes.items()}
    ranges = fp8_row_ranges(s)
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for key, shape in shapes.items():
        out[key] = (shape, fp8.E4M3 if key in ranges else None)
        if key in ranges:
            scales = (scale_rows(ranges[key], block)[-1], fp8.cdiv(shape[1], block)) if block else (shape[0], 1)
            out[f"{key}.scale"] = (scales, torch.float32)
    return out


class DecoderModel:
    """Weights (`self.weights`, internal names) and the forward; owns no KV cache and no batch state."""

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype, max_positions: int,
                 batch_invariant: bool = False, precision: str = "bf16", fp8_scale: str = "channel",
                 kv_precision: str = "auto"):
        self.shape = Shape.from_hf(hf_config)
        self.device, self.dtype = torch.device(device), dtype
        if precision == "fp8" and batch_invariant:
            raise ValueError("FP8 weights cannot be batch-invariant with a bf16 trainer: turn one off")
        if kv_precision == "fp8" and batch_invariant:
            raise ValueError("an FP8 KV cache cannot be batch-invariant with a bf16 trainer: turn one off")
        # FP8 KV cache (rl/model/fp8.py): the attention layers' keys and values in e4m3, each layer's K and V scales
        # (KV heads,) in `kv_scale` (2, layers, KV heads), set by the layer's first write after `reset_kv_scales`.
        self.kv_fp8 = kv_precision == "fp8"
        self.kv_dtype = fp8.E4M3 if self.kv_fp8 else dtype
        self.kv_scale = torch.ones(2, self.shape.num_layers, self.shape.num_kv_heads, device=self.device)
        self.kv_scaled: set[int] = set()
        if self.shape.moe_layers and batch_invariant:  # a grouped GEMM's rows per expert change with the batch
            raise ValueError(f"{hf_config.model_type}: batch-invariant mode does not cover MoE blocks")
        if self.shape.linear_layers and (batch_invariant or precision == "fp8"):
            raise ValueError(f"{hf_config.model_type}: the native engine's linear-attention layers have no "
                             f"{'batch-invariant' if batch_invariant else 'FP8'} form yet; turn it off")
        self.fp8 = precision == "fp8"
        self.init_fp8(fp8_scale)
        # Triton kernels instead of the torch definitions below: on CUDA, and in batch-invariant mode
        # (there every op is a kernel the trainer's forward calls too; see rl/model/invariant.py).
        self.batch_invariant = batch_invariant
        self.fused = self.device.type == "cuda" or batch_invariant
        self.linear = F.linear
        if batch_invariant:
            from rl.model.kernels.linear_triton import linear

            self.linear = linear
        reference = _hf_reference(hf_config)
        self.hf_shapes = {n: tuple(p.shape) for n, p in reference.named_parameters(remove_duplicate=False)}
        self.hf_buffers = {n for n, _ in reference.named_buffers(remove_duplicate=False)}
        self.name_map = hf_name_map(self.shape)
        self.row_order = interleaved_row_order(self.shape, self.device)  # tensors loaded with their rows reordered
        unknown = sorted(self.hf_shapes.keys() - self.name_map.keys())
        if unknown:
            raise ValueError(f"{hf_config.model_type}: parameters the native engine does not implement: {unknown[:4]}")
        # Each layer's cos/sin tables, one pair per RoPE (Gemma 3: its sliding and its global layers').
        kinds = self.shape.rope_kinds or (None,) * self.shape.num_layers
        tables = {kind: rope_tables(reference, max_positions, self.device, dtype, kind) for kind in set(kinds)}
        self.layer_tables = [tables[kind] for kind in kinds]
        self.weights: dict[str, torch.Tensor] = {}
        self.set_window_layers(())

    def reset_kv_scales(self) -> None:
        """A new (empty) FP8 KV cache: each layer's next write sets its scales (in place: graphs read them)."""
        self.kv_scale.fill_(1.0)
        self.kv_scaled.clear()

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s K and V scales (KV heads,) of an FP8 KV cache; (None, None) for a cache in the engine
        dtype."""
        return (self.kv_scale[0, layer], self.kv_scale[1, layer]) if self.kv_fp8 else (None, None)

    def set_window_layers(self, layers: tuple[int, ...]) -> None:
        """Keeps the KV of `layers` (sliding-window ones) in a `WindowCache`, the others in the global cache: each
        layer's (in the window cache?, index in its cache); linear-attention layers keep no KV and take no index."""
        for i in layers:
            if not self.shape.window(i):
                raise ValueError(f"layer {i} has no sliding window: its KV cannot live in the window cache")
        s = self.shape
        self.cache_index = [(i in layers, sum((j in layers) == (i in layers) and not s.is_linear(j) for j in range(i)))
                            for i in range(s.num_layers)]

    def layer_cache(self, layer: int, kv: torch.Tensor, tables: torch.Tensor, window: WindowCache | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s key cache, value cache and block tables."""
        windowed, index = self.cache_index[layer]
        if windowed:
            return window.kv[0, index], window.kv[1, index], window.tables
        return kv[0, index], kv[1, index], tables

    def init_fp8(self, fp8_scale: str) -> None:
        """The FP8 layout (`internal_tensors`): the tile size, and per block each FP8 tensor's row -> scale row and
        each row range's first scale row; torch._scaled_mm where the device has it (rl/model/fp8.py)."""
        self.fp8_block = fp8.BLOCK if self.fp8 and fp8_scale == "block" else 0
        self.tensors = internal_tensors(self.shape, "fp8" if self.fp8 else "bf16", self.fp8_block)
        self.fp8_ranges = fp8_row_ranges(self.shape) if self.fp8 else {}
        self.scale_start: dict[tuple[str, int], int] = {}
        self.row_block: dict[str, torch.Tensor] = {}
        for key, rows in self.fp8_ranges.items() if self.fp8_block else ():
            firsts = scale_rows(rows, self.fp8_block)
            self.scale_start |= {(key, start): first for (start, _), first in zip(rows, firsts)}
            self.row_block[key] = torch.cat([first + torch.arange(end - start) // self.fp8_block
                                             for (start, end), first in zip(rows, firsts)]).to(self.device)
        self.scaled_mm = self.fp8 and fp8.scaled_mm_supported(self.device)

    @torch.no_grad()
    def load_fp8(self, key: str, start: int | None, end: int | None, tensor: torch.Tensor) -> None:
        """Quantizes a pushed tensor (rows [start, end) of FP8 tensor `key`; None: all of it) into its rows and
        its scales, on the engine's device: one tensor's float32 copy at a time, never a second model."""
        q, scale = fp8.quantize(tensor.to(self.device), self.fp8_block)
        rows = slice(start, end)
        self.weights[key][rows].copy_(q)
        if self.fp8_block:
            first = self.scale_start[(key, start or 0)]
            rows = slice(first, first + scale.shape[0])
        self.weights[f"{key}.scale"][rows].copy_(scale)

    def matrix(self, key: str) -> torch.Tensor | fp8.Fp8Weight:
        """The weight of linear layer `key` as `matmul` takes it: the tensor, or its FP8 weight and scales."""
        if key not in self.fp8_ranges:
            return self.weights[key]
        return fp8.Fp8Weight(self.weights[key], self.weights[f"{key}.scale"], self.fp8_block, self.row_block.get(key))

    def matmul(self, x: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """x @ weight^T (+ bias): an FP8 weight through rl/model/fp8.py, else `self.linear`."""
        if isinstance(weight, fp8.Fp8Weight):
            return fp8.linear(x, weight, bias, self.scaled_mm)
        return self.linear(x, weight, bias)

    # ------------------------------------------------------------------ ops (Triton on CUDA, torch elsewhere)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        if self.fused:
            from rl.model.kernels.rms_norm_triton import add_rms_norm

            return add_rms_norm(x, residual, weight, s.rms_norm_eps, s.norm_plus_one, self.dtype)
        if residual is not None:
            x = x + residual
        return rms_norm_reference(x, weight, s.rms_norm_eps, s.norm_plus_one), x

    def rope_and_store(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor | None = None,
                       qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None, layer: int = 0) -> torch.Tensor:
        """Rotates q and k of `qkv` in place (each head normalised first by the `qk_norm` weights) with layer
        `layer`'s RoPE, writes k and v to their cache slots and returns `qkv`; on the fused path `qkv` may be
        split-K partial sums, summed with `bias`, and q alone comes back."""
        s = self.shape
        cos, sin = self.layer_tables[layer]
        k_scale, v_scale = self.layer_scales(layer)
        # An FP8 cache's first write to a layer sets its scales from the keys and values it writes: the torch path.
        scaling = self.kv_fp8 and layer not in self.kv_scaled
        if self.fused and not s.rotary_dim and not scaling:  # the kernel rotates whole heads: a partial RoPE takes
            from rl.model.kernels.rope_triton import rope_and_store  # the torch path

            q = rope_and_store(qkv, positions, slots, cos, sin, k_cache, v_cache, s.num_heads, s.num_kv_heads,
                               s.head_dim, bias=bias, qk_norm=(*qk_norm, s.rms_norm_eps) if qk_norm else None,
                               plus_one=s.norm_plus_one, k_scale=k_scale, v_scale=v_scale, dtype=self.dtype)
            return q if qkv.dim() == 3 else qkv
        if qkv.dim() == 3:  # split-K partial sums
            qkv = (qkv.sum(0) + (0 if bias is None else bias)).to(self.dtype)
        q, k, v = split_qkv(qkv, s)
        cos, sin = (full_table(t[positions])[:, None, :] for t in (cos, sin))  # (T, 1, rotated D)
        for x, norm in zip((q, k), qk_norm or (None, None)):  # in the activation dtype, as the HF forward rotates
            if norm is not None:
                x = x.copy_(rms_norm_reference(x, norm, s.rms_norm_eps, s.norm_plus_one))
            rotated = x[..., : cos.shape[-1]]  # a partial RoPE leaves the rest of each head as it is
            rotated.copy_(rope_reference(rotated, cos, sin))
        if self.kv_fp8:
            if scaling:
                k_scale.copy_(fp8.kv_scales(k))
                v_scale.copy_(fp8.kv_scales(v))
                self.kv_scaled.add(layer)
            # as bytes: index_copy_ has no float8 form on the CPU
            k_cache.view(torch.uint8).index_copy_(0, slots, fp8.quantize_kv(k, k_scale).view(torch.uint8))
            v_cache.view(torch.uint8).index_copy_(0, slots, fp8.quantize_kv(v, v_scale).view(torch.uint8))
            return qkv
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        return qkv

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation: silu(gate) * up, or Gemma's gelu_tanh(gate) * up."""
        gelu = self.shape.activation == "gelu_tanh"
        if self.fused:
            from rl.model.kernels.silu_triton import silu_mul

            return silu_mul(gate_up, gelu=gelu)
        return (gelu_mul_reference if gelu else silu_mul_reference)(*gate_up.chunk(2, dim=-1))

    # ------------------------------------------------------------------ forward

    def layers(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
               attend: Callable[[int, torch.Tensor], torch.Tensor], decode: bool = False,
               window: WindowCache | None = None, mix: Callable[[int, torch.Tensor], torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Runs every decoder block over tokens (T,); returns (x, residual) before the final norm, and the expert
        ids each token took in each MoE layer, (MoE layers, T, k) (None for a dense model).

        Each block writes its rotated keys and values to `slots` of `kv` (2, layers, slots, KV, D) (a layer in the
        window cache to `window.slots` of `window.kv`);
        `attend(layer, qkv)` returns the attention output (T, heads * D) from the rotated `qkv` (whose
        first heads * D columns are q). With `decode`, x may come as float32 partial sums (see `mlp`). `mix(layer, h)`:
        a linear-attention layer's output from its normalised input h (T, hidden).
        """
        w, s = self.weights, self.shape
        x = F.embedding(tokens, w["embed"])
        if s.embed_scale != 1.0:  # Gemma: times sqrt(hidden), the factor rounded to the activation dtype as HF does
            x = x * torch.tensor(s.embed_scale, dtype=x.dtype)
        residual, experts = None, []
        for i in range(s.num_layers):
            h, residual = self.add_rms_norm(x, residual, w[f"layers.{i}.input_norm"])
            if s.is_linear(i):
                x = mix(i, h)
            else:
                x = self.attention(h, positions, slots, kv, attend, decode, window, i)
            if s.sandwich_norms:
                x, _ = self.add_rms_norm(x, None, w[f"layers.{i}.attn_out_norm"])
            h, residual = self.add_rms_norm(x, residual, w[f"layers.{i}.post_norm"])
            if s.is_moe(i):
                x, ids = self.moe(h, i)
                experts.append(ids)
            else:
                x = self.mlp(h, self.matrix(f"layers.{i}.gate_up"), self.matrix(f"layers.{i}.down"), decode)
            if s.sandwich_norms:
                x, _ = self.add_rms_norm(x, None, w[f"layers.{i}.mlp_out_norm"])
        return x, residual, torch.stack(experts) if experts else None

    def attention(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                  attend: Callable[[int, torch.Tensor], torch.Tensor], decode: bool, window: WindowCache | None,
                  i: int) -> torch.Tensor:
        """Layer i's attention over its normalised input h, through o_proj. With Qwen3.5's output gate, q_proj's
        rows hold each head's q and then its gate: the attention's output is scaled by the gate's sigmoid."""
        s, w = self.shape, self.weights
        qk_norm = (w[f"layers.{i}.q_norm"], w[f"layers.{i}.k_norm"]) if s.qk_norm else None
        windowed, index = self.cache_index[i]
        cache, to = (window.kv, window.slots) if windowed else (kv, slots)
        weight, bias = self.matrix(f"layers.{i}.qkv.weight"), w.get(f"layers.{i}.qkv.bias")
        if s.attn_output_gate:
            full = self.matmul(h, weight, bias)
            q_gate = full[:, : 2 * s.q_size].view(-1, s.num_heads, 2 * s.head_dim)
            gate = q_gate[..., s.head_dim :].reshape(-1, s.q_size)
            qkv = torch.cat([q_gate[..., : s.head_dim].reshape(-1, s.q_size), full[:, 2 * s.q_size :]], dim=1)
            qkv = self.rope_and_store(qkv, positions, to, cache[0, index], cache[1, index], qk_norm=qk_norm, layer=i)
            out = attend(i, qkv) * torch.sigmoid(gate)
        else:
            qkv = self.qkv_and_rope(h, weight, bias, positions, to, cache[0, index], cache[1, index], decode, qk_norm,
                                    i)
            out = attend(i, qkv)
        return self.matmul(out, self.matrix(f"layers.{i}.o.weight"), w.get(f"layers.{i}.o.bias"))

    def linear_weights(self, layer: int) -> GatedDeltaNetWeights:
        """Layer `layer`'s Gated DeltaNet weights as rl/model/linear_attention.py takes them."""
        s, own = self.shape, f"layers.{layer}.linear."
        w = {key: self.weights[own + key] for key in linear_tensor_names(s).values()}
        if s.linear_interleaved:  # Qwen3-Next: loaded as q, k, v | z and b | a (interleaved_row_order): views
            value = s.linear_value_heads * s.linear_value_dim
            w["in_proj_qkv"], w["in_proj_z"] = w.pop("in_proj_qkvz").split([s.linear_conv_channels, value])
            w["in_proj_b"], w["in_proj_a"] = w.pop("in_proj_ba").chunk(2)
        return GatedDeltaNetWeights(w["in_proj_qkv"], w["in_proj_z"], w["in_proj_b"], w["in_proj_a"], w["conv"][:, 0],
                                    w["dt_bias"], w["A_log"], w["norm"], w["out_proj"], s.linear_key_heads,
                                    s.linear_key_dim, s.linear_value_dim, s.rms_norm_eps)

    def decode_layouts(self, h: torch.Tensor, decode: bool) -> bool:
        """Whether this forward is a decode step on CUDA small enough for the split GEMM layouts (bf16 weights: FP8
        ones take rl/model/fp8.py's linear at every batch size)."""
        return (decode and self.device.type == "cuda" and not self.batch_invariant and not self.fp8
                and h.shape[0] <= SMALL_BATCH_ROWS)

    def qkv_and_rope(self, h: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None,
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     decode: bool,
                     qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None, layer: int = 0) -> torch.Tensor:
        """The qkv projection with RoPE applied and k, v written to the cache; returns the rotated q's
        columns first (qkv itself, or q alone). A decode step on CUDA splits the GEMM over its inner
        dimension into QKV_SPLITS float32 partial sums that the RoPE kernel adds up with the bias: at
        a few hundred rows the GEMM's K loop, not its bytes, sets its time."""
        if self.decode_layouts(h, decode) and QKV_SPLITS > 1 and self.shape.hidden_size % QKV_SPLITS == 0:
            from rl.model.kernels.linear_triton import linear_split_k

            parts = linear_split_k(h, weight, QKV_SPLITS)
            return self.rope_and_store(parts, positions, slots, k_cache, v_cache, bias, qk_norm, layer)
        return self.rope_and_store(self.matmul(h, weight, bias), positions, slots, k_cache, v_cache, qk_norm=qk_norm,
                                   layer=layer)

    def mlp(self, h: torch.Tensor, gate_up: torch.Tensor | fp8.Fp8Weight, down: torch.Tensor | fp8.Fp8Weight,
            decode: bool) -> torch.Tensor:
        """down(silu(gate) * up). A decode step on CUDA (at most SMALL_BATCH_ROWS rows) computes gate_up
        as W @ h^T, the layout in which cuBLAS is fastest for a few hundred rows, and returns down's
        result as DOWN_SPLITS float32 partial sums (parts, T, hidden) for `add_rms_norm` to reduce:
        the output is too narrow to fill the GPU, and cuBLAS would otherwise split K itself and run
        a reduction kernel of its own."""
        if not self.decode_layouts(h, decode):
            return self.matmul(self.silu_mul(self.matmul(h, gate_up)), down)
        from rl.model.kernels.linear_triton import linear_split_k
        from rl.model.kernels.silu_triton import silu_mul

        act = silu_mul(F.linear(gate_up, h), transposed=True, gelu=self.shape.activation == "gelu_tanh").t()  # (T, I)
        if DOWN_SPLITS == 1 or self.shape.intermediate_size % DOWN_SPLITS:
            return F.linear(act, down)
        return linear_split_k(act, down, DOWN_SPLITS)

    def moe(self, h: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s MoE block over h (T, hidden): the routed experts' weighted sum (rl/model/moe.py's routing and
        grouped experts), plus Qwen2-MoE's shared expert scaled by its sigmoid gate; and the ids (T, k) taken."""
        s, w, own = self.shape, self.weights, f"layers.{layer}."
        ids, weights, _ = route(self.linear(h, w[f"{own}router"]), s.experts_per_token, s.norm_topk_prob)
        out = grouped_mlp(h, ids, weights.to(h.dtype), w[f"{own}experts.gate_up"], w[f"{own}experts.down"], F.silu)
        if s.shared_expert_intermediate_size:
            shared = self.mlp(h, w[f"{own}shared.gate_up"], w[f"{own}shared.down"], decode=False)
            out = out + torch.sigmoid(self.linear(h, w[f"{own}shared_gate"])) * shared
        return out, ids

    def logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.add_rms_norm(x, residual, self.weights["norm"])
        logits = self.linear(h, self.weights.get("lm_head", self.weights["embed"]))  # (N, V) in the model dtype
        cap = self.shape.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def prefill(self, tokens: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor,
                kv: torch.Tensor, page_size: int, window: WindowCache | None = None,
                linear: LinearState | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded new tokens (N, L) of N sequences -> logits after each one's last token (N, V), and the
        expert ids every token took in each MoE layer, (MoE layers, N, L, k) (None for a dense model; pads' too).

        Sequence n has its first starts[n] tokens in the cache already (a sequence kept from an earlier call)
        and counts[n] new ones after them, on pages tables[n] (N, P); each new token attends to the whole
        sequence before it, cached part included (within its window in a sliding-window layer). Pads write to slot 0.
        `window`: the window layers' cache and each sequence's tables into it, which hold at least the pages of its
        new tokens and of the window before them. `linear`: each sequence's linear-attention states after its cached
        tokens (needed with linear layers), replaced by those after its last token; the layers run over the new
        tokens packed end to end, pads left out."""
        n, length = tokens.shape
        s = self.shape
        offsets = torch.arange(length, device=tokens.device)
        new = offsets[None, :] < counts[:, None]  # (N, L)
        # A pad sits at its offset, as in a fresh prompt: inside the rotary tables whatever the start.
        positions = torch.where(new, starts[:, None] + offsets, offsets)  # (N, L)

        def slots_of(tables: torch.Tensor) -> torch.Tensor:
            pages = tables.gather(1, torch.where(new, positions // page_size, 0)).long()
            return torch.where(new, pages * page_size + positions % page_size, 0)

        slots = slots_of(tables)
        if window is not None:
            window = WindowCache(window.kv, window.tables, slots_of(window.tables).reshape(-1))
        contexts = starts + counts
        continued = not self.batch_invariant and bool(starts.any())
        if self.batch_invariant:  # every new token is a row of the decode kernel, as in the trainer
            context_lens = (positions + 1).reshape(-1).to(torch.int32)
            longest = int(contexts.max())
            rows = {False: tables.repeat_interleave(length, dim=0)}  # keyed by "is a sliding-window cache layer"
            if window is not None:
                rows[True] = window.tables.repeat_interleave(length, dim=0)

        def attend(layer: int, qkv: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache, layer_tables = self.layer_cache(layer, kv, tables, window)
            k_scale, v_scale = self.layer_scales(layer)
            if self.batch_invariant:
                from rl.model.kernels.attention_triton import invariant_attention

                return invariant_attention(split_qkv(qkv, s)[0], k_cache, v_cache, rows[self.cache_index[layer][0]],
                                           context_lens, page_size, longest, scale=s.scale, window=s.window(layer))
            if continued:  # the cached part's keys and values are read back from the cache, the new ones' too
                paged = paged_prefill_reference
                if self.fused:
                    from rl.model.kernels.attention_triton import prefill_paged_attention as paged
                return paged(split_qkv(qkv, s)[0], k_cache, v_cache, layer_tables, starts, contexts, length,
                             page_size, s.scale, window=s.window(layer), k_scale=k_scale, v_scale=v_scale)
            return padded_causal_attention(qkv, s, n, length, s.window(layer))

        with sdpa_kernel(PREFILL_ATTENTION):
            x, residual, experts = self.layers(tokens.reshape(-1), positions.reshape(-1), slots.reshape(-1), kv,
                                               attend, window=window, mix=self.packed_mix(new, counts, linear))
        last = torch.arange(n, device=tokens.device) * length + counts - 1
        return self.logits(x[last], residual[last]), None if experts is None else experts.unflatten(1, (n, length))

    def packed_mix(self, new: torch.Tensor, counts: torch.Tensor, linear: LinearState | None
                   ) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """A prefill's linear-attention layers (None without `linear`): `new` (N, L) marks each padded row's new
        tokens, counts (N,) how many; the layer runs over them packed end to end from each row's state in
        `linear`, which it replaces with the state after the row's last token."""
        if linear is None:
            return None
        real = new.reshape(-1).nonzero().squeeze(1)  # the new tokens of the padded rows, packed
        cu_seqlens = F.pad(counts.cumsum(0), (1, 0))

        def mix(layer: int, h: torch.Tensor) -> torch.Tensor:
            j = self.shape.linear_layers.index(layer)
            out, conv, recurrent = gated_deltanet_forward(h[real][None], self.linear_weights(layer),
                                                          cu_seqlens=cu_seqlens, conv_state=linear.conv[:, j],
                                                          recurrent_state=linear.recurrent[:, j])
            linear.conv[:, j], linear.recurrent[:, j] = conv, recurrent
            return h.new_zeros(h.shape).index_copy(0, real, out[0])

        return mix

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int, num_splits: int,
               window: WindowCache | None = None, linear: LinearState | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One new token per sequence (B,) -> next-token logits (B, V), and the expert ids it took in each MoE
        layer, (MoE layers, B, k) (None for a dense model); graph-safe on CUDA without MoE layers. `window`: the
        window layers' cache, each row's tables into it and its fed token's slot there. `linear`: the rows'
        linear-attention states (B, ...), advanced in place for the `live` rows."""
        s = self.shape

        def attend(layer: int, qkv: torch.Tensor) -> torch.Tensor:
            q = qkv[:, : s.num_heads * s.head_dim].view(-1, s.num_heads, s.head_dim)  # qkv, or q alone
            k_cache, v_cache, tables = self.layer_cache(layer, kv, block_tables, window)
            k_scale, v_scale = self.layer_scales(layer)
            if self.fused:
                from rl.model.kernels.attention_triton import decode_attention

                return decode_attention(
                    q, k_cache, v_cache, tables, context_lens, page_size, s.scale, num_splits,
                    split_tokens=attention.INVARIANT_SPLIT_TOKENS if self.batch_invariant else 0,
                    window=s.window(layer), k_scale=k_scale, v_scale=v_scale)
            return paged_attention_reference(q, k_cache, v_cache, tables, context_lens, page_size, s.scale,
                                             s.window(layer), k_scale, v_scale)

        def mix(layer: int, h: torch.Tensor) -> torch.Tensor:
            j = s.linear_layers.index(layer)
            conv, recurrent, live = linear.conv[:, j], linear.recurrent[:, j], linear.live
            if self.fused:  # the state read and written once, in place
                return gated_deltanet_step_(h, self.linear_weights(layer), conv, recurrent, live)
            out, new_conv, new_recurrent = gated_deltanet_step(h, self.linear_weights(layer), conv, recurrent)
            conv.copy_(torch.where(live[:, None, None], new_conv, conv))
            recurrent.copy_(torch.where(live[:, None, None, None], new_recurrent, recurrent))
            return out

        x, residual, experts = self.layers(tokens, positions, slots, kv, attend, decode=True, window=window, mix=mix)
        return self.logits(x, residual), experts


def split_qkv(qkv: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (T, heads, D) of the fused projection's q, k and v columns."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    t = qkv.shape[0]
    return (qkv[:, :q].view(t, s.num_heads, s.head_dim), qkv[:, q : q + kv].view(t, s.num_kv_heads, s.head_dim),
            qkv[:, q + kv :].view(t, s.num_kv_heads, s.head_dim))


def padded_causal_attention(qkv: torch.Tensor, s: Shape, n: int, length: int, window: int) -> torch.Tensor:
    """Fresh prompts' causal attention over their own tokens: qkv of N right-padded rows of `length`, flattened
    (N * length, ...) -> (N * length, heads * head_dim); key-value heads repeated for their query groups."""
    q, k, v = (t.reshape(n, length, -1, s.head_dim).transpose(1, 2) for t in split_qkv(qkv, s))
    group = s.num_heads // s.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = causal_attention(q, k, v, s.scale, window)
    return out.transpose(1, 2).reshape(n * length, s.num_heads * s.head_dim)


def _hf_reference(hf_config) -> torch.nn.Module:
    """The HF model on the meta device: the names and shapes the trainer pushes, and its rotary class."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
