"""Faults from start to finish through `torchrun -m rl.main`: each stops with one line naming the cause, or is
survived and counted in the metrics."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_distributed import ROOT
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


def run(inputs, out: Path, *overrides: str, nproc: int = 1, model: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 1000), "-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"),
           f"--model.path={model or inputs[0]}", f"--data.source={inputs[1]}", f"--log.output_dir={out}",
           "--reward.user_fn=tests.reward_fns:digit_fraction", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


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
    assert "every reward failed in 2 steps in a row" in one_line(proc, "rl: stopped:")
    assert [r["reward/num_errors"] for r in strict_rows(tmp_path / "run")] == [32, 32]


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
