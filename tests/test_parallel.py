"""Faults between ranks end the run: launcher death, a stalled rank, a collective past its timeout."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")


def torchrun_cmd(mode: str, out: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            "tests/parallel_checks.py", mode, str(out)]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def port(offset: int) -> int:
    return 28000 + (os.getpid() + offset) % 1000


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # reparented zombies are dead, whether or not anyone reaps them


@linux_only
def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    launcher = subprocess.Popen(torchrun_cmd("orphan", tmp_path, port(0)), cwd=ROOT, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_files = [tmp_path / f"pid{r}" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert launcher.poll() is None and time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.2)
    ranks = [int(f.read_text()) for f in pid_files]
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks), f"ranks {[p for p in ranks if alive(p)]} outlived their launcher"
    finally:
        for p in ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@linux_only
def test_a_rank_whose_launcher_is_already_gone_exits():
    code = "from rl.parallel import exit_with_launcher; exit_with_launcher(1 << 22); print('still running')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 1 and "still running" not in proc.stdout
    assert f"the launcher (pid {1 << 22}) is gone" in proc.stderr


def test_a_stalled_rank_is_named_and_the_run_stops(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(torchrun_cmd("stall", tmp_path, port(1)), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "StalledRankError: rank(s) [1] did not reach the end of step 1 within 2 s" in output, output[-3000:]
    assert time.monotonic() - start < 60


def test_a_rank_dead_before_a_step_barrier_is_named(tmp_path):
    """A rank that died before the others reach a step barrier makes it fail on its closed connection at once, not
    time out listing it: rank 0 names it through the check-in, as for any collective."""
    proc = subprocess.run(torchrun_cmd("dead", tmp_path, port(3)), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl: stopped:")]
    assert proc.returncode != 0 and lines == [
        "rl: stopped: rank 1 died: its connection closed in the middle of a collective, and did not check in after "
        "(killed by a signal or crashed); stopping the run. The output of rank 1 shows where it was"], \
        proc.stderr[-3000:]


def test_collective_timeout_is_lowered(tmp_path):
    proc = subprocess.run(torchrun_cmd("timeout", tmp_path, port(2)), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120, check=False)
    ended = time.time()
    assert proc.returncode != 0, proc.stderr[-3000:]  # rank 0's all_reduce timed out: rank 1 sleeps 20 s
    if torch.cuda.is_available():  # NCCL's watchdog names the timeout, then spends a minute on debug dumps
        assert "Timeout(ms)=3000" in proc.stderr, proc.stderr[-3000:]
    else:
        waited = ended - float((tmp_path / "started0").read_text())
        assert 2.0 < waited < 15.0, (waited, proc.stderr[-3000:])


def test_more_ranks_on_a_node_than_gpus_is_one_line_naming_the_launch(monkeypatch):
    from rl import parallel
    from rl.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device reached"))
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError) as e:
        parallel.init_distributed()
    assert str(e.value) == ("rank 1 is local rank 1 of 2 on its node, which has 1 visible GPU: launch with "
                            "--nproc-per-node 1 or fewer")


def test_a_stop_signal_ends_the_wait_for_check_ins_and_the_line_says_so(tmp_path, monkeypatch):
    """torchrun stops a node's ranks (SIGTERM) as soon as one exits and kills them 30 s later: a rank that meets a
    dead peer in a collective ends its wait for the others' check-ins at a stop signal and names who had not checked
    in (here rank 1 of a world of two that never joins), instead of being killed before it says anything."""
    import torch.distributed as dist

    from rl import parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(parallel.dist, "get_world_size", lambda group=None: 2)
        closed = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
        lost = parallel.lost_rank_error(closed, stopping=lambda: True)
        assert isinstance(lost, parallel.StalledRankError) and lost.missing == (1,) and lost.reporter == 0
        assert str(lost).startswith("rank 1 died: its connection closed in the middle of a collective, and had not "
                                    "checked in when a stop signal came "), str(lost)
        assert float(str(lost).split(" came ")[1].split(" s later")[0]) < 10  # at once, not after the 60 s wait
        assert parallel.unanswered_ranks(0, 2, 0.2) == [1]  # without a stop: the whole wait, then the same answer
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_a_plain_python_run_sets_the_launch_variables_an_in_process_engine_reads():
    """`python -m rl.main` (no torchrun) makes a group of one and leaves torchrun's variables behind it: vLLM's
    in-process executor reads RANK, LOCAL_RANK and WORLD_SIZE and joins through MASTER_ADDR:MASTER_PORT."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    plain = {k: v for k, v in env().items() if k not in keys and not k.startswith("TORCHELASTIC")}
    code = ("import os; from rl import parallel; d = parallel.init_distributed(); "
            f"print(d.rank, d.world_size, d.local_rank, *(os.environ.get(k, '-') for k in {keys!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=plain, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rank, world, local, *values = out.stdout.split()
    assert (rank, world, local) == ("0", "1", "0")
    assert dict(zip(keys, values)) | {"MASTER_PORT": "p"} == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "p"}
    assert int(values[-1]) > 0
