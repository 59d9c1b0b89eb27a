"""Checkpoints on 2 gloo ranks: exact resume, crash and fallback, resharding, preemption, export, the run folder."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_distributed import ROOT, torchrun
from tests.test_faults import one_line, rank_exit_code
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

COMPARED = ["rollout_id", "weight_version", "rollout/reward_mean", "train/loss", "train/grad_norm"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


def launch(inputs, out: Path, nproc: int = 2, *overrides: str, check: bool = True,
           script: tuple[str, ...] = ("-m", "rl.main")) -> subprocess.CompletedProcess:
    model, data = inputs
    args = [*script, "--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}", f"--data.source={data}",
            f"--log.output_dir={out}", "--reward.user_fn=tests.reward_fns:digit_fraction", *overrides]
    if check:
        return torchrun(nproc, *args)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 1000), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_resume_is_exact(inputs, tmp_path):
    """4 rollouts straight == 2 rollouts, a stop, and 2 more resumed: same metrics, bitwise-equal weights. The
    first half keeps AdamW's moments in host memory (train.optimizer_offload): the same numbers, and a checkpoint
    the plain optimizer resumes from."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(inputs, straight, 2, "--train.num_rollout=4", "--checkpoint.interval=2")
    launch(inputs, resumed, 2, "--train.num_rollout=2", "--checkpoint.interval=2", "--train.optimizer_offload=true")
    launch(inputs, resumed, 2, "--train.num_rollout=4", "--checkpoint.interval=2", "--checkpoint.resume=auto")
    a, b = rows(straight), rows(resumed)
    assert [r["rollout_id"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in COMPARED} == {k: rb[k] for k in COMPARED}
    wa, wb = final_weights(straight), final_weights(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert checkpoints(resumed) == ["rollout_1", "rollout_3"]  # keep_last = 2
    changed = sorted(json.loads(p.read_text())["train"]["num_rollout"] for p in resumed.glob("config*.json"))
    assert changed == [2, 4]  # the earlier config is kept beside the new one


def test_kill_during_save_resumes_from_the_previous_checkpoint(inputs, tmp_path):
    out = tmp_path / "run"
    proc = launch(inputs, out, 2, "--train.num_rollout=4", "--checkpoint.interval=1", check=False,
                  script=("tests/crash_in_save.py", "2"))
    assert proc.returncode != 0
    # Rank 0 names the rank that died, though torchrun stops it (SIGTERM) as soon as it sees that rank gone.
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl: stopped:")]
    assert len(lines) == 1 and re.fullmatch(
        r"rl: stopped: rank 1 died: its connection closed in the middle of a collective, and had not checked in when "
        r"a stop signal came [\d.]+ s later \(killed by a signal or crashed\); stopping the run. The output of rank 1 "
        r"shows where it was", lines[0]), proc.stderr[-3000:]
    assert checkpoints(out) == [".rollout_2.tmp", "rollout_0", "rollout_1"]
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2]
    proc = launch(inputs, out, 2, "--train.num_rollout=4", "--checkpoint.interval=1")
    assert "resumed from" in proc.stdout and "rollout_1" in proc.stdout
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2, 3]  # row 2 was dropped and written again
    assert checkpoints(out) == ["rollout_2", "rollout_3"]


def test_unreadable_checkpoint_falls_back_with_a_warning(inputs, tmp_path):
    out = tmp_path / "run"
    launch(inputs, out, 2, "--train.num_rollout=2", "--checkpoint.interval=1")
    for shard in (out / "checkpoints" / "rollout_1" / "model_optim").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # torn by a failing disk
    proc = launch(inputs, out, 2, "--train.num_rollout=3", "--checkpoint.interval=1")
    text = proc.stdout + proc.stderr
    assert "rollout_1 could not be loaded" in text and "resumed from" in text and "rollout_0 instead" in text
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2]


def test_resuming_a_checkpoint_without_a_critic_into_gae_is_one_line(inputs, tmp_path):
    """A GRPO run's checkpoint holds no value model: resuming it as PPO with GAE stops at start-up with one line
    naming both estimators, instead of failing every checkpoint's read and falling back through them."""
    out = tmp_path / "run"
    launch(inputs, out, 2, "--train.num_rollout=1")
    proc = launch(inputs, out, 2, "--train.num_rollout=2", "--algo.advantage_estimator=gae", check=False)
    assert rank_exit_code(proc) == 2
    line = one_line(proc, "rl: error:")
    assert line.startswith("rl: error: checkpoint ") and "holds no critic" in line and "'grpo'" in line, line
    assert "could not load" not in proc.stdout
    assert [r["rollout_id"] for r in rows(out)] == [0]  # nothing of the refused run was written


def test_two_rank_checkpoint_resumes_on_one_rank(inputs, tmp_path):
    out = tmp_path / "run"
    launch(inputs, out, 2, "--train.num_rollout=2")
    proc = launch(inputs, out, 1, "--train.num_rollout=3")
    assert "written by 2 ranks, resumed on 1" in proc.stdout
    assert [(r["rollout_id"], r["weight_version"]) for r in rows(out)] == [(0, 2), (1, 3), (2, 4)]


def test_sigterm_saves_and_exits_zero_then_resumes(inputs, tmp_path):
    model, data = inputs
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["bash", "launch.sh", "--nproc", "2", "configs/tiny.toml", f"--model.path={model}",
                             f"--data.source={data}", f"--log.output_dir={out}", "--train.num_rollout=1000",
                             "--reward.user_fn=tests.reward_fns:digit_fraction"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((out / "metrics.jsonl").is_file() and rows(out)):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    assert "stopping after rollout" in output
    done = [r["rollout_id"] for r in rows(out)]
    assert checkpoints(out) == [f"rollout_{done[-1]}"] and not (out / "final").exists()
    launch(inputs, out, 2, f"--train.num_rollout={done[-1] + 2}")
    assert [r["rollout_id"] for r in rows(out)] == list(range(done[-1] + 2))


def test_finished_run_is_neither_mixed_nor_lost(inputs, tmp_path):
    out = tmp_path / "run"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"What is {a} + 7?", "answer": str(a + 7)}) + "\n"
                                for a in (11, 12, 13)))
    launch(inputs, out, 1, "--train.num_rollout=2", f"--eval.source={held_out}")
    before = (out / "metrics.jsonl").read_text()
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2]  # the last row: the eval after the last update
    proc = launch(inputs, out, 1, "--train.num_rollout=2", f"--eval.source={held_out}")
    assert "already finished rollout 1" in proc.stdout
    assert (out / "metrics.jsonl").read_text() == before
    proc = launch(inputs, out, 1, "--train.num_rollout=2", "--checkpoint.resume=never", check=False)
    assert proc.returncode != 0 and "already holds a run" in proc.stderr and "--checkpoint.resume=auto" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(inputs, tmp_path):
    """An explicit resume from an earlier checkpoint of the same run branches it: the newer checkpoints and
    rows are kept aside, where neither resume=auto nor pruning reaches them."""
    out = tmp_path / "run"
    launch(inputs, out, 1, "--train.num_rollout=3", "--checkpoint.interval=1", "--checkpoint.keep_last=3")
    first = rows(out)
    proc = launch(inputs, out, 1, "--train.num_rollout=3", "--checkpoint.interval=1",
                  f"--checkpoint.resume={out / 'checkpoints' / 'rollout_0'}")
    assert "are moved to" in proc.stdout
    (aside,) = (out / "checkpoints").glob("abandoned_*")
    assert sorted(p.name for p in aside.iterdir()) == ["rollout_1", "rollout_2"]
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2]
    (replaced,) = out.glob("metrics.replaced_*.jsonl")
    assert [json.loads(line) for line in replaced.read_text().splitlines()] == first[1:]
    assert checkpoints(out) == [aside.name, "rollout_1", "rollout_2"]  # keep_last=2 prunes only this branch
    # A checkpoint from elsewhere into this folder, which holds a run: refused, nothing touched.
    before = (out / "metrics.jsonl").read_text()
    proc = launch(inputs, out, 1, f"--checkpoint.resume={aside / 'rollout_1'}", check=False)
    assert proc.returncode != 0 and "pass a new log.output_dir" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_metrics_without_a_checkpoint_are_not_overwritten(inputs, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"rollout_id": 0}\n')
    proc = launch(inputs, out, 1, check=False)
    assert proc.returncode != 0 and "no complete checkpoint" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == '{"rollout_id": 0}\n'


def test_a_second_run_into_a_busy_folder_is_refused(inputs, tmp_path):
    from rl.run.checkpointer import lock_output_dir

    out = tmp_path / "run"
    held = lock_output_dir(out)  # as a running job holds it
    try:
        proc = launch(inputs, out, 1, check=False)
    finally:
        held.close()
    assert proc.returncode != 0 and "is in use by a running job" in proc.stderr


def test_exported_folder_gives_the_trained_policy(inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    launch(inputs, out, 2, "--train.num_rollout=2")
    exported = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "rl.export", str(out / "checkpoints" / "rollout_1"), str(exported)],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ids = torch.tensor([[1, 5, 9, 13, 40, 41]])
    with torch.no_grad():
        final = AutoModelForCausalLM.from_pretrained(out / "final").eval()(ids).logits
        again = AutoModelForCausalLM.from_pretrained(exported).eval()(ids).logits
        initial = AutoModelForCausalLM.from_pretrained(inputs[0]).eval()(ids).logits
    assert torch.equal(final, again)
    assert (final - initial).abs().max() > 1e-4  # trained, not the starting weights
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / "final" / name).is_file()


def test_two_nodes_through_the_slurm_launch_path_checkpoint_and_resume(inputs, tmp_path):
    """launch.sh as a SLURM job step on two "nodes" of this machine: one torchrun each, joined by the c10d
    rendezvous the script sets up (scontrol answers with this host), then the same job again resumes."""
    model, data = inputs
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (fake_bin / "scontrol").chmod(0o755)
    out = tmp_path / "run"

    def job(num_rollout: int) -> str:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": f"{fake_bin}:{os.environ['PATH']}",
               "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
               "RDZV_PORT": str(30500 + os.getpid() % 1000)}
        nodes = [subprocess.Popen(["bash", "launch.sh", "--nproc", "1", "configs/tiny.toml", f"--model.path={model}",
                                   f"--data.source={data}", f"--log.output_dir={out}",
                                   f"--train.num_rollout={num_rollout}",
                                   "--reward.user_fn=tests.reward_fns:digit_fraction"],
                                  cwd=ROOT, env={**env, "SLURM_NODEID": str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(2)]
        logs = [node.communicate(timeout=600)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
        return "\n".join(logs)

    assert "world_size=2" in job(2)
    assert "resumed from" in job(3)
    assert [(r["rollout_id"], r["weight_version"]) for r in rows(out)] == [(0, 2), (1, 3), (2, 4)]
    assert checkpoints(out) == ["rollout_1", "rollout_2"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_loads_the_exported_folder(inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    launch(inputs, out, 1, "--train.num_rollout=1")
    subprocess.run([sys.executable, "tests/vllm_export_check.py", str(out / "final"), str(tmp_path / "vllm.json")],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    got = json.loads((tmp_path / "vllm.json").read_text())
    ids = torch.tensor([got["ids"]])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out / "final").eval()(ids).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(got["logprobs"]), want, atol=1e-3)


def test_old_checkpoints_are_renamed_at_once_and_deleted_in_the_background(tmp_path):
    from rl.run import checkpoint

    root = tmp_path / "checkpoints"
    for n in (0, 1, 2):
        (root / f"rollout_{n}" / "model_optim").mkdir(parents=True)
    (root / ".rollout_3.tmp").mkdir()  # a killed save
    checkpoint.prune(root, keep_last=1)
    assert checkpoint.complete_checkpoints(tmp_path) == [root / "rollout_2"]  # at once, before any deletion ends
    checkpoint.wait_for_removals()
    assert sorted(p.name for p in root.iterdir()) == ["rollout_2"]


def test_a_resume_applies_this_runs_optimizer_settings():
    from rl.config import TrainConfig
    from rl.train.learner import apply_optimizer_config
    from rl.train.policy import build_optimizer

    model = torch.nn.Linear(2, 2)
    saved = TrainConfig(lr=1e-3, lr_warmup_steps=4, weight_decay=0.0)
    optimizer, scheduler = build_optimizer(model, saved)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    state = (optimizer.state_dict(), scheduler.state_dict())
    now = TrainConfig(lr=1e-4, lr_warmup_steps=4, weight_decay=0.1)
    optimizer, scheduler = build_optimizer(model, now)
    optimizer.load_state_dict(state[0])
    scheduler.load_state_dict(state[1])
    apply_optimizer_config(optimizer, scheduler, now, {"lr": 1e-3, "weight_decay": 0.0})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 3 / 4)  # step 2 of a 4-step warmup
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
