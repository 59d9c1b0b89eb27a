"""Runs untrusted Python (a model's tool call, a candidate program) in a fresh interpreter inside a jail.

    run_python(code, stdin="", timeout_s=5.0, memory_mb=512, disk_mb=64, files={"data.txt": "..."}) -> SandboxResult

Each call starts `python -I -B -X utf8` on the code, with `files` beside it, in the jail that rl/env/jail.py builds:
its own user, mount, PID, network, IPC, UTS and cgroup namespaces; a root in which only what Python needs is
visible, read-only, and only /tmp (its working directory, a tmpfs of `disk_mb`) is writable; user nobody, no
capabilities; limits on CPU seconds (the timeout, rounded up), address space (`memory_mb`: an allocation past it
raises MemoryError), bytes a file (MAX_FILE_BYTES), open files; a seccomp filter that refuses new processes (a
fork bomb ends at its first fork), the kernel's mount, namespace, tracing and keyring calls, and sockets of other
families than unix and IP. Its environment holds only what Python needs (PATH, HOME and TMPDIR at /tmp, a UTF-8
locale, one BLAS thread). So the code cannot read or change the caller's files, see or signal any process
outside (its caller included), reach any socket of the host, or leave anything behind: a call that ends, or whose
worker is killed, takes its processes, files and mounts with it (rl/env/jail.py says how).

A wall-clock timeout kills the call (SIGKILL to its process group; its jailed process dies with it). stdout and
stderr are read as they come, each kept up to MAX_OUTPUT_BYTES (the rest is read and dropped, so a chatty program
cannot fill the caller's memory).

The jail needs unprivileged user namespaces (or root) and a kernel that lets them mount: `jail_problem()` says why
not where it cannot be built. Then run_python raises SandboxUnavailable, whose one line names the setting that
accepts a weaker barrier knowingly: `reward.sandbox = "barrier"` in a run (the environment variable
RL_SANDBOX=barrier elsewhere). The barrier runs the code as the caller's user in a temporary folder of the host
(removed afterwards, but left behind if the caller is killed), with the same limits and seccomp filter, in a
user and network namespace where the kernel allows one, else with Python's socket module replaced (against
ordinary code, not against code calling libc through ctypes). It is not a filesystem jail: the code can read and
change whatever the caller's user can.

Standard library only: it runs in the reward workers (rl/env/worker.py), which import nothing of the trainer.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import resource
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

from rl.env import jail

MAX_OUTPUT_BYTES = 64 * 1024  # of stdout and of stderr, each
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the largest file the code may write
MAX_OPEN_FILES = 256
MAX_PROCESSES = 32  # RLIMIT_NPROC, only where the seccomp filter is missing (see rl/env/jail.py)
DISK_MB = 64  # the jail's writable tmpfs, the code's files included
MAIN = ".sandbox_main.py"  # the code, read and removed by the prelude before it runs
JAIL_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail.py")
ISOLATIONS = ("jail", "barrier")
NOT_BOUND = ("/tmp/", "/proc/", "/dev/", "/sys/")  # the jail has its own of these
CLONE_NEWUSER, CLONE_NEWNET = jail.CLONE_NEWUSER, jail.CLONE_NEWNET
PR_SET_PDEATHSIG = jail.PR_SET_PDEATHSIG


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed at the timeout; negative: ended by that signal
    timed_out: bool  # past timeout_s of wall clock, or of CPU time

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """The jail cannot be built here and the weaker barrier was not accepted; the message is one line."""


class SandboxError(RuntimeError):
    """Building the jail failed for one call (not the code's doing)."""


def isolation() -> str:
    """"jail" unless the run accepted the barrier (reward.sandbox; the reward workers set RL_SANDBOX from it)."""
    value = os.environ.get("RL_SANDBOX", "jail")
    if value not in ISOLATIONS:
        raise SandboxUnavailable(f"RL_SANDBOX={value!r}: must be one of {', '.join(ISOLATIONS)}")
    return value


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512, disk_mb: int = DISK_MB,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `code` as a program's main module, with `stdin` as its standard input, in the limits above."""
    return finish(start_python(code, timeout_s=timeout_s, memory_mb=memory_mb, disk_mb=disk_mb, files=files), stdin)


@dataclass
class Call:
    """A started call: `finish` reads it to its end, `kill` ends it unread."""
    proc: subprocess.Popen
    deadline: float
    status_r: int | None = None  # the jail's status pipe (rl/env/jail.py)
    workdir: str | None = None  # the barrier's folder


def start_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, disk_mb: int = DISK_MB,
                 files: dict[str, str] | None = None, pass_fds: tuple[int, ...] = (), quiet: bool = False) -> Call:
    """Starts `code` as run_python does and returns at once; `pass_fds`: descriptors the program keeps, at the
    same numbers (pipes to another call); `quiet`: its stdin closed and its output dropped, for a program that
    talks through `pass_fds` alone."""
    files = {checked_name(name): text for name, text in (files or {}).items()} | {MAIN: code}
    for name, text in files.items():
        text.encode("utf-8")  # a lone surrogate fails here, in the caller, not as the program's exit
    output = subprocess.DEVNULL if quiet else subprocess.PIPE
    if isolation() == "barrier":
        call = start_in_barrier(files, timeout_s, memory_mb, pass_fds, output)
    else:
        require_jail("jail")
        call = start_in_jail(files, timeout_s, memory_mb, disk_mb, pass_fds, output)
    if quiet:
        call.proc.stdin.close()
    return call


def finish(call: Call, stdin: str = "") -> SandboxResult:
    """Feeds `stdin`, reads the outputs until the program ends or its deadline passes, and cleans up; a
    SandboxError when the jail could not be built."""
    try:
        result = communicate(call.proc, stdin.encode(), call.deadline)
    finally:
        failure = clean_up(call)
    if failure:
        raise SandboxError(failure)
    return result


def kill(call: Call) -> str:
    """Ends a call at once (its process group, and with it the jail's process) and cleans up; returns what the
    jail reported ('' when it held)."""
    try:
        os.killpg(call.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    call.proc.wait()
    return clean_up(call)


def clean_up(call: Call) -> str:
    """Closes what the call held and removes the barrier's folder; returns what the jail reported ('' if all
    went well)."""
    failure = ""
    if call.status_r is not None:
        failure = os.read(call.status_r, 4096).decode(errors="replace")
        os.close(call.status_r)
    if call.workdir is not None:
        remove_tree(call.workdir)
    return failure


def require_jail(isolation: str) -> None:
    """Raises SandboxUnavailable (one line: why, and the setting that accepts the barrier) where no jail can be
    built and `isolation` asks for one; `rl.env.reward.RewardPool` calls it at start-up for the runs whose functions
    import this module."""
    if isolation == "jail" and jail_problem():
        raise SandboxUnavailable(f"{jail_problem()}; model-written code (a code reward, a tool) needs it. Set "
                                 "reward.sandbox = \"barrier\" (RL_SANDBOX=barrier outside a run) to run that code "
                                 "without the jail, knowingly: as your user, with your files in reach")


@functools.cache
def jail_problem() -> str:
    """Why the jail cannot be built here ("" when it can), asked once of a throwaway call."""
    if sys.platform != "linux":
        return f"the sandbox's jail needs Linux namespaces; this is {sys.platform}"
    try:
        result = finish(start_in_jail({MAIN: "print('ok')"}, 30.0, 256, 1, (), subprocess.PIPE))
    except (SandboxError, OSError) as e:
        return f"{e} (user namespaces: {user_namespace_setting()})"
    return "" if result.stdout == "ok\n" else f"the jail's test call failed: {result}"


def user_namespace_setting() -> str:
    """What the kernel's switches say about unprivileged user namespaces (for the error line)."""
    said = []
    for name in ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
                 "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"):
        try:
            with open(name) as f:
                said.append(f"{name.removeprefix('/proc/sys/').replace('/', '.')}={f.read().strip()}")
        except OSError:
            pass
    return ", ".join(said) or "no switch readable"


def start_in_jail(files: dict[str, str], timeout_s: float, memory_mb: int, disk_mb: int, pass_fds: tuple[int, ...],
                  output: int) -> Call:
    """Starts rl/env/jail.py on the call and hands it the files (its stdin's first bytes)."""
    status_r, status_w = os.pipe()
    links, binds = jail_paths()
    spec = {"caller": os.getpid(), "status_fd": status_w, "links": links, "binds": binds,
            "prelude": prelude(block_sockets=False), "env": child_env("/tmp"),
            "timeout_s": timeout_s, "memory_mb": memory_mb, "disk_mb": disk_mb, "max_file_bytes": MAX_FILE_BYTES,
            "max_open_files": MAX_OPEN_FILES, "max_processes": MAX_PROCESSES}
    packed = json.dumps(files).encode()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-X", "utf8", JAIL_PROGRAM, json.dumps(spec)], cwd="/",
                                env={"LC_ALL": "C.UTF-8"}, stdin=subprocess.PIPE, stdout=output, stderr=output,
                                start_new_session=True, pass_fds=(status_w, *pass_fds))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    call = Call(proc, time.monotonic() + timeout_s, status_r=status_r)
    try:
        proc.stdin.write(len(packed).to_bytes(8, "little") + packed)
        proc.stdin.flush()
    except BrokenPipeError:  # the keeper is gone already: finish or kill reports why
        pass
    return call


@functools.cache
def jail_paths() -> tuple[list[tuple[str, str]], list[str]]:
    """What the jail shows of the host, read-only: (links, folders and files to bind). The binds are real paths,
    none inside another; the links are every symbolic link on the way to them from the paths Python names."""
    named = {"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime",
             sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable),
             *site.getsitepackages()}
    named = {p for p in named if os.path.lexists(p) and not p.startswith(NOT_BOUND)}
    real = {os.path.realpath(p) for p in named | {sys.executable}}
    real = {p for p in real if os.path.exists(p) and not p.startswith(NOT_BOUND)}
    binds = sorted(p for p in real if not any(p.startswith(q.rstrip("/") + "/") for q in real if q != p))
    links = {}
    for path in named | {sys.executable}:
        parts = PurePosixPath(path).parts
        for i in range(2, len(parts) + 1):
            step = str(PurePosixPath(*parts[:i]))
            if os.path.islink(step) and not any(step.startswith(b + "/") or step == b for b in binds):
                links[step] = os.readlink(step)
    return sorted(links.items()), binds


def start_in_barrier(files: dict[str, str], timeout_s: float, memory_mb: int, pass_fds: tuple[int, ...],
                     output: int) -> Call:
    """Starts the call behind the weaker barrier (the module docstring), in a temporary folder of the host."""
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    try:
        for name, text in files.items():
            write_file(os.path.join(workdir, name), text)
        isolated = network_namespace_available()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-X", "utf8", "-c", prelude(block_sockets=not isolated)], cwd=workdir,
            env=child_env(workdir), stdin=subprocess.PIPE, stdout=output, stderr=output, start_new_session=True,
            pass_fds=pass_fds, preexec_fn=functools.partial(limit_child, timeout_s, memory_mb, isolated))
    except BaseException:
        remove_tree(workdir)
        raise
    return Call(proc, time.monotonic() + timeout_s, workdir=workdir)


def checked_name(name: str) -> str:
    """A file name of `files`, refused if it leaves the directory or takes the code's own name."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or name == MAIN:
        raise ValueError(f"sandbox: file name {name!r} must be a relative path inside the directory, not {MAIN}")
    return name


def write_file(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def child_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def prelude(block_sockets: bool) -> str:
    """The child's first code: read the program and remove its file, make the directory importable, refuse
    sockets where no network namespace holds, then run the program as __main__ (its tracebacks quote it, and
    start at its own frames)."""
    block = ("import socket, _socket\n"
             "class _NoNetwork:\n"
             "    def __init__(self, *a, **k):\n"
             "        raise PermissionError(1, 'network access is disabled in this sandbox')\n"
             "socket.socket = _socket.socket = socket.SocketType = _NoNetwork\n"
             "socket.socketpair = socket.create_connection = socket.fromfd = _NoNetwork\n"
             "del socket, _socket, _NoNetwork\n") if block_sockets else ""
    return ("import linecache as _lc, os as _os, sys as _sys\n"
            f"with open({MAIN!r}, encoding='utf-8') as _f:\n"
            "    _src = _f.read()\n"
            f"_os.remove({MAIN!r})\n"
            "_sys.path.insert(0, _os.getcwd())\n"
            "_lc.cache['main.py'] = (len(_src), None, _src.splitlines(True), 'main.py')\n"
            f"{block}"
            "del _lc, _os, _f\n"
            "try:\n"
            "    exec(compile(_src, 'main.py', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n"
            "except SystemExit:\n"
            "    raise\n"
            "except BaseException as _e:\n"  # the traceback from the program's own frames on
            "    import traceback\n"
            "    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)\n"
            "    _sys.exit(1)\n")


@functools.cache
def network_namespace_available() -> bool:
    """Whether an unprivileged user + network namespace can be made here (asked once, of a throwaway child)."""
    if sys.platform != "linux":
        return False
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWUSER | CLONE_NEWNET}))"
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", probe], env={}, timeout=30,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def limit_child(timeout_s: float, memory_mb: int, isolated: bool) -> None:
    """The barrier's child, before exec: signals back to their defaults, death with the caller, a user and
    network namespace where possible, the jail's limits, and last its seccomp filter (it outlives exec)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the reward workers ignore these
        signal.signal(sig, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if isolated and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
    jail.set_limits(timeout_s, memory_mb, MAX_FILE_BYTES, MAX_OPEN_FILES)
    if not jail.install_filter() and isolated:
        # Counted per user namespace (Linux >= 5.14), so only this child's processes; the root user is exempt.
        jail.set_limit(resource.RLIMIT_NPROC, MAX_PROCESSES)


def communicate(proc: subprocess.Popen, stdin: bytes, deadline: float) -> SandboxResult:
    """Feeds stdin and reads both outputs, bounded, until the child closes them or the deadline passes; then the
    process group is killed (whatever the code left running in it) and the child reaped."""
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    kept, sizes = {out_fd: bytearray(), err_fd: bytearray()}, {out_fd: 0, err_fd: 0}
    timed_out, sent = False, 0
    with selectors.DefaultSelector() as selector:
        for fd, event in ((out_fd, selectors.EVENT_READ), (err_fd, selectors.EVENT_READ),
                          (in_fd, selectors.EVENT_WRITE)):
            os.set_blocking(fd, False)
            selector.register(fd, event)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in selector.select(left):
                if key.fd == in_fd:
                    try:
                        sent += os.write(in_fd, stdin[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the code stopped reading: the rest is dropped
                        sent = len(stdin)
                    if sent >= len(stdin):
                        selector.unregister(in_fd)
                        proc.stdin.close()
                    continue
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(key.fd)
                sizes[key.fd] += len(data)
                kept[key.fd] += data[: max(MAX_OUTPUT_BYTES - len(kept[key.fd]), 0)]
    # Wait for the child's exit without reaping it, so that its pid, the group's id, cannot be reused before the
    # group is killed.
    while not timed_out and not exited(proc.pid):
        if time.monotonic() >= deadline:
            timed_out = True
        else:
            time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    returncode = proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        pipe.close()
    timed_out = timed_out or returncode == -signal.SIGXCPU  # the CPU-time limit
    return SandboxResult(decoded(kept[out_fd], sizes[out_fd]), decoded(kept[err_fd], sizes[err_fd]),
                         None if timed_out else returncode, timed_out)


def exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def decoded(data: bytearray, size: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text + f"\n[output truncated: {size} bytes, the first {MAX_OUTPUT_BYTES} kept]" if size > len(data) else text


def remove_tree(path: str) -> None:
    """Removes the directory, also where the code took its own write or search permission away."""
    folders = [path]
    while folders:
        folder = folders.pop()
        try:
            os.chmod(folder, 0o700)
            folders += [e.path for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)
