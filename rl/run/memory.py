"""Device memory: the plan at start-up, the allocator a run trains in, and the one line an out-of-memory error
becomes mid-run.

The plan estimates, per rank and per phase, what the config asks of one device, from the model's
config.json shapes alone (no weights are loaded): the policy's fp32 parameters, gradients and AdamW
moments sharded by FSDP2 over the ranks (with LoRA, gradients and moments of the adapters alone), its
gathered compute-dtype copy, the activations and logits of the largest micro-batch, the engine's weights (its
blocks' matrices at 1 byte a parameter, plus scales, with rollout.precision = "fp8"), KV cache and working
memory, the reference and the critic.
Which of them share the device follows the loop (docs/architecture.md, "One RL step"): the engine sleeps
while the learner trains (`rollout.sleep_level`), the training state leaves the device while the engine
runs only with `train.offload`, and AdamW's moments stay in host memory with `train.optimizer_offload`. On
CUDA a plan that cannot fit stops the run before any weights load, with one line naming the keys that would
make it fit and by how much; so does one whose pinned host memory would not fit the node.

The counts are of the tensors each phase holds at its peak, not a measurement: the allocator's
fragmentation, the CUDA context and the communication buffers are covered by a reserve of the device
(`RESERVE`), and `train.memory_check = false` runs a plan the estimate refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rl.config import Config, ConfigError, RunStopped
from rl.model.fp8 import BLOCK as FP8_BLOCK
from rl.model.linear_attention import CHUNK_SIZE as LINEAR_CHUNK
from rl.model.shape import ModelShape
from rl.parallel import print0
from rl.rollout import engine_dtype
from rl.rollout.native import PAGE_SIZE, PREFILL_TOKENS, kv_cache_pages, window_cache_pages, window_layers
from rl.train.host_adamw import CHUNK_ELEMENTS
from rl.train.lora import expert_targets
from rl.train.step import FUSED_LOGPROBS, LOGPROB_CHUNK_BYTES

GB = 1e9  # as the memory/ metrics count
RESERVE = 0.05  # of the device, kept out of the plan: CUDA context, NCCL and cuBLAS workspaces, fragmentation
FP32 = 4
HOST_SHARE = 0.85  # of the host's memory that pinned buffers may take: the rest for the ranks' processes and files


@dataclass(frozen=True)
class Models:
    policy: ModelShape
    reference: ModelShape | None = None  # algo.kl_coef > 0
    critic: ModelShape | None = None  # algo.advantage_estimator = "gae"


# ---------------------------------------------------------------------------- shapes -> bytes (pure)


LORA_SHAPES = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
               "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"), "down_proj": ("inter", "hidden")}


def lora_block_params(s: ModelShape, rank: int, targets: list[str]) -> int:
    """One block's LoRA adapters: rank * (in + out) for each targeted projection (rl/train/lora.py; a target outside
    the attention and MLP projections is not counted)."""
    size = {"hidden": s.hidden_size, "q": s.q_size, "kv": s.kv_size, "inter": s.intermediate_size}
    return sum(rank * (size[a] + size[b]) for name, (a, b) in LORA_SHAPES.items() if name in targets)


EXPERT_LORA_SIZES = {"gate_up_proj": ("hidden", "2 inter"), "down_proj": ("inter", "hidden")}  # (in, out)


def expert_lora_params(s: ModelShape, rank: int, targets: list[str]) -> int:
    """One MoE block's adapters on its routed experts' fused tensors: per expert rank * (in + out) for each tensor
    the targets select (rl/train/lora.py's `expert_targets`)."""
    size = {"hidden": s.hidden_size, "inter": s.moe_intermediate_size, "2 inter": 2 * s.moe_intermediate_size}
    return s.num_experts * sum(rank * (size[a] + size[b]) for name, (a, b) in EXPERT_LORA_SIZES.items()
                               if name in expert_targets(targets))


def lora_layer_params(s: ModelShape, rank: int, targets: list[str]) -> list[int]:
    """Each block's LoRA adapters: a dense block's `lora_block_params`; a MoE block's on its attention, its shared
    expert (an MLP of shared_expert_intermediate_size) and its routed experts (`expert_lora_params`)."""
    dense = lora_block_params(s, rank, targets)
    attention = lora_block_params(s, rank, [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj")])
    shared = dataclasses.replace(s, intermediate_size=s.shared_expert_intermediate_size)
    with_shared = lora_block_params(shared, rank, targets) if s.shared_expert_intermediate_size else attention
    moe = with_shared + expert_lora_params(s, rank, targets) if s.moe_layers else 0
    return [moe if s.is_moe(i) else dense for i in range(s.num_layers)]


def rank_lora_params(s: ModelShape, rank: int, targets: list[str], dp: int, expert_parallel: int = 1) -> float:
    """The LoRA adapters one rank holds (`rank_params`'s split): FSDP2's shard of them, and with expert parallelism
    FSDP2's shard of all but the routed experts' plus 1 / expert_parallel of those (split with their experts)."""
    experts = len(s.moe_layers) * expert_lora_params(s, rank, targets) if expert_parallel > 1 else 0
    return (sum(lora_layer_params(s, rank, targets)) - experts) / dp + experts / expert_parallel


def lora_activation_bytes(s: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool, rank: int,
                          targets: list[str], dropout: bool) -> int:
    """What the adapters add to the saved activations: each targeted layer's rank-wide x @ A.T, and with dropout
    its dropped input (in features), per token, and in a MoE block the same for each of its top-k experts' adapted
    tensors; one block's worth when checkpointing recomputes them."""
    size = {"hidden": s.hidden_size, "q": s.q_size, "kv": s.kv_size, "inter": s.intermediate_size}
    per_token = sum(rank + (size[a] if dropout else 0) for name, (a, _) in LORA_SHAPES.items() if name in targets)
    if s.moe_layers:
        inputs = {"hidden": s.hidden_size, "inter": s.moe_intermediate_size}
        per_token += s.experts_per_token * sum(rank + (inputs[a] if dropout else 0)
                                               for name, (a, _) in EXPERT_LORA_SIZES.items()
                                               if name in expert_targets(targets))
    return tokens * per_token * compute_bytes * (1 if checkpointing else s.num_layers)


def split_expert_params(s: ModelShape, expert_parallel: int) -> int:
    """The routed experts' weights of all MoE blocks when train.expert_parallel > 1 splits them over its groups
    (rl/model/expert_parallel.py: each rank holds 1 / expert_parallel of them whole, outside FSDP2); 0 otherwise."""
    return len(s.moe_layers) * s.num_experts * 3 * s.hidden_size * s.moe_intermediate_size if expert_parallel > 1 else 0


def rank_params(s: ModelShape, dp: int, expert_parallel: int = 1) -> float:
    """The parameters one rank holds: FSDP2's shard of the model, and with expert parallelism FSDP2's shard of all
    but the routed experts plus 1 / expert_parallel of those."""
    experts = split_expert_params(s, expert_parallel)
    return (s.num_params - experts) / dp + experts / expert_parallel


def gathered_bytes(s: ModelShape, compute_bytes: int, reshard_after_forward: bool, expert_parallel: int = 1) -> float:
    """FSDP2's unsharded copy in the compute dtype: the whole model when it stays gathered through a step;
    otherwise the root (FSDP2 keeps the root gathered from forward to backward) and two blocks (the one
    running and the one prefetched). Experts split by expert parallelism are never gathered: their compute-dtype
    copies instead, 1 / expert_parallel of them, kept from the forward to the backward."""
    experts = split_expert_params(s, expert_parallel)
    block_experts = experts / max(len(s.moe_layers), 1)
    held = experts / expert_parallel if experts else 0
    if not reshard_after_forward:
        return (s.num_params - experts + held) * compute_bytes
    return (s.root_params + 2 * (s.block_params - block_experts) + held) * compute_bytes


def grad_bytes(s: ModelShape, dp: int, compute_bytes: int, expert_parallel: int = 1) -> float:
    """The fp32 gradients of this rank's parameters (`rank_params`), and one block's unsharded gradient in the
    compute dtype with its fp32 copy that FSDP2 reduce-scatters (reduce_dtype float32) during backward (split
    experts left out: their gradients are their own fp32 ones)."""
    block_experts = split_expert_params(s, expert_parallel) / max(len(s.moe_layers), 1)
    return FP32 * rank_params(s, dp, expert_parallel) + (s.block_params - block_experts) * (compute_bytes + FP32)


def block_activation_bytes(s: ModelShape, compute_bytes: int, compiled: bool = False, linear: bool = False) -> int:
    """Bytes one token leaves saved for backward in one decoder block: each RMSNorm keeps its fp32 input and its
    output, and the next linear its input (2 x); q and k after RoPE, v, the attention output and its contiguous
    copy (o_proj's input), SDPA's fp32 log-sum-exp per head; the MLP's gate, silu(gate), up and their product.
    A compiled block (model.compile) keeps less: each norm its input and output in the compute dtype, the MLP
    gate, up and their product (silu(gate) is rebuilt in backward). Measured on one H200 (packed rows of 32768
    tokens, benchmarks/train.py): the peaks less the state and logits were 34.5 GB at 0.5B and 72.2 GB at 1.5B,
    against 33.5 and 70.4 GB from these counts (the final norm included), and 46.8 and 98.2 GB from the eager ones.
    Uncompiled, a QK-norm keeps its float32 input twice (Qwen3, Gemma 3); an output gate (Qwen3.5) keeps the gate
    and the attention output it scales. A linear-attention block (`linear`) keeps only its layer's input in place
    of the attention's (rl/model/linear_attention.py computes the layer again in its backward:
    `linear_recompute_bytes`)."""
    q, kv, b, inter = s.q_size, s.kv_size, compute_bytes, mlp_width(s)
    if linear:
        attention = b * s.hidden_size
    else:
        attention = b * (3 * q + 2 * kv) + FP32 * s.num_heads + (2 - compiled) * b * q * s.attn_output_gate
        attention += 0 if compiled or not s.qk_norm else 2 * FP32 * (q + kv)
    attention += routed_inputs_bytes(s, b, compiled)
    if compiled:
        return 2 * 2 * b * s.hidden_size + attention + 3 * b * inter
    norms = 2 * (FP32 * s.hidden_size + 2 * b * s.hidden_size)
    return norms + attention + 4 * b * inter


def mlp_width(s: ModelShape) -> int:
    """The widest MLP one token passes through: a dense layer's intermediate size, or a MoE block's top-k experts'
    and its shared expert's (the grouped forward computes a copy of the token for each expert it takes)."""
    return max(s.experts_per_token * s.moe_intermediate_size + s.shared_expert_intermediate_size if s.is_moe(i)
               else s.intermediate_size for i in range(s.num_layers))


def routed_inputs_bytes(s: ModelShape, compute_bytes: int, compiled: bool = False) -> int:
    """What a MoE block keeps per token besides its experts' activations: the token's copy sorted to each of its
    top-k experts, each expert's output for it (the weighted sum over them keeps those), and the router's float32
    logits; uncompiled also the sorted outputs once more (the unsorting copy keeps its source). Nothing for a dense
    model. Measured on one H100 (Qwen3-MoE 2.25B, 8192-token micro-batches, compiled): a 60.4 GB peak, against
    60.6 GB from these counts and 57.4 GB without the experts' outputs."""
    if not s.moe_layers:
        return 0
    return (3 - compiled) * s.experts_per_token * s.hidden_size * compute_bytes + FP32 * s.num_experts


def linear_recompute_bytes(s: ModelShape, compute_bytes: int) -> int:
    """What one linear-attention layer holds per token while its backward computes it again: everything the plain
    PyTorch chunked rule saves (rl/model/linear_attention.py). The convolution's float32 windows and SiLU input;
    q, k, v and the output per head in float32, as tokens, as chunks and as each chunk step's pieces; the output
    norm's inputs; each chunk's pairwise decays and triangular system; the state entering each chunk (twice); the
    projections' inputs. Counted against the layer's saved tensors at Qwen3.5-1.5B's widths: 389,120 against
    385,040 bytes a token."""
    if not s.linear_layers:
        return 0
    heads, head_dim = s.linear_value_heads, max(s.linear_key_dim, s.linear_value_dim)
    return ((s.linear_conv_kernel + 1) * FP32 * s.linear_conv_channels + 23 * FP32 * heads * head_dim
            + 2 * compute_bytes * heads * s.linear_value_dim + 6 * FP32 * heads * LINEAR_CHUNK
            + 2 * FP32 * heads * s.linear_key_dim * s.linear_value_dim // LINEAR_CHUNK
            + 3 * compute_bytes * s.hidden_size)


def activation_bytes(s: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool,
                     compiled: bool = False) -> int:
    """Saved activations of a micro-batch of `tokens` (padded) tokens at the start of its backward, and what one
    linear-attention layer adds while it is computed again. With gradient checkpointing each block keeps only its
    input and one block's are rebuilt at a time."""
    final_norm = FP32 * s.hidden_size + 2 * compute_bytes * s.hidden_size
    linear = len(s.linear_layers)
    blocks = ([block_activation_bytes(s, compute_bytes, compiled, linear=True)] * linear
              + [block_activation_bytes(s, compute_bytes, compiled)] * (s.num_layers - linear))
    per_token = sum(blocks)
    if checkpointing:
        per_token = s.num_layers * compute_bytes * s.hidden_size + max(blocks)
    return tokens * (per_token + final_norm + linear_recompute_bytes(s, compute_bytes))


def logits_bytes(s: ModelShape, tokens: int, compute_bytes: int, fused: bool) -> int:
    """The (tokens, vocab) logits, kept for backward, and their gradient (rl/train/step.py's TokenLogprobs); without
    the fused kernels it also holds two float32 chunks of LOGPROB_CHUNK_BYTES (softmax rebuilt per chunk)."""
    vocab = 1 if s.value_head else s.vocab_size
    chunks = 0 if fused or s.value_head else 2 * min(tokens, max(1, LOGPROB_CHUNK_BYTES // (FP32 * vocab))) * FP32 * vocab
    return 2 * tokens * vocab * compute_bytes + chunks


def forward_bytes(s: ModelShape, tokens: int, compute_bytes: int) -> int:
    """A no-grad pass (reference logprobs): nothing is saved, the widest point is a block's MLP (gate, up, their
    product) beside the residual stream and its normalised copy, then the logits."""
    vocab = 1 if s.value_head else s.vocab_size
    return tokens * compute_bytes * (2 * s.hidden_size + 3 * mlp_width(s) + vocab)


def kv_cache_bytes(s: ModelShape, tokens: int, engine_bytes: int, window_tokens: int = 0, windowed: int = 0) -> int:
    """K and V of every attention layer for `tokens` cache slots (linear-attention layers keep none); with `windowed`
    sliding-window layers in a window cache of their own, those layers' for `window_tokens` slots instead."""
    return (tokens * s.kv_bytes_per_token(engine_bytes, s.attention_layers - windowed)
            + window_tokens * s.kv_bytes_per_token(engine_bytes, windowed))


def routing_record_bytes(s: ModelShape, tokens: int) -> int:
    """A micro-batch's recorded experts on the device (rl/model/moe.py's replay, or its comparison without replay):
    int64 ids per MoE layer, token and top-k slot, and the token mask."""
    return tokens * (len(s.moe_layers) * s.experts_per_token * 8 + 1)


def fp8_matrices(s: ModelShape, layer: int) -> list[tuple[int, int]]:
    """Layer `layer`'s matrices the native engine holds in FP8 as the trainer pushes them, (rows, columns): q, k, v,
    o, and a dense MLP's gate, up, down (rl/model/decoder.py's FP8_LINEARS); a MoE block's router, experts and
    shared expert keep the engine dtype."""
    h, q, kv, inter = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q)] + ([] if s.is_moe(layer) else [(inter, h), (inter, h), (h, inter)])


def fp8_scale_bytes(s: ModelShape, fp8_scale: str) -> int:
    """The float32 scales of every block's FP8 matrices: one per row, or one per 128x128 tile of each matrix
    (rl/model/fp8.py; the native engine quantizes each pushed matrix on its own grid)."""
    return FP32 * sum(rows if fp8_scale == "channel" else math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
                      for layer in range(s.num_layers) for rows, cols in fp8_matrices(s, layer))


def engine_weight_bytes(s: ModelShape, engine_bytes: int, precision: str, fp8_scale: str) -> float:
    """The engine's copy of the policy: every parameter in the engine dtype, or with rollout.precision = "fp8" the
    blocks' matrices at 1 byte a parameter and their scales (embedding, norms and lm_head as they were)."""
    if precision != "fp8":
        return s.num_params * engine_bytes
    matrices = sum(rows * cols for layer in range(s.num_layers) for rows, cols in fp8_matrices(s, layer))
    return (s.num_params - matrices) * engine_bytes + matrices + fp8_scale_bytes(s, fp8_scale)


def engine_workspace_bytes(s: ModelShape, max_batch_size: int, engine_bytes: int, fp8_scale: str = "") -> int:
    """The engine's working memory: a prefill forward of PREFILL_TOKENS tokens at its widest (the residual stream,
    q, k, v, and the MLP's gate, up and product) and a decode step's float32 logits and probabilities. Per-block
    FP8 weights (`fp8_scale` "block") add the widest matrix dequantized for its product (rl/model/fp8.py's linear)."""
    q, kv = s.q_size, s.kv_size
    prefill = PREFILL_TOKENS * engine_bytes * (2 * s.hidden_size + q + 2 * kv + 3 * mlp_width(s))
    dequantized = 2 * s.intermediate_size * s.hidden_size * engine_bytes if fp8_scale == "block" else 0
    return prefill + 2 * max_batch_size * s.vocab_size * FP32 + dequantized


def fp8_quantize_bytes(s: ModelShape) -> int:
    """Quantizing a pushed matrix to FP8 (rl/model/fp8.py): its float32 copy and the scaled float32 values, for the
    largest one (an MLP matrix, or q), one at a time."""
    return 2 * FP32 * max(rows * cols for layer in range(s.num_layers) for rows, cols in fp8_matrices(s, layer))


def push_bytes(s: ModelShape, bucket_bytes: int, engine_bytes: int, dp: int) -> float:
    """rl/train/weights.py's gather of one bucket: it closes once past `bucket_bytes`, so it holds up to a bucket plus
    the largest tensor, gathered, beside this rank's flat shard of it."""
    experts = 2 * s.num_experts * s.moe_intermediate_size * s.hidden_size  # a MoE block's fused gate_up
    largest = max(s.vocab_size * s.hidden_size, s.hidden_size * s.intermediate_size, experts) * engine_bytes
    return (bucket_bytes + largest) * (1 + 1 / dp)


# ---------------------------------------------------------------------------- the config -> the plan


def micro_batch_tokens(cfg: Config) -> int:
    """Padded tokens of the largest micro-batch: the token budget (a longer sequence trains alone), else
    micro_batch_size rows of the longest sequence."""
    tr, longest = cfg.train, cfg.rollout.max_context_len
    return max(tr.micro_batch_tokens, longest) if tr.micro_batch_tokens else tr.micro_batch_size * longest


def native_kv_tokens(cfg: Config) -> int:
    """The native engine's cache slots as rollout.native.kv_cache_tokens counts them (its scratch page left out)."""
    ro = cfg.rollout
    return (kv_cache_pages(ro.native.kv_cache_tokens, ro.max_batch_size, ro.max_context_len) - 1) * PAGE_SIZE


def engine_terms(cfg: Config, s: ModelShape, engine_bytes: int, device_total: float | None) -> dict[str, float]:
    """The awake engine of this rank (a TP group splits weights and cache). vLLM takes
    rollout.vllm.kv_cache_memory_bytes of cache, else rollout.vllm.gpu_memory_utilization of the device for everything."""
    ro = cfg.rollout
    weights = engine_weight_bytes(s, engine_bytes, ro.precision, ro.fp8_scale) / ro.tensor_parallel_size
    workspace = engine_workspace_bytes(s, ro.max_batch_size, engine_bytes,
                                       ro.fp8_scale if ro.precision == "fp8" else "")
    if ro.engine != "vllm":  # + the scratch pages; sliding-window layers hold rows' windows (rl/rollout/native.py)
        windowed = window_layers(s, ro.max_context_len)
        window = max((s.window(i) for i in windowed), default=0)
        window_pages = window_cache_pages(window, ro.max_batch_size, ro.max_context_len, PAGE_SIZE,
                                          ro.native.window_cache_tokens) if window else 0
        # rollout.kv_precision = "fp8": 1 byte an element, and float32 K and V scales per layer and KV head
        fp8_kv = ro.kv_precision == "fp8"
        kv = kv_cache_bytes(s, native_kv_tokens(cfg) + PAGE_SIZE, 1 if fp8_kv else engine_bytes,
                            window_pages * PAGE_SIZE, len(windowed))
        kv += 2 * FP32 * s.num_layers * s.num_kv_heads if fp8_kv else 0
        # linear-attention layers: a state per running row, and one per prompt its rows start from
        kv += 2 * ro.max_batch_size * s.linear_state_bytes(engine_bytes)
    elif ro.vllm.kv_cache_memory_bytes is not None:
        kv = ro.vllm.kv_cache_memory_bytes
    else:
        kv = max(0.0, ro.vllm.gpu_memory_utilization * (device_total or 0.0) - weights - workspace)
    return {"engine weights": weights, "KV cache": kv, "engine workspace": workspace}


def plan_memory(cfg: Config, models: Models, world_size: int, device_type: str = "cuda",
                device_total: float | None = None) -> dict[str, dict[str, float]]:
    """Phase -> what it holds on one rank, in bytes. `device_total` sizes vLLM's share of the device."""
    s, dp, ro = models.policy, world_size, cfg.rollout
    b = 2 if device_type == "cuda" else FP32  # rl/train/policy.py: bf16 compute on CUDA, fp32 elsewhere
    eb = engine_dtype(ro.dtype, torch.device(device_type)).itemsize
    tokens = micro_batch_tokens(cfg)
    lora = cfg.lora
    shard, trained = policy_state_bytes(cfg, s, dp)
    # gradients are freed by each step; train.optimizer_offload keeps the moments in host memory
    resting = {"policy params": shard, **({} if cfg.train.optimizer_offload else {"policy AdamW": 2 * trained})}
    engine = engine_terms(cfg, s, eb, device_total)
    kept = {k: engine[k] for k in ("engine weights", "KV cache")} if ro.sleep_level == 0 else {}
    critic = {}
    if models.critic is not None:  # its own AdamW; built with reshard_after_forward false (rl/train/critic.py)
        c_shard = FP32 * models.critic.num_params / dp
        c_state = c_shard * (1 if cfg.train.optimizer_offload else 3)
        critic = {"resting": c_state, "training": c_state + grad_bytes(models.critic, dp, b)
                  + stream_bytes(cfg, c_shard)
                  + gathered_bytes(models.critic, b, False)
                  + activation_bytes(models.critic, tokens, b, cfg.model.gradient_checkpointing)
                  + logits_bytes(models.critic, tokens, b, True)}
    parked = {} if cfg.train.offload else resting  # train.offload parks the training state while the engine runs
    critic_parked = {} if cfg.train.offload or not critic else {"critic": critic["resting"]}
    critic_resting = {"critic": critic["resting"]} if critic else {}
    plan = {"rollout": {**parked, **critic_parked, **engine}}
    if models.reference is not None:
        r = models.reference
        plan["reference"] = {**resting, **critic_parked, **kept, "reference": FP32 * r.num_params / dp
                             + gathered_bytes(r, b, cfg.model.reshard_after_forward) + forward_bytes(r, tokens, b)}
    grads = trained + max(lora_layer_params(s, lora.rank, lora.target_modules)) * (b + FP32) if lora.rank \
        else grad_bytes(s, dp, b, cfg.train.expert_parallel)
    activations = activation_bytes(s, tokens, b, cfg.model.gradient_checkpointing, cfg.model.compile)
    if lora.rank:
        activations += lora_activation_bytes(s, tokens, b, cfg.model.gradient_checkpointing, lora.rank,
                                             lora.target_modules, lora.dropout > 0)
    streamed = {"AdamW stream": stream_bytes(cfg, trained)} if cfg.train.optimizer_offload else {}
    plan["train"] = {**resting, "policy grads": grads, **streamed, **critic_resting, **kept,
                     "policy gathered": gathered_bytes(s, b, cfg.model.reshard_after_forward,
                                                       cfg.train.expert_parallel),
                     "activations": activations,
                     "logits": logits_bytes(s, tokens, b, FUSED_LOGPROBS and device_type == "cuda"),
                     **({"routing record": routing_record_bytes(s, tokens)} if s.moe_layers else {})}
    if critic:
        plan["critic"] = {**resting, **kept, "critic": critic["training"]}
    plan["push"] = {**resting, **critic_parked, "engine weights": engine["engine weights"],
                    "push buckets": push_bytes(s, int(cfg.weights.bucket_mb * 2**20), eb, dp)
                    + (fp8_quantize_bytes(s) if ro.precision == "fp8" else 0),
                    **({"KV cache": engine["KV cache"]} if ro.sleep_level == 0 else {})}
    return plan


def policy_state_bytes(cfg: Config, s: ModelShape, dp: int, expert_parallel: int | None = None
                       ) -> tuple[float, float]:
    """One rank's shard of the policy's fp32 parameters (LoRA's adapters included; with train.expert_parallel its
    split experts, `rank_params`), and of those that train (LoRA: the adapters alone; the frozen base has no
    gradients nor moments). `expert_parallel`: train.expert_parallel unless given."""
    lora = cfg.lora
    ep = cfg.train.expert_parallel if expert_parallel is None else expert_parallel
    adapters = rank_lora_params(s, lora.rank, lora.target_modules, dp, ep) if lora.rank else 0
    shard = FP32 * (rank_params(s, dp, ep) + adapters)
    return shard, FP32 * adapters if lora.rank else shard


def stream_bytes(cfg: Config, trained_bytes: float) -> float:
    """rl/train/host_adamw.py's device buffers for moments streamed from host memory: two chunks of two moments."""
    return 4 * FP32 * min(CHUNK_ELEMENTS, trained_bytes / FP32) if cfg.train.optimizer_offload else 0.0


def host_plan(cfg: Config, models: Models, world_size: int) -> dict[str, float]:
    """What one rank keeps in pinned host memory at most: the moments with train.optimizer_offload, the parked
    training state with train.offload (parameters, and moments still on the device otherwise), the reference
    parked between its passes (rl/train/reference.py)."""
    dp = world_size
    shard, trained = policy_state_bytes(cfg, models.policy, dp)
    critic = FP32 * models.critic.num_params / dp if models.critic is not None else 0.0
    out = {}
    if cfg.train.optimizer_offload:
        out["AdamW moments"] = 2 * (trained + critic)
    if cfg.train.offload:
        out["parked training state"] = shard + critic + (0 if cfg.train.optimizer_offload else 2 * (trained + critic))
    if models.reference is not None:
        out["reference"] = FP32 * models.reference.num_params / dp
    return out


def checkpoint_bytes(cfg: Config, models: Models) -> float:
    """One checkpoint, all ranks' shards (rl/run/checkpoint.py): the policy's fp32 parameters and AdamW's two moments
    (LoRA: the adapters alone, the base being the model folder's), the critic's parameters and moments."""
    _, trained = policy_state_bytes(cfg, models.policy, 1, expert_parallel=1)  # every expert once
    critic = FP32 * models.critic.num_params if models.critic is not None else 0
    return 3 * (trained + critic)


def check_disk(cfg: Config, models: Models, export_itemsize: int, free: float) -> None:
    """Raises ConfigError, one line, when log.output_dir's disk has no room for one checkpoint and the final export
    (a save that fills the disk fails at the run's end, after its work); prints a warning when it has no room for
    the checkpoint.keep_last checkpoints kept and the one being written."""
    one, export = checkpoint_bytes(cfg, models), models.policy.num_params * export_itemsize
    where = f"{cfg.log.output_dir} has {free / GB:.1f} GB free"
    if cfg.checkpoint.interval < 0:  # no checkpoint is written: only the export needs room
        print0(f"checkpoint.interval=-1: this run writes no checkpoint; a stop or a crash loses its training state "
               f"(its metrics and, at the end, the export in {cfg.log.output_dir}/final are kept)")
        if export > free:
            raise ConfigError(f"disk: {where}, less than the final export needs ({export / GB:.1f} GB): free space "
                              f"there or set log.output_dir on a larger disk")
        return
    sizes = f"a checkpoint takes {one / GB:.1f} GB, the final export {export / GB:.1f} GB"
    if one + export > free:
        raise ConfigError(f"disk: {where}, less than one checkpoint and the final export need ({sizes}): free space "
                          f"there or set log.output_dir on a larger disk")
    kept = (cfg.checkpoint.keep_last + 1) * one + export
    if kept > free:
        print0(f"disk warning: {where}, less than the {kept / GB:.1f} GB that checkpoint.keep_last="
               f"{cfg.checkpoint.keep_last} needs ({sizes}, and a save writes one more before it removes the oldest)")


def check_disk_space(cfg: Config, hf_config) -> None:
    """`check_disk` against the free space under log.output_dir (claimed, so it exists, before this runs)."""
    from rl.run.export import export_dtype

    itemsize = export_dtype(cfg.checkpoint.export_dtype, hf_config.to_dict()).itemsize
    check_disk(cfg, models_of(cfg, hf_config), itemsize, shutil.disk_usage(cfg.log.output_dir).free)


def peaks(plan: dict[str, dict[str, float]]) -> dict[str, float]:
    return {phase: sum(terms.values()) for phase, terms in plan.items()}


def usable_bytes(device_total: float) -> float:
    return device_total * (1 - RESERVE)


def plan_table(plan: dict[str, dict[str, float]], device_total: float | None) -> str:
    """One column per phase, one row per part, in GB; the device's total and usable memory in the title."""
    rows = list(dict.fromkeys(k for terms in plan.values() for k in terms))
    width = max(map(len, rows)) + 2
    device = f"; device {device_total / GB:.1f} GB, {usable_bytes(device_total) / GB:.1f} usable" if device_total \
        else ""
    lines = [f"memory plan per rank (GB{device}):", " " * width + "".join(f"{p:>10}" for p in plan)]
    for row in rows:
        cells = (f"{plan[p][row] / GB:.1f}" if plan[p].get(row) else "-" for p in plan)
        lines.append(f"{row:<{width}}" + "".join(f"{c:>10}" for c in cells))
    lines.append(f"{'total':<{width}}" + "".join(f"{v / GB:>10.1f}" for v in peaks(plan).values()))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- a plan that cannot fit


def models_of(cfg: Config, hf_config) -> Models:
    """The shapes of every model the run builds: the reference and the critic read their own folder's
    config.json when they name one (the critic's head is one value per position)."""
    from transformers import AutoConfig

    policy = ModelShape.from_hf(hf_config)
    reference = critic = None
    if cfg.algo.kl_coef > 0 and not (cfg.lora.rank and not cfg.model.ref_path):  # LoRA's is the policy's own base
        reference = ModelShape.from_hf(AutoConfig.from_pretrained(cfg.model.ref_path)) if cfg.model.ref_path else policy
    if cfg.algo.advantage_estimator == "gae":
        critic = ModelShape.from_hf(AutoConfig.from_pretrained(cfg.critic.path) if cfg.critic.path else hf_config,
                                    value_head=True)
    return Models(policy, reference, critic)


def largest_fitting(fits_at, low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits_at(n), for a need that grows with n; None when `low` does not fit."""
    if high < low or not fits_at(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid - 1)
    return low


def _with(cfg, section: str, **values):
    """`cfg` with `values` in `section`, a table's path ("rollout.native")."""
    first, _, rest = section.partition(".")
    inner = getattr(cfg, first)
    return dataclasses.replace(cfg, **{first: _with(inner, rest, **values) if rest else
                                       dataclasses.replace(inner, **values)})


SWITCHES = (("model", "gradient_checkpointing", True), ("model", "reshard_after_forward", True),
            ("rollout", "sleep_level", 2), ("train", "offload", True), ("train", "optimizer_offload", True))


def fixes(cfg: Config, need_of, world_size: int, usable: float) -> list[str]:
    """Each key that would shrink the phase furthest over `usable`: by how much, and whether it fits alone; when
    none does, a set of them that fits together; and how many ranks would. `need_of(cfg, world_size)` is the
    plan's peak per phase."""
    now = need_of(cfg, world_size)
    over = [phase for phase, need in now.items() if need > usable]
    fits = lambda c, ws=world_size: max(need_of(c, ws).values()) <= usable  # noqa: E731

    def saved(changed: Config) -> tuple[float, str]:  # the most it takes off a phase that is over, and that phase
        after = need_of(changed, world_size)
        return max(((now[p] - after[p]) / GB, p) for p in over)

    def saving(changed: Config) -> str:
        gb, phase = saved(changed)
        return f"saves {gb:.1f} GB in {phase}"

    switches = [(f"{section}.{key}={str(value).lower()}", section, {key: value}) for section, key, value in SWITCHES
                if getattr(getattr(cfg, section), key) != value and saved(_with(cfg, section, **{key: value}))[0] > 0.05]
    out = [f"{name} {saving(changed)}" + (" (enough alone)" if fits(changed) else "")
           for name, changed in ((name, _with(cfg, section, **kv)) for name, section, kv in switches)]
    sized = [(name, changed) for name, changed in (largest_size(cfg, knob, fits) for knob in sized_knobs(cfg))
             if changed is not None]
    out += [f"{name} {saving(changed)}" for name, changed in sized]
    if switches and not sized and not any(fix.endswith("(enough alone)") for fix in out):
        combined = cfg
        for _, section, kv in switches:
            combined = _with(combined, section, **kv)
        name = next((n for n, changed in (largest_size(combined, k, fits) for k in sized_knobs(combined)) if changed),
                    None)
        if name:
            out.append(f"together: {' '.join([n for n, _, _ in switches] + [name])}")
    ranks = next((n for n in (2 ** k for k in range(1, 11)) if n > world_size and fits(cfg, n)), None)
    if ranks:
        out.append(f"{ranks} ranks (the training state shards over them)")
    return out


def largest_size(cfg: Config, knob: tuple, fits) -> tuple[str, Config | None]:
    """("section.key=value", the config with it) for the largest value of a sized key that fits, else (.., None)."""
    section, key, low, high, unit = knob
    value = lambda n: round(n * unit, 2) if isinstance(unit, float) else n * unit  # noqa: E731
    n = largest_fitting(lambda n: fits(_with(cfg, section, **{key: value(n)})), low, high)
    if n is None:
        return f"{section}.{key}", None
    return f"{section}.{key}={value(n)}", _with(cfg, section, **{key: value(n)})


def sized_knobs(cfg: Config) -> list[tuple[str, str, int, int, int | float]]:
    """(section, key, lowest, highest, unit): sizes searched in units for the largest that fits, below the value now."""
    tr, ro = cfg.train, cfg.rollout
    longest = ro.max_context_len
    knobs = [("train", "micro_batch_tokens", 1, tr.micro_batch_tokens // 64 - 1, 64) if tr.micro_batch_tokens
             else ("train", "micro_batch_size", 1, tr.micro_batch_size - 1, 1)]
    if ro.engine == "native":  # room for one sequence at least
        knobs.append(("rollout.native", "kv_cache_tokens", math.ceil(longest / PAGE_SIZE) + 1,
                      native_kv_tokens(cfg) // PAGE_SIZE - 1, PAGE_SIZE))
    elif ro.vllm.kv_cache_memory_bytes is None:
        knobs.append(("rollout.vllm", "gpu_memory_utilization", 1, round(ro.vllm.gpu_memory_utilization * 100) - 1, 0.01))
    return knobs


def check_fits(cfg: Config, models: Models, world_size: int, device_total: float, device_type: str = "cuda") -> None:
    """Raises ConfigError, one line, when a phase of the plan needs more than the usable part of the device."""
    def need_of(c: Config, ws: int) -> dict[str, float]:
        return peaks(plan_memory(c, models, ws, device_type, device_total))

    usable = usable_bytes(device_total)
    need = need_of(cfg, world_size)
    over = {p: v for p, v in need.items() if v > usable}
    if not over:
        return
    phases = " and ".join(f"{p} ({v / GB:.1f} GB)" for p, v in sorted(over.items(), key=lambda kv: -kv[1]))
    raise ConfigError(f"memory plan: the {phases} phase{'s' if len(over) > 1 else ''} need{'' if len(over) > 1 else 's'}"
                      f" more than the {usable / GB:.1f} GB usable per device ({device_total / GB:.1f} GB less "
                      f"{RESERVE:.0%}; table above); to fit: "
                      + "; ".join(fixes(cfg, need_of, world_size, usable) + ["or train.memory_check=false to run "
                                                                            "anyway if the estimate is wrong"]))


def check_memory_plan(cfg: Config, hf_config, world_size: int, device: torch.device) -> None:
    """At start-up, before any weights load: on CUDA, prints the plan against the device and stops one that cannot
    fit. Off CUDA nothing is printed: a CPU run's memory is the host's, shared with everything else."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    models = models_of(cfg, hf_config)
    print0(plan_table(plan_memory(cfg, models, world_size, "cuda", total), total))
    if cfg.train.memory_check:
        check_fits(cfg, models, world_size, total)
    check_host(cfg, models, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
               os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_host(cfg: Config, models: Models, world_size: int, local_ranks: int, host_total: float) -> None:
    """Prints what the node's ranks pin in host memory; raises ConfigError, one line, when it passes HOST_SHARE of
    the host's memory (the kernel would kill a rank mid-run instead)."""
    per_rank = host_plan(cfg, models, world_size)
    if not per_rank:
        return
    need = sum(per_rank.values()) * local_ranks
    parts = ", ".join(f"{k} {v * local_ranks / GB:.1f}" for k, v in per_rank.items())
    print0(f"host memory plan per node: {need / GB:.1f} GB pinned by {local_ranks} rank{'s' * (local_ranks > 1)} "
           f"({parts}) of {host_total / GB:.1f} GB")
    if cfg.train.memory_check and need > HOST_SHARE * host_total:
        knobs = [f"train.{k}=false" for k in ("offload", "optimizer_offload") if getattr(cfg.train, k)]
        raise ConfigError(f"memory plan: the ranks of a node would pin {need / GB:.1f} GB of host memory ({parts}), "
                          f"more than {HOST_SHARE:.0%} of the host's {host_total / GB:.1f} GB; to fit: "
                          + "; ".join(knobs + ["more nodes (the state shards over them)", "or train.memory_check="
                                               "false to run anyway if the estimate is wrong"]))


# ---------------------------------------------------------------------------- the allocator


def choose_allocator(engine: str, environ=os.environ) -> None:
    """Before CUDA starts: PyTorch's caching allocator grows expandable segments (one address range, mapped a
    page at a time) instead of fixed-size blocks, unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF says
    otherwise. With fixed blocks the free memory splinters between train phases: at 1.5B on a 32 x 8 x 1024-token batch (a
    train peak of 115 GB of the device's 143 usable) the fourth train phase ran out with 105.5 GB allocated
    and 139.4 GB reserved; with expandable segments six phases ran at 117.6 GB reserved. vLLM's sleep-mode
    pools refuse expandable segments (its allocator checks this variable), so a vLLM run keeps the default."""
    if engine == "native" and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & environ.keys():
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


# ---------------------------------------------------------------------------- an out-of-memory error mid-run


def memory_in_use(device: torch.device) -> dict[str, float] | None:
    """PyTorch's allocated and reserved bytes and the device's used and total, on CUDA; None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "used": total - free, "total": total}


def oom_knobs(phase: str, cfg: Config) -> list[str]:
    """The keys that shrink what `phase` holds, with their values now."""
    ro, tr, model = cfg.rollout, cfg.train, cfg.model
    knobs = []
    if phase in ("rollout", "engine start-up"):
        if ro.engine == "native":
            knobs += [f"lower rollout.native.kv_cache_tokens (now {native_kv_tokens(cfg)})",
                      f"lower rollout.max_batch_size (now {ro.max_batch_size})"]
        else:
            knobs.append(vllm_memory_knob(ro))
    if phase == "train":
        knobs.append(f"lower train.micro_batch_tokens (now {tr.micro_batch_tokens})" if tr.micro_batch_tokens
                     else f"lower train.micro_batch_size (now {tr.micro_batch_size})")
        knobs += [f"model.{k}=true" for k in ("gradient_checkpointing", "reshard_after_forward") if not getattr(model, k)]
    if phase == "push":
        knobs.append(f"lower weights.bucket_mb (now {cfg.weights.bucket_mb:g})")
        if ro.engine == "vllm":  # the push ends with the engine's KV cache mapped back
            knobs.append(vllm_memory_knob(ro))
    if phase in ("rollout", "push", "engine start-up") and not tr.offload:
        knobs.append("train.offload=true")
    if phase in ("train", "push") and ro.sleep_level == 0:
        knobs.append("rollout.sleep_level=2")
    return knobs + (["more ranks (the training state shards over them)"] if phase == "train" else [])


def vllm_memory_knob(ro) -> str:
    if ro.vllm.kv_cache_memory_bytes is not None:
        return f"lower rollout.vllm.kv_cache_memory_bytes (now {ro.vllm.kv_cache_memory_bytes})"
    return f"lower rollout.vllm.gpu_memory_utilization (now {ro.vllm.gpu_memory_utilization})"


def is_device_oom(error: BaseException) -> bool:
    """PyTorch's OutOfMemoryError, or the RuntimeError an allocator outside PyTorch's raises: vLLM's sleep-mode
    allocator ("CUDA Error: out of memory at .../cumem_allocator.cpp") and the native engine's address-keeping
    memory ("cuMemCreate of 12.38 GiB on cuda:0 failed: CUDA_ERROR_OUT_OF_MEMORY", rl/rollout/vmem.py)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "out_of_memory" in text))


def oom_message(phase: str, cfg: Config, in_use: dict[str, float] | None) -> str:
    held = "memory in use unknown"
    if in_use:
        held = (f"{in_use['allocated'] / GB:.1f} GB allocated by PyTorch, {in_use['reserved'] / GB:.1f} GB reserved, "
                f"{in_use['used'] / GB:.1f} of {in_use['total'] / GB:.1f} GB of the device in use")
    return (f"out of device memory in the {phase} phase ({held}): {', '.join(oom_knobs(phase, cfg))}; nothing of this "
            f"step was saved: the same command resumes from the last checkpoint")


@contextlib.contextmanager
def stop_on_oom(phase: str, cfg: Config, device: torch.device) -> Iterator[None]:
    """A device out-of-memory error in `phase` becomes RunStopped's one line: the phase, the memory in use and the
    keys to change. It leaves the loop before the step's checkpoint, so the last one stays the run's state."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_device_oom(e):
            raise
        raise RunStopped(oom_message(phase, cfg, memory_in_use(device))) from e
