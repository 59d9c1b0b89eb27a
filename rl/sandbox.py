"""Runs untrusted Python (a model's tool call, a candidate program) in a fresh, limited interpreter.

    run_python(code, stdin="", timeout_s=5.0, memory_mb=512, files={"data.txt": "..."}) -> SandboxResult

Each call starts `python -I -B -X utf8` in a new temporary directory (removed afterwards; `files` are written there
first, and the code may import them), with an environment that holds only what Python needs (PATH, HOME and
TMPDIR at the directory, a UTF-8 locale, one BLAS thread). In the child, before the interpreter starts:

- limits (`resource.setrlimit`): CPU seconds (the timeout, rounded up), address space (`memory_mb`: an
  allocation past it raises MemoryError), bytes per written file (MAX_FILE_BYTES), open files, no core dumps;
- no new processes: a seccomp filter refuses fork, vfork and every clone but a thread's (EPERM; clone3 answers
  ENOSYS so that threads fall back to clone), so a fork bomb ends at its first fork. Where the filter cannot be
  installed (not x86-64 or aarch64 Linux), RLIMIT_NPROC bounds the processes instead, inside the namespace below;
- no network: the child unshares a user and a network namespace (CLONE_NEWUSER | CLONE_NEWNET), in which only
  a loopback device exists, down, so every connection fails, the host's own 127.0.0.1 included. Where the kernel
  refuses unprivileged namespaces (`network_namespace_available()` says which holds), a prelude replaces
  `socket.socket` and `_socket.socket` in the child's interpreter before the code runs: a barrier against
  ordinary code, not against code that calls libc through ctypes.

A wall-clock timeout kills the whole process group (SIGKILL), and whatever is left of it once the code exits.
stdout and stderr are read as they come, each kept up to MAX_OUTPUT_BYTES (the rest is read and dropped, so a
chatty program cannot fill the caller's memory). What this is not: a filesystem jail. The code runs as the
caller's user, with that user's rights over files outside the directory (no extra capabilities: inside the user
namespace they do not reach the host), so run it as a user that owns nothing worth protecting. The total bytes
written to disk are bounded by time and MAX_FILE_BYTES per file, not overall.

Standard library only: it runs in the reward workers (rl/reward_worker.py), which import nothing of the trainer.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

MAX_OUTPUT_BYTES = 64 * 1024  # of stdout and of stderr, each
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the largest file the code may write
MAX_OPEN_FILES = 256
MAX_PROCESSES = 32  # RLIMIT_NPROC, only where the seccomp filter is missing (see the module docstring)
MAIN = ".sandbox_main.py"  # the code, read and removed by the prelude before it runs
CLONE_NEWUSER, CLONE_NEWNET, CLONE_THREAD = 0x10000000, 0x40000000, 0x00010000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed at the timeout; negative: ended by that signal
    timed_out: bool  # past timeout_s of wall clock, or of CPU time

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `code` as a program's main module, with `stdin` as its standard input, in the limits above."""
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    try:
        for name, text in (files or {}).items():
            write_file(os.path.join(workdir, checked_name(name)), text)
        write_file(os.path.join(workdir, MAIN), code)
        isolated = network_namespace_available()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-X", "utf8", "-c", prelude(block_sockets=not isolated)], cwd=workdir,
            env=child_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=functools.partial(limit_child, timeout_s, memory_mb, isolated))
        return communicate(proc, stdin.encode(), time.monotonic() + timeout_s)
    finally:
        remove_tree(workdir)


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
    """In the forked child, before exec: signals back to their defaults, death with the caller, namespaces,
    limits, and last the seccomp filter (it outlives exec)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the reward workers ignore these
        signal.signal(sig, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if isolated and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
    cpu_s = max(math.ceil(timeout_s), 1)
    set_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    set_limit(resource.RLIMIT_AS, memory_mb * 2**20)
    set_limit(resource.RLIMIT_FSIZE, MAX_FILE_BYTES)
    set_limit(resource.RLIMIT_NOFILE, MAX_OPEN_FILES)
    set_limit(resource.RLIMIT_CORE, 0)
    if not install_no_fork_filter(libc) and isolated:
        # Counted per user namespace (Linux >= 5.14), so only this child's processes; the root user is exempt.
        set_limit(resource.RLIMIT_NPROC, MAX_PROCESSES)


def set_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lowers a limit, never past the caller's own hard limit (a reward worker already caps its memory)."""
    _, current = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


# seccomp: (audit arch, {syscall: number}) of the architectures the filter knows; clone3 is 435 on both.
ARCHES = {"x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435}),
          "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def no_fork_program(arch: int, numbers: dict[str, int]) -> list[tuple[int, int, int, int]]:
    """The BPF program: a thread's clone passes, any other clone, fork and vfork get EPERM, clone3 ENOSYS (so
    that the C library falls back to clone, whose flags a filter can read), a foreign arch EPERM."""
    load, jeq, jge, and_, ret = 0x20, 0x15, 0x35, 0x54, 0x06
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # (code, k, jump-if-true label, jump-if-false label); labels name the returns at the end
    program = [(load, 4, None, None), (jeq, arch, None, "deny"),  # seccomp_data.arch
               (load, 0, None, None), (jge, 0x40000000, "deny", None),  # seccomp_data.nr; x32 calls
               (jeq, numbers["clone3"], "nosys", None)]
    program += [(jeq, numbers[name], "deny", None) for name in ("fork", "vfork") if name in numbers]
    program += [(jeq, numbers["clone"], None, "allow"),
                (load, 16, None, None), (and_, CLONE_THREAD, None, None),  # the low word of args[0], the flags
                (jeq, CLONE_THREAD, "allow", "deny")]
    labels = {"allow": len(program), "deny": len(program) + 1, "nosys": len(program) + 2}
    out = [(code, 0 if t is None else labels[t] - i - 1, 0 if f is None else labels[f] - i - 1, k)
           for i, (code, k, t, f) in enumerate(program)]
    return out + [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, nosys)]


def install_no_fork_filter(libc) -> bool:
    """Installs the filter on this process and what it executes; false where this architecture is unknown."""
    if platform.machine() not in ARCHES:
        return False
    program = no_fork_program(*ARCHES[platform.machine()])
    filters = (SockFilter * len(program))(*[SockFilter(code, jt, jf, k) for code, jt, jf, k in program])
    fprog = SockFprog(len(program), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return False
    return True


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
