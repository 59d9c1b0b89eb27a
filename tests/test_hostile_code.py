"""Hostile programs against rl/env/sandbox.py's jail: each reach below worked against the earlier sandbox (limits and
seccomp around a process of the caller's user, in a temporary folder of the host; `reward.sandbox = "barrier"` is
that barrier still) and must fail in the jail. Run with RL_SANDBOX=barrier to watch them fail.

The reaches: the caller's files (read, write, delete; a .pth planted in site-packages that every later Python of
the machine runs), the caller's environment (API keys), another process of the user and the caller itself
(signals), unix sockets (a path and the abstract namespace) and IP sockets on the host's loopback, /dev/shm (host
memory outside memory_mb), the disk beyond the cap, new processes, what a worker killed mid-call leaves behind, and
a symlink swapped for the code's own folder before the clean-up."""

import os
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from rl.env import sandbox
from rl.env.sandbox import run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail is Linux's")


@pytest.fixture
def outside():
    """A folder of the caller's outside /tmp (the jail has a /tmp of its own): a secret and a file to keep."""
    folder = tempfile.mkdtemp(prefix="rl-hostile-", dir="/var/tmp")
    for name, text in (("secret.txt", "the key"), ("keep.txt", "intact")):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    yield folder
    subprocess.run(["chmod", "-R", "u+rwx", folder], check=False)
    subprocess.run(["rm", "-rf", folder], check=False)


def hostile(code: str, **kwargs):
    return run_python(code, timeout_s=kwargs.pop("timeout_s", 10.0), **kwargs)


def test_the_callers_files_are_neither_visible_nor_writable(outside):
    code = f"""
import os, shutil
for attempt in (lambda: print(open({outside!r} + '/secret.txt').read()),
                lambda: open({outside!r} + '/keep.txt', 'w').write('overwritten'),
                lambda: os.remove({outside!r} + '/keep.txt'),
                lambda: shutil.rmtree({outside!r}),
                lambda: print(os.listdir({outside!r}))):
    try:
        attempt()
    except OSError as e:
        print('refused', e.errno)
"""
    r = hostile(code)
    assert r.ok and "the key" not in r.stdout and r.stdout.count("refused") == 5, r
    with open(os.path.join(outside, "keep.txt")) as f:
        assert f.read() == "intact"


def test_nothing_can_be_planted_where_the_trainers_python_reads():
    """A .pth file in site-packages runs in every later interpreter of the machine: the trainer's included."""
    planted = os.path.join(site.getsitepackages()[0], f"rl_planted_{uuid.uuid4().hex}.pth")
    try:
        r = hostile(f"""
try:
    open({planted!r}, 'w').write('import os; os.environ["PLANTED"] = "1"\\n')
    print('planted')
except OSError as e:
    print('refused', e.errno)
""")
        assert r.ok and r.stdout.startswith("refused") and not os.path.exists(planted), r
    finally:
        if os.path.exists(planted):
            os.remove(planted)


def test_the_callers_environment_is_not_readable():
    """The worker's environment holds the user's keys (WANDB_API_KEY...): the code's own has none of them, and no
    other process's /proc/<pid>/environ is there to read."""
    secret = f"sk-{uuid.uuid4().hex}"
    code = """
import os, glob
found = [os.environ.get('RL_HOSTILE_KEY', '')]
for path in glob.glob('/proc/*/environ'):
    try:
        found.append(open(path, 'rb').read().decode(errors='replace'))
    except OSError:
        pass
print('\\n'.join(found))
"""
    caller = ("import sys\nfrom rl.env.sandbox import run_python\n"
              "print(run_python(sys.stdin.read(), timeout_s=10).stdout)")
    out = subprocess.run([sys.executable, "-c", caller], input=code, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, RL_HOSTILE_KEY=secret))
    assert out.returncode == 0 and secret not in out.stdout, out


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_another_process_of_the_user_cannot_be_signalled():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""
import os, signal
for sig in (signal.SIGSTOP, signal.SIGKILL):
    try:
        os.kill({bystander.pid}, sig)
        print('sent')
    except OSError as e:
        print('refused', e.errno)
"""
        r = hostile(code)
        time.sleep(0.2)
        assert r.ok and "sent" not in r.stdout, r
        assert bystander.poll() is None and process_state(bystander.pid) != "T"
    finally:
        bystander.kill()
        bystander.wait()


def test_the_caller_cannot_be_stopped_or_killed():
    """A stopped caller hung for good (the sandbox's timer runs in it). The caller here is a worker process that
    runs the code and then reports; the code aims at its parent, its process group and the worker's pid."""
    caller = ("import os, sys\nfrom rl.env.sandbox import run_python\n"
              "r = run_python(sys.stdin.read().replace('CALLER', str(os.getpid())), timeout_s=5)\n"
              "print('caller alive after', r.stdout.split())")
    code = """
import os, signal
for target in (os.getppid(), CALLER, 0, -CALLER):
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(target, sig)
            print('sent', target)
        except OSError as e:
            print('refused', e.errno)
"""
    worker = subprocess.Popen([sys.executable, "-c", caller], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        out, _ = worker.communicate(code, timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.communicate()
        pytest.fail("the caller hung: the code stopped it")
    assert worker.returncode == 0 and out.startswith("caller alive after"), (worker.returncode, out)


def test_no_unix_socket_of_the_host_is_reachable(outside):
    path = os.path.join(outside, "host.sock")
    abstract = f"\0rl-hostile-{uuid.uuid4().hex}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.setblocking(False)
        servers.append(server)
    try:
        r = hostile(f"""
import socket
for address in ({path!r}, {abstract!r}):
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
        s.sendall(b'hello')
        print('connected')
    except OSError as e:
        print('refused', e.errno)
""")
        assert r.ok and "connected" not in r.stdout, r
        assert not select.select(servers, [], [], 0.2)[0]  # no connection waits to be accepted
    finally:
        for server in servers:
            server.close()


def test_no_ip_socket_of_the_host_is_reachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        r = hostile(f"""
import socket
for family, address in ((socket.AF_INET, ('127.0.0.1', {server.getsockname()[1]})), (socket.AF_INET6, ('::1', 22))):
    try:
        socket.create_connection(address, timeout=2).sendall(b'hello')
        print('connected')
    except OSError as e:
        print('refused', e.errno)
import ctypes, struct  # the C library's socket, past anything done to Python's socket module
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
address = struct.pack('=H', 2) + struct.pack('!H', {server.getsockname()[1]}) + bytes([127, 0, 0, 1]) + bytes(8)
print('connected' if fd >= 0 and libc.connect(fd, address, len(address)) == 0 else 'refused')
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK: a virtual machine's way to its host, in no namespace
    print('vsock')
except OSError as e:
    print('refused', e.errno)
""")
        assert r.ok and "connected" not in r.stdout and "vsock" not in r.stdout, r
        assert not select.select([server], [], [], 0.2)[0]


def fill(prefix: str, files: int, mb: int) -> str:
    """A program writing `files` files of `mb` MB named prefix0, prefix1, ... until the disk refuses; it prints
    how many MB it wrote."""
    return f"""
written = 0
try:
    for i in range({files}):
        with open(f'{prefix}{{i}}', 'wb') as f:
            f.write(b'x' * ({mb} << 20))
        written += {mb}
except OSError as e:
    print('stopped', e.errno)
print('written', written)
"""


def test_dev_shm_is_the_jails_own_and_inside_the_disk_cap():
    """/dev/shm is host memory outside memory_mb: 20 files of 10 MB were written there in a blink and left."""
    tag = uuid.uuid4().hex
    r = hostile(fill(f"/dev/shm/rl-{tag}-", 20, 10), disk_mb=32)
    try:
        assert r.ok and int(r.stdout.split("written ")[1]) <= 32, r
        assert not [name for name in os.listdir("/dev/shm") if tag in name]
    finally:
        for name in os.listdir("/dev/shm"):
            if tag in name:
                os.remove(os.path.join("/dev/shm", name))


def test_the_disk_is_capped_and_nothing_outside_is_writable(outside):
    r = hostile(fill("f", 12, 4) + f"""
try:
    open({outside!r} + '/fill', 'wb').write(b'x' * (1 << 20))
    print('wrote outside')
except OSError as e:
    print('refused', e.errno)
""", disk_mb=16)
    assert r.ok and "stopped 28" in r.stdout and int(r.stdout.split("written ")[1].split()[0]) <= 16, r
    assert "wrote outside" not in r.stdout and not os.path.exists(os.path.join(outside, "fill"))


def test_no_new_process_in_any_way():
    r = hostile("""
import os, subprocess
for attempt in (os.fork, lambda: subprocess.run(['true']), lambda: os.posix_spawn('/bin/true', ['true'], {})):
    try:
        attempt()
        print('started')
    except OSError as e:
        print('refused', e.errno)
""")
    assert r.ok and "started" not in r.stdout and r.stdout.count("refused") == 3, r


SUBMOUNT = """
import sys
sys.path.insert(0, {root!r})
from rl.env import sandbox
sandbox.JAIL_PROGRAM = {program!r}
r = sandbox.run_python("open('/usr/share/rl-planted', 'w').write('x')")
print('refused' if 'Read-only file system' in r.stderr else r)
"""


@pytest.mark.parametrize("how", ["mount_setattr", "remounts"])
def test_a_mount_under_a_bound_folder_is_read_only_too(how, tmp_path):
    """A folder the jail binds read-only may hold mounts of its own (a container's volume under /usr): each is
    made read-only too, by mount_setattr's AT_RECURSIVE or, on kernels before 5.12, one remount each. The mount
    here lives in a private mount namespace of the test's own (unshare -m), gone with it."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command")
    program = sandbox.JAIL_PROGRAM
    if how == "remounts":  # a jail whose mount_setattr is a call the kernel does not know (ENOSYS)
        program = str(tmp_path / "jail.py")
        with open(sandbox.JAIL_PROGRAM) as f:
            source = f.read()
        with open(program, "w") as f:
            f.write(source.replace("SYS_MOUNT_SETATTR = 442", "SYS_MOUNT_SETATTR = 100000"))
    code = SUBMOUNT.format(root=os.path.dirname(os.path.dirname(sandbox.__file__)), program=program)
    script = (f"mount -t tmpfs -o mode=1777 tmpfs /usr/share && {sys.executable} -c \"$0\" && "
              "test ! -e /usr/share/rl-planted && echo intact")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, code],
                         capture_output=True, text=True, timeout=60)
    if out.returncode and "Operation not permitted" in out.stderr:
        pytest.skip("unshare -m needs root or user namespaces here")
    assert out.stdout.split() == ["refused", "intact"], (out.stdout, out.stderr)


def descendants(pid: int) -> set[int]:
    """The processes below `pid`, from /proc's parent links."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_a_worker_killed_mid_call_leaves_no_process_folder_or_mount():
    mounts_before = open("/proc/self/mountinfo").read()
    folders_before = set(os.listdir(tempfile.gettempdir()))
    caller = ("import sys\nfrom rl.env.sandbox import run_python\n"
              "run_python(\"open('work.txt', 'w').write('x')\\nprint('running', flush=True)\\n"
              "import time\\ntime.sleep(60)\", timeout_s=60)")
    worker = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not descendants(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the jailed program is running by now (its output is the worker's pipe, unread)
        left = descendants(worker.pid)
        assert left, "the call never started"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and process_state(pid) != "Z" for pid in left) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in left if os.path.exists(f"/proc/{pid}") and process_state(pid) != "Z"]
    assert not alive, f"processes left behind: {alive}"
    assert not [f for f in set(os.listdir(tempfile.gettempdir())) - folders_before if f.startswith("rl-sandbox-")]
    assert open("/proc/self/mountinfo").read() == mounts_before


def test_a_symlink_swapped_for_the_codes_folder_changes_nothing_outside(outside):
    """The code put a link to another folder where its own folder was; the clean-up then opened that folder's
    permissions (chmod 700 through the link)."""
    os.chmod(outside, 0o500)
    r = hostile(f"""
import os
here = os.getcwd()
os.chdir('/')
try:
    os.rename(here, here + '.moved')
    os.symlink({outside!r}, here)
    print('swapped')
except OSError as e:
    print('refused', e.errno)
""")
    assert r.exit_code == 0, r
    assert os.stat(outside).st_mode & 0o777 == 0o500
    assert sorted(os.listdir(outside)) == ["keep.txt", "secret.txt"]
