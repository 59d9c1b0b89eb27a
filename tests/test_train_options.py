"""The train phase's speed options give the same loss and gradients as the plain path, on the CPU in float32:
padded rows without an attention mask against each sample alone, and compiled decoder blocks against eager
ones, and FSDP2 parameters kept gathered across micro-batches against resharded after each pass. (The fused
log-prob kernels have their own test, tests/test_logprob_kernels.py.)"""

import copy
import functools
import random

import pytest
import torch
from torch.distributed.tensor import DTensor

from rl import parallel
from rl.config import AlgoConfig, TrainConfig
from rl.data import Sample
from rl.model.rope import unfuse_rope
from rl.train.algo import policy_loss
from rl.train.measure import graphs_compiled
from rl.train.policy import build_optimizer, compile_blocks, shard_policy
from rl.train.step import Schedule, collate, fill_old_logprobs, token_logprobs, train_on_rollout
from tests.tiny import tiny_model


def samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = Sample(prompt="", tokens=[rng.randrange(3, 256) for _ in range(rng.randint(3, 9))], index=i)
        k = rng.randint(2, 14)
        s.append_response_tokens([rng.randrange(3, 256) for _ in range(k)], [-5.5] * k)
        s.advantage = rng.uniform(-1, 1)
        out.append(s)
    return out


def loss_and_grads(model, batch: list[Sample], width: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A PPO loss summed over the batch's trained tokens (old logprobs fixed), and the gradients it leaves."""
    model.zero_grad(set_to_none=True)
    mb = collate(batch, next(model.parameters()).device, width=width)
    lp, entropy = token_logprobs(model, mb, 0.8)
    loss, _ = policy_loss("ppo", lp, mb.rollout_logprobs, mb.advantages, mb.loss_mask, 0.2, 0.28, 0.0)
    total = (loss * mb.loss_mask).sum() - 0.01 * (entropy * mb.loss_mask).sum()
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=rtol, atol=rtol * b[n].abs().max().item()) for n in b)


def test_padded_rows_without_attention_mask_match_each_sample_alone():
    """Right-padded rows run with no attention mask (flash attention on a GPU): each row's logprobs, the loss
    and the gradients equal those of every sample run alone, with no padding at all."""
    model = tiny_model(seed=1)
    batch = samples(5)
    mb = collate(batch, torch.device("cpu"))
    with torch.no_grad():
        lp, entropy = token_logprobs(model, mb, 0.8)
        for row, s in enumerate(batch):
            alone, h = token_logprobs(model, collate([s], torch.device("cpu")), 0.8)
            n = len(s.tokens) - 1
            assert torch.allclose(lp[row, :n], alone[0], atol=1e-5), s.index
            assert torch.allclose(entropy[row, :n], h[0], atol=1e-5), s.index
    loss, grads = loss_and_grads(model, batch)
    parts = [loss_and_grads(model, [s]) for s in batch]
    assert torch.allclose(loss, sum(p[0] for p in parts), rtol=1e-5)
    assert close(grads, {n: sum(p[1][n] for p in parts) for n in grads}, 1e-4)


def test_rounded_widths_give_the_same_loss_and_gradients():
    """Micro-batch widths rounded up (on CUDA, to repeat attention shapes) only add padding after every row."""
    model = tiny_model(seed=3)
    batch = samples(4, seed=3)
    exact = max(len(s.tokens) for s in batch)
    want_loss, want = loss_and_grads(model, batch)
    got_loss, got = loss_and_grads(model, batch, width=exact + 13)
    assert torch.allclose(got_loss, want_loss, rtol=1e-5)
    assert close(got, want, 1e-4)


def test_compiled_blocks_give_the_eager_loss_and_gradients():
    """model.compile: the same loss and gradients as eager over micro-batches of different shapes (a recompile
    with dynamic sizes after the first), every block compiled with its own weights."""
    eager = tiny_model(seed=2, layers=3)
    wants = [loss_and_grads(eager, batch) for batch in (samples(3, seed=1), samples(4, seed=2))]
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)  # RoPE as rl/model/rope.py's op from here, for every Qwen2 model of the process
    try:
        for batch, (want_loss, want) in zip((samples(3, seed=1), samples(4, seed=2)), wants):
            got_loss, got = loss_and_grads(compiled, batch)
            assert torch.allclose(got_loss, want_loss, rtol=1e-5)
            assert close(got, want, 1e-4)
    finally:
        unfuse_rope()


def test_compiled_blocks_keep_compiling_past_dynamos_default_limit(monkeypatch):
    """All of a process's models share one compiled forward: five MLP widths, each with and without grad,
    are ten variants, past Dynamo's default limit of 8 after which it runs new ones eager. Every one must
    compile. (Dynamo's eager backend: the variants and the limit are Dynamo's, Inductor is not needed.)"""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # the default, put back afterwards
    monkeypatch.setattr("rl.train.policy.torch.compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    ids = torch.randint(3, 256, (2, 8))
    compiled = []
    try:
        for width in (64, 72, 80, 88, 96):
            model = tiny_model(seed=0, layers=1, intermediate_size=width)
            compile_blocks(model)
            for grad in (True, False):
                counts: dict[str, float] = {}
                with torch.set_grad_enabled(grad), graphs_compiled(counts, "graphs"):
                    model(input_ids=ids, use_cache=False)
                compiled.append(counts["graphs"])
    finally:
        unfuse_rope()
        torch._dynamo.reset()
    assert compiled == [1] * 10


def two_steps(d, reshard: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Two optimizer steps of two micro-batches each on a tiny policy sharded over `d`'s mesh: their grad
    norms and the weights after (the second step ran on the first one's update)."""
    batch = samples(8, seed=3)
    model = shard_policy(tiny_model(seed=1), d.mesh, d.device, False, reshard_after_forward=reshard)
    train = TrainConfig(lr=1e-2, num_steps_per_rollout=2)
    optimizer, scheduler = build_optimizer(model, train)
    steps = [[collate(batch[i:i + 2], d.device) for i in (k, k + 2)] for k in (0, 4)]
    tokens = [sum(int(mb.loss_mask.sum()) for mb in step) for step in steps]
    seqs = [sum(int((mb.loss_mask.sum(-1) > 0).sum()) for mb in step) for step in steps]
    schedule = Schedule(steps, tokens, seqs, padding=0)
    fill_old_logprobs(model, schedule.micro_batches, 1.0)  # two steps: the old logprobs take a pass
    out = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=train,
                           algo=AlgoConfig(eps_clip_high=0.2), temperature=1.0)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return out["grad_norm"], {n: p.full_tensor().clone() for n, p in model.named_parameters()}


@pytest.fixture
def one_rank(monkeypatch):
    for key, value in dict(MASTER_PORT="29653", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    d = parallel.init_distributed()
    try:
        yield d
    finally:
        parallel.teardown()


def test_parameters_kept_gathered_across_micro_batches_give_the_same_steps(one_rank):
    """model.reshard_after_forward=false: FSDP2 keeps the gathered parameters from an optimizer step's first
    micro-batch to its last. Two steps of two micro-batches each give the grad norms and updated weights of
    resharding after every forward and backward (so the second step ran on the first one's update), and every
    parameter is back on its shard afterwards, where weight sync and checkpoints read it."""
    (norm_resharded, weights_resharded), (norm_gathered, weights_gathered) = (two_steps(one_rank, r)
                                                                              for r in (True, False))
    assert norm_gathered == pytest.approx(norm_resharded, rel=1e-5) and norm_gathered > 0
    assert close(weights_gathered, weights_resharded, 1e-5)


@pytest.mark.parametrize("reshard", [True, False])
def test_one_rank_reduces_a_steps_gradients_once(one_rank, monkeypatch, reshard):
    """On one rank an optimizer step's micro-batches accumulate their gradients unsharded and FSDP2 reduces
    them once, after the step's last backward (`reduce_once`): one reduction per FSDP2 module and step, not
    per micro-batch, and the same grad norms and updated weights as reducing after every micro-batch."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
    reductions = []
    real = group.foreach_reduce
    monkeypatch.setattr(group, "foreach_reduce", lambda *a, **k: reductions.append(1) or real(*a, **k))
    norm_once, weights_once = two_steps(one_rank, reshard)
    once = len(reductions)
    monkeypatch.setattr("rl.train.step.reduce_once", lambda model, dp_size: False)
    norm_each, weights_each = two_steps(one_rank, reshard)
    modules = 3  # the tiny policy's two decoder blocks and its root
    assert (once, len(reductions) - once) == (2 * modules, 2 * 2 * modules)
    assert norm_once == pytest.approx(norm_each, rel=1e-5) and norm_once > 0
    assert close(weights_once, weights_each, 1e-5)
