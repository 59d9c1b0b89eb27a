"""What a sandboxed call costs, in the jail and behind the barrier: calls per second from N callers at once.

    python benchmarks/sandbox.py [--callers 1 2] [--seconds 10]

Each caller is a thread calling rl/env/sandbox.py's run_python on a short program (the Python tool's typical call:
arithmetic and a print) back to back; `code reward` is rl/env/code_reward.py's `passes` on a right HumanEval-style
solution (two sandboxes a call, the candidate's and the tests'). The reward workers are processes, not threads,
but a call spends its time in the child interpreters, so threads load the machine the same way. The CPU column is
what the children spent per call, which a busy machine changes less than the rate.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.env import sandbox  # noqa: E402
from rl.env.code_reward import passes  # noqa: E402

PROGRAM = "x = 48 / 2 + 48\nprint(x)\n"
SETUP = 'def total(xs):\n    """The sum of xs."""\n'
TESTS = "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n\ncheck(total)\n"
SOLUTION = "def total(xs):\n    return sum(xs)\n"


def tool_call() -> None:
    assert sandbox.run_python(PROGRAM).stdout == "72.0\n"


def code_reward() -> None:
    assert passes(SOLUTION, TESTS, SETUP)


def cpu_s() -> float:
    """CPU seconds of this process's ended children and theirs (the jail's keeper waits for its program)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rate(call, callers: int, seconds: float) -> tuple[float, float]:
    """Calls per second over `seconds`, `callers` threads calling back to back, and the CPU milliseconds of the
    child processes per call (what the machine spends on one, however busy it is)."""
    call()  # the first call asks once whether the jail can be built
    done, stop, cpu_before = [0] * callers, time.monotonic() + seconds, cpu_s()

    def loop(i: int) -> None:
        while time.monotonic() < stop:
            call()
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - start), 1000 * (cpu_s() - cpu_before) / sum(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; jail: {sandbox.jail_problem() or 'builds here'}")
    print("| call | callers | jail calls/s | barrier calls/s | jail / barrier | jail CPU ms a call | barrier CPU ms a call |")
    print("|---|---|---|---|---|---|---|")
    for name, call in (("tool call", tool_call), ("code reward", code_reward)):
        for callers in args.callers:
            rates = {}
            for isolation in ("jail", "barrier"):
                os.environ["RL_SANDBOX"] = isolation
                rates[isolation] = rate(call, callers, args.seconds)
            (jail, jail_cpu), (barrier, barrier_cpu) = rates["jail"], rates["barrier"]
            print(f"| {name} | {callers} | {jail:.1f} | {barrier:.1f} | {jail / barrier:.2f} | {jail_cpu:.0f} | "
                  f"{barrier_cpu:.0f} |", flush=True)


if __name__ == "__main__":
    main()
