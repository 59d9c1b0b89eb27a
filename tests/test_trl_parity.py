"""Where README says "TRL's", the numbers are TRL's: its CISPO loss, its advantages for a response that every reward
function passes on, and its documented reward-function conventions (async functions, `trainer_state`, `log_metric`,
`log_extra`, factories) run through the reward pool as a run runs them. TRL's formulas are written out here by hand
(TRL itself is not a dependency)."""

import dataclasses
import logging
import math

import pytest
import torch

from rl.config import ConfigError, RewardConfig, TrainConfig, config_from_dict
from rl.env.reward import RewardPool, metrics
from rl.train.algo import advantages, aggregate, policy_loss

# ---------------------------------------------------------------------------- CISPO


def trl_cispo_loss(logprobs, old_logprobs, adv, mask, epsilon_high):
    """TRL's CISPO (loss_type="cispo"): the ratio capped at epsilon_high itself (no lower bound), detached, times
    -A log p, summed over the batch's tokens and divided by their number."""
    weight = torch.exp(logprobs - old_logprobs).clamp(max=epsilon_high).detach()
    return ((-weight * adv * logprobs) * mask).sum() / mask.sum()


def rl_cispo_loss(logprobs, old_logprobs, adv, mask, eps_clip_high):
    per_token, _ = policy_loss("cispo", logprobs, old_logprobs, adv, mask, eps_clip=1.0, eps_clip_high=eps_clip_high)
    return aggregate(per_token, mask, "token_mean", float(mask.sum()), 1.0, 1.0)


def test_cispo_maps_epsilon_high_to_eps_clip_high_plus_one():
    # Ratios e^0.5 = 1.649, 1 and e^-0.5 = 0.607, advantage 1.
    logprobs = torch.tensor([[-0.5, -1.0, -2.0]])
    old = torch.tensor([[-1.0, -1.0, -1.5]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    # TRL with epsilon_high = 1.3: weights 1.3, 1, 0.607 -> (1.3 * 0.5 + 1 * 1 + 0.607 * 2) / 3
    by_hand = (1.3 * 0.5 + 1.0 + math.exp(-0.5) * 2.0) / 3
    assert by_hand == pytest.approx(0.95436, abs=1e-5)
    assert trl_cispo_loss(logprobs, old, adv, mask, 1.3).item() == pytest.approx(by_hand, rel=1e-6)
    # README's mapping: eps_clip_high = epsilon_high - 1.
    assert rl_cispo_loss(logprobs, old, adv, mask, 0.3).item() == pytest.approx(by_hand, rel=1e-6)
    # The off-by-one mapping (eps_clip_high = epsilon_high) caps at 2.3 and keeps the 1.649: another loss.
    assert rl_cispo_loss(logprobs, old, adv, mask, 1.3).item() == pytest.approx((math.exp(0.5) * 0.5 + 1 + math.exp(
        -0.5) * 2) / 3, rel=1e-6)
    # The gradient is the same too: every token keeps it, weighted by the capped ratio.
    for loss in (trl_cispo_loss, rl_cispo_loss):
        lp = logprobs.clone().requires_grad_()
        loss(lp, old, adv, mask, 1.3 if loss is trl_cispo_loss else 0.3).backward()
        assert lp.grad.tolist()[0] == pytest.approx([-1.3 / 3, -1 / 3, -math.exp(-0.5) / 3], rel=1e-6)


def test_readme_maps_cispo_epsilon_high_minus_one():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs/algorithms.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith('| `loss_type="cispo"`'))
    assert "`epsilon_high` - 1" in row, row


# ---------------------------------------------------------------------------- None: every function passed


NAN = math.nan


def test_a_response_every_function_passes_on_is_left_out_of_its_group_as_trl_leaves_it():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0, 2.0, 2.0, NAN, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # TRL, group [1, None, 0, 0]: mean over the three scored 1/3, unbiased std sqrt(1/3) = 0.577;
    # (1 - 1/3) / 0.577 = 1.155, (0 - 1/3) / 0.577 = -0.577, and 0 for the unscored one.
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    grpo = advantages("grpo", rewards, groups)
    assert grpo[:4].tolist() == pytest.approx([(2 / 3) / std, 0.0, -(1 / 3) / std, -(1 / 3) / std], abs=1e-5)
    assert grpo[:4].tolist() == pytest.approx([1.155, 0.0, -0.577, -0.577], abs=1e-3)
    # group [2, 2, None, 0]: mean 4/3, std sqrt(4/3) = 1.155
    std = math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2)
    assert grpo[4:].tolist() == pytest.approx([(2 / 3) / std, (2 / 3) / std, 0.0, -(4 / 3) / std], abs=1e-5)
    # Without the std (TRL's scale_rewards="none"): centred on the scored mean.
    assert advantages("dr_grpo", rewards, groups).tolist() == pytest.approx(
        [2 / 3, 0.0, -1 / 3, -1 / 3, 2 / 3, 2 / 3, 0.0, -4 / 3], abs=1e-6)
    # RLOO: the mean of the other scored ones, G / (G - 1) x centred with G = 3 scored.
    assert advantages("rloo", rewards, groups).tolist() == pytest.approx(
        [1.0, 0.0, -0.5, -0.5, 1.0, 1.0, 0.0, -2.0], abs=1e-6)


def test_unscored_responses_are_left_out_of_the_batch_whitening():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    # REINFORCE++: the three scored rewards whitened alone: mean 1/3, unbiased var 1/3.
    rpp = advantages("reinforce_plus_plus", rewards, groups)
    assert rpp.tolist() == pytest.approx([(2 / 3) / math.sqrt(1 / 3), 0.0, -(1 / 3) / math.sqrt(1 / 3),
                                          -(1 / 3) / math.sqrt(1 / 3)], abs=1e-5)
    # With the group baseline: group 0 has one scored reward (centred to 0), group 1 two zeros: all 0.
    assert advantages("reinforce_plus_plus_baseline", rewards, groups).tolist() == [0.0, 0.0, 0.0, 0.0]
    # A group every function passed on has no signal at all.
    assert advantages("grpo", torch.tensor([NAN, NAN, 1.0, 0.0]), groups)[:2].tolist() == [0.0, 0.0]


def test_gae_counts_an_unscored_response_as_reward_zero():
    from rl.train.algo import gae

    mask = torch.ones(1, 2)
    nan_adv, nan_ret = gae(torch.tensor([[0.0, NAN]]), torch.tensor([[0.5, 0.25]]), mask, 1.0, 1.0)
    zero_adv, zero_ret = gae(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 0.25]]), mask, 1.0, 1.0)
    assert nan_adv.tolist() == zero_adv.tolist() == [[-0.5, -0.25]] and nan_ret.tolist() == zero_ret.tolist()


def test_rollout_metrics_and_the_dynamic_filter_leave_unscored_responses_out():
    from rl.data import Sample
    from rl.rollout.collect import keep_group, rollout_metrics

    def group(*rewards):
        return [Sample("p", [0, 1], reward=r, response_length=1) for r in rewards]

    assert not keep_group(group(1.0, NAN, NAN, 1.0), "nonzero_std")  # one distinct scored reward: no signal
    assert keep_group(group(1.0, NAN, 0.0, 0.0), "nonzero_std")
    stats = rollout_metrics(group(1.0, NAN, 0.0, 0.0) + group(NAN, NAN, NAN, NAN), 4)
    assert stats["rollout/reward_mean"] == pytest.approx(1 / 3) and stats["rollout/zero_std_group_frac"] == 0.5


# ---------------------------------------------------------------------------- TRL's reward-function examples


def chat_inputs(groups):
    """RewardInputs of chat-format rows, one group per (row, responses): ids one per character."""
    from tests.test_reward_functions import inputs_of

    out = []
    for g, (row, responses) in enumerate(groups):
        out += [dataclasses.replace(inp, group=g) for inp in inputs_of([row], len(responses), responses, chat=True)]
    return out


FUNCTIONS = ["longer_is_better", "think_then_answer", "boxed_matches_solution", "math_task", "code_task",
             "async_judge", "async_checker", "curriculum", "logs_what_it_sees",
             "get_overlong_penalty(max_completion_len=10, soft_punish_cache=4)"]


def test_trls_documented_reward_functions_run_unchanged_through_the_reward_pool():
    cfg = RewardConfig(functions=[f"tests.trl_rewards:{name}" for name in FUNCTIONS],
                       function_weights=[0.1, 1.0, 2.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0], num_workers=2)
    thought = "<think>x</think><answer>\\boxed{4}</answer>"
    assert len(thought) == 42
    inputs = chat_inputs([({"prompt": "2 + 2?", "task": "math", "solution": "4"}, [thought, "\\boxed{5}"]),
                          ({"prompt": "Write code", "task": "code", "solution": "-"}, ["```x```", "text"])])
    with RewardPool(cfg, train=TrainConfig(num_rollout=4, num_steps_per_rollout=2)) as pool:
        pool.begin_rollout(rollout_id=1, epoch=0.5)  # 2 optimizer steps taken of 8
        result = pool.score(inputs)
    assert (result.num_errors, result.num_timeouts, result.num_unscored) == (0, 0, 0)
    terms = result.terms
    assert terms["longer_is_better"] == [42.0, 9.0, 7.0, 4.0]
    assert terms["think_then_answer"] == [1.0, 0.0, 0.0, 0.0]
    assert terms["boxed_matches_solution"] == [1.0, 0.0, 0.0, 0.0]
    assert terms["math_task"] == [1.0, 0.0, None, None] and terms["code_task"] == [None, None, 1.0, 0.0]
    # The two async functions of a call ran together: each saw the other start before it finished.
    assert terms["async_judge"] == terms["async_checker"] == [1.0] * 4
    assert terms["curriculum"] == [0.25 * 42, 0.25 * 9, 0.25 * 7, 0.25 * 4]  # global_step 2 / max_steps 8
    assert terms["logs_what_it_sees"] == [None] * 4
    # The factory's function: 0 up to 6 tokens, then (6 - n) / 4, and -1 past 10.
    assert terms["get_overlong_penalty"] == [-1.0, -0.75, -0.25, 0.0]
    assert result.rewards == pytest.approx([4.2 + 1 + 2 + 1 + 1 + 10.5 - 1, 0.9 + 1 + 2.25 - 0.75,
                                            0.7 + 1 + 1 + 1.75 - 0.25, 0.4 + 1 + 1.0])
    # log_metric: each call's values, averaged over the step's calls (one per prompt group); log_extra: per input.
    assert result.logged == {"global_step": [2.0, 2.0], "epoch": [0.5, 0.5], "mean_length": [25.5, 5.5]}
    stats = metrics(result)
    assert (stats["reward/logged/global_step"], stats["reward/logged/epoch"]) == (2.0, 0.5)
    assert stats["reward/logged/mean_length"] == 15.5
    assert result.extra == [{"length": n, "half": n / 2, "shape": f"{{{n}}}"} for n in (42, 9, 7, 4)]


def test_a_response_every_function_passes_on_gets_trls_advantage_through_the_pool():
    cfg = RewardConfig(functions=["tests.trl_rewards:digits_unless_empty"], num_workers=1)
    with RewardPool(cfg) as pool:
        result = pool.score(chat_inputs([({"prompt": "p"}, ["7", "", "a", "b"])]))
    assert result.num_unscored == 1 and math.isnan(result.rewards[1])
    adv = advantages("grpo", torch.tensor(result.rewards), torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == pytest.approx([1.155, 0.0, -0.577, -0.577], abs=1e-3)


def test_a_failing_async_function_and_a_misused_helper_cost_their_group_naming_the_function(caplog):
    cfg = RewardConfig(functions=["tests.trl_rewards:async_judge", "tests.trl_rewards:bad_helper_use"], num_workers=1)
    with RewardPool(cfg) as pool, caplog.at_level(logging.WARNING, logger="rl.env.reward"):
        result = pool.score(chat_inputs([({"prompt": "p", "kind": "metric"}, ["a", "b"]),
                                         ({"prompt": "q", "kind": "extra"}, ["c", "d"]),
                                         ({"prompt": "r", "kind": "raise"}, ["e", "f"])]))
    assert result.num_errors == 6 and result.rewards == [0.0] * 6
    log = caplog.text
    assert "log_metric(name, value) takes a name and a finite number, got 'm', 'high'" in log
    assert "log_extra(column, values) takes a name and one value per completion (2), got 'c' and [1]" in log
    assert "ValueError: async failure (in reward.functions tests.trl_rewards:bad_helper_use)" in log


@pytest.mark.parametrize("entry, error", [
    ("m:f(1)", "reward.functions entry 'm:f(1)': a factory call takes keyword arguments only"),
    ("m:f(a=b)", "reward.functions entry 'm:f(a=b)': a factory's arguments must be literals"),
    ("m:f(a=1", "reward.functions entry 'm:f(a=1': its arguments do not parse"),
    ("m:f(a=1) + 1", "a factory call takes keyword arguments only"),
    ("m.f(a=1)", "reward.functions must name 'pkg.module:function', got 'm.f(a=1)' (or a factory call"),
])
def test_a_bad_factory_entry_is_one_line(entry, error):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl"}, "reward": {"functions": [entry]}})
    assert error in str(info.value) and "\n" not in str(info.value)


def test_a_factory_that_raises_or_returns_no_function_fails_at_start_up_naming_the_entry():
    with pytest.raises(ConfigError, match=r"^reward.functions='tests.trl_rewards:get_overlong_penalty\(size=3\)': the "
                                          r"factory raised TypeError: .*unexpected keyword argument 'size'$"):
        RewardPool(RewardConfig(functions=["tests.trl_rewards:get_overlong_penalty(size=3)"]))
    with pytest.raises(ConfigError, match=r"the factory returned list \[\], not a function"):  # a plain function
        RewardPool(RewardConfig(functions=["tests.trl_rewards:think_then_answer(completions=[])"]))


def test_the_answer_column_is_optional_where_reward_functions_score():
    def data(reward, **keys):
        return config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl", **keys},
                                 "reward": reward}).data

    assert data({"functions": ["tests.trl_rewards:reward"]}).answer_key == ""  # TRL's rows hold `solution`
    assert data({"group_fn": "tests.reward_fns:longest_in_group"}).answer_key == ""
    assert data({"functions": ["tests.trl_rewards:reward"]}, answer_key="answer").answer_key == "answer"  # given
    assert data({}).answer_key == "answer"  # the default math reward checks it
    assert data({"user_fn": "tests.reward_fns:digit_fraction"}).answer_key == "answer"  # label= is the answer


# ---------------------------------------------------------------------------- a run


def test_a_trl_dataset_without_answers_trains_on_trl_functions_and_logs_what_they_log(tmp_path):
    """A run as a TRL user writes it: rows of chat prompts and a `solution` column (no `answer`), a config that names
    no answer column, functions that are async, read `trainer_state`, log with `log_metric` / `log_extra`, and a
    factory call; what they log reaches metrics.jsonl (the row wandb is given too) and the sample dumps."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_faults import ENV, ROOT, strict_rows
    from tests.tiny import save_tiny_model_dir

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": str(i + 1), "task": "math"}
            for i in range(16)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = """[reward]
num_workers = 1
functions = ["tests.trl_rewards:math_task", "tests.trl_rewards:async_judge", "tests.trl_rewards:async_checker",
             "tests.trl_rewards:logs_what_it_sees",
             "tests.trl_rewards:get_overlong_penalty(max_completion_len = 8, soft_punish_cache = 4)"]
function_weights = [1.0, 0.5, 0.5, 1.0, 0.1]
"""
    config = (ROOT / "configs/tiny.toml").read_text().replace('prompt_key = "question"\nanswer_key = "answer"\n',
                                                              'prompt_key = "prompt"\n')
    config = config.replace("[reward]\nnum_workers = 1\n", reward)
    assert "answer_key" not in config and "get_overlong_penalty" in config
    (tmp_path / "run.toml").write_text(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
           str(29500 + os.getpid() % 1000), "-m", "rl.main", "--config", str(tmp_path / "run.toml"),
           f"--model.path={save_tiny_model_dir(tmp_path / 'model')}", f"--data.source={data}",
           f"--log.output_dir={tmp_path / 'run'}", "--log.sample_interval=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = strict_rows(tmp_path / "run")
    assert [r["reward/num_errors"] for r in rows] == [0, 0] and all(r["reward/async_judge_mean"] == 1.0 for r in rows)
    assert [r["reward/logged/global_step"] for r in rows] == [0.0, 1.0]  # one optimizer step per rollout
    assert rows[0]["reward/logged/epoch"] == 0.0 and rows[1]["reward/logged/epoch"] == 0.5  # 8 of 16 prompts
    assert all(0 <= r["reward/logged/mean_length"] for r in rows) and "reward/get_overlong_penalty_mean" in rows[0]
    samples = [json.loads(line) for line in (tmp_path / "run/samples/rollout_1.jsonl").read_text().splitlines()]
    assert len(samples) == 32 and all(s["logged"]["length"] == len(s["response"]) for s in samples)
    assert all(s["label"] is None for s in samples)  # no answer column: no label


# ---------------------------------------------------------------------------- the TRL table, numerically


def rl_config(**sections):
    """The resolved rl config of a run that sets `sections` (as the TRL table's rows say), on `world` ranks."""
    from rl.config import resolve

    world = sections.pop("world", None)
    return resolve(config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl"}, **sections}), world)


def rl_step_loss(algo, logprobs, old, adv, mask, rollout=None, ref=None, entropy=None):
    """rl's loss of a one-micro-batch step (rl.train.step.micro_batch_loss), adv (B, 1) broadcast to the tokens."""
    from collections import defaultdict

    from rl.train.step import MicroBatch, micro_batch_loss

    mb = MicroBatch(torch.zeros_like(mask), mask, adv.expand_as(mask), old if rollout is None else rollout, [])
    entropy = torch.zeros_like(mask) if entropy is None else entropy
    sums = defaultdict(lambda: torch.zeros(()))
    return micro_batch_loss(sums, mb, logprobs, entropy, old, ref, algo, float(mask.sum()),
                            float((mask.sum(-1) > 0).sum()))


def trl_grpo_loss(logprobs, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=None, delta=None,
                  level="token", beta=0.0, ref=None, is_ratio=None, max_completion_length=None, entropy=None,
                  entropy_coef=0.0):
    """TRL's GRPO loss, one process and one accumulation step (use_bias_correction_kl=False): the ratio (per
    token, or the exp of the sequence's mean log-ratio), clipped to [1 - epsilon, 1 + epsilon_high], the unclipped
    one capped at delta when set; times the vLLM importance ratio; plus beta x k3; aggregated by loss_type; minus
    entropy_coef x the mean token entropy."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logprobs - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = coef_1.clamp(1 - epsilon, 1 + epsilon_high)
    if delta is not None:
        coef_1 = coef_1.clamp(max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logprobs) - (ref - logprobs) - 1)
    if loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum()
    elif loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:  # dr_grpo
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    if entropy_coef:
        loss = loss - entropy_coef * (entropy * mask).sum() / mask.sum()
    return loss


# Two responses, the second one token shorter: ratios e^1 = 2.718, e^-0.5 = 0.607, 1 | e^0.1 = 1.105, e^-1 = 0.368.
LOGPROBS = torch.tensor([[-1.0, -2.0, -1.0], [-0.9, -2.0, -5.0]])
OLD = torch.tensor([[-2.0, -1.5, -1.0], [-1.0, -1.0, -5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize("trl, rl", [
    (dict(epsilon=0.2, epsilon_high=0.28), dict(eps_clip=0.2, eps_clip_high=0.28)),
    (dict(delta=1.5), dict(eps_clip_c=1.5)),
    (dict(loss_type="grpo"), dict(loss_agg="seq_mean_token_mean")),
    (dict(loss_type="dr_grpo", max_completion_length=8), dict(loss_agg="seq_mean_token_sum_norm")),
    (dict(level="sequence"), dict(policy_loss="gspo")),
    (dict(level="sequence", loss_type="grpo"), dict(policy_loss="gspo", loss_agg="seq_mean_token_mean")),
], ids=["epsilon_high", "delta", "grpo", "dr_grpo", "sequence", "sequence_grpo"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["A>0", "A<0"])
def test_trl_loss_settings_give_rls_loss_and_gradient_under_the_documented_keys(trl, rl, sign):
    adv = sign * torch.tensor([[1.0], [-0.5]])
    # dr_grpo's constant: rl's loss_agg_norm defaults to rollout.max_new_tokens, TRL's max_completion_length.
    algo = rl_config(rollout={"max_new_tokens": 8}, algo=rl).algo
    grads = []
    for loss_of in (lambda lp: trl_grpo_loss(lp, OLD, adv, MASK, **trl), lambda lp: rl_step_loss(algo, lp, OLD, adv,
                                                                                                  MASK)):
        lp = LOGPROBS.clone().requires_grad_()
        loss = loss_of(lp)
        loss.backward()
        grads.append((loss.item(), lp.grad * MASK))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_trl_delta_caps_a_negative_advantage_token_as_eps_clip_c_does():
    # One token, ratio e = 2.718, A = -1: PPO's clipped loss alone is e (the unclipped branch is larger); TRL's
    # delta = 1.5 caps it at 1.5 with no gradient, and so does rl's dual clip at eps_clip_c = 1.5.
    lp, old, adv, mask = torch.tensor([[0.0]]), torch.tensor([[-1.0]]), -torch.ones(1, 1), torch.ones(1, 1)
    assert trl_grpo_loss(lp, old, adv, mask, delta=1.5).item() == pytest.approx(1.5)
    assert rl_step_loss(rl_config(algo={"eps_clip_c": 1.5}).algo, lp, old, adv, mask).item() == pytest.approx(1.5)
    assert rl_step_loss(rl_config().algo, lp, old, adv, mask).item() == pytest.approx(math.e)


def test_trl_beta_and_entropy_coef_are_kl_coef_with_k3_and_entropy_coef():
    # Token 3 of response 1: log ref - log p = 3, so k3 = e^3 - 3 - 1 = 16.09, past low_var_kl's clamp at 10.
    ref = LOGPROBS + torch.tensor([[0.1, -0.2, 3.0], [0.0, 0.5, 0.0]])
    adv, entropy = torch.tensor([[1.0], [-0.5]]), torch.tensor([[1.0, 2.0, 0.5], [0.25, 3.0, 9.0]])
    trl = trl_grpo_loss(LOGPROBS, OLD, adv, MASK, beta=0.04, ref=ref, entropy=entropy, entropy_coef=0.01)
    algo = rl_config(algo={"kl_coef": 0.04, "kl_estimator": "k3", "entropy_coef": 0.01}).algo
    assert rl_step_loss(algo, LOGPROBS, OLD, adv, MASK, ref=ref, entropy=entropy).item() == pytest.approx(trl.item())
    # The KL part by hand: (k3 of 0.1, -0.2, 3 and 0, 0.5) / 5 tokens.
    k3 = [math.exp(d) - d - 1 for d in (0.1, -0.2, 3.0, 0.0, 0.5)]
    no_kl = rl_step_loss(dataclasses.replace(algo, kl_coef=0.0), LOGPROBS, OLD, adv, MASK, entropy=entropy)
    assert trl.item() - no_kl.item() == pytest.approx(0.04 * sum(k3) / 5, rel=1e-5)
    # rl's default estimator (low_var_kl) clamps the 16.09 to 10: the reason the table names k3.
    default = dataclasses.replace(algo, kl_estimator="low_var_kl")
    assert rl_step_loss(default, LOGPROBS, OLD, adv, MASK, ref=ref, entropy=entropy).item() == pytest.approx(
        trl.item() - 0.04 * (k3[2] - 10) / 5, rel=1e-5)


def trl_vllm_is_ratio(old, sampling, mask, mode, clip_max):
    """TRL's vllm_importance_sampling_mode with clip_min unset: exp(old - sampling) per token, or of its sum over
    the sequence (*sequence_*); *_truncate caps it at clip_max, *_mask zeroes it above clip_max."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    return ratio.clamp(max=clip_max) if mode.endswith("truncate") else ratio.masked_fill(ratio > clip_max, 0.0)


@pytest.mark.parametrize("mode, level, rl_mode", [("token_truncate", "token", "truncate"),
                                                  ("token_mask", "token", "mask"),
                                                  ("sequence_truncate", "sequence", "truncate"),
                                                  ("sequence_mask", "sequence", "mask")])
def test_trl_vllm_importance_sampling_modes_are_tis_level_and_tis_mode(mode, level, rl_mode):
    # The engine's logprobs: response 1's per-token ratios e^1.2 = 3.32, 1, e^-0.2 (sequence: e^1 = 2.72 < 3);
    # response 2's e^0.5, e^0.7 (sequence: e^1.2 = 3.32 > 3).
    engine = OLD - torch.tensor([[1.2, 0.0, -0.2], [0.5, 0.7, 0.0]])
    adv = torch.tensor([[1.0], [-0.5]])
    algo = rl_config(algo={"tis_cap": 3.0, "tis_level": level, "tis_mode": rl_mode}).algo
    trl = trl_grpo_loss(LOGPROBS, OLD, adv, MASK, is_ratio=trl_vllm_is_ratio(OLD, engine, MASK, mode, 3.0))
    assert rl_step_loss(algo, LOGPROBS, OLD, adv, MASK, rollout=engine).item() == pytest.approx(trl.item(), rel=1e-6)
    if mode == "sequence_mask":  # TRL's default: response 2 (ratio 3.32 > 3) leaves the loss
        assert trl.item() == pytest.approx(trl_grpo_loss(LOGPROBS, OLD, adv, MASK * torch.tensor([[1.0], [0.0]]))
                                           .item() * 3 / 5 * math.e, rel=1e-6)


@pytest.mark.parametrize("per_device, world, accumulation, generations, steps_per_generation", [
    (4, 2, 4, 8, None), (4, 2, 2, 8, 8), (8, 1, 1, 4, 4)])
def test_trl_batch_sizes_are_rls_prompts_samples_and_steps(per_device, world, accumulation, generations,
                                                          steps_per_generation):
    # TRL counts completions: an optimizer step takes per_device x world x accumulation of them, and one generation
    # makes per_device x world x steps_per_generation (default: accumulation) = that / num_generations prompts.
    steps_per_generation = steps_per_generation or accumulation
    generated = per_device * world * steps_per_generation
    cfg = rl_config(world=world, rollout={"rollout_batch_size": generated // generations,
                                          "n_samples_per_prompt": generations},
                    train={"num_steps_per_rollout": steps_per_generation // accumulation,
                           "micro_batch_size": per_device})
    assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt == generated
    assert cfg.train.global_batch_size == per_device * world * accumulation
    assert cfg.train.global_batch_size // world // cfg.train.micro_batch_size == accumulation


def test_trl_warmup_is_rls_lr_warmup_steps_one_step_earlier():
    # transformers' constant_with_warmup: lr x step / W before step W (0 at the first step), then lr.
    from rl.config import TrainConfig
    from rl.train.policy import build_optimizer

    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), TrainConfig(lr=1e-3, lr_warmup_steps=4), fused=False)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    hf = [1e-3 * min(step / 4, 1.0) for step in range(7)]
    assert lrs == pytest.approx(hf[1:]) and lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
