"""Launch plumbing: stop requests, restarts after a crash, and torchrun's error-file protocol.

Stop requests. SIGTERM, SIGUSR1 (a preemption notice), a first SIGINT, or the file named by
`RL_STOP_FILE` (launch.sh creates it when it is signalled) ask the loop to checkpoint at the end of
its step and exit 0. The file reaches ranks that do not exist yet or have not installed their handlers
(a signal sent then would be lost), and it is how launch.sh talks to ranks that no terminal or process
group signal reaches: torchrun starts each rank in a session of its own. A second SIGINT stops at once.

Restarts. Under `torchrun --max-restarts N` a rank that dies makes torchrun stop the others and start
them all again (`TORCHELASTIC_RESTART_COUNT` counts the attempts); the loop then resumes from the newest
complete checkpoint. Each new attempt reads why the last one ended from the error files its ranks left
(`restart_cause`). A run that ended on one of our own one-line errors (bad input, a stop rule) would end
the same way again, so such an attempt is not repeated: the restarted ranks repeat the error at once.

Error files. A cause torchrun's failure summary should show (one line, not a traceback) is written to the
rank's error file (`record_error`); ranks of one node record in rank order so the summary names the
first rank's line the root cause.

Under launch.sh. Torchrun restarts ranks after any failed exit, and ends with a page of `ChildFailedError`.
So launch.sh checks the config before torchrun starts (`python -m rl.launch`, `check`: one line, no
ranks), and a rank that still meets one of our final errors hands it to launch.sh in the file named by
`RL_ERROR_FILE` and exits 0: torchrun neither restarts nor summarises, and launch.sh exits with the code.
`rl` (the console command) is launch.sh run by the Python that runs `rl`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rl.config import ConfigError, RunStopped, check_paths, help_request, help_text, load_config, resolve

RANK0_REPORT_S = 20.0  # how long the other ranks wait after an error for rank 0 to say it
PEERS_RECORD_S = 10.0  # how long rank 0 then waits for the other ranks of its node to record the error
FIRST_RECORD_S = 5.0  # how long the other ranks of a node wait for its first rank to record the error first


class StopRequests:
    """Collects stop requests; `reason()` says whether one came and how. `signalled`: whether a stop signal came
    to this process (the class's: `rl.parallel.lost_rank_error` reads it, as torchrun's SIGTERM ends its wait)."""

    signalled = False

    def __init__(self, stop_file: str | None, rank: str):
        self.received: str | None = None
        self.stop_file = stop_file
        self.rank = rank
        self.interrupts = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGINT, self._interrupt)

    def _handle(self, signum, _frame) -> None:
        self.received = self.received or signal.Signals(signum).name
        StopRequests.signalled = True

    def _interrupt(self, signum, frame) -> None:
        self.interrupts += 1
        if self.interrupts > 1:
            raise KeyboardInterrupt
        self._handle(signum, frame)
        if self.rank == "0":
            print("rl: SIGINT: stopping at the end of this step with a checkpoint; Ctrl-C again to stop now",
                  file=sys.stderr, flush=True)

    def reason(self) -> str | None:
        if self.received is None and self.stop_file and os.path.exists(self.stop_file):
            self.received = "a stop request from launch.sh"
        return self.received


# ---------------------------------------------------------------------------- torchrun's error files


def record_error(message: str, final: bool, exitcode: int) -> None:
    """Writes the one-line cause where torchrun's failure summary reads it (its error file), so the
    summary names the cause instead of `error_file: <N/A>`. `final`: a restart would end the same way."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": message,
                                   "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time())),
                                                 "rl_final": final, "rl_exitcode": exitcode}}}, f)


def read_error(path: str) -> dict | None:
    """The `message` part of an error file, None when there is none (yet) or it cannot be read."""
    try:
        with open(path) as f:
            message = json.load(f)["message"]
        return message if isinstance(message, dict) else {"message": str(message), "extraInfo": {}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recorded(path: str) -> bool:
    """Whether the error file at `path` holds record_error's line (its callstack is the message), not yet
    the traceback that `record` writes first."""
    message = read_error(path)
    return message is not None and message.get("extraInfo", {}).get("py_callstack") == message.get("message")


def local_error_files(own: str | None, attempt: str = "") -> list[str]:
    """The error files of this node's ranks by local rank, in this attempt or (`attempt="attempt_<k>"`)
    another; torchrun's are <run_log_dir>/attempt_<k>/<local_rank>/error.json. None outside torchrun."""
    local_rank = os.environ.get("LOCAL_RANK")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not own or os.path.basename(os.path.dirname(own)) != local_rank:
        return []
    attempt_dir = os.path.dirname(os.path.dirname(own))
    if attempt:
        attempt_dir = os.path.join(os.path.dirname(attempt_dir), attempt)
    return [os.path.join(attempt_dir, str(r), os.path.basename(own)) for r in range(local_world_size)]


def await_recorded(paths: list[str], seconds: float) -> None:
    """Waits, `seconds` at most, until every error file in `paths` holds its rank's recorded error. A rank that
    never meets the error (one that another rank alone saw) costs the bound, no more."""
    deadline = time.monotonic() + seconds
    while not all(map(recorded, paths)) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------------------- restarts


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def previous_attempt_errors() -> list[tuple[int, dict | None]]:
    """(global rank, error) for each rank of this node in the attempt before this one; error None where the
    rank left no error file (killed by a signal: kill -9, the kernel's OOM killer, a driver fault)."""
    count = restart_count()
    files = local_error_files(os.environ.get("TORCHELASTIC_ERROR_FILE"), f"attempt_{count - 1}") if count else []
    first_rank = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    return [(first_rank + local, read_error(path)) for local, path in enumerate(files)]


def restart_cause(errors: list[tuple[int, dict | None]]) -> str:
    """Why the previous attempt ended, in one line: the ranks that died without a word first (the others'
    errors are mostly their collectives failing against the dead one), else the earliest recorded error."""
    silent = [rank for rank, error in errors if error is None]
    if silent:
        return (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of this node ended without "
                f"an error report (killed by a signal: kill -9, the kernel's OOM killer, a driver fault)")
    reported = sorted((str(e.get("extraInfo", {}).get("timestamp", "")), rank, e) for rank, e in errors if e)
    if not reported:
        return "another node's ranks failed"
    _, rank, error = reported[0]
    return f"rank {rank}: " + (str(error.get("message", "")).strip().splitlines() or ["(no message)"])[-1][:300]


def final_error(errors: list[tuple[int, dict | None]]) -> dict | None:
    """The previous attempt's own one-line error when a restart would only repeat it (bad input, a stop rule)."""
    return next((e for _, e in errors if e and e.get("extraInfo", {}).get("rl_final")), None)


# ---------------------------------------------------------------------------- the command line


def cli(main: Callable[[list[str]], None], argv: list[str]) -> int:
    """A bad config or input, or a fault the run cannot survive: one line on rank 0 and exit 2 (input) or
    1 (run stopped). Anything else is a bug and keeps its traceback (recorded for torchrun's summary)."""
    # torch here and in `report`, not at the top: launch.sh's `python -m rl.launch` check runs without it
    from torch.distributed.elastic.multiprocessing.errors import record

    from rl.parallel import StalledRankError, lost_rank_error

    repeated = final_error(previous_attempt_errors())
    try:
        if (section := help_request(argv)) is not None:
            if os.environ.get("RANK", "0") == "0":
                print(f"usage: torchrun ... -m rl.main --config FILE [--section.key=VALUE ...]\n\n{help_text(section)}")
            return 0
        if repeated:
            raise RepeatedError(repeated)
        record(main)(argv)
    except (ConfigError, RunStopped, StalledRankError, RepeatedError) as e:
        return report(e)
    except RuntimeError as e:  # a collective that another rank stopped answering, or died in, else a bug
        if (lost := lost_rank_error(e, stopping=lambda: StopRequests.signalled)) is None:
            raise
        return report(lost)
    return 0


class RepeatedError(Exception):
    """The error a restarted attempt repeats without running (see `final_error`)."""

    def __init__(self, error: dict):
        self.exitcode = int(error.get("extraInfo", {}).get("rl_exitcode", 1))
        message = re.sub(r"^rl: \w+: ", "", str(error.get("message", "")))
        super().__init__(re.sub(r" \(restart \d+ not run: [^)]*\)$", "", message))


def report(e: Exception) -> int:
    """Prints and records the one line; returns the exit code (2 for bad input, else 1; 0 under launch.sh, which
    takes the code from RL_ERROR_FILE)."""
    from rl.parallel import StalledRankError

    code = e.exitcode if isinstance(e, RepeatedError) else 2 if isinstance(e, ConfigError) else 1
    kind = "error" if code == 2 else "stopped"
    message = f"rl: {kind}: {e}"
    if isinstance(e, RepeatedError):
        message += f" (restart {restart_count()} not run: the same input ends the same way)"
    # Every rank meets the same error, and torchrun's summary names the earliest recorded one the root cause,
    # so the node's other ranks record theirs after its first rank has. Torchrun stops the other ranks as soon
    # as one exits: the first rank waits until they have recorded (or a rank stopped before it recorded shows
    # as `error_file: <N/A>`), the others give rank 0 the time to print the line and end when they are stopped.
    files = local_error_files(os.environ.get("TORCHELASTIC_ERROR_FILE"))
    if files and files[0] != os.environ.get("TORCHELASTIC_ERROR_FILE"):
        await_recorded(files[:1], FIRST_RECORD_S)
    final = not isinstance(e, StalledRankError)
    record_error(message, final=final, exitcode=code)
    handed_on = final and hand_to_launcher(message, code)
    if int(os.environ.get("RANK", "0")) == (e.reporter if isinstance(e, StalledRankError) else 0):
        print(message, file=sys.stderr, flush=True)
        if not handed_on:  # not for the ranks the line names: stopped or dead, they record nothing
            first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
            lost = e.missing if isinstance(e, StalledRankError) else ()
            await_recorded([f for i, f in enumerate(files) if i and first + i not in lost], PEERS_RECORD_S)
    elif not handed_on:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(RANK0_REPORT_S)
    return 0 if handed_on else code


def hand_to_launcher(message: str, code: int) -> bool:
    """Under launch.sh (RL_ERROR_FILE set): leaves the exit code and the line for it, and says so; the rank then
    exits 0, since torchrun restarts every failed exit. Every rank meets the same input, so every rank ends;
    one that does not loses its peers in a collective, and its restart repeats the recorded error at once."""
    path = os.environ.get("RL_ERROR_FILE")
    if not path:
        return False
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one writer per node: launch.sh runs one torchrun per node
        Path(path).write_text(f"{code}\n{message}\n")
    return True


# ---------------------------------------------------------------------------- launch.sh's check


def check(argv: list[str], world_size: int) -> None:
    """What a rank checks before its process group starts, in the launcher: the config's keys and values,
    the model and tokenizer folders, and the split over `world_size` ranks. Paths are the caller's."""
    cfg = load_config(argv)
    check_paths(cfg)
    resolve(cfg, world_size)


def check_command(argv: list[str]) -> int:
    """`python -m rl.launch [--world-size N] CONFIG [--section.key=VALUE ...]`, as launch.sh runs it before
    torchrun: the config's first problem as one line (exit 2), or --help's answer, or nothing (exit 0)."""
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    if (section := help_request(argv)) is not None:
        try:
            text = help_text(section)
            print(f"usage: bash launch.sh [--install] [--nproc N] [--max-restarts N] CONFIG [--section.key=VALUE ...]"
                  f"\n   or: rl [--nproc N] [--max-restarts N] CONFIG [--section.key=VALUE ...]\n\n{text}")
        except ConfigError as e:
            print(f"rl: error: {e}", file=sys.stderr)
            return 2
        return 0
    config, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else (None, argv)
    try:
        check(([f"--config={config}"] if config else []) + rest, world_size)
    except ConfigError as e:
        print(f"rl: error: {e}", file=sys.stderr)
        return 2
    return 0


def console() -> None:
    """The `rl` command: launch.sh with the Python that runs `rl`, so that the ranks import what it imports."""
    script = Path(__file__).resolve().with_name("launch.sh")
    os.execvpe("bash", ["bash", str(script), *sys.argv[1:]], {**os.environ, "PYTHON": sys.executable})


if __name__ == "__main__":
    sys.exit(check_command(sys.argv[1:]))
