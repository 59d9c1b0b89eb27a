"""A run from a folder of the user's own, outside the checkout, as a TRL user sets one up: a dataset saved with
`datasets`, a reward module that imports the user's own package, configs/cpu_start.toml with relative paths,
the tiny model from `python -m rl.prepare tiny`, and one command, `rl` (here its entry function)."""

import json
import os
import subprocess
import sys

import datasets

from tests.test_distributed import ROOT

REWARDS = '''from scoring import contains  # the user's own package, beside this module


def reward(completions, answer, **kwargs):
    return [contains(c[0]["content"], a) for c, a in zip(completions, answer)]
'''
SCORING = '''def contains(text, answer):
    return 1.0 if answer in text else 0.0
'''


def own_folder(folder) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder / "data" / "sums"))
    (folder / "scoring").mkdir()
    (folder / "scoring" / "__init__.py").write_text(SCORING)
    (folder / "my_rewards.py").write_text(REWARDS)
    (folder / "cpu_start.toml").write_text((ROOT / "configs" / "cpu_start.toml").read_text())


def test_a_run_from_the_users_own_folder_with_one_command(tmp_path):
    own_folder(tmp_path)
    # The `python` on PATH is not the user's: the ranks must run in the Python that runs `rl`.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\necho 'not the Python that runs rl' >&2\nexit 97\n")
    (tmp_path / "bin" / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("PYTHON", None)
    prepared = subprocess.run([sys.executable, "-m", "rl.prepare", "tiny", "models/tiny"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    rl = [sys.executable, "-c", "from rl.launch import console; console()"]  # what the `rl` script runs
    proc = subprocess.run([*rl, "--nproc", "1", "cpu_start.toml", "--data.source=data/sums", "--train.num_rollout=2",
                           "--rollout.rollout_batch_size=2", "--rollout.n_samples_per_prompt=2",
                           "--rollout.max_new_tokens=8", "--train.micro_batch_size=4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert [row["rollout_id"] for row in rows] == [0, 1]
    assert all(row["rollout/num_scored"] == 4 and row.get("reward/num_errors", 0) == 0 for row in rows), rows
    assert (tmp_path / "runs" / "mine" / "final" / "config.json").is_file()
