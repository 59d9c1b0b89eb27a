"""Process groups, device mesh, rank helpers and the data movement between ranks.

One torchrun program: NCCL on GPUs, gloo on CPU. Each engine (one rank, or a
tensor-parallel group of contiguous ranks) generates whole prompt groups; samples
are then gathered so every rank sees the full rollout, and each rank picks its
length-balanced share for training.
The loop's collectives on samples and scalars live here and are called from `main.py`;
the weight-sync gathers live in `weights.py`, and FSDP2 issues its own inside forward
and backward.

Faults between ranks end the run instead of hanging it: a rank whose launcher dies is
killed by the kernel (parent-death signal), the collective timeout drops from the
start-up 30 minutes to a few once the first step is done (`set_collective_timeout`),
and `step_barrier`, a monitored barrier on a side gloo group, names the ranks that did
not arrive in time.
"""

from __future__ import annotations

import ctypes
import datetime
import heapq
import math
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from rl.config import ConfigError

# The parent as this process first saw it, read at import (before anything slow): when the launcher
# dies before the parent-death signal is armed, the parent has changed by the time it is.
_PARENT_AT_START = os.getppid()
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    monitor_group: dist.ProcessGroup | None = None  # gloo side group of `step_barrier` (None: one rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class StalledRankError(RuntimeError):
    """Some rank did not reach a `step_barrier` in time, or stopped answering or died in a collective: the run
    stops instead of hanging. `reporter`: the rank that prints the line (rank 0, unless it is the one lost);
    `missing`: the ranks it names, whose error files the reporter does not wait for."""

    def __init__(self, message: str, reporter: int = 0, missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.reporter, self.missing = reporter, tuple(missing)


def exit_with_launcher(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent (the torchrun agent) dies, and exits at once
    if it already has. Without this a `kill -9` of the launcher leaves the ranks training unsupervised.
    SIGKILL, not SIGTERM: nothing is left to report to, and a handler could keep a rank alive; reward
    workers see their pipe close and exit. Linux only (prctl); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        print(f"rank {os.environ.get('RANK', '?')}: the launcher (pid {parent_pid}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def init_distributed(timeout_minutes: int = 30) -> Dist:
    """Joins the torchrun group (or makes a group of one when started with plain python).

    Under torchrun the rank dies with its launcher; a plain python run is left alone (its parent is a
    shell, which nohup or setsid runs outlive on purpose)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher(_PARENT_AT_START)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        # A group of one meets no other process: a free port, so that runs beside it do not collide on a fixed one.
        os.environ["MASTER_PORT"] = str(free_port(os.environ["MASTER_ADDR"]))
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")  # torchrun's whole set: vLLM's in-process executor reads LOCAL_RANK
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if local_rank >= visible:  # one rank per GPU: more ranks on a node than GPUs is a launch mistake
            raise ConfigError(f"rank {os.environ['RANK']} is local rank {local_rank} of "
                              f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} on its node, which has {visible} visible "
                              f"GPU{'s' * (visible != 1)}: launch with --nproc-per-node {visible} or fewer")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        try:
            store = restarted_store(timeout)
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                    **({"store": store, "rank": int(os.environ["RANK"]),
                                        "world_size": int(os.environ["WORLD_SIZE"])} if store else {}))
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise ConfigError(f"port {os.environ['MASTER_PORT']} of {os.environ['MASTER_ADDR']} (MASTER_ADDR:"
                              f"MASTER_PORT) is taken, most likely by another run on this machine: set MASTER_PORT to "
                              f"a free port (torchrun: --master-port; launch.sh picks a free one, and under SLURM "
                              f"reads RDZV_PORT)") from None
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    # monitored_barrier exists for gloo only; a group of its own keeps it apart from NCCL's streams
    monitor = dist.new_group(backend="gloo") if world_size > 1 else None
    return Dist(dist.get_rank(), world_size, local_rank, device, mesh, monitor)


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def restarted_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of a restarted attempt (torchrun --max-restarts), its keys apart from the earlier
    attempts'. torchrun's agent keeps one store for the whole job, and without a prefix of its own an attempt's
    process groups read the addresses the dead attempt's ranks left there and fail to connect. None for a
    first attempt, which uses the store as torchrun set it up."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not restart:
        return None
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=not agent_hosts_it and os.environ["RANK"] == "0", timeout=timeout)
    return dist.PrefixStore(f"rl_attempt_{restart}", store)


def set_collective_timeout(seconds: float, mesh: DeviceMesh | None = None) -> None:
    """Sets the timeout of collectives issued from now on, on the default group, the mesh's groups (FSDP2's) and
    those of every expert-parallel mesh (`expert_parallel_mesh`: the experts' all-to-alls and reductions).

    Start-up keeps a long one (loading, compiling, the first rollout); after the first step a rank stuck
    for `seconds` fails the collective on the others (gloo raises, NCCL's watchdog aborts) instead of
    hanging them for half an hour."""
    if not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=seconds)
    groups = [dist.distributed_c10d._get_default_group()]
    for m in ([mesh] if mesh is not None else []) + _EXPERT_MESHES:
        groups += [g for g in m.get_all_groups() if g not in groups]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def step_barrier(d: Dist, timeout_s: float, where: str) -> None:
    """Waits until every rank reaches this point; raises StalledRankError naming the ranks that did not
    arrive within `timeout_s` (stalled or dead), so the run stops instead of hanging.

    Call it where ranks rejoin after work of their own (generation, rewards), before the next
    collective: a rank stuck in that work then shows up here by number rather than as an anonymous
    collective timeout. Rank 0 names the missing ranks; the other ranks point to rank 0's message. A rank that died
    before the others came closes its connection, which fails the barrier at once: that error goes up as it is, for
    `lost_rank_error` to name the dead rank (rl.launch.cli), as after any collective."""
    if d.monitor_group is None:
        return
    try:
        dist.monitored_barrier(d.monitor_group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
        if d.rank == 0 and found:
            ranks = [int(r) for r in found.group(1).replace(",", " ").split()]
            raise StalledRankError(f"rank(s) {ranks} did not reach {where} within {timeout_s:g} s (stalled or dead); "
                                   f"stopping the run. See those ranks' output for where they were",
                                   missing=tuple(ranks)) from e
        if _CONNECTION_LOST.search(str(e)):  # a rank died before the barrier: rl.launch.cli's check-in names it
            raise
        raise StalledRankError(f"rank {d.rank} reached {where} but rank 0 did not confirm that every rank did "
                               f"within {timeout_s:g} s: rank 0's message names the stalled ranks (or rank 0 "
                               f"is the one that stalled)") from e


CHECK_IN_MAX_S = 60.0  # how long `lost_rank_error` waits at most for the other ranks to check in
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_CONNECTION_LOST = re.compile(r"connection (reset|closed) by peer|broken pipe|connection refused", re.IGNORECASE)


def lost_rank_error(e: BaseException, stopping=lambda: False) -> StalledRankError | None:
    """A collective that failed because another rank stopped answering (it timed out: SIGSTOP, a hang) or died
    (its connection closed: kill -9, a crash), as one line naming that rank; None for any other error, a bug that
    keeps its traceback. The ranks still alive check in through the rendezvous store, whose connections do not
    pass through the failed collective's; those that do not within the collective timeout (CHECK_IN_MAX_S at
    most) are the ones named. A SIGTERM during the wait, or a stop signal before it (`stopping()`), ends it early:
    torchrun stops a node's ranks once one of them has exited (a killed rank), and kills those still running 30 s
    later, which would lose the line; the ranks not checked in by then are named, with how long they had."""
    if not isinstance(e, RuntimeError) or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    timed_out, closed = _TIMED_OUT.search(str(e)), _CONNECTION_LOST.search(str(e))
    if not (timed_out or closed):
        return None
    rank, timeout_s = dist.get_rank(), collective_timeout_s()
    terminated: list[bool] = []
    start = time.monotonic()
    previous = signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    try:
        missing = unanswered_ranks(rank, dist.get_world_size(), min(timeout_s, CHECK_IN_MAX_S),
                                   stop=lambda: bool(terminated) or stopping())
    finally:
        signal.signal(signal.SIGTERM, previous)
    waited = time.monotonic() - start
    what = (f"stopped answering: a collective waited {timeout_s:g} s (train.collective_timeout_s) for it"
            if timed_out else "died: its connection closed in the middle of a collective")
    if missing is None:
        return StalledRankError(f"another rank {what}, and the rendezvous store does not answer either (rank 0 "
                                f"hosts it unless torchrun's agent does); stopping the run", reporter=rank)
    if not missing:
        if not timed_out:
            return None
        return StalledRankError(f"a collective waited {timeout_s:g} s (train.collective_timeout_s) though every rank "
                                f"still answers: one spent longer than that between two collectives; raise "
                                f"train.collective_timeout_s", reporter=0)
    ranks = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
    why = ("stopped or hung, not crashed: a crashed rank's connections close at once" if timed_out
           else "killed by a signal or crashed")
    checked = (f"had not checked in when a stop signal came {waited:.1f} s later"
               if terminated or stopping() else "did not check in after")
    return StalledRankError(f"{ranks} {what}, and {checked} ({why}); stopping the run. The output "
                            f"of {ranks} shows where {'they were' if len(missing) > 1 else 'it was'}",
                            reporter=min(set(range(dist.get_world_size())) - set(missing)), missing=tuple(missing))


def collective_timeout_s() -> float:
    """The default group's collective timeout now (set_collective_timeout)."""
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
    return backend.options._timeout.total_seconds()


def unanswered_ranks(rank: int, world_size: int, wait_s: float, stop=lambda: False) -> list[int] | None:
    """The ranks that have not checked in through the rendezvous store `wait_s` after this one did, or when
    `stop()` turns true; None when the store does not answer."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"rl_check_in/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    deadline = time.monotonic() + wait_s
    try:
        store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
        store.set(f"{prefix}{rank}", "alive")
        while True:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline or stop():
                return missing
            time.sleep(0.1)
    except RuntimeError:
        return None


def teardown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def expert_parallel_mesh(size: int, device_type: str = "cpu") -> DeviceMesh:
    """The (replica, expert) mesh of expert parallelism over `size` ranks (rl/model/expert_parallel.py): along
    "expert", the contiguous ranks [i * size, (i + 1) * size) that split the experts (an expert-parallel group);
    along "replica", the ranks at the same place in every expert-parallel group (they hold the same experts; their
    gradients are averaged over it). Checkpoints place the split experts on it (rl/run/checkpoint.py). Every rank
    must call it, in the same order (it creates the groups)."""
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"expert parallelism over {size} ranks: it must divide the world size ({world})")
    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("replica", "expert"))
    _EXPERT_MESHES.append(mesh)
    return mesh


_EXPERT_MESHES: list[DeviceMesh] = []  # every expert_parallel_mesh made, for set_collective_timeout


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device's queue: pinned first where the device is
    CUDA (a copy from pageable memory waits, non_blocking or not)."""
    if device is not None and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


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


def engine_share(items: list, index: int, parts: int) -> list:
    """Contiguous share `index` of `parts`, ceil(len / parts) items each, the last ones fewer or none (every
    item goes to exactly one share; whole groups of samples, so a prompt's n samples stay on one engine)."""
    step = math.ceil(len(items) / parts)
    return items[index * step : (index + 1) * step]


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


def full_shape(target: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor of which this rank holds `target`: a DTensor's global shape, a split expert
    tensor's with every expert (rl/model/expert_parallel.py marks it `global_experts`), else its own."""
    experts = getattr(target, "global_experts", None)
    return torch.Size((experts, *target.shape[1:])) if experts else target.shape


def own_rows(target: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of the whole tensor (`full_shape`) that this rank holds: FSDP2 shards dim 0 like
    torch.chunk; a split expert tensor holds its experts (`first_expert`, and as many as it has)."""
    if not isinstance(target, DTensor):
        return getattr(target, "first_expert", 0), target.shape[0]
    mesh, local = target.device_mesh, target.to_local()
    rows = math.ceil(target.shape[0] / mesh.size())
    start = mesh.get_local_rank() * rows
    if local.shape[0] != max(0, min(rows, target.shape[0] - start)):
        raise ValueError(f"local shard {list(local.shape)} is not rows {start}.. of {list(target.shape)} split "
                         f"like torch.chunk over {mesh.size()} ranks")
    return start, local.shape[0]


def copy_own_rows(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copies the rows of the whole tensor `full` that this rank holds of `target` (all of them when `target` is
    not sharded) into it."""
    start, rows = own_rows(target)
    if rows:
        (target.to_local() if isinstance(target, DTensor) else target).copy_(full[start : start + rows])
