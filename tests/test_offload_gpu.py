"""The policy's pinned-host offload round trip on a CUDA device (skipped elsewhere: CPU runs never offload)."""

import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from rl import parallel
from rl.config import TrainConfig
from rl.train import PolicyOffloader, build_optimizer, shard_policy
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves state off a CUDA device")


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def train_step(model, optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=gen).cuda()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_snapshot(model, optimizer) -> list[torch.Tensor]:
    tensors = [local(p).detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [local(v).clone() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensors


def test_offload_round_trip_is_exact_and_frees_the_gpu():
    os.environ.setdefault("MASTER_PORT", "29531")
    d = parallel.init_distributed()
    models = [shard_policy(tiny_model(seed=0), d.mesh, d.device, gradient_checkpointing=False) for _ in range(2)]
    optims = [build_optimizer(m, TrainConfig(lr=1e-3))[0] for m in models]
    for m, o in zip(models, optims):
        train_step(m, o, seed=1)
    model, optimizer = models[0], optims[0]
    before = state_snapshot(model, optimizer)
    offloader = PolicyOffloader(model, optimizer)
    for _ in range(2):  # the second round reuses the pinned buffers of the first
        allocated = torch.cuda.memory_allocated()
        offloader.offload()
        freed = allocated - torch.cuda.memory_allocated()
        assert freed >= sum(t.numel() * t.element_size() for t in before)
        assert all(local(p).device.type == "cpu" and local(p).is_pinned() for p in model.parameters())
        buffers = {k: b.data_ptr() for k, b in offloader.host.items()}
        offloader.onload(d.device)
        assert all(local(p).device == d.device for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(state_snapshot(model, optimizer), before))
    assert {k: b.data_ptr() for k, b in offloader.host.items()} == buffers
    for m, o in zip(models, optims):  # training goes on exactly as if nothing had moved
        train_step(m, o, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(state_snapshot(models[0], optims[0]),
                                                  state_snapshot(models[1], optims[1])))
    parallel.teardown()
