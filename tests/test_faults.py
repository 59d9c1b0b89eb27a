"""Faults from start to finish through `torchrun -m rl.main`: each stops with one line naming the cause, or is
survived and counted in the metrics."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.run.checkpoint import complete_checkpoints
from tests.test_distributed import ROOT
from tests.test_reward import worker_running
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def rl_main(inputs, out: Path, *overrides: str, model: Path | None = None) -> list[str]:
    return ["-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model or inputs[0]}",
            f"--data.source={inputs[1]}", f"--log.output_dir={out}", "--reward.user_fn=tests.reward_fns:digit_fraction",
            *overrides]


def run(inputs, out: Path, *overrides: str, nproc: int = 1, model: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 1000), *rl_main(inputs, out, *overrides, model=model)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def strict_rows(out: Path) -> list[dict]:
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=no_constants) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rank_exit_code(proc: subprocess.CompletedProcess) -> int:
    """The exit code of the rank that failed first (torchrun itself exits 1 for any failure)."""
    assert proc.returncode != 0
    return int(re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", proc.stderr, re.DOTALL).group(1))


def one_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The single line that says why the run ended: printed once (rank 0), no traceback of the ranks (torchrun's
    own, of its ChildFailedError, stays), and in torchrun's failure summary."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "rl/main.py" not in proc.stderr and "error_file: <N/A>" not in proc.stderr  # no frame of ours
    assert f"traceback : {lines[0]}" in proc.stderr  # torchrun's failure summary names the cause
    return lines[0]


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(inputs, tmp_path):
    proc = run(inputs, tmp_path / "run", "--train.lr=1e20", "--train.max_bad_steps=2", "--train.num_rollout=6")
    assert rank_exit_code(proc) == 1
    assert "2 optimizer steps in a row had a non-finite loss or grad norm" in one_line(proc, "rl: stopped:")
    rows = strict_rows(tmp_path / "run")  # NaN became null: every row is JSON
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 1]
    assert rows[1]["train/loss"] is None
    assert [r["weight_version"] for r in rows] == [2, 2, 2]  # a skipped step pushes no new version
    assert "health warning: train/skipped_steps = 1" in proc.stdout
    assert rows[-1]["health/warnings"] >= 2  # the two skipped steps (a random tiny model also truncates)
    assert not (tmp_path / "run" / "final").exists()  # never a broken model after a stop


def test_a_collapsed_policy_warns_and_the_boxed_template_works(inputs, tmp_path):
    proc = run(inputs, tmp_path / "run", "--train.lr=1e6", "--train.num_rollout=4",
               "--data.prompt_template={prompt} \\boxed{}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "health warning: train/entropy" in proc.stdout and "health warning: train/grad_norm" in proc.stdout
    rows = strict_rows(tmp_path / "run")
    assert rows[-1]["health/warnings"] >= 2
    assert rows[0]["data/prompts_filtered"] == 0  # every prompt went through the template


def test_a_group_of_one_sample_is_refused_once_on_two_ranks(inputs, tmp_path):
    proc = run(inputs, tmp_path / "run", "--rollout.n_samples_per_prompt=1", nproc=2)
    assert rank_exit_code(proc) == 2
    assert "rollout.n_samples_per_prompt=1" in one_line(proc, "rl: error:")


def test_rewards_that_always_fail_stop_the_run(inputs, tmp_path):
    proc = run(inputs, tmp_path / "run", "--reward.user_fn=tests.reward_fns:wrong_signature",
               "--reward.max_failed_steps=2", "--train.num_rollout=5")
    assert rank_exit_code(proc) == 1
    # A function failing on every input of the run's first step is broken: the run stops there, not at the streak.
    assert "every reward of the run's first scored step failed (32 of 32)" in one_line(proc, "rl: stopped:")
    assert [r["reward/num_errors"] for r in strict_rows(tmp_path / "run")] == [32]


def test_a_tokenizer_larger_than_the_embedding_is_refused(inputs, tmp_path):
    model = shutil.copytree(inputs[0], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    proc = run(inputs, tmp_path / "run", model=model)
    assert rank_exit_code(proc) == 2
    assert "vocab_size 200" in one_line(proc, "rl: error:")


def test_a_context_past_the_model_positions_is_refused(inputs, tmp_path):
    proc = run(inputs, tmp_path / "run", "--rollout.max_context_len=1024")
    assert rank_exit_code(proc) == 2
    line = one_line(proc, "rl: error:")
    assert "rollout.max_context_len" in line and "512" in line


def test_a_model_without_a_producible_eos_is_refused(inputs, tmp_path):
    model = shutil.copytree(inputs[0], tmp_path / "model")
    (model / "generation_config.json").unlink()
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": None}))
    proc = run(inputs, tmp_path / "run", model=model)
    assert rank_exit_code(proc) == 2
    assert "EOS" in one_line(proc, "rl: error:")


def rank_pid(out: Path, rank: int) -> int:
    """The pid of the rank of the run writing to `out` (not its reward workers)."""
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and f"--log.output_dir={out}".encode() in (entry / "cmdline").read_bytes()
                    and b"rl.main" in (entry / "cmdline").read_bytes()
                    and f"\0RANK={rank}\0".encode() in b"\0" + (entry / "environ").read_bytes()):
                return int(entry.name)
        except OSError:
            pass
    raise AssertionError(f"no rank {rank} writing to {out}")


def wait_for_rows(out: Path, count: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + 240
    while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= count):
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "the run ended or stalled early"
        time.sleep(0.05)


def test_a_stopped_rank_is_named_in_one_line(inputs, tmp_path):
    """SIGSTOP: the rank neither answers nor closes its connections; the collective times out on rank 0, which
    names it (not a gloo traceback); the rows and the checkpoint written before stay whole."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                             "0", "--master-port", str(29500 + os.getpid() % 1000),
                             *rl_main(inputs, out, "--train.num_rollout=200", "--train.collective_timeout_s=3",
                                      "--checkpoint.interval=2")],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(out, 3, [proc])
        reporter, stopped = rank_pid(out, 0), rank_pid(out, 1)
        os.kill(stopped, signal.SIGSTOP)
        rows_then = strict_rows(out)
        # Once rank 0 has stopped the run, the stopped rank is killed here: torchrun's SIGTERM would wait 30 s on it.
        deadline = time.time() + 180
        while worker_running(reporter) and time.time() < deadline:
            time.sleep(0.1)
        os.kill(stopped, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(stopped, sig)
            except (OSError, UnboundLocalError):
                pass
    done = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    assert rank_exit_code(done) == 1
    lines = [line for line in stderr.splitlines() if line.startswith("rl: stopped:")]
    assert len(lines) == 1 and f"traceback : {lines[0]}" in stderr.split("Root Cause")[1], stderr[-3000:]
    line = lines[0]
    # Stopped in generation, the monitored barrier after it names the rank; anywhere else, the collective's timeout
    # and the check-in after it do.
    assert line.startswith(("rl: stopped: rank 1 stopped answering: a collective waited 3 s "
                            "(train.collective_timeout_s) for it, and did not check in after (stopped or hung, not "
                            "crashed",
                            "rl: stopped: rank(s) [1] did not reach the end of rollout generation within 3 s "
                            "(stalled or dead)")), line
    assert "rl/main.py" not in stderr  # no traceback of the ranks (torchrun's own, of its ChildFailedError, stays)
    rows = strict_rows(out)
    assert rows[: len(rows_then)] == rows_then and [r["rollout_id"] for r in rows] == list(range(len(rows)))
    saved = complete_checkpoints(out)
    assert saved and all((path / "trainer_state.json").is_file() for path in saved)


@pytest.mark.parametrize("loop", [(), ("--rollout.partial_rollout=true", "--rollout.max_staleness=1")],
                         ids=["synchronous", "partial"])
def test_a_rank_killed_on_another_node_is_named_by_the_survivor(inputs, tmp_path, loop):
    """Two torchrun agents as two nodes: rank 1's agent sees its rank die, rank 0's does not, so rank 0 meets the
    death itself, in a collective whose connection closed, and says so in one line."""
    out = tmp_path / "run"
    port = str(29500 + (os.getpid() + 7) % 1000)
    nodes = []
    for _ in range(2):  # the first agent hosts the rendezvous store, which outlives the second
        nodes.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                       "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
                                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tmp_path.name,
                                       *rl_main(inputs, out, "--train.num_rollout=200",
                                                "--train.collective_timeout_s=3", *loop)],
                                      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(3)
    try:
        wait_for_rows(out, 3, nodes)
        os.kill(rank_pid(out, 1), signal.SIGKILL)
        stderr = nodes[0].communicate(timeout=120)[1]
    finally:
        for node in nodes:
            node.kill()
            node.communicate()
    lines = [line for line in stderr.splitlines() if line.startswith("rl: stopped:")]
    # Killed in generation, the monitored barrier after it names the rank (or, gone before rank 0 came, its closed
    # connection does); anywhere else, the closed connection and the check-in after it do, that check-in ended early
    # where rank 0's agent stops it first (the other node's agent has exited).
    died = (r"rl: stopped: rank 1 died: its connection closed in the middle of a collective, and (did not check in "
            r"after|had not checked in when a stop signal came [\d.]+ s later) \(killed by a signal or crashed\); "
            r"stopping the run. The output of rank 1 shows where it was")
    stalled = (r"rl: stopped: rank\(s\) \[1\] did not reach the end of rollout generation within 3 s \(stalled or "
               r"dead\); stopping the run. See those ranks' output for where they were")
    assert len(lines) == 1 and re.fullmatch(f"{died}|{stalled}", lines[0]), stderr[-3000:]
    assert "rl/main.py" not in stderr  # no traceback of the ranks (torchrun's own, of its ChildFailedError, stays)
