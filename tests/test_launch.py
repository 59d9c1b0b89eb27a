"""launch.sh's signal paths with stand-ins for torchrun (run as `$PYTHON -m torch.distributed.run`), srun and
scontrol (no training): a stop request reaches the ranks as SIGUSR1, torchrun survives a SIGUSR1 of its own,
Ctrl-C stops then kills, and a SLURM batch job runs the submitted script (not Slurm's copy) on its nodes and
requeues after a stop; input errors in one line, checked before torchrun or handed back by a rank without a
restart; and a rendezvous port that another run holds."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_distributed import ROOT
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

# torchrun's stand-in starts one "rank" that waits for SIGUSR1, writes how many it got and exits 0 (10 when
# none came within 30 s), as a rank that checkpoints and stops would.
FAKE_TORCHRUN = """#!/usr/bin/env python3
import os, signal, subprocess, sys
print("torchrun: SIGUSR1 ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else "torchrun: SIGUSR1 default",
      flush=True)
open(os.environ["MARK"] + ".torchrun", "w").write(str(os.getpid()))
rank = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
open(os.environ["MARK"] + ".rank", "w").write("ready")
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.02)
time.sleep(0.3)  # a second signal in flight still counts
open(os.environ["MARK"] + ".count", "w").write(str(len(got)))
sys.exit(0 if got else 10)
'''])
sys.exit(rank.wait())
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> list[str]:
    """Overrides that make configs/tiny.toml a config launch.sh's check accepts."""
    folder = tmp_path_factory.mktemp("tiny")
    model, data = save_tiny_model_dir(folder / "model"), write_arithmetic_jsonl(folder / "train.jsonl")
    return [f"--model.path={model}", f"--data.source={data}", f"--log.output_dir={folder / 'run'}"]


@pytest.fixture
def fake(tmp_path, tiny_run):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun.py").write_text(FAKE_TORCHRUN)
    # The Python launch.sh is told to use ($PYTHON): torchrun's stand-in for `-m torch.distributed.run`, else itself.
    (bin_dir / "python").write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2; '
                                    f'exec {sys.executable} {bin_dir / "torchrun.py"} "$@"; fi\n'
                                    f'exec {sys.executable} "$@"\n')
    # srun runs its command as the job step, in its place so that its signals reach the step; a command
    # under the batch node's spool folder is refused, as the other nodes would not find it.
    (bin_dir / "srun").write_text('#!/bin/sh\ncase "$*" in *"$SPOOL"*) echo "srun: no $SPOOL on the other nodes"; '
                                  'exit 3 ;; esac\nshift\nexport SLURM_STEP_ID=0 SLURM_NODEID=0 SLURM_NNODES=1\n'
                                  'exec "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$1 $2" in\n'
        f'  "show job") echo "   Command={ROOT}/launch.sh" ;;\n'
        '  "show hostnames") echo 127.0.0.1 ;;\n'
        '  requeue*) echo "$2" > "$MARK.requeued" ;;\nesac\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MARK": str(tmp_path / "mark"),
            "PYTHON": str(bin_dir / "python"), "ARGS": "\n".join(tiny_run)}


def start(env: dict, script: str = "launch.sh", **extra: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", script, "--nproc", "1", "configs/tiny.toml", *env["ARGS"].split("\n")], cwd=ROOT,
                            env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_rank(env: dict) -> None:
    deadline = time.time() + 30
    while not Path(env["MARK"] + ".rank").exists():
        assert time.time() < deadline, "the stand-in rank never started"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_request_reaches_the_ranks_and_torchrun_survives_its_own(fake, sig):
    proc = start(fake)
    wait_for_rank(fake)
    os.kill(int(Path(fake["MARK"] + ".torchrun").read_text()), signal.SIGUSR1)  # as SLURM signals a whole task
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0]
    assert "torchrun: SIGUSR1 ignored" in out
    assert proc.returncode == 0, out  # torchrun lived on
    assert Path(fake["MARK"] + ".count").read_text() == "1"  # and the rank got the stop request


def test_a_second_ctrl_c_kills_the_run(fake):
    proc = start(fake)
    wait_for_rank(fake)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert "Ctrl-C again to kill the run now" in out
    assert proc.returncode in (0, 137), out  # killed, unless the rank had already stopped on the first


def test_slurm_batch_job_runs_the_submitted_script_and_requeues_after_a_stop(fake, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(ROOT / "launch.sh", spool / "slurm_script")  # what sbatch runs: a private copy
    proc = start(fake, str(spool / "slurm_script"), SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(ROOT),
                 SLURM_JOB_NODELIST="node0", SPOOL=str(spool))
    wait_for_rank(fake)
    proc.send_signal(signal.SIGUSR1)  # --signal=B:USR1: the batch shell alone
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert Path(fake["MARK"] + ".count").read_text() == "1"
    assert "requeueing job 77" in out
    assert Path(fake["MARK"] + ".requeued").read_text().strip() == "77"


def held_port(port: int = 0) -> socket.socket:
    """A listening socket on `port` (0: a free one), as another run's rendezvous store holds its port."""
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    return held


def plain_run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`python -m rl.main` without torchrun (a group of one), stopped at start-up before any model loads."""
    stop_file = tmp_path / "stop"
    stop_file.touch()  # a stop request read at start-up: the run ends once its process group is up
    model = save_tiny_model_dir(tmp_path / "model")
    data = write_arithmetic_jsonl(tmp_path / "train.jsonl")
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "rl.main", "--config", "configs/tiny.toml", f"--model.path={model}",
                           f"--data.source={data}", f"--log.output_dir={tmp_path / 'run'}"], cwd=ROOT, text=True,
                          env={**environ, "PYTHONPATH": str(ROOT), "RL_STOP_FILE": str(stop_file), **env},
                          capture_output=True, timeout=300)


def test_a_taken_rendezvous_port_is_one_line_naming_the_variable(tmp_path):
    with held_port() as held:
        port = held.getsockname()[1]
        proc = plain_run(tmp_path, MASTER_PORT=str(port))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"rl: error: port {port} of 127.0.0.1 (MASTER_ADDR:MASTER_PORT) is taken, most likely by another run on "
        f"this machine: set MASTER_PORT to a free port (torchrun: --master-port; launch.sh picks a free one, and under "
        f"SLURM reads RDZV_PORT)"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_two_plain_runs_at_once_do_not_share_a_port(tmp_path):
    """A group of one without MASTER_PORT takes a free port: a second run beside the first starts."""
    try:
        held = held_port(29517)  # the fixed port such runs took before
    except OSError:
        held = None  # another run holds it already, as wanted
    try:
        proc = plain_run(tmp_path)
    finally:
        if held is not None:
            held.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rl: stopped before rollout 0 (a stop request from launch.sh): nothing new to save" in proc.stdout


def launch(folder: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """`bash <checkout>/launch.sh ARGS` run from `folder`, and how long it took."""
    began = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "launch.sh"), *args], cwd=folder, env={**os.environ, **env}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc, time.monotonic() - began


def test_a_config_error_is_one_line_within_seconds_from_any_folder(tmp_path):
    (tmp_path / "run.toml").write_text('[model]\npath = "models/mine"\n[data]\nsource = "rows.jsonl"\n'
                                       '[train]\nlr = 0\n')
    proc, took = launch(tmp_path, "--nproc", "2", "run.toml")
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert proc.stdout == "rl: error: train.lr must be > 0, got 0.0\n", proc.stdout[-3000:]
    assert took < 10, f"{took:.1f} s"  # checked before torchrun starts: no ranks, no restarts
    save_tiny_model_dir(tmp_path / "models" / "mine")  # the paths are the caller's: found from its folder
    proc, _ = launch(tmp_path, "--nproc", "2", "run.toml", "--train.lr=1e-5", "--rollout.rollout_batch_size=3")
    (line,) = proc.stdout.splitlines()  # the split over the --nproc ranks, checked before them too
    assert line.startswith("rl: error: rollout.over_sampling_batch_size (3, default rollout_batch_size) must be "
                           "divisible by the number of engines (2 "), proc.stdout[-3000:]


def test_a_rank_input_error_is_handed_back_without_a_restart(tmp_path):
    """An input error only a rank meets (every prompt longer than data.max_prompt_len): its one line and exit 2,
    never torchrun's restarts or its failure summary."""
    save_tiny_model_dir(tmp_path / "model")
    write_arithmetic_jsonl(tmp_path / "rows.jsonl", rows=5)
    proc, _ = launch(tmp_path, "--nproc", "1", "--max-restarts", "3", str(ROOT / "configs/tiny.toml"),
                     "--model.path=model", "--data.source=rows.jsonl", "--data.max_prompt_len=3")
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert proc.stdout.splitlines()[-1] == (
        "rl: error: data.source yields no prompts: all 5 are longer than data.max_prompt_len=3 tokens with the "
        "template (their lengths, shortest first: 33, 33, 33, 33, 33; the longest 33)"), proc.stdout[-3000:]
    for noise in ("restart", "ChildFailedError", "Traceback"):
        assert noise not in proc.stdout, proc.stdout[-3000:]


def test_without_PYTHON_the_ranks_run_the_python_on_PATH(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    proc = subprocess.run(["bash", str(ROOT / "launch.sh"), "--nproc", "1", str(ROOT / "configs/tiny.toml"),
                           "--help=train"], cwd=tmp_path, env={**environ, "PATH": f"{bin_dir}:{environ['PATH']}"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "[train]" in proc.stdout, proc.stderr[-3000:]
    assert (tmp_path / "calls").read_text().startswith("-m rl.launch ")


def test_a_stop_request_during_the_config_check_ends_the_run_before_it_starts(fake, tmp_path):
    """A group SIGTERM while the check runs: the check finishes (it ignores the signal, as torchrun does), and
    launch.sh then starts no torchrun and exits 0."""
    slow = tmp_path / "slow_python"  # the check, held until the signal has come
    slow.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m rl.launch" ]; then touch {tmp_path / "checking"}; sleep 2; fi\n'
                    f'exec {fake["PYTHON"]} "$@"\n')
    slow.chmod(0o755)
    proc = subprocess.Popen(["bash", "launch.sh", "--nproc", "1", "configs/tiny.toml", *fake["ARGS"].split("\n")],
                            cwd=ROOT, env={**fake, "PYTHON": str(slow)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 30
    while not (tmp_path / "checking").exists():
        assert time.time() < deadline, "the check never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "launch.sh: stop requested before the run started; nothing to save" in out
    assert not Path(fake["MARK"] + ".torchrun").exists()
