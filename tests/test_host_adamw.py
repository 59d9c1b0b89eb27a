"""train.optimizer_offload's AdamW (rl/train/host_adamw.py) in one process: its chunks, its numbers, its resume. The
sharded steps and checkpoints across both optimizers are in tests/dist_checks.py; the device streams in
tests/test_offload_gpu.py."""

import torch

from rl.train.host_adamw import HostAdamW, element_chunks


def test_chunks_cover_every_element_once_within_the_width():
    sizes = [5, 1, 17, 3, 0, 9]
    for width in (1, 4, 7, 35, 100):
        chunks = list(element_chunks(sizes, width))
        assert all(0 < sum(b - a for _, a, b in c) <= width for c in chunks)
        assert all(sum(b - a for _, a, b in c) == width for c in chunks[:-1])  # only the last runs short
        covered = [(i, e) for c in chunks for i, a, b in c for e in range(a, b)]
        assert covered == [(i, e) for i, size in enumerate(sizes) for e in range(size)]


def model_pair():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    b = torch.nn.Sequential(torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
    b.load_state_dict(a.state_dict())
    return a, b


def train(model, optimizer, seeds):
    for seed in seeds:
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_resume_loads_into_the_moments_own_host_buffers_and_steps_on_as_adamw():
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    a, b = model_pair()
    plain = torch.optim.AdamW(a.parameters(), foreach=False, **hyper)
    host = HostAdamW(b.parameters(), chunk_elements=50, **hyper)  # the first weight (143 elements) spans chunks
    train(a, plain, [1, 2])
    train(b, host, [1, 2])
    buffers = [host.state[p][k].data_ptr() for p in b.parameters() for k in ("exp_avg", "exp_avg_sq")]
    host.load_state_dict(plain.state_dict())  # an AdamW checkpoint into the offloaded optimizer
    assert [host.state[p][k].data_ptr() for p in b.parameters() for k in ("exp_avg", "exp_avg_sq")] == buffers
    assert all(host.state[p]["step"].item() == 2 for p in b.parameters())
    train(a, plain, [3, 4])
    train(b, host, [3, 4])
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(plain.state[pa][k], host.state[pb][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_buffers_fill_a_reserved_block_exactly_and_first_fit_the_rest():
    from tests.test_offload_gpu import UnpinnedArena

    shapes = [torch.Size([3, 5]), torch.Size([100, 7]), torch.Size([2000]), torch.Size([1])]
    arena = UnpinnedArena()
    arena.reserve(sum(arena.aligned(s.numel() * 4) for s in shapes))
    views = [arena.take(s, torch.float32) for s in shapes]
    assert len(arena.blocks) == 1 and arena.blocks[0][1] == arena.blocks[0][0].numel()  # filled to the byte
    for i, v in enumerate(views):
        v.fill_(i)
    assert all(bool((v == i).all()) for i, v in enumerate(views))  # no buffer overlaps another
    arena.take(torch.Size([500]), torch.float32)  # past the reservation: a new block (of BLOCK_BYTES)
    small = arena.take(torch.Size([10]), torch.float32)  # into that block's tail, not a third block
    assert len(arena.blocks) == 2 and small.untyped_storage().data_ptr() == arena.blocks[1][0].data_ptr()
