"""Verifiable rewards: the reward of one response, and the pool that scores a batch.

`score_one` is a weighted sum of three terms (rl/env/answers.py): correctness (math_verify on the
extracted answer, or a user function named by import path), format (a regex) and DAPO's soft
overlong penalty. With TRL-style batched
functions or a group hook (`reward.functions`, `reward.group_fn`, in rl/env/groups.py),
their weighted sum is the correctness term and a prompt's whole group is scored at once.
`RewardPool` runs either in worker processes so that a reward function that raises, hangs or
crashes costs its sample (or its group) a 0.0 and a count, not the run.

How it departs from the textbook, where the reward is a function called inline:
- Workers are fresh interpreters running `python -m rl.env.worker`, never forks (the trainer
  holds torch and NCCL thread pools that a fork would copy half-locked) and never multiprocessing
  spawns (which re-import the trainer's main module, rl.main, and with it torch and transformers).
  A worker imports math_verify and sympy and nothing of the trainer; it is ready within
  `start_timeout_s` or the run stops with a message naming the key.
- A timeout is per unit (one input, or one group with batched functions), counted from when a worker was
  handed it. It is
  enforced by killing that worker and starting a fresh one, because a hung
  Python call cannot be interrupted from outside. So k hanging inputs cost about
  ceil(k / num_workers) * timeout_s, and other inputs keep flowing meanwhile.
- Each worker's address space is capped at `memory_limit_mb` (a worker needs about 70 MB): an
  input that blows it raises MemoryError (or kills the worker), scores 0.0 and is counted, and the
  worker is replaced.
- What workers print goes to a pipe, not the trainer's stdout; the first `OUTPUT_LIMIT_BYTES` of
  each `score` call are logged with the failures, the rest is counted and dropped.
- Errors never propagate: a failed input gets 0.0 in every term, is counted
  and logged once (grouped by message) with its traceback.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.config import ConfigError, RewardConfig, RunStopped, TrainConfig
from rl.env import EnvOutcome, EnvStep
from rl.env.answers import format_score, length_penalty, math_correct
from rl.functions import load_function

# ---------------------------------------------------------------------------- one input


@dataclass(frozen=True)
class RewardInput:
    """One response to score; everything here crosses to a worker process, so it must pickle."""

    prompt: str
    response: str
    label: Any
    response_length: int  # tokens
    max_new_tokens: int
    metadata: dict = field(default_factory=dict)
    # What TRL-style functions see besides the response: the row's prompt and other columns, the response's ids.
    raw_prompt: Any = None
    columns: dict = field(default_factory=dict)
    completion_ids: tuple[int, ...] | list[int] = ()
    group: int | None = None  # inputs of one prompt group share it (Sample.group_index); None: a group of its own


@dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` holds that a reward function reads, in this loop's terms: `global_step`, the
    optimizer steps taken before this rollout (train.num_steps_per_rollout x num_iterations a rollout), of
    `max_steps` in the run
    (train.num_rollout rollouts); `epoch`, the passes through the prompts so far, fractional as TRL's."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


def require_sandbox(isolation: str) -> None:
    """A ConfigError (one line) where the sandbox's jail cannot be built and reward.sandbox did not accept the
    barrier: before the model loads, not at the first tool call."""
    from rl.env import sandbox

    try:
        sandbox.require_jail(isolation)
    except sandbox.SandboxUnavailable as e:
        raise ConfigError(str(e)) from None


def function_paths(cfg: RewardConfig) -> list[tuple[str, str]]:
    """(config key, path) of every user function the config names."""
    return ([("reward.user_fn", cfg.user_fn)] if cfg.user_fn else []) + [("reward.functions", path) for path in
            cfg.functions] + ([("reward.group_fn", cfg.group_fn)] if cfg.group_fn else [])


def scores_groups(cfg: RewardConfig) -> bool:
    return bool(cfg.functions or cfg.group_fn)


BUILT_IN_TERMS = ("correct", "format", "length")


def function_names(cfg: RewardConfig) -> list[str]:
    """The term (and metric, reward/<name>_mean) of each batched function and then the group hook: the
    function's own name, as TRL logs it, or "module.function" where that would clash with another's or ours."""
    paths = [*cfg.functions, *([cfg.group_fn] if cfg.group_fn else [])]
    short = [path.partition(":")[2].partition("(")[0].strip() for path in paths]  # a factory call: the factory's
    return [name if short.count(name) == 1 and name not in BUILT_IN_TERMS else path.replace(":", ".")
            for name, path in zip(short, paths)]


def score_column(name: str, taken) -> str:
    """A reward function's column in a table of samples: its name, or reward/<name> where the table has that column
    of its own (a function named `reward`)."""
    return f"reward/{name}" if name in taken else name


def function_weights(cfg: RewardConfig) -> list[float]:
    """The weight of each batched function and then the group hook, in function_names' order."""
    return [*(cfg.function_weights or [1.0] * len(cfg.functions)), *([cfg.group_weight] if cfg.group_fn else [])]


def call_user_fn(path: str, inp: RewardInput) -> float:
    fn = load_function(path)  # sys.modules makes this a dict lookup after the first call
    try:
        returned = fn(prompt=inp.prompt, response=inp.response, label=inp.label, metadata=inp.metadata)
    except Exception as e:
        e.add_note(f"in reward.user_fn {path}")  # the failure log names the function
        raise
    value = real_number(returned)
    if value is None:
        raise TypeError(f"reward.user_fn {path} returned {type(returned).__name__} {returned!r}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward.user_fn {path} returned {returned!r}, expected a finite float")
    return value


def real_number(value: Any) -> float | None:
    """`value` as a float when it is a real number: a Python number, a numpy scalar (np.bool_ is no
    numbers.Real), a 0-d array or tensor; else None. Duck-typed through `shape` and `.item()`, so a
    worker needs neither numpy nor torch to take them."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else None


def score_one(inp: RewardInput, cfg: RewardConfig) -> dict[str, float]:
    """The terms of one response and their weighted sum under "reward"."""
    if cfg.user_fn:
        correct = call_user_fn(cfg.user_fn, inp)
    else:
        correct = math_correct(inp.response, inp.label)
    return combine_terms(correct, inp, cfg)


def combine_terms(correct: float, inp: RewardInput, cfg: RewardConfig) -> dict[str, float]:
    """The correctness term beside the format and length terms, and their weighted sum under "reward"."""
    terms = {
        "correct": correct,
        "format": format_score(inp.response, cfg.format_pattern),
        "length": length_penalty(inp.response_length, inp.max_new_tokens, cfg.length_penalty_buffer),
    }
    terms["reward"] = sum(weight * terms[name] for name, weight in built_in_weights(cfg).items())
    return terms


def built_in_weights(cfg: RewardConfig) -> dict[str, float]:
    """Each built-in term's weight in the reward, in the order the weighted sum adds them."""
    return {"correct": cfg.correct_weight, "format": cfg.format_weight, "length": cfg.length_penalty_weight}


def units_of(inputs: list[RewardInput], cfg: RewardConfig) -> list[list[int]]:
    """What one worker call scores, as input indices: each input alone, or with batched functions each run of
    inputs sharing a group."""
    units: list[list[int]] = []
    for i, inp in enumerate(inputs):
        joins = scores_groups(cfg) and units and inp.group is not None and inputs[units[-1][0]].group == inp.group
        if joins:
            units[-1].append(i)
        else:
            units.append([i])
    return units


# ---------------------------------------------------------------------------- pool

OUTPUT_LIMIT_BYTES = 4096  # of what the workers print during one `score`, kept for the failure log
RL_ROOT = str(Path(__file__).resolve().parents[2])  # where `python -m rl.env.worker` finds `rl`


@dataclass
class RewardResult:
    rewards: list[float]  # NaN where every batched function passed (returned None) and no other term weighs
    # "correct", "format", "length", then each batched function's name; 0.0 where the input failed, None where
    # a function passed on it
    terms: dict[str, list[float | None]]
    num_errors: int = 0
    num_timeouts: int = 0
    num_unscored: int | None = None  # with batched functions: inputs every function passed on (no reward)
    logged: dict[str, list[float]] = field(default_factory=dict)  # log_metric's values, by name, over the calls
    extra: list[dict[str, Any]] = field(default_factory=list)  # log_extra's columns, one dict per input


@dataclass(eq=False)  # identity, so `self.workers.index` finds this very worker
class Worker:
    process: subprocess.Popen
    conn: multiprocessing.connection.Connection
    started_at: float
    ready: bool = False
    index: int | None = None  # the unit it is scoring
    deadline: float = math.inf
    printing: bool = True  # its stdout pipe is still open


@dataclass
class Failures:
    """What went wrong in one `score` call, kept to log once per distinct message, and what workers printed.
    Errors and timeouts are kept by input; what was printed, by unit (an input, or a group of them)."""

    errors: dict[str, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    tracebacks: dict[str, str] = field(default_factory=dict)
    timeouts: list[int] = field(default_factory=list)
    printed: dict[int | None, bytearray] = field(default_factory=dict)  # by unit; None: starting or idle
    printed_bytes: int = 0  # all of it, kept or not
    unit_name: str = "input"

    def add_error(self, indices: list[int], message: str, tb: str) -> None:
        self.errors[message].extend(indices)
        self.tracebacks.setdefault(message, tb)

    def add_output(self, index: int | None, chunk: bytes) -> None:
        room = OUTPUT_LIMIT_BYTES - sum(len(text) for text in self.printed.values())
        if room > 0:
            self.printed.setdefault(index, bytearray()).extend(chunk[:room])
        self.printed_bytes += len(chunk)

    def output_text(self) -> str:
        return "\n".join(f"[{self.unit_name + ' ' + str(i) if i is not None else 'no input'}] "
                         f"{text.decode(errors='replace').rstrip()}" for i, text in self.printed.items())


def log_failures(failures: Failures, timeout_s: float, what: str = "reward", scorer: str = "") -> None:
    """`what`: "reward" (inputs scored) or "env" (episode steps, which end their episode with reward 0); `scorer`:
    the config keys that name what scored, said with each timeout (an error names its function itself)."""
    log = logging.getLogger(__name__)
    unit, cost = ("input", "scored 0.0") if what == "reward" else ("step", "ended its episode with reward 0")
    for message, indices in failures.errors.items():
        log.warning("%s: %d %s(s) %s after %s (%ss %s)\n%s", what,
                    len(indices), unit, cost, message, unit, indices[:10], failures.tracebacks[message])
    if failures.timeouts:
        log.warning("%s: %d %s(s) %s after exceeding %s.timeout_s=%g s (%ss %s); "
                    "their workers were killed and replaced%s", what, len(failures.timeouts), unit, cost, what, timeout_s,
                    unit, failures.timeouts[:10], f" (scored by {scorer})" if scorer else "")
    if failures.printed_bytes:
        kept = sum(len(text) for text in failures.printed.values())
        log.warning("%s: workers printed %d bytes; the first %d, by %s:\n%s", what,
                    failures.printed_bytes, kept, unit, failures.output_text())


def read_output(worker: Worker, failures: Failures) -> None:
    """Moves what the worker printed into `failures`, which keeps the first few KB. Reading all of it keeps
    the pipe from filling and blocking the worker; at most 1 MB per call, so a worker printing in a loop
    cannot keep the pool from its deadlines."""
    for _ in range(16):
        if not worker.printing:
            return
        try:
            chunk = os.read(worker.process.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if chunk:
            failures.add_output(worker.index, chunk)
        else:
            worker.printing = False


def stop(process: subprocess.Popen) -> str:
    """Kills the process (a no-op once it has exited) and says how it ended."""
    process.kill()  # SIGKILL: a hung reward function may ignore anything gentler
    code = process.wait()
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


class RewardPool:
    """`cfg.num_workers` worker processes (`rl.env.worker`) running `score_one`, each input bounded by
    `cfg.timeout_s`, each worker by `cfg.memory_limit_mb` and `cfg.start_timeout_s`.

    Use as a context manager (or call `close()`). Not thread-safe: one `score` at a time, from the thread
    that built the pool (a worker dies with the thread that started it).
    """

    def __init__(self, cfg: RewardConfig, env_fn: str = "", train: TrainConfig | None = None):
        if cfg.num_workers < 1 or cfg.timeout_s <= 0:
            raise ConfigError("reward.num_workers must be >= 1 and reward.timeout_s > 0")
        for key, path in function_paths(cfg):
            load_function(path, key)  # a bad path fails here, in the parent, not as N worker errors
        if env_fn:  # imported here only to fail early: episodes are made and stepped in the workers
            load_function(env_fn, "env.fn")
        if "rl.env.sandbox" in sys.modules:  # a function runs model-written code: refuse a missing jail now
            require_sandbox(cfg.sandbox)
        self.cfg, self.env_fn = cfg, env_fn
        # The run's length for `trainer_state` (reward.functions): optimizer steps per rollout and rollouts.
        per_rollout = train.num_steps_per_rollout * train.num_iterations if train is not None else 1
        self.steps = (per_rollout, train.num_rollout if train is not None else 0)
        self.trainer_state = TrainerState(max_steps=self.steps[0] * self.steps[1])
        # Started without waiting: workers import while the caller does other work; `score` waits.
        self.workers = [self.start_worker() for _ in range(cfg.num_workers)]

    def start_worker(self) -> Worker:
        """`python -m rl.env.worker`: a fresh interpreter that imports nothing of the trainer. A plain
        exec, not multiprocessing's spawn, which would re-import the trainer's main module (rl.main)."""
        started_at = time.monotonic()
        parent_conn, child_conn = multiprocessing.Pipe()
        fd = child_conn.fileno()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [RL_ROOT, os.environ.get("PYTHONPATH")])),
                   RL_SANDBOX=self.cfg.sandbox)  # how rl/env/sandbox.py runs model-written code there
        process = subprocess.Popen([sys.executable, "-u", "-m", "rl.env.worker", str(fd)], pass_fds=[fd], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        child_conn.close()  # so the parent sees EOF when the worker dies
        os.set_blocking(process.stdout.fileno(), False)
        parent_conn.send((sys.path, self.cfg, self.env_fn))
        return Worker(process, parent_conn, started_at)

    def retire(self, worker: Worker, failures: Failures) -> str:
        how = stop(worker.process)
        read_output(worker, failures)  # its last words, e.g. a fatal error's message
        worker.conn.close()
        worker.process.stdout.close()
        return how

    def replace(self, worker: Worker, failures: Failures) -> None:
        self.retire(worker, failures)
        self.workers[self.workers.index(worker)] = self.start_worker()

    def begin_rollout(self, rollout_id: int, epoch: float) -> None:
        """The `trainer_state` the functions see while this rollout is scored; `epoch`: passes through the prompts."""
        per_rollout, rollouts = self.steps
        self.trainer_state = TrainerState(rollout_id * per_rollout, rollouts * per_rollout, epoch)

    def score(self, inputs: list[RewardInput]) -> RewardResult:
        """Scores every input; one that raises, crashes its worker or times out gets 0.0 and a count (with
        batched functions: every input of its group)."""
        if not self.workers:
            raise RuntimeError("RewardPool.score called after close()")
        units = units_of(inputs, self.cfg)
        failures = Failures(unit_name="group" if scores_groups(self.cfg) else "input")
        outcomes = self.run_units(inputs, units, self.cfg.timeout_s, failures)
        log_failures(failures, self.cfg.timeout_s, scorer=", ".join(f"{key}={path!r}" for key, path in
                                                                     function_paths(self.cfg)))
        return gather(outcomes, len(failures.timeouts), self.cfg)

    def step_envs(self, steps: list[EnvStep], timeout_s: float) -> tuple[list[EnvOutcome | None], int, int]:
        """One step of each episode (rl/env/__init__.py), each bounded by `timeout_s`; None where a step failed. Also
        the numbers of steps that raised (or crashed their worker) and that timed out."""
        stepping = self.env_steps(timeout_s)
        stepping.add(steps)
        return stepping.finish()

    def env_steps(self, timeout_s: float) -> EnvSteps:
        """Environment steps handed to the workers as the caller adds them (`EnvSteps`), for a caller that has
        more to do meanwhile: the turn loop adds an episode's step as soon as its turn is generated."""
        if not self.workers:
            raise RuntimeError("RewardPool.env_steps called after close()")
        return EnvSteps(Jobs(self, timeout_s, Failures(unit_name="step")))

    def run_units(self, inputs: list, units: list[list[int]], timeout_s: float, failures: Failures) -> list:
        """Each unit on a free worker within `timeout_s`; one outcome per input, None where its unit failed."""
        jobs = Jobs(self, timeout_s, failures)
        jobs.add(inputs, units)
        return jobs.finish()

    def dispatch(self, inputs: list, units: list[list[int]], pending: collections.deque, timeout_s: float) -> None:
        for worker in self.workers:
            if pending and worker.ready and worker.index is None:
                index = pending.popleft()
                try:
                    worker.conn.send((index, [inputs[i] for i in units[index]], self.trainer_state))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died while idle; `collect` sees the closed socket and replaces it
                worker.index, worker.deadline = index, time.monotonic() + timeout_s

    def wait(self) -> None:
        """Blocks until a worker has news (a message, output, its exit) or the nearest deadline passes."""
        deadlines = [w.deadline if w.ready else w.started_at + self.cfg.start_timeout_s for w in self.workers]
        timeout = max(0.0, min(deadlines) - time.monotonic())
        handles = [w.conn for w in self.workers] + [w.process.stdout for w in self.workers if w.printing]
        multiprocessing.connection.wait(handles, timeout=timeout)

    def collect(self, worker: Worker, units: list[list[int]], outcomes: list, failures: Failures) -> None:
        """Takes one worker's output and messages, and replaces it if it died or ran past its deadline."""
        read_output(worker, failures)
        exited = False
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "failed":
                    self.retire(worker, failures)
                    raise RunStopped(f"reward worker could not start ({self.limits()}): {message[1]}\n"
                                       f"{message[2]}{failures.output_text()}")
                if message[0] == "ready":
                    worker.ready = True
                    continue
                read_output(worker, failures)  # printed before it answered: belongs to this unit
                for i, outcome in zip(units[message[1]], message[2] if message[0] == "ok" else []):
                    outcomes[i] = outcome
                if message[0] == "error":
                    failures.add_error(units[message[1]], message[2], message[3])
                worker.index, worker.deadline = None, math.inf
                if message[0] == "error" and message[4]:  # it ran out of memory and exits: replace it now
                    exited = True
                    break
        except (EOFError, OSError):
            exited = True  # the socket closed: the worker is gone or going
        now = time.monotonic()
        if exited or worker.process.poll() is not None:
            how = self.retire(worker, failures)
            if not worker.ready:
                raise RunStopped(f"reward worker could not start ({self.limits()}): it exited with {how}\n"
                                   f"{failures.output_text()}")
            if worker.index is not None:
                failures.add_error(units[worker.index], f"WorkerDied: reward worker exited with {how}",
                                   "(no traceback: the process died; what it printed is logged below)\n")
            self.workers[self.workers.index(worker)] = self.start_worker()
        elif worker.index is not None and now >= worker.deadline:
            failures.timeouts.extend(units[worker.index])
            self.replace(worker, failures)
        elif not worker.ready and now >= worker.started_at + self.cfg.start_timeout_s:
            self.retire(worker, failures)
            raise RunStopped(f"reward worker did not start within reward.start_timeout_s="
                               f"{self.cfg.start_timeout_s:g} s\n{failures.output_text()}")

    def limits(self) -> str:
        """For start-up errors: a too-small memory limit shows as any error at all (sympy's ImportError)."""
        named = ", ".join(f"{key}={path!r}" for key, path in function_paths(self.cfg)) or "reward.user_fn=''"
        return f"reward.memory_limit_mb={self.cfg.memory_limit_mb}, {named}"

    def close(self) -> None:
        for worker in self.workers:
            self.retire(worker, Failures())
        self.workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Jobs:
    """Units of work on a pool's workers, taken in as they come: `add` queues units, `pump` hands units to free
    workers and takes back what finished without blocking, `finish` blocks until every unit is done. One at a
    time per pool: a worker's `index` is a unit of the jobs that handed it out."""

    def __init__(self, pool: RewardPool, timeout_s: float, failures: Failures):
        self.pool, self.timeout_s, self.failures = pool, timeout_s, failures
        self.inputs: list = []
        self.units: list[list[int]] = []
        self.outcomes: list = []
        self.pending: collections.deque = collections.deque()

    def add(self, inputs: list, units: list[list[int]] | None = None) -> None:
        """Queues `inputs` in `units` (positions among them; default: one unit each)."""
        start = len(self.inputs)
        self.inputs += inputs
        self.outcomes += [None] * len(inputs)
        for unit in units if units is not None else [[i] for i in range(len(inputs))]:
            self.pending.append(len(self.units))
            self.units.append([start + i for i in unit])

    def pump(self) -> None:
        """Takes back what finished and hands queued units to free workers; never waits."""
        pool = self.pool
        for worker in list(pool.workers):
            pool.collect(worker, self.units, self.outcomes, self.failures)
        pool.dispatch(self.inputs, self.units, self.pending, self.timeout_s)

    def finish(self) -> list:
        """Every unit run (or failed); one outcome per input in the order added, None where its unit failed."""
        self.pump()
        while self.pending or any(w.index is not None for w in self.pool.workers):
            self.pool.wait()
            self.pump()
        return self.outcomes


@dataclass
class EnvSteps:
    """Environment steps in flight (RewardPool.env_steps): `add` them as they come (each add also takes back what
    finished and hands out what waits), `finish` for the outcomes in the order added and the counts of steps that
    raised and that timed out."""

    jobs: Jobs

    def add(self, steps: list[EnvStep]) -> None:
        self.jobs.add(steps)
        self.jobs.pump()

    def finish(self) -> tuple[list[EnvOutcome | None], int, int]:
        outcomes, failures = self.jobs.finish(), self.jobs.failures
        log_failures(failures, self.jobs.timeout_s, "env")
        return outcomes, sum(o is None for o in outcomes) - len(failures.timeouts), len(failures.timeouts)


def gather(outcomes: list[dict[str, float] | None], num_timeouts: int, cfg: RewardConfig) -> RewardResult:
    """Outcomes (None where an input failed) -> a RewardResult with 0.0 for the failures."""
    functions = function_names(cfg)
    failed = {**dict.fromkeys(BUILT_IN_TERMS + ("reward",), 0.0), "functions": dict.fromkeys(functions, 0.0)}
    filled = [o if o is not None else failed for o in outcomes]
    # A function of weight 0 is logged (its reward/<name>_mean, as TRL logs it) but adds nothing: its value does not
    # make a response scored that every weighted function passed on.
    weighted = [f for f, w in zip(functions, function_weights(cfg)) if w] or functions
    unscored = [i for i, o in enumerate(outcomes) if o is not None and all(o["functions"][f] is None for f in weighted)]
    # With no format or length term either, such a response has no score at all: NaN, left out of its group's
    # advantage statistics with advantage 0 (rl/train/algo.py), as TRL leaves it.
    no_score = set(unscored) if functions and not (cfg.format_weight or cfg.length_penalty_weight) else set()
    if functions and unscored:
        logging.getLogger(__name__).warning(
            "reward: every reward function returned None for %d input(s) (inputs %s), %s; a function returns None "
            "for inputs that are another's to score", len(unscored), unscored[:10],
            "left out of their groups' statistics with advantage 0" if no_score else "scored by the format and "
            "length terms alone")
    return RewardResult(
        rewards=[math.nan if i in no_score else o["reward"] for i, o in enumerate(filled)],
        terms={**{name: [o[name] for o in filled] for name in BUILT_IN_TERMS},
               **{name: [o["functions"][name] for o in filled] for name in functions}},
        num_errors=sum(o is None for o in outcomes) - num_timeouts,
        num_timeouts=num_timeouts,
        num_unscored=len(unscored) if functions else None,
        logged=logged_metrics(outcomes),
        extra=[o.get("extra", {}) if o is not None else {} for o in outcomes],
    )


def logged_metrics(outcomes: list[dict | None]) -> dict[str, list[float]]:
    """What the functions passed to log_metric, by name, in the order of the calls (each call's on its first input)."""
    logged: dict[str, list[float]] = {}
    for outcome in outcomes:
        for name, values in (outcome or {}).get("logged", {}).items():
            logged.setdefault(name, []).extend(values)
    return logged


def metrics(result: RewardResult) -> dict[str, float]:
    """reward/<term>_mean for every term (over the inputs a function did not pass on), and the counts."""
    out = {}
    for name, values in result.terms.items():
        scored = [v for v in values if v is not None]
        if scored:
            out[f"reward/{name}_mean"] = sum(scored) / len(scored)
    for name, values in result.logged.items():  # TRL averages a step's log_metric calls too
        out[f"reward/logged/{name}"] = sum(values) / len(values)
    out |= {"reward/num_inputs": float(len(result.rewards)), "reward/num_errors": float(result.num_errors),
            "reward/num_timeouts": float(result.num_timeouts)}
    if result.num_unscored is not None:
        out["reward/num_unscored"] = float(result.num_unscored)
    return out


COUNTS = ("num_inputs", "num_errors", "num_timeouts", "num_unscored")  # summed over ranks and rounds


def reduce_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Counts summed, means averaged over the ranks that have them (a function may pass on all of a rank's)."""
    out = {}
    for key in dict.fromkeys(key for m in per_rank for key in m):
        values = [m[key] for m in per_rank if key in m]
        out[key] = sum(values) if key.endswith(COUNTS) else sum(values) / len(values)
    return out
