"""FSDP2 DTensor shards -> full tensors for the engine, a bucket at a time.

Parameters are walked in buckets of about `bucket_mb` (counted at the engine dtype).
Each bucket's local shards are cast to the engine dtype, padded to FSDP2's chunk
size, flattened into one buffer and gathered with a single collective; the full
tensors are cut out of the gathered buffer, handed to the engine and freed before
the next bucket. Tied parameters are gathered once and yielded under every name.
Persistent buffers are not sharded and are pushed as they are; the computed ones (rotary tables, Gemma's
`embed_scale`) are not pushed. MoE experts split over ranks by expert
parallelism (rl/model/expert_parallel.py: plain slices, not DTensors) are gathered whole over their group.
With LoRA (rl/train/lora.py) the engine gets each adapted layer's merged weight (W + scale * B @ A),
never the adapters; once it holds the base, a push may send the adapted layers alone. An engine with FP8
weights (rollout.precision) quantizes each tensor as it takes it (rl/model/fp8.py): the stream is the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from rl.model.expert_parallel import full_experts
from rl.parallel import full_shape
from rl.train.lora import changed_names, merged_weights, scales_of


def _shard_rows(param: DTensor) -> int:
    """FSDP2 splits dim 0 like torch.chunk: every rank holds ceil(d0 / world) rows, the last ones fewer."""
    world = param.device_mesh.size()
    return math.ceil(param.shape[0] / world)


def _padded_local(param: DTensor, dtype: torch.dtype) -> torch.Tensor:
    local = param.to_local().detach().to(dtype)
    rows = _shard_rows(param)
    if local.shape[0] < rows:
        pad = local.new_zeros((rows - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    return local.reshape(-1)


def _gather_bucket(params: list[DTensor], dtype: torch.dtype) -> list[torch.Tensor]:
    group = params[0].device_mesh.get_group()
    world = dist.get_world_size(group)
    flat = torch.cat([_padded_local(p, dtype) for p in params])  # this rank's shards of the bucket
    gathered = flat.new_empty(world * flat.numel())
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(gathered, flat, group=group)
    else:  # gloo has no all_gather_into_tensor; all_gather into views of one buffer is still one collective
        dist.all_gather(list(gathered.chunk(world)), flat, group=group)
    per_rank = gathered.view(world, -1)
    out, offset = [], 0
    for p in params:
        rows = _shard_rows(p)
        row_numel = math.prod(p.shape[1:])
        numel = rows * row_numel
        full = per_rank[:, offset : offset + numel].reshape(world * rows, *p.shape[1:])
        out.append(full[: p.shape[0]])
        offset += numel
    return out


def _check_placement(name: str, param: torch.Tensor) -> None:
    if isinstance(param, DTensor) and (len(param.placements) != 1 or param.placements[0] != Shard(0)):
        raise ValueError(f"{name}: expected an FSDP2 Shard(0) DTensor, got placements {param.placements}")


def iter_full_weights(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, only: set[str] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, full tensor in `dtype`) for every name of `model`'s state_dict (every parameter name and
    persistent buffer); `only`: the parameters of those names alone, and no buffers (every rank must pass the same
    set)."""
    names_of: dict[int, list[str]] = {}
    unique: list[torch.Tensor] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if only is not None and name not in only:
            continue
        _check_placement(name, param)
        if id(param) not in names_of:
            names_of[id(param)] = []
            unique.append(param)
        names_of[id(param)].append(name)

    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        sharded = [p for p in bucket if isinstance(p, DTensor)]
        full = dict(zip(map(id, sharded), _gather_bucket(sharded, dtype))) if sharded else {}
        for p in bucket:
            tensor = full.get(id(p))
            if tensor is None and hasattr(p, "expert_group"):  # experts split over ranks (rl/model/expert_parallel.py)
                tensor = full_experts(p, dtype)
            if tensor is None:
                tensor = p.detach().to(dtype)
            for name in names_of[id(p)]:
                yield name, tensor

    with torch.no_grad():
        for param in unique:
            bucket.append(param)
            size += math.prod(full_shape(param)) * itemsize  # gathered whole (a split expert tensor too)
            if size >= bucket_bytes:
                yield from flush()
                bucket, size = [], 0
        if bucket:
            yield from flush()
        for name, buf in persistent_buffers(model) if only is None else ():
            yield name, buf.detach()


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds, by their state_dict names: not a non-persistent one (Gemma's `embed_scale`,
    a rotary `inv_freq`), which the model computes from its config and an engine's loader does not know by name."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def iter_merged_weights(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, changed_only: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """What an engine or a Hugging Face folder holds: `iter_full_weights` with LoRA's adapters merged into their
    layers' weights (the same stream for a full-parameter model). `changed_only`: the adapted layers alone."""
    only = changed_names(model) if changed_only else None
    return merged_weights(iter_full_weights(model, dtype, bucket_bytes, only), scales_of(model))


def sync_weights(model: torch.nn.Module, engine, dtype: torch.dtype, bucket_mb: float,
                 changed_only: bool = False) -> dict[str, float]:
    """Pushes the trained weights into the engine (`changed_only`: the layers training changes, for an engine that
    still holds the rest); returns timing for the metrics."""
    start = time.perf_counter()
    pushed = 0

    def counted():
        nonlocal pushed
        for name, tensor in iter_merged_weights(model, dtype, int(bucket_mb * 2**20), changed_only):
            pushed += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.load_weights(counted())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"perf/weight_sync_s": seconds, "perf/weight_sync_gbps": pushed / max(seconds, 1e-9) / 1e9}
