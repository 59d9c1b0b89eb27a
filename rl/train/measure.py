"""What a step measures of itself: seconds per phase, graphs torch.compile built, a profile of one phase, and
device memory after each phase (`perf/*`, `memory/*` in the metrics, rl/run/metrics.py)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from rl.config import LogConfig
from rl.rollout.vmem import unmapped_allocator_bytes


@contextlib.contextmanager
def timed(times: dict[str, float], key: str):
    """Adds the seconds the block takes to `times[key]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def graphs_compiled(counts: dict[str, float], key: str):
    """Adds the graphs torch.compile compiled during the block to `counts[key]`: with model.compile, the first
    micro-batch of a new kind (one row, a token count across a threshold of the compiled code, no grad)
    compiles the decoder block again, and that train phase is seconds slower (benchmarks/RESULTS.md)."""
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    try:
        yield
    finally:
        counts[key] = counts.get(key, 0) + stats["unique_graphs"] - before


def profile_path(log: LogConfig, phase: str, rollout_id: int, rank: int) -> Path | None:
    """Where `profiled` writes `phase` ("generate": the rollout phase; "train") of rollout `rollout_id` on `rank`,
    when `log.profile_rollout` names that rollout; else None."""
    if rollout_id != log.profile_rollout:
        return None
    return Path(log.output_dir) / "profile" / f"{phase}_rollout_{rollout_id}_rank{rank}.txt"


@contextlib.contextmanager
def profiled(path: Path | None):
    """With a path, profiles the block with torch.profiler (host ops, and device kernels on CUDA) and writes
    the wall time and the largest entries by device time and by host time to that text file; else nothing."""
    if path is None:
        yield
        return
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    table = prof.key_averages()
    parts = [f"wall {wall:.3f} s (profiled)\n"]
    if cuda:
        parts += ["largest device time:", table.table(sort_by="self_device_time_total", row_limit=40,
                                                       max_name_column_width=80)]
    parts += ["largest host time:", table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


def memory_phase(phase: str, device: torch.device) -> dict[str, float]:
    """Peak and reserved memory of torch's allocator since the previous call (then a fresh peak counter),
    and the device memory in use now by the driver's count, which also covers what lives outside torch's
    allocator (the native engine's weights and KV cache) and the CUDA context.

    Segments with no memory behind them at the call (a sleeping vLLM's pools, which torch keeps counting)
    are left out of peak and reserved; they stay unmapped through the train phase, so its peak is the
    trainer's own."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    unmapped_allocated, unmapped_reserved = unmapped_allocator_bytes(device)
    stats = {f"memory/{phase}_peak_gb": (torch.cuda.max_memory_allocated(device) - unmapped_allocated) / 1e9,
             f"memory/{phase}_reserved_gb": (torch.cuda.memory_reserved(device) - unmapped_reserved) / 1e9,
             f"memory/{phase}_device_used_gb": (total - free) / 1e9}
    torch.cuda.reset_peak_memory_stats(device)
    return stats


class StepRecord:
    """One step's phase timings (`perf/*_s`) and device memory after each phase (`memory/*`), filled by the
    phases themselves so the loop reads as its phases."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.start = time.perf_counter()

    def timed(self, key: str):
        return timed(self.times, key)

    def memory_after(self, phase: str) -> None:
        self.memory |= memory_phase(phase, self.device)

    def metrics(self) -> dict[str, float]:
        return {**self.memory, **self.times, "perf/step_s": time.perf_counter() - self.start}
