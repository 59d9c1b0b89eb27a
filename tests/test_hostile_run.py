"""A real `launch.sh` run whose tool environment attacks the run through the sandbox (tests/hostile_env.py): it
tries to delete the checkpoints and the metrics, plant pickles in every file a resume reads, and kill its rank.
Through the jail the run finishes with every checkpoint and metrics row intact, no restart, nothing executed."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_distributed import ROOT
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the jail is Linux's")


def test_a_hostile_tool_environment_leaves_the_run_intact(tmp_path):
    model, data = save_tiny_model_dir(tmp_path / "model"), write_arithmetic_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RL_HOSTILE_RUN": str(out)}
    proc = subprocess.run(
        ["bash", "launch.sh", "--nproc", "2", "--max-restarts", "2", "configs/tiny.toml", f"--model.path={model}",
         f"--data.source={data}", f"--log.output_dir={out}", "--train.num_rollout=3", "--checkpoint.interval=1",
         "--checkpoint.keep_last=5", "--env.fn=tests.hostile_env:hostile", "--rollout.rollout_batch_size=4",
         "--rollout.n_samples_per_prompt=2", "--train.micro_batch_size=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert all(r.get("run/restarts", 0) == 0 for r in rows)  # no rank was killed
    assert all(r["rollout/reward_mean"] == 1.0 for r in rows)  # every attack found nothing to reach
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["rollout_0", "rollout_1", "rollout_2"]
    assert not (out / "PWNED").exists()
    assert (out / "final").is_dir()
