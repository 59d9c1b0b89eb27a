"""Loss-scale checks, started by tests/test_loss_scale.py as
`torchrun --nproc-per-node N tests/loss_scale_checks.py OUT` with N = 1 and N = 2.

One global batch, one optimizer step, two ways: on 1 rank as a single micro-batch, on 2 ranks as
length-balanced shares cut by a token budget, where one rank runs a zero-loss padding micro-batch.
Both write the step's loss and its gradients (as the optimizer receives them); the test requires
them equal. A second model, one bias vector, takes one PPO step whose new
weights the test works out by hand.
"""

import json
import math
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import AlgoConfig, TrainConfig  # noqa: E402
from rl.data import Sample  # noqa: E402
from rl.train.policy import build_optimizer, shard_policy  # noqa: E402
from rl.train.step import build_schedule, train_metrics, train_on_rollout  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

RESPONSE_LENGTHS = [40, 3, 3, 3, 38, 3, 3, 36]  # on 2 ranks with 45 tokens: [5, 5, 5] [42] | [5, 5] [38] [40]
TOKEN_BUDGET = 45


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def uneven_samples(vocab: int) -> list[Sample]:
    """Responses of very different lengths, rollout logprobs a little off the model's (about
    -log(vocab) at random init) so some ratios leave the clip range, and one untrained tail."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate(RESPONSE_LENGTHS):
        s = Sample(prompt="", tokens=torch.randint(3, vocab, (2,), generator=gen).tolist(), index=i, group_index=i // 4)
        tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
        logprobs = (-math.log(vocab) + 0.6 * (torch.rand(n, generator=gen) - 0.5)).tolist()
        trained = n - 2 if n > 30 else n  # e.g. tool output inside a response: no loss, but in the sequence
        s.append_response_tokens(tokens[:trained], logprobs[:trained])
        s.append_response_tokens(tokens[trained:], logprobs[trained:], trainable=False)
        s.advantage = [1.5, -0.5, 0.25, -1.0, -0.75, 1.0, 0.5, -2.0][i]
        samples.append(s)
    return samples


# The same step under each loss aggregation and with every extra term of the loss (entropy bonus, KL to a
# reference, truncated importance weights): each must divide by global counts, not by the micro-batch's.
VARIANTS = {
    "ppo_token_mean": AlgoConfig(eps_clip=0.2, eps_clip_high=0.2, use_rollout_logprobs=True),
    "gspo_seq_mean_token_mean": AlgoConfig(policy_loss="gspo", eps_clip=0.02, eps_clip_high=0.02,
                                           loss_agg="seq_mean_token_mean", use_rollout_logprobs=True),
    "cispo_sum_norm_entropy_kl_tis": AlgoConfig(policy_loss="cispo", eps_clip=0.2, eps_clip_high=0.2,
                                                loss_agg="seq_mean_token_sum_norm", loss_agg_norm=64.0,
                                                entropy_coef=0.01, kl_coef=0.1, kl_estimator="k3", tis_cap=1.2),
}


def step_two_ways(d, out: dict, name: str) -> None:
    model = shard_policy(tiny_model(seed=0), d.mesh, d.device, gradient_checkpointing=False)
    train_cfg = TrainConfig(global_batch_size=8, lr=1e-3, clip_grad=0.0,  # clipping would hide the scale
                            micro_batch_size=8, micro_batch_tokens=0 if d.world_size == 1 else TOKEN_BUDGET)
    algo = VARIANTS[name]
    optimizer, scheduler = build_optimizer(model, train_cfg)
    names = {p: n for n, p in model.named_parameters()}
    grads = {}
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.update(
        {names[p]: full(p.grad) for p in names if p.grad is not None}))
    schedule = build_schedule(uneven_samples(model.config.vocab_size), train_cfg, d.rank, d.world_size, d.device)
    for mb in schedule.micro_batches if algo.kl_coef else ():
        # a reference a little off the rollout policy (stands in for the reference model's logprobs)
        mb.ref_logprobs = torch.stack([row - 0.3 * torch.sin(torch.arange(len(row), dtype=row.dtype) + i)
                                       for i, row in zip(mb.indices, mb.rollout_logprobs)])
    stats = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=d.world_size, train=train_cfg, algo=algo,
                             temperature=1.0)
    per_rank = parallel.all_gather_objects([stats])
    out[name] = {"schedule": {"micro_batches": [len(s) for s in schedule.steps], "step_tokens": schedule.step_tokens,
                              "step_seqs": schedule.step_seqs, "padding": schedule.padding,
                              "rows": [mb.input_ids.shape[0] for mb in schedule.steps[0]]},
                 "metrics": train_metrics(per_rank, len(schedule.steps), algo), "grads": grads}


class BiasLM(torch.nn.Module):
    """The same logits at every position: log p(y) = b_y - logsumexp(b), a gradient to write by hand."""

    def __init__(self, vocab: int):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids: torch.Tensor, **_) -> CausalLMOutput:
        return CausalLMOutput(logits=self.bias.repeat(*input_ids.shape, 1))


def hand_samples() -> list[Sample]:
    """Two equal-length samples (one per rank on 2 ranks) whose tokens have ratios 1, 2, 2, 1/2."""
    ln = math.log
    a = Sample(prompt="", tokens=[0], index=0, group_index=0)
    a.append_response_tokens([1, 1], [-ln(4), -ln(8)])
    a.advantage = 1.0
    b = Sample(prompt="", tokens=[0], index=1, group_index=0)
    b.append_response_tokens([2, 3], [-ln(8), -ln(2)])
    b.advantage = -0.5
    return [a, b]


def ppo_step_by_hand(d, out: dict) -> None:
    model = fully_shard(BiasLM(4), mesh=d.mesh)
    train_cfg = TrainConfig(global_batch_size=2, micro_batch_size=1, clip_grad=0.0)  # 2 micro-batches on 1 rank
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # new weights = old - gradient
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule = build_schedule(hand_samples(), train_cfg, d.rank, d.world_size, d.device)
    stats = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=d.world_size, train=train_cfg,
                             algo=AlgoConfig(eps_clip=0.2, eps_clip_high=0.2, use_rollout_logprobs=True),
                             temperature=1.0)
    out["hand_metrics"] = train_metrics(parallel.all_gather_objects([stats]), len(schedule.steps))
    out["hand_bias"] = full(model.bias).tolist()


def main(out_dir: str) -> None:
    d = parallel.init_distributed()
    torch.manual_seed(0)
    out: dict = {}
    for name in VARIANTS:
        step_two_ways(d, out, name)
    ppo_step_by_hand(d, out)
    if d.is_main:
        torch.save({name: out[name].pop("grads") for name in VARIANTS}, Path(out_dir) / f"grads{d.world_size}.pt")
        (Path(out_dir) / f"results{d.world_size}.json").write_text(json.dumps(out))
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
