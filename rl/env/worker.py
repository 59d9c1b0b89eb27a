"""A reward worker process: `python -u -m rl.env.worker FD`, started by `rl.env.reward.RewardPool`.

Its own main module, so a worker imports the standard library, `rl.config`, `rl.env.answers`, `rl.env` and
`rl.env.reward` (standard library only), then math_verify and sympy or the user's reward functions: never the
trainer, torch or transformers. It talks to the pool over the socket FD:

    pool -> worker   (sys_path, RewardConfig, env.fn)     once, first
    worker -> pool   ("ready",) | ("failed", message, traceback)
    pool -> worker   (index, [RewardInput, ...], state)   one unit at a time: an input, or a prompt's group,
                     (index, [EnvStep], state)            or one step of an episode (rl/env/__init__.py); state: the
                                                          TrainerState that TRL-style functions are handed
    worker -> pool   ("ok", index, [terms or EnvOutcome, ...]) | ("error", index, message, traceback, exiting)

Whatever it prints (stdout and stderr, fd 1 and 2) goes to a pipe the pool reads and caps.
It runs under an address-space limit of `reward.memory_limit_mb`, so an input that explodes
raises MemoryError here instead of taking the machine's memory; after one, the worker answers and
exits, and the pool starts a fresh one rather than trust its heap.
"""

from __future__ import annotations

import ctypes
import resource
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from rl.config import RewardConfig
from rl.env import EnvStep, step_episode
from rl.env.answers import math_correct
from rl.env.groups import score_group
from rl.env.reward import TrainerState, function_paths, score_one, scores_groups
from rl.functions import load_function

PR_SET_PDEATHSIG = 1


def limit_memory(limit_mb: int) -> None:
    """Caps the address space (RLIMIT_AS): a little above the resident size, as it counts reserved mappings."""
    if limit_mb <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = limit_mb * 2**20 if hard == resource.RLIM_INFINITY else min(limit_mb * 2**20, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def die_with_parent() -> None:
    """SIGKILL when the trainer dies, so a worker stuck in a hung reward function does not outlive it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def warm_up(cfg: RewardConfig, env_fn: str) -> None:
    """Pays the imports before the worker reports ready, so no input's timeout is spent on them."""
    for key, path in function_paths(cfg) + ([("env.fn", env_fn)] if env_fn else []):
        load_function(path, key)
    if not function_paths(cfg):
        math_correct(r"\boxed{\frac{1}{2}}", "0.5")


def score_unit(inputs: list, cfg: RewardConfig, env_fn: str, state: TrainerState) -> list:
    """The terms of each input: a group scored at once with batched functions, else each input alone; or
    for episode steps (rl/env/__init__.py), each step's outcome."""
    if inputs and isinstance(inputs[0], EnvStep):
        return [step_episode(step, load_function(env_fn, "env.fn")) for step in inputs]
    return score_group(inputs, cfg, state) if scores_groups(cfg) else [score_one(inp, cfg) for inp in inputs]


def error_message(e: BaseException) -> str:
    """The exception's one line, with its notes (which function raised it) in brackets."""
    notes = "; ".join(getattr(e, "__notes__", []))
    return f"{type(e).__name__}: {e}" + (f" ({notes})" if notes else "")


def serve(conn: Connection, cfg: RewardConfig, env_fn: str) -> None:
    """Scores (index, inputs) messages until the pool closes the socket or memory runs out."""
    while True:
        try:
            index, inputs, state = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", index, score_unit(inputs, cfg, env_fn, state)))
        except MemoryError:
            conn.send(("error", index, f"MemoryError: past reward.memory_limit_mb={cfg.memory_limit_mb}",
                       traceback.format_exc(), True))  # in the same message, so no input is sent to us meanwhile
            return
        except Exception as e:
            conn.send(("error", index, error_message(e), traceback.format_exc(), False))


def main(fd: int) -> None:
    # Ctrl-C, SIGTERM and a preemption notice reach whole process groups and jobs (a terminal, `kill -TERM -PGID`,
    # scancel); they are the trainer's to handle, which may still need us (a final eval), and it kills us itself.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()
    conn = Connection(fd)
    sys_path, cfg, env_fn = conn.recv()
    sys.path[:] = sys_path  # the trainer's, so a user function imports as it did there
    try:
        limit_memory(cfg.memory_limit_mb)
        warm_up(cfg, env_fn)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready",))
    serve(conn, cfg, env_fn)


if __name__ == "__main__":
    main(int(sys.argv[1]))
