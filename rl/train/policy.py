"""The policy: build it, shard it with FSDP2, its optimizer, and parking it in host memory.

The model is a plain `transformers` causal LM, built the torchtitan way: on the meta device
(no memory), `fully_shard` per decoder block and at the root (on GPU with bf16 compute and
fp32 master weights and gradient reduction, on CPU in fp32), materialised empty on the
device, then filled from the folder's safetensors with each rank reading only the rows of
its own shard. No rank ever holds the whole fp32 model, where `from_pretrained` on every
rank held one full copy each (8 ranks of a 7B model: 8 x 28 GB of host memory).
Unlike `from_pretrained`, a weight missing from the files (or one the model does not
have) stops the run instead of being randomly initialised with a warning.

MoE experts: transformers 5 holds each layer's experts fused (`mlp.experts.gate_up_proj` (E, 2 * I, H), the
gate rows first, and `mlp.experts.down_proj` (E, H, I)), and loads either that or the hub's layout of one tensor
per expert (`mlp.experts.N.gate_proj.weight`, `up_proj`, `down_proj`), which its `save_pretrained` also writes.
The loader takes both: a fused tensor the files do not hold under its own name is stacked from its experts' tensors,
each rank reading only its own experts (its FSDP2 rows), one expert's matrix at a time.

Expert parallelism (`train.expert_parallel` = N > 1, rl/model/expert_parallel.py): each rank of a group of N holds
E / N of every MoE block's experts whole, plain tensors FSDP2 leaves alone; the loader and the random init fill them
with their experts' rows of the whole tensor (rl/parallel.py's `own_rows` and `full_shape`), as they fill FSDP2's
shards with theirs.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rl.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from rl.model.expert_parallel import mark_split_experts, shard_experts
from rl.model.invariant import make_batch_invariant
from rl.model.linear_attention import use_packed_linear_attention
from rl.model.moe import moe_blocks, use_grouped_moe
from rl.model.rope import fuse_rope
from rl.parallel import copy_own_rows, expert_parallel_mesh, full_shape, own_rows, print0
from rl.rollout import derive_seed
from rl.train.host_adamw import HostAdamW, PinnedArena, local
from rl.train.lora import adapter_names, apply_lora, init_adapters, trainable
from rl.train.weights import persistent_buffers


def build_policy(cfg: ModelConfig, mesh, device: torch.device, seed: int, max_context_len: int,
                 value_head: bool = False, lora: LoraConfig | None = None,
                 expert_parallel: int = 1) -> torch.nn.Module:
    """The sharded policy with its weights: meta model -> (grouped MoE blocks, batch-invariant patch, LoRA, the
    packed linear-attention forward) -> fully_shard -> to_empty -> each rank loads its rows from the safetensors,
    or with `model.random_init` fills them with random weights drawn on the device from `seed`
    (init_random_weights). `max_context_len` sizes the batch-invariant RoPE tables. `value_head`: the critic of PPO,
    the same body with `lm_head` replaced by a zero-initialised (hidden -> 1) projection, so its "logits" are one
    value per position (every value starts at 0). `lora` with rank > 0: the base frozen, adapters on its target
    layers (rl/train/lora.py), initialised from `seed` after the load. `expert_parallel` > 1: the MoE blocks' experts
    split over groups of that many ranks (`shard_policy`), each rank loading or drawing its own experts."""
    hf_config = AutoConfig.from_pretrained(cfg.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                 attn_implementation=cfg.attn_implementation)
    if value_head:
        model.lm_head = torch.nn.Linear(model.lm_head.in_features, 1, bias=False, device="meta")
    use_grouped_moe(model)  # Qwen2/Qwen3-MoE: grouped expert matmuls and routing replay (rl/model/moe.py); dense: no-op
    if cfg.batch_invariant:  # patches forwards and builds its tables on the CPU: works on a meta model
        model = make_batch_invariant(model, max_context_len)
    if lora is not None and lora.rank:
        apply_lora(model, lora)  # before sharding: FSDP2 records which parameters train
    use_packed_linear_attention(model)  # Qwen3-Next, Qwen3.5: a packed row's sequences apart (linear_attention.py)
    model = shard_policy(model, mesh, device, cfg.gradient_checkpointing, cfg.compile, cfg.reshard_after_forward,
                         expert_parallel)
    model.to_empty(device=device)
    mark_split_experts(model)  # to_empty made new parameters of the split experts
    init_non_persistent_buffers(model)
    skip = ({"lm_head.weight"} if value_head else set()) | adapter_names(model)
    if cfg.random_init:
        init_random_weights(model, seed, hf_config.get_text_config().initializer_range, skip)
    else:
        load_safetensors(model, cfg.path, skip=skip)
        if (Path(cfg.path).expanduser() / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(cfg.path)
    if value_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    if lora is not None and lora.rank:
        init_adapters(model, seed)
    return model


def init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Buffers that are computed, not saved (RoPE's inv_freq), hold garbage after `to_empty`: each module
    that has them is built again on the CPU from its config and its buffers are copied over. Gemma's scaled
    embedding has no config: its one buffer, `embed_scale` (sqrt(hidden_size) in the model's dtype), is filled
    from the float the module keeps beside it."""
    for name, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        if names == ["embed_scale"] and isinstance(getattr(module, "scalar_embed_scale", None), float):
            with torch.no_grad():  # rounded to the buffer's dtype, as torch.tensor(embed_scale) rounded it
                module._buffers["embed_scale"].fill_(module.scalar_embed_scale)
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"cannot recompute the non-persistent buffers {names} of {name} "
                             f"({type(module).__name__}): it has no config to rebuild it from")
        with torch.device("cpu"):
            fresh = type(module)(config=module.config)
        with torch.no_grad():
            for n in names:
                module._buffers[n].copy_(fresh._buffers[n])


def init_random_weights(model: torch.nn.Module, seed: int, std: float, skip: set[str] = frozenset()) -> None:
    """Random weights in the sharded model, the way Hugging Face initialises Qwen2 and Llama (matrices and
    embeddings normal(0, std), norm weights 1, biases 0), each tensor drawn whole on the device from a generator of
    its own (`seed` and its name) and each rank keeping its own rows: the same weights on every rank and for any
    number of ranks, in seconds where building the whole model on the host took minutes at 7B. The draws depend
    on the device type (CUDA's generator is not the CPU's). Names in `skip` are left as they are."""
    seen: set[int] = set()
    for name, target in _state_tensors(model).items():
        if name in skip or id(target) in seen:
            continue
        seen.add(id(target))
        if not isinstance(target, torch.nn.Parameter):
            raise ConfigError(f"model.random_init: the model has a saved buffer {name}, which has no random value to "
                              f"take; load its weights instead (model.random_init=false)")
        shard = local(target)
        generator = torch.Generator(shard.device).manual_seed(derive_seed(seed, zlib.crc32(name.encode())))
        with torch.no_grad():
            whole = torch.empty(full_shape(target), dtype=shard.dtype, device=shard.device)
            if whole.dim() >= 2:
                whole.normal_(0.0, std, generator=generator)
            else:
                whole.fill_(0.0 if name.endswith("bias") else 1.0)
            copy_own_rows(target, whole)


def weight_files(path: str) -> list[Path]:
    """The folder's safetensors files: the shards its index lists, or the single model.safetensors."""
    folder = Path(path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"model.path {path!r}: {index.name} lists {absent[:3]}, not in the folder")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise ConfigError(f"model.path {path!r}: no model.safetensors or model.safetensors.index.json "
                      f"(the policy loads safetensors weights only)")


def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` holds, by name: parameters (tied ones under each name) and persistent buffers."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(persistent_buffers(model))


def _names(names: list[str]) -> str:
    return f"{len(names)} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"


def check_weight_names(model: torch.nn.Module, file_keys: set[str], path: str, skip: set[str] = frozenset()) -> None:
    """Every tensor of the model is in the files (tied ones under any of their names) and nothing else is;
    names in `skip` are neither loaded nor required. A fused expert tensor may come as its experts' tensors
    (`stacked_experts`)."""
    targets = {n: t for n, t in _state_tensors(model).items() if n not in skip}
    file_keys = file_keys - skip
    stacked = stacked_experts(targets, file_keys, path)
    sources = {k for per_expert in stacked.values() for keys in per_expert for k in keys}
    file_keys = (file_keys - sources) | set(stacked)
    tied: dict[int, list[str]] = {}
    for name, t in targets.items():
        tied.setdefault(id(t), []).append(name)
    missing = [names[0] for names in tied.values() if not any(n in file_keys for n in names)]
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    ignored.append(re.compile(r"rotary_emb\.inv_freq$"))  # computed, though some old checkpoints saved it
    unexpected = sorted(k for k in file_keys if k not in targets and not any(p.search(k) for p in ignored))
    if missing or unexpected:
        raise ConfigError(f"model.path {path!r}: the safetensors weights do not match the model of its config.json: "
                          f"missing {_names(missing)}, unexpected {_names(unexpected)}")


# A fused expert tensor of transformers 5 (Qwen2-MoE, Qwen3-MoE) and, in the order it concatenates them along its
# dim 1, the per-expert tensors of the hub's checkpoints it is stacked from (gate before up, as the experts' forward
# chunks the gate_up product).
FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def stacked_experts(targets: dict[str, torch.Tensor], file_keys: set[str], path: str
                    ) -> dict[str, list[tuple[str, ...]]]:
    """The fused expert tensors that the files hold one tensor per expert instead: name -> per expert, the keys
    concatenated into its slice (see EXPERT_PARTS). A fused tensor with none of its experts' keys in the files is
    left out (reported missing under its own name); one with some but not all stops with the first it lacks."""
    stacked = {}
    for name, target in targets.items():
        match = FUSED_EXPERTS.match(name)
        if match is None or name in file_keys or target.dim() != 3:
            continue
        prefix, kind = match.groups()
        per_expert = [tuple(f"{prefix}.{e}.{part}.weight" for part in EXPERT_PARTS[kind])
                      for e in range(full_shape(target)[0])]
        keys = [k for group in per_expert for k in group]
        absent = [k for k in keys if k not in file_keys]
        if len(absent) == len(keys):
            continue
        if absent:
            raise ConfigError(f"model.path {path!r}: {absent[0]} is not in the safetensors ({len(absent)} of the "
                              f"{len(keys)} per-expert tensors that {name} is stacked from are missing)")
        stacked[name] = per_expert
    return stacked


def load_safetensors(model: torch.nn.Module, path: str, skip: set[str] = frozenset()) -> None:
    """Copies the folder's weights into the materialised (sharded) model: a rank reads only the rows of its
    own FSDP2 shard of each tensor (dim 0, split like torch.chunk), straight from the memory-mapped file; a fused
    expert tensor held one tensor per expert is stacked from its own experts' (`_stack_own_experts`)."""
    files = weight_files(path)
    file_keys: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            file_keys.update(dict.fromkeys(f.keys(), file))
    check_weight_names(model, set(file_keys), path, skip)
    targets = {n: t for n, t in _state_tensors(model).items() if n not in skip}
    stacked = stacked_experts(targets, set(file_keys) - skip, path)
    sources = {k for per_expert in stacked.values() for keys in per_expert for k in keys}
    loaded: set[int] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    target = targets.get(key)
                    # stacked below, ignored, or a tied tensor already filled
                    if key in sources or target is None or id(target) in loaded:
                        continue
                    _copy_own_rows(target, f, key, path)
                    loaded.add(id(target))
        if stacked:
            with contextlib.ExitStack() as stack:
                opened: dict[Path, object] = {}

                def handle(key: str):
                    file = file_keys[key]
                    if file not in opened:
                        opened[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                    return opened[file]

                for name, per_expert in stacked.items():
                    if id(targets[name]) not in loaded:
                        _stack_own_experts(targets[name], per_expert, handle, path)
                        loaded.add(id(targets[name]))


def _stack_own_experts(target: torch.Tensor, per_expert: list[tuple[str, ...]], handle, path: str) -> None:
    """Fills this rank's experts (its dim-0 rows) of a fused expert tensor: expert e's row is its keys' tensors
    concatenated along dim 0 of the row (gate rows, then up rows), each read whole, one at a time."""
    start, rows = own_rows(target)
    local = target.to_local() if isinstance(target, DTensor) else target
    parts = len(per_expert[0])
    height, width = target.shape[1] // parts, target.shape[2]
    for e in range(start, start + rows):
        for j, key in enumerate(per_expert[e]):
            f = handle(key)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != (height, width) or height * parts != target.shape[1]:
                raise ConfigError(f"model.path {path!r}: {key} has shape {list(shape)} in the safetensors but the "
                                  f"model's {list(target.shape)} wants {[height, width]} per expert")
            local[e - start, j * height : (j + 1) * height].copy_(f.get_tensor(key))


def _copy_own_rows(target: torch.Tensor, f, key: str, path: str) -> None:
    stored = f.get_slice(key)
    shape = tuple(stored.get_shape())
    if shape != tuple(full_shape(target)):
        raise ConfigError(f"model.path {path!r}: {key} has shape {list(shape)} in the safetensors but "
                          f"{list(full_shape(target))} in the model of its config.json")
    if not isinstance(target, DTensor) and not hasattr(target, "expert_group"):
        target.copy_(f.get_tensor(key))
        return
    start, rows = own_rows(target)
    if rows:
        (target.to_local() if isinstance(target, DTensor) else target).copy_(stored[start : start + rows])


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ValueError(f"cannot find decoder blocks of {type(model).__name__} to shard")
    return blocks


RECOMPILE_LIMIT = 64  # compiled variants of the decoder blocks' forward, for all of a process's models


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each decoder block's forward, not the block's call: FSDP2's gather and reshard hooks stay
    eager around it. Shapes are dynamic from the start (micro-batches vary in rows and length), and every
    block runs the same code, so the blocks share their compiled graphs. RoPE runs as its own op
    (`rl.model.rope.fuse_rope`: for the whole process, every model of that modeling module), which Inductor
    compiled to a kernel 10x off the memory floor.

    Sharing has a ceiling: Dynamo keeps at most `recompile_limit` (8) compiled variants of one function and
    runs every later one eager, and all of a process's models share this one. A variant is compiled for
    each model size, grad mode (train passes, no-grad log-prob passes), one row or several, and side of a
    token-count threshold of the compiled code (on an H200 at 0.5B, 3 with grad and 2 without:
    benchmarks/ARCHIVE.md), so a policy with a critic of another size goes past 8. The limit is raised to
    `RECOMPILE_LIMIT`; each variant still compiles only once (4-12 s on an H200).

    Python floats the blocks read (norms' epsilon, attention's scaling, LoRA's alpha / rank) are compiled in
    as constants: with dynamic shapes Dynamo otherwise passes each as a float64 CPU tensor input."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.specialize_float = True
    fuse_rope(model)
    for block in decoder_blocks(model):
        block.forward = torch.compile(block.forward, dynamic=True)


def shard_policy(model: torch.nn.Module, mesh, device: torch.device, gradient_checkpointing: bool,
                 compile: bool = False, reshard_after_forward: bool = True, expert_parallel: int = 1) -> torch.nn.Module:
    """FSDP2 over `mesh`, per decoder block and at the root. `reshard_after_forward=False` keeps gathered
    parameters through forwards and backwards until `rl.train.step.reshard`, which `rl.train.step.optimizer_step` and
    the no-grad passes call (the step's updated shards are gathered afresh). `expert_parallel` > 1: each grouped MoE
    block's experts split over groups of that many ranks (rl/model/expert_parallel.py), plain local slices FSDP2
    ignores; their gradients are averaged by `reduce_expert_grads` (the groups: `model.expert_groups`, the
    (expert, replica) groups of `model.expert_mesh`)."""
    ignored: set[torch.nn.Parameter] = set()
    if expert_parallel > 1:
        model.expert_mesh = expert_parallel_mesh(expert_parallel, device.type)
        model.expert_groups = (model.expert_mesh.get_group("expert"), model.expert_mesh.get_group("replica"))
        for block in moe_blocks(model):
            shard_experts(block, model.expert_groups[0])
            ignored |= set(block.experts.parameters(recurse=False))  # LoRA's adapters of the experts too
        spread = [b.expert_parallel for b in moe_blocks(model)]
        if not spread:
            raise ConfigError(f"train.expert_parallel={expert_parallel}: {type(model).__name__} has no MoE blocks whose "
                              f"experts it splits (Qwen2-MoE, Qwen3-MoE); set 1")
        print0(f"policy: the experts of {len(spread)} MoE blocks split over groups of {expert_parallel} ranks, "
               f"{spread[0].local} of {spread[0].num_experts} on each (train.expert_parallel)")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    if compile:
        compile_blocks(model)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                ignored_params=ignored or None)
    model.set_reshard_after_backward(reshard_after_forward)
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool | None = None):
    """AdamW over the parameters that train (with LoRA the adapters alone: the frozen base gets no moments), and
    its warm-up schedule; with train.optimizer_offload its moments live in host memory (rl/train/host_adamw.py).
    `fused` (default: on CUDA) takes torch's single-kernel AdamW, 2% of the train step faster than the
    multi-tensor one at 1.5B on one H200 (benchmarks/ARCHIVE.md). Experts split by expert parallelism are a param
    group of their own (`param_groups`)."""
    if fused is None:
        fused = next(model.parameters()).device.type == "cuda"
    hyper = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer_offload:  # the moments in host memory, streamed through the device at each step
        optimizer = HostAdamW(param_groups(model), **hyper)
    else:
        optimizer = torch.optim.AdamW(param_groups(model), fused=fused, **hyper)
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, scheduler


def param_groups(model: torch.nn.Module) -> list:
    """The parameters that train; with experts split by expert parallelism (plain tensors beside FSDP2's DTensors)
    two param groups, the DTensors' and the experts': torch's fused and multi-tensor AdamW refuse a group that
    mixes the two kinds."""
    params = trainable(model)
    split = [p for p in params if hasattr(p, "expert_group")]
    if not split:
        return params
    return [{"params": [p for p in params if not hasattr(p, "expert_group")]}, {"params": split}]


class HostOffloader:
    """Moves one model's FSDP2 shards and optimizer state (the policy's, the critic's; the frozen reference has
    no optimizer) between the GPU and host memory around rollout.

    Host copies live in pinned buffers (rl/train/host_adamw.py's PinnedArena) allocated on the first offload and
    reused after, so both directions run at copy-engine speed (pageable `model.to("cpu")` moved 1.5B's
    18 GB of training state at ~4 GB/s) and no host allocation happens per step. Parameters move
    through `Module._apply`, so FSDP2 re-links its sharded storage exactly as it does for `model.to`.
    Moments that already live in host memory (train.optimizer_offload) stay where they are. On a CPU run
    nothing moves.
    """

    def __init__(self, model: torch.nn.Module, optimizer=None):  # no optimizer: a frozen model (the reference)
        self.model, self.optimizer = model, optimizer
        self.host: dict[tuple, torch.Tensor] = {}
        self.arena = PinnedArena()
        self.moves_moments = optimizer is not None and not getattr(optimizer, "keeps_state_on_host", False)

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def onload(self, device: torch.device) -> None:
        self._move(device)

    def _move(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            return  # CPU training: the state already lives in host memory
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # gradients are dead after the step: never copied
        if device.type == "cpu" and not self.arena.blocks:  # the first offload: one block of exactly what moves
            self.arena.reserve(sum(PinnedArena.aligned(t.numel() * t.element_size()) for t in self._movable()))
        order = iter(range(1 << 62))
        self.model._apply(lambda t: self._moved(("module", next(order)), t, device))
        mark_split_experts(self.model)  # in case `_apply` made new parameters of the split experts
        for i, state in enumerate(self.optimizer.state.values() if self.moves_moments else ()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # Adam's 0-dim `step` stays on the host
                    state[key] = self._moved(("optim", i, key), value, device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _movable(self) -> list[torch.Tensor]:
        """The local tensors an offload copies into pinned buffers: the parameters' and buffers' (not an unevenly
        sharded parameter's padded view, which FSDP2 re-pads into memory of its own) and the moments it moves."""
        tensors = [local(t) for t in [*self.model.parameters(), *self.model.buffers()]]
        tensors = [t for t in tensors if not padded_view(t)]
        if self.moves_moments:
            tensors += [local(value) for state in self.optimizer.state.values() for value in state.values()
                        if torch.is_tensor(value) and value.dim() > 0]
        return tensors

    def _moved(self, key: tuple, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        shard = local(t)
        if shard.device == device:
            return t
        if device.type != "cpu":
            moved = shard.to(device, non_blocking=True)
        elif padded_view(shard):
            # An unevenly sharded FSDP2 parameter: a view of its padded shard. FSDP2 re-pads the new
            # local tensor into fresh host memory inside `_apply`, reading it at once, so this copy
            # must have landed before returning (and a pinned buffer would go unused).
            moved = shard.cpu()
        else:
            buf = self.host.get(key)
            if buf is None or buf.shape != shard.shape or buf.dtype != shard.dtype:
                buf = self.host[key] = self.arena.take(shard.shape, shard.dtype)
            moved = buf.copy_(shard, non_blocking=True)
        if isinstance(t, DTensor):  # same spec, new local tensor (from_local would move it to the mesh's device)
            return DTensor(moved, t._spec, requires_grad=t.requires_grad)
        return moved


def padded_view(t: torch.Tensor) -> bool:
    """Whether a local shard is a view into a larger storage: an unevenly sharded FSDP2 parameter's padded shard."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()
