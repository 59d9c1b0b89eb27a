"""One decoder-only model's shape, read from its config.json, and the counts that follow from it.

The memory plan (rl/run/memory.py), the FLOPs behind `perf/train_mfu` (rl/model/flops.py) and the native engine's
tensors (rl/model/decoder.py) all read the model from here, so a new architecture changes one description.
The layout is Llama / Qwen2 / Qwen3 / Gemma 3's: per block q, k, v (biases with Qwen2 or `attention_bias`) and o
over grouped KV heads, an RMSNorm of each q and k head (`qk_norm`: Qwen3, Gemma 3), a gated MLP of three matrices,
and two RMSNorms (four with Gemma 3's `sandwich_norms` around attention and MLP); an embedding, a final norm and an
lm_head (tied or not) around the blocks. The rest of Gemma 3's differences (the (1 + w) norm scale, the scaled
embedding, GeGLU, sliding-window layers with their own RoPE base, the attention scale) change no parameter count
and are read here too, so the engine reads one description.

Mixture-of-experts blocks (Qwen2-MoE, Qwen3-MoE) replace the MLP of their layers (`moe_layers`: those the config's
`decoder_sparse_step` and `mlp_only_layers` make sparse; the others keep a dense MLP of `intermediate_size`) with a
router (hidden -> num_experts), `num_experts` gated experts of `moe_intermediate_size` of which each token takes
`experts_per_token`, and with Qwen2-MoE a shared gated expert of `shared_expert_intermediate_size` scaled by a
sigmoid gate (hidden -> 1). Parameter counts are totals; `active_matmul_params` counts what one token computes.

Qwen3.5's text model (`qwen3_5_text`) and Qwen3-Next (`qwen3_next`, the same with Qwen2-MoE-like sparse blocks and
the linear layers' projections fused per key head: `linear_interleaved`) interleave Gated DeltaNet layers (`linear_layers`; rl/model/linear_attention.py:
a projection to the short convolution's q, k, v channels, the output gate z, b and a, the convolution, dt_bias,
A_log, a gated norm, out_proj) with full-attention layers whose q_proj is twice as wide (each head's q, then its
output gate) under QK-norm and a partial RoPE (`rotary_dim`); every norm scales by (1 + w). A linear layer keeps a
state per sequence (`linear_state_bytes`) in place of KV, so the KV counts cover the attention layers alone.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_NORM_MODEL_TYPES = ("qwen3", "gemma3_text", "qwen3_moe", "qwen3_5_text", "qwen3_next")
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
GEMMA_MODEL_TYPES = ("gemma3_text",)
SHARED_EXPERT = ("qwen2_moe", "qwen3_next")  # MoE families with a shared expert (a config key alone builds none in Qwen3-MoE)


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q, k and v have biases (Qwen2, or Llama with attention_bias)
    o_bias: bool = False  # o_proj has one too (Llama with attention_bias)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    value_head: bool = False  # the critic: lm_head is (hidden -> 1), never tied
    # Gemma 3: norms after attention and after the MLP too; norms scale by (1 + w) in float32, rounding once;
    # the embedding times sqrt(hidden) (rounded to the activation dtype); GeGLU; attention scaled by
    # query_pre_attn_scalar ** -0.5; per layer a sliding window (0: global) and the RoPE of its layer type.
    sandwich_norms: bool = False
    norm_plus_one: bool = False
    embed_scale: float = 1.0
    activation: str = "silu"  # or "gelu_tanh"
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    windows: tuple[int, ...] = ()  # per layer, 0 for global attention; () when every layer is global
    rope_kinds: tuple[str, ...] = ()  # per layer, the HF layer type whose RoPE it uses; () for one RoPE
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE): the sparse layers, their experts, and the shared expert (0: none).
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    # Qwen3.5: the Gated DeltaNet layers and their heads, the convolution's kernel; the attention's output gate (q_proj
    # twice as wide); the rotated part of each head (0: all of it).
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False
    rotary_dim: int = 0
    linear_interleaved: bool = False  # Qwen3-Next: q, k, v, z in one projection and b, a in another, per key head

    @classmethod
    def from_hf(cls, config, value_head: bool = False) -> ModelShape:
        """The shape of a Hugging Face config (a multimodal one's text model)."""
        c = config.get_text_config()
        heads = c.num_attention_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        model_type = getattr(c, "model_type", "")
        qkv_bias = model_type == "qwen2" or attention_bias or bool(getattr(c, "qkv_bias", False))  # Qwen2-MoE's key
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, heads,
                   getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads,
                   rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
                   tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                   qkv_bias=qkv_bias, o_bias=attention_bias, qk_norm=model_type in QK_NORM_MODEL_TYPES,
                   value_head=value_head, **(gemma_fields(c) if model_type in GEMMA_MODEL_TYPES else {}),
                   **moe_fields(c), **(qwen35_fields(c) if model_type in LINEAR_ATTENTION_MODEL_TYPES else {}))

    @property
    def scale(self) -> float:
        """The attention's softmax scale."""
        return self.attn_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (a token sees itself and the window - 1 before it), 0 if global."""
        return self.windows[layer] if self.windows else 0

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet (linear-attention) layer, with a state instead of KV."""
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> int:
        """The layers that keep KV (all but the linear-attention ones)."""
        return self.num_layers - len(self.linear_layers)

    @property
    def linear_conv_channels(self) -> int:
        """A linear layer's convolved channels: q and k (key heads), v (value heads)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def linear_state_bytes(self, itemsize: int) -> int:
        """One sequence's state in every linear layer: the convolution's last kernel - 1 inputs at `itemsize` bytes
        and the delta rule's (value heads, key dim, value dim) in float32."""
        conv = self.linear_conv_channels * (self.linear_conv_kernel - 1) * itemsize
        return len(self.linear_layers) * (conv + 4 * self.linear_value_heads * self.linear_key_dim
                                          * self.linear_value_dim)

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a sparse MoE block."""
        return layer in self.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def mlp_matmul_params(self, layer: int, active: bool = False) -> int:
        """Layer `layer`'s MLP weights: the gated MLP's three matrices, or a MoE block's router, experts (all of
        them, or with `active` the ones a token takes) and shared expert with its gate."""
        h = self.hidden_size
        if not self.is_moe(layer):
            return 3 * h * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size + shared

    def layer_matmul_params(self, layer: int, active: bool = False) -> int:
        """One block's matmul weights: q (and its output gate), k, v, o, or a linear layer's projections; and its MLP's
        (no biases, no norms)."""
        h = self.hidden_size
        if self.is_linear(layer):
            value = self.linear_value_heads * self.linear_value_dim
            mixer = h * (self.linear_conv_channels + value + 2 * self.linear_value_heads) + value * h
        else:
            q = self.q_size * (2 if self.attn_output_gate else 1)
            mixer = h * (q + 2 * self.kv_size) + self.q_size * h
        return mixer + self.mlp_matmul_params(layer, active)

    @property
    def decoder_matmul_params(self) -> int:
        """Every block's matmul weights (the lm_head apart)."""
        return sum(self.layer_matmul_params(i) for i in range(self.num_layers))

    @property
    def active_matmul_params(self) -> int:
        """The blocks' matmul weights one token computes with (a MoE layer's routed experts only): the FLOPs' count."""
        return sum(self.layer_matmul_params(i, active=True) for i in range(self.num_layers))

    def layer_params(self, layer: int) -> int:
        """One decoder block: its matmul weights, the attention biases, its norms (two or four, and QK-norm's); a
        linear layer's convolution, dt_bias, A_log and gated norm instead of the attention's biases and QK-norm."""
        norms = (4 if self.sandwich_norms else 2) * self.hidden_size
        if self.is_linear(layer):
            extra = (self.linear_conv_channels * self.linear_conv_kernel + 2 * self.linear_value_heads
                     + self.linear_value_dim)
            return self.layer_matmul_params(layer) + norms + extra
        q = self.q_size * (2 if self.attn_output_gate else 1)
        biases = (q + 2 * self.kv_size if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        return self.layer_matmul_params(layer) + biases + norms + qk_norms

    @property
    def block_params(self) -> int:
        """The largest decoder block (FSDP2 gathers one block at a time)."""
        return max(self.layer_params(i) for i in range(self.num_layers))

    @property
    def root_params(self) -> int:
        """Everything outside the blocks (FSDP2's root group): the embedding, the final norm and the head (none
        when tied; hidden -> 1 for a value head)."""
        h = self.hidden_size
        head = h if self.value_head else 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + h + head

    @property
    def num_params(self) -> int:
        return self.root_params + sum(self.layer_params(i) for i in range(self.num_layers))

    def kv_bytes_per_token(self, itemsize: int, layers: int | None = None) -> int:
        """K and V of every attention layer (or of `layers` of them) for one token, at `itemsize` bytes an element."""
        return 2 * (self.attention_layers if layers is None else layers) * self.kv_size * itemsize


def gemma_fields(c) -> dict:
    """The ModelShape fields that set a Gemma 3 text config apart."""
    windows = tuple(c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types)
    return dict(sandwich_norms=True, norm_plus_one=True, embed_scale=c.hidden_size ** 0.5,
                activation="gelu_tanh" if c.hidden_activation == "gelu_pytorch_tanh" else c.hidden_activation,
                attn_scale=c.query_pre_attn_scalar ** -0.5, windows=windows if any(windows) else (),
                rope_kinds=tuple(c.layer_types), final_softcap=c.final_logit_softcapping or 0.0)


def qwen35_fields(c) -> dict:
    """The ModelShape fields of a Qwen3.5 text config: its linear-attention layers, the attention's output gate, the
    (1 + w) norms and the partial RoPE."""
    rope = getattr(c, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    return dict(linear_layers=tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention"),
                linear_key_heads=c.linear_num_key_heads, linear_value_heads=c.linear_num_value_heads,
                linear_key_dim=c.linear_key_head_dim, linear_value_dim=c.linear_value_head_dim,
                linear_conv_kernel=c.linear_conv_kernel_dim, attn_output_gate=True, norm_plus_one=True,
                rotary_dim=int(c.head_dim * factor), linear_interleaved=c.model_type == "qwen3_next")


def moe_fields(c) -> dict:
    """The ModelShape fields of a Qwen2-MoE / Qwen3-MoE config's sparse blocks (none for a dense config): a layer is
    sparse unless `mlp_only_layers` names it, and then where (layer + 1) is a multiple of `decoder_sparse_step`, as
    transformers builds them."""
    experts = getattr(c, "num_experts", 0) or 0
    if not experts or not getattr(c, "moe_intermediate_size", 0):
        return {}
    step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(moe_layers=layers, num_experts=experts, experts_per_token=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size,
                shared_expert_intermediate_size=(c.shared_expert_intermediate_size if c.model_type in SHARED_EXPERT
                                                 else 0),
                norm_topk_prob=bool(getattr(c, "norm_topk_prob", False)))
