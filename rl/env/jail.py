"""The jail a sandboxed program runs in: rl/env/sandbox.py starts this file as its own program, once a call.

    python -I -B -X utf8 rl/env/jail.py SPEC   (SPEC: JSON; stdin: 8 bytes of length, the JSON of the files, then
                                            the program's own standard input)

This process (the keeper) asks for the SIGKILL when its caller dies, then unshares a user namespace together with
new mount, PID, network, IPC, UTS and cgroup namespaces. A short-lived helper forked before that, still outside,
writes the user namespace's maps: inside, the program is user and group 65534 (nobody); outside, the same ids
when the caller is root, else the caller's own (the one id an unprivileged process may map). The keeper then forks
the program's process, PID 1 of the new PID namespace, and waits for it, passing its exit status on. That process,
still holding the namespace's capabilities,

- builds a new root on a tmpfs: read-only bind mounts of what Python needs (the interpreter's prefixes and
  site-packages, /usr and the system library folders, the dynamic loader's cache), /dev's null, zero, full,
  random and urandom, a /proc of its own PID namespace where the kernel allows it, and one writable folder,
  /tmp, a tmpfs of `disk_mb` (the disk cap; /dev/shm points into it), holding the caller's files and the code;
- pivots into it and detaches the old root, so no other path of the host exists for it, and makes the new root
  read-only;
- becomes nobody and drops every capability (the bounding set too), asks again for the SIGKILL with the keeper,
  takes a session of its own, sets its limits (CPU seconds, address space, bytes a file, open files, no core
  dumps), sets no-new-privileges and installs the seccomp filter below, and runs the code in this same
  interpreter (started as the code's would be: one interpreter's start a call, not two).

What that gives: no file of the host is writable and none but Python's is visible; no process outside is visible
or reachable by a signal (the caller included); no network device but a loopback that is down, and no host socket
of any family (abstract unix sockets belong to the network namespace; a socket file of the host is not in the
tree; vsock and the other families that cross namespaces are refused by the filter); SysV IPC and POSIX shared
memory are its own; all it writes lives in a tmpfs that goes with the mount namespace when its last process
exits, so a killed call leaves no folder, process or mount behind.

The seccomp filter: fork, vfork and every clone but a thread's get EPERM (clone3 ENOSYS, so the C library falls
back to clone, whose flags a filter can read); so do the calls that reach the kernel's mount, namespace, keyring,
tracing, BPF, userfaultfd and io_uring machinery, and socket() for families other than unix, IPv4 and IPv6.

A failure to build the jail is written to the status descriptor (SPEC's status_fd, closed before the code runs
when all went well) and the program's process exits 125: rl/env/sandbox.py raises it as an error of the sandbox, not
a failure of the code. Standard library only; nothing of the trainer is imported here.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import json
import os
import resource
import signal
import sys

NOBODY = 65534
JAIL_FAILED = 125  # the program's process's exit code when the jail could not be built
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_THREAD = 0x10000000, 0x20000000, 0x40000000, 0x00010000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_PRIVATE, MS_RELATIME, MNT_DETACH = 1024, 2048, 1 << 18, 1 << 21, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAPBSET_DROP = 1, 38, 22, 2, 24
MACHINE = os.uname().machine
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, AT_FDCWD, AT_RECURSIVE = 0x1, 0x2, 0x4, -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on x86-64 and aarch64
# statvfs flags that a bind mount keeps (the kernel refuses to clear them in a user namespace) -> mount flags
KEPT_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME,
              os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
DEVICES = ("null", "zero", "full", "random", "urandom")
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
# (audit arch, pivot_root's number, {name: number}) of the architectures the filter knows
ARCHES = {
    "x86_64": (0xC000003E, 155, {
        "clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "socket": 41,
        "denied": [165, 166, 155, 161, 272, 308, 101, 248, 249, 250, 321, 298, 323, 425, 426, 427, 310, 311]}),
    "aarch64": (0xC00000B7, 41, {
        "clone": 220, "clone3": 435, "socket": 198,
        "denied": [40, 39, 41, 51, 97, 268, 117, 217, 218, 219, 280, 241, 282, 425, 426, 427, 270, 271]}),
}
# denied: mount, umount2, pivot_root, chroot, unshare, setns, ptrace, add_key, request_key, keyctl, bpf,
# perf_event_open, userfaultfd, io_uring_setup / _enter / _register, process_vm_readv / _writev

libc = ctypes.CDLL(None, use_errno=True)


class JailError(OSError):
    """A step of building the jail failed; its message names the step."""


def check(result: int, step: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise JailError(err, f"{step} failed: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(None if source is None else source.encode(), target.encode(),
                     None if fstype is None else fstype.encode(), flags, None if data is None else data.encode()),
          f"mount {fstype or source or ''} on {target}")


def main(spec: dict) -> None:
    """The keeper: namespaces, then the program's process, whose exit status becomes this one's."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != spec["caller"]:  # the caller died before the line above
        os._exit(1)
    files = json.loads(read_exactly(0, int.from_bytes(read_exactly(0, 8), "little")))
    status_fd = spec["status_fd"]
    try:
        enter_namespaces()
    except OSError as e:
        os.write(status_fd, describe(e))
        os._exit(JAIL_FAILED)
    alive_r, alive_w = os.pipe()  # the program's process sees EOF on alive_r once the keeper is gone
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            jail(spec, files, alive_r)
        except Exception as e:  # whatever it is, the jail did not hold: never the code's failure
            os.write(status_fd, describe(e))
            os._exit(JAIL_FAILED)
        os.close(status_fd)  # nothing written: the jail held
        run_program(spec)
        sys.exit(0)
    os.close(status_fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the caller ends the call with SIGKILL, to the keeper's group
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def describe(e: Exception) -> bytes:
    """The status line for a failed step: what failed, and on which path."""
    if not isinstance(e, OSError):
        return f"sandbox: the jail could not be built: {type(e).__name__}: {e}".encode()
    where = f" ({e.filename})" if e.filename else ""
    return f"sandbox: the jail could not be built: {e.strerror or e}{where}".encode()


def read_exactly(fd: int, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("sandbox: the caller closed the jail's input early")
        data += chunk
    return bytes(data)


def enter_namespaces() -> None:
    """Unshares every namespace at once; a helper forked first, outside them, writes the user namespace's maps."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        os.setgroups([])  # root's supplementary groups do not follow it in (setgroups is denied inside)
    outside_uid, outside_gid = (NOBODY, NOBODY) if uid == 0 else (uid, gid)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    keeper = os.getpid()
    helper = os.fork()
    if helper == 0:
        os.close(go_w)
        os.close(done_r)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.read(go_r, 1) == b"":
            os._exit(1)
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{NOBODY} {outside_uid} 1"),
                               ("gid_map", f"{NOBODY} {outside_gid} 1")):
                with open(f"/proc/{keeper}/{name}", "w") as f:
                    f.write(text)
            os.write(done_w, b"ok")
        except OSError as e:
            os.write(done_w, f"writing the user namespace's {name} failed: {e.strerror}".encode())
        os._exit(0)
    os.close(go_r)
    os.close(done_w)
    try:
        flags = (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
                 | CLONE_NEWCGROUP)
        check(libc.unshare(flags), "unshare(user, mount, PID, network, IPC, UTS and cgroup namespaces)")
        os.write(go_w, b"1")
        answer = os.read(done_r, 200).decode()
        if answer != "ok":
            raise JailError(0, answer or "the helper writing the user namespace's maps died")
    finally:
        os.close(go_w)
        os.close(done_r)
        os.waitpid(helper, 0)


def jail(spec: dict, files: dict[str, str], alive_r: int) -> None:
    """In PID 1 of the new namespace: the new root, nobody without capabilities, the files, limits and the filter."""
    build_root(spec)
    drop_bounding_set()
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    header, no_caps = CapHeader(0x20080522, 0), (CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    check(libc.capset(ctypes.byref(header), no_caps), "dropping the capabilities")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a change of user clears it
    if not_alive(alive_r):
        os._exit(1)
    os.close(alive_r)
    os.setsid()  # a session and process group of its own: kill(0, ...) reaches nothing but the jail
    os.chdir("/tmp")
    for name, text in files.items():
        if os.path.dirname(name):
            os.makedirs(os.path.dirname(name), exist_ok=True)
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    set_limits(spec["timeout_s"], spec["memory_mb"], spec["max_file_bytes"], spec["max_open_files"])
    if not install_filter():
        set_limit(resource.RLIMIT_NPROC, spec["max_processes"])  # counted per user namespace (Linux >= 5.14)


def drop_bounding_set() -> None:
    """No capability can come back through an exec (no-new-privileges says the same, once set)."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            check(-1, f"dropping capability {cap} from the bounding set")


def run_program(spec: dict) -> None:
    """The code, in this interpreter (started `-I -B -X utf8`, so no second one starts): the environment and
    arguments a fresh program has, then the sandbox's prelude (rl/env/sandbox.py), which runs MAIN as __main__."""
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.argv = ["main.py"]
    exec(compile(spec["prelude"], "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": builtins})


def not_alive(fd: int) -> bool:
    """Whether the keeper is gone: it holds the pipe's only writing end, so EOF (no data is ever sent) says so."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def build_root(spec: dict) -> None:
    """The new root (see the module docstring), pivoted into; the old root detached."""
    if MACHINE not in ARCHES:  # pivot_root's number and the seccomp filter are known for these alone
        raise JailError(0, f"the jail knows x86_64 and aarch64, not {MACHINE}")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    # The sources are opened before the new root hides anything under its mount point (/tmp may hold one).
    sources = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in spec["binds"]]
    devices = [(f"/dev/{name}", os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)) for name in DEVICES]
    # Root's own id has no place in the user namespace, and files cannot be made under an unmapped one: the
    # tree is made as nobody (the capabilities the mounts need stay).
    libc.setfsuid(NOBODY)
    libc.setfsgid(NOBODY)
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    # The code's own /tmp first: a bound path under /tmp (a Python or virtual environment there) then gets its mount
    # point inside it, read-only as every bind, instead of being hidden by it.
    os.makedirs(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={spec['disk_mb']}m,nr_inodes=16384,mode=0700,uid={NOBODY},gid={NOBODY}")
    for path, target in spec["links"]:  # every link on the way to a bound path, as the host has it
        os.makedirs(root + os.path.dirname(path), exist_ok=True)
        os.symlink(target, root + path)
    for path, fd in sources + devices:
        bind(fd, root + path, read_only=not path.startswith("/dev/"))
        os.close(fd)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{root}/dev/{link}")
    os.makedirs(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except JailError:  # a host whose /proc is partly masked (some containers): the jail goes without one
        pass
    os.chdir(root)
    check(libc.syscall(ARCHES[MACHINE][1], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    libc.sethostname(b"sandbox", 7)


def bind(fd: int, target: str, read_only: bool) -> None:
    """Binds the open source `fd` at `target` (a folder and what is mounted under it, or one file); read-only:
    every mount of that tree."""
    is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
    os.makedirs(target if is_dir else os.path.dirname(target), exist_ok=True)
    if not is_dir:
        open(target, "a").close()
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    if read_only:
        read_only_tree(target)


def read_only_tree(target: str) -> None:
    """Makes the mount at `target` and every mount under it read-only, nosuid and nodev: mount_setattr with
    AT_RECURSIVE (Linux >= 5.12), else a remount of each mount that /proc/self/mountinfo lists there. A mount
    under a bound folder (a container's volume under /usr, say) keeps the host's read-write flag otherwise."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr),
                    ctypes.sizeof(attr)) == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        check(-1, f"making {target} and the mounts under it read-only (mount_setattr)")
    for point in mounts_under(target):
        kept = os.statvfs(point).f_flag
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        mount(None, point, None, flags | sum(m for st, m in KEPT_FLAGS.items() if kept & st))


def mounts_under(target: str) -> list[str]:
    """The mount points at and under `target`, from this mount namespace's /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):  # the kernel's escapes
        points = [p.replace(escaped, char) for p in points]
    return [p for p in points if p == target or p.startswith(target.rstrip("/") + "/")]


def set_limits(timeout_s: float, memory_mb: int, max_file_bytes: int, max_open_files: int) -> None:
    cpu_s = max(int(-(-timeout_s // 1)), 1)
    set_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    set_limit(resource.RLIMIT_AS, memory_mb * 2**20)
    set_limit(resource.RLIMIT_FSIZE, max_file_bytes)
    set_limit(resource.RLIMIT_NOFILE, max_open_files)
    set_limit(resource.RLIMIT_CORE, 0)


def set_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lowers a limit, never past the caller's own hard limit (a reward worker already caps its memory)."""
    _, current = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def filter_program(arch: int, numbers: dict) -> list[tuple[int, int, int, int]]:
    """The BPF program of the module docstring's filter; a foreign architecture and x32 calls get EPERM."""
    load, jeq, jge, and_, ret = 0x20, 0x15, 0x35, 0x54, 0x06
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # (code, k, jump-if-true label, jump-if-false label); labels name the returns at the end
    program = [(load, 4, None, None), (jeq, arch, None, "deny"),  # seccomp_data.arch
               (load, 0, None, None), (jge, 0x40000000, "deny", None),  # seccomp_data.nr; x32 calls
               (jeq, numbers["clone3"], "nosys", None)]
    program += [(jeq, nr, "deny", None) for nr in [numbers[n] for n in ("fork", "vfork") if n in numbers]
                + numbers["denied"]]
    program += [(jeq, numbers["socket"], "socket", None),
                (jeq, numbers["clone"], None, "allow"),
                (load, 16, None, None), (and_, CLONE_THREAD, None, None),  # the low word of args[0], the flags
                (jeq, CLONE_THREAD, "allow", "deny")]
    socket_at = len(program)
    program += [(load, 16, None, None)] + [(jeq, family, "allow", None) for family in SOCKET_FAMILIES[:-1]]
    program += [(jeq, SOCKET_FAMILIES[-1], "allow", "deny")]
    labels = {"socket": socket_at, "allow": len(program), "deny": len(program) + 1, "nosys": len(program) + 2}
    out = [(code, 0 if t is None else labels[t] - i - 1, 0 if f is None else labels[f] - i - 1, k)
           for i, (code, k, t, f) in enumerate(program)]
    return out + [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, nosys)]


def install_filter() -> bool:
    """Sets no-new-privileges and installs the filter on this process and what it executes; false where this
    architecture is unknown."""
    if MACHINE not in ARCHES:
        return False
    arch, _, numbers = ARCHES[MACHINE]
    program = filter_program(arch, numbers)
    filters = (SockFilter * len(program))(*[SockFilter(code, jt, jf, k) for code, jt, jf, k in program])
    fprog = SockFprog(len(program), filters)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "installing the seccomp filter")
    return True


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
