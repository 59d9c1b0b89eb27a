"""rl/sandbox.py: output and exit codes, the wall-clock and memory limits, no new processes, no network, and the
temporary directory with the caller's files, there during the run and gone after it."""

import glob
import os
import socket
import tempfile
import time

import pytest

from rl import sandbox
from rl.sandbox import MAX_OUTPUT_BYTES, SandboxResult, run_python

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


@pytest.mark.parametrize("namespace", [True, False])
def test_no_network(namespace, monkeypatch):
    """Neither a network namespace nor, where none can be made, the socket prelude lets a connection through,
    not even to a server on this machine's loopback."""
    if namespace and not sandbox.network_namespace_available():
        pytest.skip("this kernel makes no unprivileged network namespaces")
    monkeypatch.setattr(sandbox, "network_namespace_available", lambda: namespace)
    with socket.create_server(("127.0.0.1", 0)) as server:
        r = run_python(CONNECT.format(port=server.getsockname()[1]))
    assert r.ok and r.stdout.startswith("refused:"), r


def test_files_are_visible_and_the_directory_is_removed():
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
