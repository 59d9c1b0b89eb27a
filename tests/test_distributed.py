"""Multi-rank tests over gloo, each a real torchrun launch."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:  # one rank per GPU (rl/parallel.py)
        pytest.skip(f"{nproc} ranks need {nproc} GPUs on a CUDA machine; {torch.cuda.device_count()} visible")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 1000), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def test_fsdp2_train_step_and_weight_sync(tmp_path):
    torchrun(2, "tests/dist_checks.py", str(tmp_path))
    results = [json.loads((tmp_path / f"results{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["gather_exact"] and r["gather_names"] == []
        assert r["rollout_vs_train_before"] < 1e-4
        assert r["rollout_vs_train_after"] < 1e-4
        assert r["changed"] > 1e-5 and r["grad_norm"] > 0
        assert r.get("offload_exact", not torch.cuda.is_available())  # reported by GPU runs only
        assert r["host_adamw_exact"] and r["host_adamw_loads_into"] and r["host_adamw_loads_from"]
    w0, w1 = (torch.load(tmp_path / f"weights{r}.pt") for r in range(2))
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[n], w1[n]) for n in w0)  # both ranks hold the same updated model


def run_loop(tmp_path: Path, nproc: int, *overrides: str) -> list[dict]:
    model_dir = save_tiny_model_dir(tmp_path / "model")
    data = write_arithmetic_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    torchrun(nproc, "-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"),
             f"--model.path={model_dir}", f"--data.source={data}", f"--log.output_dir={out}", *overrides)
    assert json.loads((out / "config.json").read_text())["train"]["global_batch_size"] > 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


REQUIRED = ["rollout_id", "rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
            "train/clip_frac", "perf/step_s", "perf/rollout_s", "perf/train_s", "perf/weight_sync_s",
            "weight_version", "rollout/logprob_k3_kl", "rollout/logprob_k3_kl_max"]


def test_main_loop_two_ranks(tmp_path):
    rows = run_loop(tmp_path, 2, "--train.num_rollout=3", "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows] == [2, 3, 4]
    for row in rows:
        assert all(key in row for key in REQUIRED), sorted(set(REQUIRED) - set(row))
        assert row["rollout/num_samples"] == 8 * 4
        assert row["train/grad_norm"] > 0
        # Each of the two engines ran its 16 sequences, up to 8 tokens each (the first one comes with the prefill).
        assert row["rollout/response_length_max"] - 1 <= row["rollout/decode_steps"] <= 8 - 1
        assert 1 <= row["rollout/decode_rows_mean"] <= 8 * 4 / 2


def test_the_seeds_layout_of_eight_ranks(tmp_path):
    """The seed's 8 ranks (gloo on CPU): FSDP over all eight, an engine on each, the rollout's groups split over the
    engines, each prompt's samples generated once, on one engine."""
    data = tmp_path / "distinct.jsonl"  # 64 different prompts, so that a prompt drawn twice shows
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}) + "\n"
                            for i in range(64)))
    rows = run_loop(tmp_path, 8, "--train.num_rollout=2", "--reward.user_fn=tests.reward_fns:digit_fraction",
                    "--log.sample_interval=1", "--rollout.temperature=1.5", f"--data.source={data}")
    assert [(r["rollout_id"], r["weight_version"]) for r in rows] == [(0, 2), (1, 3)]
    for row in rows:
        assert row["rollout/num_samples"] == 8 * 4 and row["train/grad_norm"] > 0
    for rollout in range(2):
        samples = [json.loads(line) for line in
                   (tmp_path / f"run/samples/rollout_{rollout}.jsonl").read_text().splitlines()]
        groups = {}
        for s in samples:
            groups.setdefault(s["group_index"], []).append(s)
        assert len(groups) == 8 and all(len(g) == 4 for g in groups.values())
        assert len({g[0]["prompt"] for g in groups.values()}) == 8  # 8 different prompts, none drawn twice
        # a group's samples are sampled, not copies of one
        assert all(len({s["response"] for s in g}) > 1 for g in groups.values())


def test_main_loop_compiled_blocks_train_as_eager_on_two_ranks(tmp_path):
    """model.compile under FSDP2 on two ranks (compiled block forwards, FSDP2's hooks eager around them): the
    same losses and grad norms as the eager loop over two rollouts, the second trained on the weights the
    compiled run's first update pushed into the engine; the compiled run counts the graphs it compiled."""
    args = ("--train.num_rollout=2", "--reward.user_fn=tests.reward_fns:digit_fraction")
    eager = run_loop(tmp_path / "eager", 2, *args)
    compiled = run_loop(tmp_path / "compiled", 2, *args, "--model.compile=true")
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert [r[key] for r in compiled] == pytest.approx([r[key] for r in eager], rel=1e-5, abs=1e-7), key
    # the compiled run's first train phase compiled the blocks, and says so (the health check's speed bands skip it)
    assert compiled[0]["perf/train_graphs_compiled"] > 0
    assert [r["perf/train_graphs_compiled"] for r in eager] == [0, 0]


def test_main_loop_steps_per_rollout_filter_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--train.num_steps_per_rollout=2",
                    "--rollout.sleep_level=1", "--rollout.dynamic_filter=nonzero_std",
                    "--rollout.over_sampling_batch_size=8", "--rollout.max_sampling_rounds=32",
                    "--reward.user_fn=tests.reward_fns:flat_on_multiples_of_4", "--log.wandb=true")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert row["rollout/num_samples"] == 8 * 4
        assert row["rollout/sampling_rounds"] >= 2  # 7 in 10 answers are multiples of 4: dropped
        assert row["rollout/filtered_group_frac"] > 0
        # every kept group has rewards that differ, except groups topped up when the rounds ran out
        assert row["rollout/zero_std_group_frac"] == row["rollout/topped_up_groups"] / 8
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_main_loop_kl_to_the_reference(tmp_path):
    """KL in the loss against the initial policy: the reference is built once, its KL is exactly 0 at the
    first update (same weights, same forward) and grows as the policy moves; TIS weights are logged."""
    rows = run_loop(tmp_path, 2, "--train.num_rollout=3", "--train.lr=1e-3", "--algo.kl_coef=0.1",
                    "--algo.kl_estimator=k3", "--algo.tis_cap=2.0", "--reward.user_fn=tests.reward_fns:digit_fraction")
    kl = [r["train/kl_ref"] for r in rows]
    assert kl[0] == 0.0 and 0 < kl[1] < kl[2], kl
    for row in rows:
        assert 0 < row["train/tis_weight_mean"] <= 2.0 and 0 <= row["train/tis_clip_frac"] < 0.5
        assert row["train/grad_norm"] > 0


def test_main_loop_kl_in_reward_rloo_gspo_two_steps(tmp_path):
    """The menu's other path through the loop: KL folded into the reward before the advantages (so the old
    logprobs come first), RLOO, GSPO over sequence means, an entropy bonus, two optimizer steps per rollout."""
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--train.num_steps_per_rollout=2", "--train.lr=1e-3",
                    "--algo.kl_coef=0.1", "--algo.kl_in_reward=true", "--algo.advantage_estimator=rloo",
                    "--algo.policy_loss=gspo", "--algo.eps_clip=0.01", "--algo.loss_agg=seq_mean_token_mean",
                    "--algo.entropy_coef=0.01", "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    assert rows[0]["train/kl_reward_penalty"] == 0.0  # the old policy is the reference at the first rollout
    assert rows[1]["train/kl_reward_penalty"] > 0 and rows[1]["train/kl_ref"] > 0
    for row in rows:
        assert row["train/grad_norm"] > 0


def test_main_loop_ppo_with_a_critic_resumes_it(tmp_path):
    """GAE with a value model: the zero-initialised head gives values 0 at the first rollout, the critic learns
    (its values move), and a resume restores it with the policy (the resumed rollout's values are not 0)."""
    args = ["--algo.advantage_estimator=gae", "--algo.lam=0.95", "--critic.lr=1e-3", "--checkpoint.interval=1",
            "--reward.user_fn=tests.reward_fns:digit_fraction"]
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", *args)
    assert rows[0]["critic/values_mean"] == 0.0 and rows[1]["critic/values_mean"] != 0.0
    for row in rows:
        assert row["critic/vf_loss"] > 0 and 0 <= row["critic/vf_clip_frac"] <= 1 and row["critic/grad_norm"] > 0
        assert row["train/grad_norm"] > 0
    rows = run_loop(tmp_path, 2, "--train.num_rollout=3", *args)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert rows[2]["critic/values_mean"] != 0.0  # a fresh critic would start at 0 again


def test_main_loop_four_ranks(tmp_path):
    """The whole loop on 4 gloo ranks: 4 engines, FSDP2 over 4, length-balanced DP split, micro-batches
    cut by tokens from prompts of uneven length, so ranks cut different counts and pad."""
    data = tmp_path / "uneven.jsonl"
    rows = [{"question": "x " * (i % 15) + f"What is {i % 10} + 1?", "answer": str(i % 10 + 1)} for i in range(64)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows = run_loop(tmp_path, 4, "--train.num_rollout=2", "--rollout.dynamic_filter=nonzero_std",
                    "--train.micro_batch_tokens=100", f"--data.source={data}",
                    "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    # Whether ranks cut different counts here depends on the sampled lengths; tests/test_loss_scale.py pads for sure.
    assert all(r["train/padding_micro_batches"] >= 0 for r in rows)
    for row in rows:
        assert row["rollout/num_samples"] == 8 * 4
        assert row["train/grad_norm"] > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_main_loop_batch_invariant(tmp_path, monkeypatch):
    """`model.batch_invariant` through the whole loop on 2 gloo ranks: the trainer's FSDP2 forward of
    the patched model scores the engine's tokens as the engine did (the Triton kernels run in
    float32 through Triton's interpreter here), and training and weight sync go on as usual."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--model.batch_invariant=true",
                    "--rollout.rollout_batch_size=4", "--rollout.n_samples_per_prompt=2",  # the interpreter is slow
                    "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] < 1e-5
        assert row["train/grad_norm"] > 0


def test_batch_invariant_on_cpu_needs_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AssertionError, match="model.batch_invariant runs the native engine's Triton kernels"):
        run_loop(tmp_path, 1, "--model.batch_invariant=true")


def test_main_loop_trls_batch_scale_masked_truncation_and_iterations(tmp_path):
    """TRL's scale_rewards="batch", mask_truncated_completions and num_iterations=2 through the loop: the trained
    tokens are among the responses that ended, counted once a pass."""
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--train.num_iterations=2", "--algo.mask_truncated=true",
                    "--algo.advantage_estimator=grpo_batch_std", "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        samples = row["rollout/num_samples"]
        masked = row["train/masked_truncated_samples"]
        assert masked == round(row["rollout/truncated_frac"] * samples) and 0 < masked < samples
        ended_tokens = row["rollout/response_length_mean"] * samples - 8 * masked  # max_new_tokens = 8
        assert 0 < row["train/tokens"] <= 2 * ended_tokens + 1e-6  # zero-advantage samples run no pass
        assert row["train/optimizer_steps"] == 2
        assert row["train/grad_norm"] > 0
