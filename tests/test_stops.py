"""Stops and crashes of real runs started with `bash launch.sh`, signalled the way a terminal, `kill -TERM -PGID`
and a scheduler deliver signals: to the whole process group (under a real pty for Ctrl-C). Every stop ends in a
checkpoint (or, before the first step, with nothing to lose) and exit 0; a rank killed mid-run restarts the job,
which finishes on its own."""

import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from rl import launch
from tests.test_distributed import ROOT
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    evals = root / "eval.jsonl"  # sums of a two-digit term: none is a training prompt
    evals.write_text("".join(json.dumps({"question": f"What is {10 + i} + {i % 7}?", "answer": str(10 + i + i % 7),
                                         "metadata": {"kind": "eval"}}) + "\n" for i in range(4)))
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl"), evals


class Run:
    """`bash launch.sh` in a process group (and session) of its own, optionally on a pty as its terminal."""

    def __init__(self, inputs, out: Path, *overrides: str, nproc: int = 2, terminal: bool = False,
                 launch_flags: tuple[str, ...] = ()):
        self.out = out
        model, data, _ = inputs
        cmd = ["bash", "launch.sh", "--nproc", str(nproc), *launch_flags, "configs/tiny.toml",
               f"--model.path={model}", f"--data.source={data}", f"--log.output_dir={out}",
               "--reward.user_fn=tests.reward_fns:digit_fraction", *overrides]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EVAL_MARK": str(out) + ".eval_mark"}
        self.output, self.master = [], None
        if terminal:
            self.master, slave = pty.openpty()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave,
                                         start_new_session=True,  # then the pty becomes its controlling terminal
                                         preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
            os.close(slave)
            threading.Thread(target=self._read_terminal, daemon=True).start()
        else:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, start_new_session=True)
            threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()

    def _read_terminal(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the terminal's last writer is gone
                return
            if not chunk:
                return
            self.output.append(chunk.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.output)

    def rows(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def wait_for(self, condition, what: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.text()[-3000:]}"
            assert time.time() < deadline, f"no {what} within {timeout} s:\n{self.text()[-3000:]}"
            time.sleep(0.05)

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")  # the terminal sends SIGINT to its foreground process group

    def finish(self, timeout: float = 240) -> int:
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # the reader threads drain what is left
        return code

    def processes_left(self) -> list[int]:
        """Processes still running for this run: torchrun and the ranks (their command lines name its output
        dir) and whatever descends from them (reward workers)."""
        parent, named = {}, []
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit():
                    continue
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if str(self.out) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    named.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
        found = set(named)
        while grown := {pid for pid, ppid in parent.items() if ppid in found} - found:
            found |= grown
        return sorted(found)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended since
        return ""


def checkpoints(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("rollout_")) if root.is_dir() else []


def test_a_group_sigterm_before_the_ranks_exist_ends_at_once_with_nothing_to_save(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", nproc=1)
    # launch.sh has checked the config and started torchrun, which is still importing: no rank exists yet
    run.wait_for(lambda: "torch.distributed.run" in " ".join(map(command_line, run.processes_left())), "torchrun")
    run.signal_group(signal.SIGTERM)
    assert run.finish() == 0, run.text()[-3000:]
    assert "rl: stopped before rollout 0 (a stop request from launch.sh): nothing new to save" in run.text()
    assert run.rows() == [] and checkpoints(run.out) == [] and not (run.out / "final").exists()


def test_a_group_sigterm_mid_run_checkpoints_the_step_and_the_rerun_resumes(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", "--train.num_rollout=200")
    run.wait_for(lambda: len(run.rows()) >= 2, "two rollouts")
    run.signal_group(signal.SIGTERM)  # launch.sh, torchrun: as `kill -TERM -PGID` and a container stop do
    assert run.finish() == 0, run.text()[-3000:]
    last = run.rows()[-1]["rollout_id"]
    assert f"rl: stopping after rollout {last}" in run.text()
    assert checkpoints(run.out) == [f"rollout_{last}"] and not (run.out / "final").exists()
    assert run.processes_left() == []
    again = Run(inputs, run.out, f"--train.num_rollout={last + 3}")
    assert again.finish() == 0, again.text()[-3000:]
    assert [r["rollout_id"] for r in again.rows()] == list(range(last + 3))
    assert f"resumed from {run.out}/checkpoints/rollout_{last}" in again.text()


def test_ctrl_c_in_a_terminal_checkpoints_the_step(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", "--train.num_rollout=200", terminal=True)
    run.wait_for(lambda: len(run.rows()) >= 2, "two rollouts")
    run.ctrl_c()
    assert run.finish() == 0, run.text()[-3000:]
    text = run.text()
    last = run.rows()[-1]["rollout_id"]
    assert "Ctrl-C again to kill the run now" in text and f"rl: stopping after rollout {last}" in text
    assert "KeyboardInterrupt" not in text and "SignalException" not in text
    assert checkpoints(run.out) == [f"rollout_{last}"]
    assert run.processes_left() == []


def test_a_second_ctrl_c_in_a_terminal_kills_the_run_at_once(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", "--train.num_rollout=200", terminal=True)
    run.wait_for(lambda: len(run.rows()) >= 1, "a rollout")
    run.ctrl_c()
    run.wait_for(lambda: "Ctrl-C again" in run.text(), "the first Ctrl-C's answer", timeout=30)
    run.ctrl_c()
    assert run.finish(timeout=30) != 0
    time.sleep(1)  # the ranks and reward workers die with their parents (a parent-death signal)
    assert run.processes_left() == []


def test_a_group_sigterm_during_the_final_eval_finishes_the_run(inputs, tmp_path):
    mark = Path(str(tmp_path / "run") + ".eval_mark")
    run = Run(inputs, tmp_path / "run", "--train.num_rollout=3", f"--eval.source={inputs[2]}", "--eval.interval=100",
              "--reward.user_fn=tests.reward_fns:slow_on_eval")
    run.wait_for(lambda: len(run.rows()) == 3, "the last rollout")
    scored = len(mark.read_text().splitlines())  # the eval before rollout 0
    run.wait_for(lambda: len(mark.read_text().splitlines()) > scored, "the final eval")
    run.signal_group(signal.SIGTERM)
    assert run.finish() == 0, run.text()[-3000:]
    final_row = run.rows()[-1]
    assert final_row["rollout_id"] == 3 and final_row["eval/reward_errors"] == 0  # no reward worker died of it
    assert (run.out / "final" / "config.json").is_file() and checkpoints(run.out)[-1] == "rollout_2"


def test_a_rank_killed_mid_run_restarts_the_job_which_finishes(inputs, tmp_path):
    run = Run(inputs, tmp_path / "run", "--train.num_rollout=24", "--checkpoint.interval=5")
    run.wait_for(lambda: len(run.rows()) >= 12, "twelve rollouts")
    rank1 = [pid for pid in run.processes_left() if b"rl.main" in Path(f"/proc/{pid}/cmdline").read_bytes()
             and b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]  # not its reward workers
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    assert run.finish() == 0, run.text()[-3000:]
    rows = run.rows()
    assert [r["rollout_id"] for r in rows] == list(range(24))  # each once: the rows after the checkpoint moved aside
    restarted = [r for r in rows if r["run/restarts"] == 1]
    assert restarted and "rank 1 of this node ended without an error report" in restarted[0]["run/restart_cause"]
    assert "rl: restart 1 of at most 3, after: rank 1" in run.text()
    assert (run.out / "final" / "config.json").is_file()


def test_an_input_error_is_not_retried_by_plain_torchruns_restarts(inputs, tmp_path):
    """(launch.sh checks the config before torchrun starts, and takes a rank's input error without a restart:
    tests/test_launch.py.)"""
    model, data, _ = inputs
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "--max-restarts", "2", "-m", "rl.main", "--config", "configs/tiny.toml",
                           f"--model.path={model}", f"--data.source={data}", f"--log.output_dir={tmp_path / 'run'}",
                           "--rollout.n_samples_per_prompt=1"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if line.startswith("rl: error: ")]
    assert len(lines) == 3, text[-3000:]  # the first attempt's line, then each restart repeats it without running
    assert lines[1] == lines[0] + " (restart 1 not run: the same input ends the same way)"
    assert lines[2] == lines[0] + " (restart 2 not run: the same input ends the same way)"
    assert "policy: built" not in text


def test_the_restart_cause_names_the_rank_that_died_without_a_word(tmp_path, monkeypatch):
    run_dir = tmp_path / "run_id"
    for local_rank, error in [(0, {"message": "RuntimeError: Connection closed by peer", "extraInfo":
                                   {"py_callstack": "...", "timestamp": "1"}}), (1, None), (2, None)]:
        (run_dir / "attempt_0" / str(local_rank)).mkdir(parents=True)
        (run_dir / "attempt_1" / str(local_rank)).mkdir(parents=True)
        if error:
            (run_dir / "attempt_0" / str(local_rank) / "error.json").write_text(json.dumps({"message": error}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(run_dir / "attempt_1" / "0" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "3")  # the second node's first rank
    errors = launch.previous_attempt_errors()
    assert [rank for rank, _ in errors] == [3, 4, 5]
    assert launch.restart_cause(errors).startswith("ranks 4, 5 of this node ended without an error report")
    assert launch.restart_cause(errors[:1]) == "rank 3: RuntimeError: Connection closed by peer"
    assert launch.final_error(errors) is None


def test_a_restarted_attempt_does_not_read_the_keys_of_the_attempt_before(monkeypatch):
    """torchrun's agent keeps one store for the whole job: a process group of the new attempt that read the
    addresses the dead attempt's ranks left there would fail to connect (a race, so not seen in every run)."""
    import datetime

    import torch.distributed as dist

    from rl.parallel import restarted_store

    agent_store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restarted_store(datetime.timedelta(seconds=10)) is None  # a first attempt uses torchrun's store as it is
    agent_store.set("default_pg/0//cpu//0/rank_0", "the dead attempt's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = restarted_store(datetime.timedelta(seconds=10))
    assert not store.check(["default_pg/0//cpu//0/rank_0"])
    store.set("default_pg/0//cpu//0/rank_0", "this attempt's")
    assert agent_store.get("default_pg/0//cpu//0/rank_0") == b"the dead attempt's address"
