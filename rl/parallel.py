"""Process groups, device mesh, rank helpers and the data movement between ranks.

One torchrun program: NCCL on GPUs, gloo on CPU. Each engine (one rank, or a
tensor-parallel group of contiguous ranks) generates whole prompt groups; samples
are then gathered so every rank sees the full rollout, and each rank picks its
length-balanced share for training.
All collectives of the RL loop live here and are called from `main.py`.
"""

from __future__ import annotations

import datetime
import heapq
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: int = 30) -> Dist:
    """Joins the torchrun group (or makes a group of one when started with plain python)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                                device_id=device if backend == "nccl" else None)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return Dist(dist.get_rank(), world_size, local_rank, device, mesh)


def teardown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """Prints on rank 0 only: the single place where rank-0 behaviour is decided for stdout."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def _gather_per_rank(local: list) -> list[list]:
    """Every rank's list, indexed by rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(local)]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return parts


def all_gather_objects(local: list) -> list:
    """Concatenation, in rank order, of every rank's list."""
    return [item for part in _gather_per_rank(local) for item in part]


def gather_engine_outputs(local: list, tensor_parallel_size: int) -> list:
    """Every engine's samples once: the ranks of a TP group hold identical copies, keep the first."""
    parts = _gather_per_rank(local)
    return [item for rank, part in enumerate(parts) if rank % tensor_parallel_size == 0 for item in part]


def all_reduce_max(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def shard_groups(groups: list, engine_index: int, num_engines: int) -> list:
    """Contiguous whole groups for one engine (all n samples of a prompt stay together)."""
    per_engine = len(groups) // num_engines
    return groups[engine_index * per_engine : (engine_index + 1) * per_engine]


def balanced_partition(costs: list[float], parts: int) -> list[list[int]]:
    """Splits indices into `parts` lists of equal size with balanced total cost (greedy LPT).

    Equal counts keep every rank at the same number of micro-batches, so collectives
    inside forward/backward stay matched.
    """
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} items cannot be split evenly into {parts} parts")
    capacity = len(costs) // parts
    heap = [(0.0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        skipped = []
        load, p = heapq.heappop(heap)
        while len(out[p]) >= capacity:
            skipped.append((load, p))
            load, p = heapq.heappop(heap)
        out[p].append(i)
        heapq.heappush(heap, (load + costs[i], p))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(part) for part in out]
