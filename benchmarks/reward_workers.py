"""Reward workers as the trainer starts them: start-up time, resident memory, and the cost of a timeout.

    python -m benchmarks.reward_workers            # from the repository root, on the tree under test

It runs the way `torchrun -m rl.main` does: as a module (`-m`) that imports torch and transformers
before it builds a `RewardPool`, so a worker that re-imports the parent's main module shows it.
Per worker it prints the time from the pool's construction to "ready" (math_verify warmed up) and
the CPU time it spent getting there (the number to compare on a busy machine), its resident and virtual memory (/proc/<pid>/status VmRSS, VmSize) and whether libtorch is mapped into
it. Then it scores the adversarial `\\boxed{9^{9^{9}}}` (reward.timeout_s=2): the time `score` takes
(the timeout, or a MemoryError under reward.memory_limit_mb), the time until the replacement worker
is ready, and the worker's peak memory is visible as what the limit allowed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch  # noqa: F401  # the trainer's heavy imports, present in the parent as in rl.main
import transformers  # noqa: F401

from rl.config import RewardConfig
from rl.env.reward import Failures, RewardInput, RewardPool


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def cpu_seconds(pid: int) -> float:
    """user + system CPU time so far: unlike wall time, not inflated by other work on the machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def wait_ready(pool: RewardPool, start: float) -> list[float]:
    """Seconds from `start` until each worker reported ready (polls the pool's own wait/collect)."""
    ready_at: dict[int, float] = {}
    while len(ready_at) < len(pool.workers):
        pool.wait()
        for i, worker in enumerate(list(pool.workers)):
            pool.collect(worker, [], Failures())
            if pool.workers[i].ready and i not in ready_at:
                ready_at[i] = time.monotonic() - start
    return [ready_at[i] for i in range(len(pool.workers))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    cfg = RewardConfig(num_workers=args.num_workers, timeout_s=args.timeout_s)

    start = time.monotonic()
    pool = RewardPool(cfg)
    ready = wait_ready(pool, start)
    print("| worker | ready after (s) | CPU to ready (s) | VmRSS (MB) | VmSize (MB) | libtorch mapped |")
    print("|---|---|---|---|---|---|")
    for i, (worker, seconds) in enumerate(zip(pool.workers, ready)):
        status = proc_status(worker.process.pid)
        rss, size = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmSize"))
        print(f"| {i} | {seconds:.2f} | {cpu_seconds(worker.process.pid):.2f} | {rss:.0f} | {size:.0f} "
              f"| {maps_torch(worker.process.pid)} |")

    adversarial = RewardInput(prompt="q", response=r"\boxed{9^{9^{9}}}", label="1", response_length=8,
                              max_new_tokens=100)
    t = time.monotonic()
    result = pool.score([adversarial])
    score_s = time.monotonic() - t
    t = time.monotonic()
    replaced = wait_ready(pool, t)
    print(f"\nadversarial input: score took {score_s:.2f} s (reward.timeout_s={cfg.timeout_s}), "
          f"num_errors={result.num_errors} num_timeouts={result.num_timeouts}; "
          f"replacement ready {max(replaced):.2f} s later "
          f"({max(cpu_seconds(w.process.pid) for w in pool.workers):.2f} s CPU); "
          f"cost beyond the timeout: {score_s + max(replaced) - cfg.timeout_s:.2f} s")
    pool.close()


if __name__ == "__main__":
    main()
