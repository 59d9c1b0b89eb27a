"""The policy's pinned-host offload: buffer carving everywhere, the round trip on a CUDA device (CPU runs
never offload)."""

import os

import pytest
import torch

from rl import parallel
from rl.config import TrainConfig
from rl.train.host_adamw import PinnedArena
from rl.train.policy import HostOffloader, build_optimizer, shard_policy
from tests.tiny import local_tensor, tiny_model, training_state

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves state off a CUDA device")


class UnpinnedArena(PinnedArena):
    BLOCK_BYTES = 4096

    @staticmethod
    def new_block(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)  # pinning needs a CUDA driver


def test_host_buffers_are_disjoint_aligned_views_of_few_arenas():
    arena = UnpinnedArena()
    tensors = [torch.randn(3, 5), torch.randn(100, 7), torch.randn(2000), torch.randn(1).double(),
               torch.randn(10, 10).bfloat16(), torch.randn(3)]
    buffers = [arena.take(t.shape, t.dtype) for t in tensors]
    for buf, t in zip(buffers, tensors):
        buf.copy_(t)
    assert all(torch.equal(buf, t) for buf, t in zip(buffers, tensors))  # no buffer overwrote another
    arenas = {buf.untyped_storage().data_ptr() for buf in buffers}
    assert len(arenas) == 3  # 4 KiB, then an 8 KiB arena for the 8000-byte tensor, then a fresh one
    assert all((buf.data_ptr() - buf.untyped_storage().data_ptr()) % 512 == 0 for buf in buffers)


def train_step(model, optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=gen).cuda()
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@needs_cuda
def test_offload_round_trip_is_exact_and_frees_the_gpu():
    os.environ.setdefault("MASTER_PORT", "29531")
    d = parallel.init_distributed()
    models = [shard_policy(tiny_model(seed=0), d.mesh, d.device, gradient_checkpointing=False) for _ in range(2)]
    optims = [build_optimizer(m, TrainConfig(lr=1e-3))[0] for m in models]
    for m, o in zip(models, optims):
        train_step(m, o, seed=1)
    model, optimizer = models[0], optims[0]
    before = training_state(model, optimizer)
    offloader = HostOffloader(model, optimizer)
    for _ in range(2):  # the second round reuses the pinned buffers of the first
        allocated = torch.cuda.memory_allocated()
        offloader.offload()
        freed = allocated - torch.cuda.memory_allocated()
        assert freed >= sum(t.numel() * t.element_size() for t in before)
        assert all(local_tensor(p).device.type == "cpu" and local_tensor(p).is_pinned() for p in model.parameters())
        buffers = {k: b.data_ptr() for k, b in offloader.host.items()}
        offloader.onload(d.device)
        assert all(local_tensor(p).device == d.device for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(training_state(model, optimizer), before))
    assert {k: b.data_ptr() for k, b in offloader.host.items()} == buffers
    assert len(offloader.arena.blocks) == 1  # what the first offload moves, reserved in one block
    for m, o in zip(models, optims):  # training goes on exactly as if nothing had moved
        train_step(m, o, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(training_state(models[0], optims[0]),
                                                  training_state(models[1], optims[1])))
    parallel.teardown()


@needs_cuda
def test_host_adamw_streams_moments_from_pinned_memory_as_fused_adamw_steps():
    from rl.train.host_adamw import HostAdamW

    os.environ.setdefault("MASTER_PORT", "29532")
    d = parallel.init_distributed()
    models = [shard_policy(tiny_model(seed=0), d.mesh, d.device, gradient_checkpointing=False) for _ in range(2)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    fused = torch.optim.AdamW(models[0].parameters(), fused=True, **hyper)
    host = HostAdamW(models[1].parameters(), chunk_elements=4099, **hyper)  # parameters cut across chunks
    for seed in (1, 2, 3):
        train_step(models[0], fused, seed)
        train_step(models[1], host, seed)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(training_state(models[0], fused),
                                                               training_state(models[1], host)))
    moments = [local_tensor(s[k]) for s in host.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert all(m.device.type == "cpu" and m.is_pinned() for m in moments)
    assert len(host.arena.blocks) == 1  # reserved at once, exactly: no 1 GiB block started for a tensor that missed
    offloader = HostOffloader(models[1], host)  # train.offload beside it moves the parameters, not the moments
    offloader.offload()
    offloader.onload(d.device)
    assert [m.data_ptr() for s in host.state.values() for m in (local_tensor(s["exp_avg"]),
                                                                  local_tensor(s["exp_avg_sq"]))] \
        == [m.data_ptr() for m in moments]
    host.load_state_dict(fused.state_dict())  # moments and steps of a fused AdamW, all on the device
    assert all(local_tensor(s[k]).device.type == "cpu" for s in host.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert all(s["step"].device.type == "cpu" for s in host.state.values())
    train_step(models[0], fused, 4)
    train_step(models[1], host, 4)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(training_state(models[0], fused),
                                                               training_state(models[1], host)))
    parallel.teardown()
