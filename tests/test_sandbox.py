"""rl/env/sandbox.py: output and exit codes, the wall-clock and memory limits, no new processes, no network, the
caller's files beside the code, in the jail and behind the weaker barrier; a jail that cannot be built is one line
naming the setting, never a silent downgrade. The attacks on the jail are tests/test_hostile_code.py's."""

import glob
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rl.env import sandbox
from rl.env.sandbox import MAX_OUTPUT_BYTES, SandboxResult, run_python

pytestmark = pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the sandbox's limits are Linux's")


def test_output_stdin_and_exit_codes():
    r = run_python("import sys\nprint(input()[::-1])\nprint('to stderr', file=sys.stderr)", stdin="abc\n")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.ok) == ("cba\n", "to stderr\n", 0, False, True)
    assert run_python("import sys; sys.exit(3)").exit_code == 3
    failed = run_python("def f():\n    return 1 / 0\nf()")
    assert failed.exit_code == 1 and not failed.ok
    # the traceback starts at the program's own frames and quotes its lines
    assert failed.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert "return 1 / 0" in failed.stderr and failed.stderr.endswith("ZeroDivisionError: division by zero\n")
    chatty = run_python(f"print('x' * {3 * MAX_OUTPUT_BYTES})")
    assert chatty.ok and len(chatty.stdout) < MAX_OUTPUT_BYTES + 100 and "[output truncated" in chatty.stdout
    with pytest.raises(AttributeError):
        failed.exit_code = 0  # frozen


def test_an_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - start < 4
    assert r == SandboxResult("", "", None, True) and not r.ok
    # a program that went quiet after printing keeps what it printed
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert r.timed_out and r.stdout == "started\n"


def test_a_memory_bomb_fails_inside_its_limit():
    r = run_python("x = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


FORKS = """
import os, time
children = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError as e:
        print('refused:', e.strerror)
        break
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    children += 1
print('children', children)
"""


def test_a_fork_bomb_is_bounded():
    r = run_python(FORKS)
    assert r.ok and "refused:" in r.stdout
    assert int(r.stdout.split("children ")[1]) <= sandbox.MAX_PROCESSES
    bomb = run_python("import os\nwhile True:\n    os.fork()", timeout_s=5.0)
    assert not bomb.timed_out and bomb.exit_code == 1  # ended at its first refused fork
    threads = run_python("import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()")
    assert threads.ok and threads.stdout == "thread\n"  # threads are not processes


CONNECT = """
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hello')
    print('connected')
except OSError as e:
    print('refused:', e)
"""


@pytest.fixture
def barrier(monkeypatch):
    monkeypatch.setenv("RL_SANDBOX", "barrier")


@pytest.mark.parametrize("mode", ["jail", "namespace", "prelude"])
def test_no_network(mode, monkeypatch):
    """Neither the jail, nor the barrier's network namespace, nor, where none can be made, its socket prelude
    lets a connection through, not even to a server on this machine's loopback."""
    if mode == "namespace" and not sandbox.network_namespace_available():
        pytest.skip("this kernel makes no unprivileged network namespaces")
    if mode != "jail":
        monkeypatch.setenv("RL_SANDBOX", "barrier")
        monkeypatch.setattr(sandbox, "network_namespace_available", lambda: mode == "namespace")
    with socket.create_server(("127.0.0.1", 0)) as server:
        r = run_python(CONNECT.format(port=server.getsockname()[1]))
    assert r.ok and r.stdout.startswith("refused:"), r


def test_files_are_beside_the_code_in_the_jails_own_tmp():
    code = ("import os, helper\nprint(os.getcwd())\nprint(sorted(os.listdir('.')), open('data/a.txt').read())\n"
            "print(helper.VALUE, os.environ['HOME'], os.environ['TMPDIR'])")
    r = run_python(code, files={"data/a.txt": "seven", "helper.py": "VALUE = 7"})
    # A Python (or virtual environment) that lives under /tmp is bound read-only at its own path there.
    pythons = {Path(p).parts[2] for p in (sys.prefix, sys.base_prefix) if Path(p).is_relative_to("/tmp")}
    listed = sorted(["data", "helper.py", *pythons])
    assert r.stdout.splitlines() == ["/tmp", f"{listed} seven", "7 /tmp /tmp"], r
    with pytest.raises(ValueError, match="relative path"):
        run_python("pass", files={"../escape.txt": "x"})
    with pytest.raises(UnicodeEncodeError):  # no UTF-8 for a lone surrogate: the caller's error, not an exit 1
        run_python("print('\ud800')")


def test_a_jail_that_cannot_be_built_is_one_line_naming_the_setting(monkeypatch):
    monkeypatch.setattr(sandbox, "jail_problem", lambda: "sandbox: unshare(...) failed: Operation not permitted")
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        run_python("print('ran')")
    assert "Operation not permitted" in str(refused.value) and 'reward.sandbox = "barrier"' in str(refused.value)
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("RL_SANDBOX", "barrier")  # accepted knowingly: the code runs behind the barrier
    assert run_python("print('ran')").stdout == "ran\n"
    monkeypatch.setenv("RL_SANDBOX", "none")
    with pytest.raises(sandbox.SandboxUnavailable, match="RL_SANDBOX='none'"):
        run_python("pass")


def test_a_step_of_the_jail_that_fails_is_an_error_naming_it_not_a_failed_program(monkeypatch):
    monkeypatch.setattr(sandbox, "jail_paths", lambda: ([], ["/no/such/python-rl"]))
    with pytest.raises(sandbox.SandboxError, match=r"not be built: No such file or directory \(/no/such/python-rl\)"):
        run_python("print('ran')")


def test_the_code_runs_as_nobody_with_no_capabilities_under_the_filter():
    r = run_python("print(open('/proc/self/status').read())")
    status = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    status = {key: value.split() for key, value in status.items()}
    assert status["Uid"] == status["Gid"] == ["65534"] * 4 and status["Pid"] == ["1"]
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps][0], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"] == ["1"] and status["Seccomp"] == ["2"]


def test_the_jail_can_be_built_on_this_machine():
    """CI's machine and the GPU machines run as root with user namespaces: the jail must hold there, so that the
    tests above and the hostile-code tests exercise it rather than the barrier."""
    assert sandbox.jail_problem() == ""


def test_barrier_files_are_visible_and_the_directory_is_removed(barrier):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rl-sandbox-*")))
    code = ("import os, helper\nprint(os.getcwd())\nprint(sorted(os.listdir('.')), open('data/a.txt').read())\n"
            "print(helper.VALUE)\nos.makedirs('locked/in')\nos.chmod('locked', 0)")  # removal must not trip on it
    r = run_python(code, files={"data/a.txt": "seven", "helper.py": "VALUE = 7"})
    workdir, listing, value = r.stdout.splitlines()
    assert r.ok and listing == "['data', 'helper.py'] seven" and value == "7"
    assert not os.path.exists(workdir)
    assert not run_python("raise SystemExit(2)").ok
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rl-sandbox-*"))) <= before
    with pytest.raises(ValueError, match="relative path"):
        run_python("pass", files={"../escape.txt": "x"})
