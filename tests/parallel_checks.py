"""Fault cases of rl.parallel, started by tests/test_parallel.py as `torchrun --nproc-per-node 2 tests/parallel_checks.py MODE OUT`.

- orphan: each rank writes its pid to OUT/pid<rank> and keeps running collectives; the test kills
  the launcher and watches the ranks go.
- stall: rank 1 sleeps past a short step_barrier; rank 0 must name it and the run must fail.
- timeout: after set_collective_timeout(3), rank 1 sleeps 20 s before an all_reduce that rank 0 is
  already in (it writes OUT/started0 first); the run must fail ~3 s later, not when rank 1 wakes
  (nor after the start-up 30 minutes).
- dead: rank 1 exits before rank 0 reaches a step_barrier, whose connection to it is then closed (not a timeout);
  run as rl.main runs (rl.launch.cli), rank 0 must say in one line that rank 1 died.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402


def main(mode: str, out_dir: str) -> None:
    d = parallel.init_distributed()
    out = Path(out_dir)
    if mode == "orphan":
        (out / f"pid{d.rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120  # bounded even if nothing kills it
        while time.monotonic() < deadline:
            dist.all_reduce(torch.ones(1, device=d.device))
            time.sleep(0.2)
    elif mode == "stall":
        parallel.step_barrier(d, 30.0, "the end of step 0")  # both arrive: passes
        if d.rank == 1:
            time.sleep(20)
        parallel.step_barrier(d, 2.0, "the end of step 1")
    elif mode == "timeout":
        dist.all_reduce(torch.ones(1, device=d.device))
        parallel.set_collective_timeout(3.0, d.mesh)
        if d.rank == 1:
            time.sleep(20)
        (out / f"started{d.rank}").write_text(repr(time.time()))
        dist.all_reduce(torch.ones(1, device=d.device))
        if d.device.type == "cuda":  # NCCL fails in its watchdog, which aborts the process
            torch.cuda.synchronize()
    elif mode == "dead":
        parallel.set_collective_timeout(3.0, d.mesh)  # the check-in after a lost rank waits this long at most
        parallel.step_barrier(d, 30.0, "the end of step 0")
        if d.rank == 1:
            os._exit(0)
        time.sleep(2)
        parallel.step_barrier(d, 30.0, "the end of step 1")
    parallel.teardown()


if __name__ == "__main__":
    if sys.argv[1] == "dead":
        from rl.launch import cli

        sys.exit(cli(lambda argv: main(*argv), sys.argv[1:]))
    main(sys.argv[1], sys.argv[2])
