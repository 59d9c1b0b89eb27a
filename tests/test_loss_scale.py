"""The loss scale of a train step: the same global batch gives the same loss and gradients however it
is split into ranks and micro-batches, and one PPO step lands where a hand computation says.

Each check is a real torchrun launch over gloo (tests/loss_scale_checks.py), once on 1 rank and once
on 2. A dropped data-parallel factor, a per-micro-batch token denominator or a padding micro-batch
that adds loss all change the gradient by a large factor; float32 rounding changes it by ~1e-6.
"""

import json

import pytest
import torch

from tests.test_distributed import torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_scale")
    for nproc in (1, 2):
        torchrun(nproc, "tests/loss_scale_checks.py", str(out))
    return {n: {**json.loads((out / f"results{n}.json").read_text()), "grads": torch.load(out / f"grads{n}.pt")}
            for n in (1, 2)}


@pytest.mark.parametrize("variant", ["ppo_token_mean", "gspo_seq_mean_token_mean", "cispo_sum_norm_entropy_kl_tis"])
def test_two_ranks_with_token_budget_and_padding_train_as_one_rank(runs, variant):
    one, two = runs[1][variant], runs[2][variant]
    assert one["schedule"] == {"micro_batches": [1], "step_tokens": [123], "step_seqs": [8], "padding": 0,
                               "rows": [8]}
    # rank 0 cuts [5, 5, 5] [42] and pads with a copy of its first micro-batch; rank 1 cuts [5, 5] [38] [40]
    assert two["schedule"] == {"micro_batches": [3], "step_tokens": [123], "step_seqs": [8], "padding": 1,
                               "rows": [3, 1, 3]}
    assert two["metrics"]["train/tokens"] == one["metrics"]["train/tokens"] == 123  # 6 untrained tokens left out
    keys = [k for k in one["metrics"] if k.startswith("train/")]
    assert {"train/kl_ref", "train/tis_weight_mean", "train/tis_clip_frac"} <= set(keys) or "kl" not in variant
    for key in keys:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    # both branches of the clip (or of the importance-weight cap) are in the gradient
    assert 0 < one["metrics"]["train/tis_clip_frac" if "tis" in variant else "train/clip_frac"] < 0.5
    grads_one, grads_two = runs[1]["grads"][variant], runs[2]["grads"][variant]
    assert grads_one.keys() == grads_two.keys() and len(grads_one) > 20
    for name, want in grads_one.items():
        err = float((grads_two[name] - want).abs().max() / want.abs().max())
        assert err < 1e-5, (name, err)


def test_ppo_step_by_hand(runs):
    """logits = b at every position, b = 0 over 4 tokens: log p(y) = -log 4 and d log p(y) / d b_i = 1[i = y] - 1/4.

    sample a: prompt [0], response [1, 1], A = +1; sample b: prompt [0], response [2, 3], A = -0.5. The rollout
    logprobs make the ratios 1, 2, 2, 1/2; eps_clip 0.2; N = 4 loss tokens in the global batch.
      token  y  A     ratio  loss = max(-r A, -clip(r) A)      d loss / d log p
      1      1  +1    1      -1                                 -1
      2      1  +1    2      max(-2, -1.2) = -1.2  clipped      0
      3      2  -0.5  2      max(1, 0.6) = 1                    -r A = 1
      4      3  -0.5  1/2    max(0.25, 0.4) = 0.4  clipped      0
    loss = (-1 - 1.2 + 1 + 0.4) / 4 = -0.2, clip_frac = 2/4. The weights on d log p sum to 0, so the -1/4
    terms cancel: grad b = [0, -1, 1, 0] / 4, |grad| = sqrt(2) / 4, and one SGD step at lr 1 gives
    b = [0, 0.25, -0.25, 0]. On 1 rank the two samples are two micro-batches, on 2 ranks one each."""
    for run in runs.values():
        assert run["hand_bias"] == pytest.approx([0.0, 0.25, -0.25, 0.0], abs=1e-6)
        m = run["hand_metrics"]
        assert m["train/loss"] == pytest.approx(-0.2, abs=1e-6)
        assert m["train/clip_frac"] == 0.5 and m["train/tokens"] == 4
        assert m["train/grad_norm"] == pytest.approx(2 ** 0.5 / 4, abs=1e-6)
