"""Multi-rank checks, started by tests/test_distributed.py as `torchrun --nproc-per-node N tests/dist_checks.py OUT`."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import AlgoConfig, TrainConfig  # noqa: E402
from rl.data import Sample  # noqa: E402
from rl.rollout import SamplingParams  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402
from rl.train.policy import HostOffloader, build_optimizer, shard_policy  # noqa: E402
from rl.train.step import Schedule, collate, token_logprobs, train_on_rollout  # noqa: E402
from rl.train.weights import iter_full_weights, sync_weights  # noqa: E402
from tests.tiny import tiny_model, training_state  # noqa: E402


def full_params(model):
    return {name: t.clone() for name, t in iter_full_weights(model, torch.float32, 1 << 30)}


def rollout_samples(engine, n):
    prompts = [[1, 5 + i % 7, 9, 13 + i % 3] for i in range(n)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0))
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        s = Sample(prompt="", tokens=list(p), index=i, group_index=i // 2)
        s.append_response_tokens(o.token_ids, o.logprobs)
        s.advantage = 1.0 if i % 2 else -1.0
        samples.append(s)
    return samples


def main(out_dir: str) -> None:
    d = parallel.init_distributed()
    torch.manual_seed(0)
    reference = tiny_model(seed=0, vocab_size=259, tie=True)  # odd vocab: uneven FSDP2 shards
    expected = {n: t.detach().clone() for n, t in reference.named_parameters(remove_duplicate=False)}
    saved = set(reference.state_dict())
    model = shard_policy(reference, d.mesh, d.device, gradient_checkpointing=False)
    results = {}

    # Bucketed gathers (several buckets, tied weights) rebuild every parameter exactly.
    gathered = {n: t.clone() for n, t in iter_full_weights(model, torch.float32, 40_000)}
    results["gather_exact"] = all(torch.equal(gathered[n], expected[n]) for n in expected)
    results["gather_names"] = sorted(saved ^ set(gathered))  # the state_dict's names, no more and no fewer

    engine = NativeEngine(model.config, d.device, torch.float32, max_batch_size=8, seed=d.rank)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    samples = rollout_samples(engine, 8)
    mb = collate(samples, d.device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, mb, 1.0)
    model.reshard()
    results["rollout_vs_train_before"] = float(((lp - mb.rollout_logprobs).abs() * mb.loss_mask).max())

    train_cfg = TrainConfig(lr=1e-3)
    optimizer, scheduler = build_optimizer(model, train_cfg)
    before = full_params(model)
    tokens = int(mb.loss_mask.sum()) * d.world_size
    seqs = int((mb.loss_mask.sum(-1) > 0).sum()) * d.world_size
    stats = train_on_rollout(model, optimizer, scheduler, Schedule([[mb]], [tokens], [seqs], padding=0),
                             dp_size=d.world_size, train=train_cfg, algo=AlgoConfig(eps_clip_high=0.2), temperature=1.0)
    after = full_params(model)
    results["changed"] = max(float((after[n] - before[n]).abs().max()) for n in before)
    results["grad_norm"] = stats["grad_norm"]
    torch.save(after, Path(out_dir) / f"weights{d.rank}.pt")

    # Offload round trip with uneven shards (vocab 259 over the ranks): exact. Only GPU runs offload.
    if torch.cuda.is_available():
        snapshot, offloader = training_state(model, optimizer), HostOffloader(model, optimizer)
        offloader.offload()
        on_host = all(p._local_tensor.device.type == "cpu" for p in model.parameters())
        offloader.onload(d.device)
        after_trip = training_state(model, optimizer)
        results["offload_exact"] = on_host and all(torch.equal(a, b) for a, b in zip(after_trip, snapshot))

    # After a sync the engine's logprobs of its new samples equal the trainer's forward on them.
    engine.sleep(2)
    engine.wake_up(["weights"])
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    engine.wake_up(["kv_cache"])
    new = collate(rollout_samples(engine, 8), d.device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, new, 1.0)
    model.reshard()
    results["rollout_vs_train_after"] = float(((lp - new.rollout_logprobs).abs() * new.loss_mask).max())
    results |= host_adamw_checks(d, Path(out_dir))
    (Path(out_dir) / f"results{d.rank}.json").write_text(json.dumps(results))
    parallel.teardown()


def host_adamw_checks(d, out: Path) -> dict:
    """train.optimizer_offload's AdamW on uneven shards, its chunks cutting parameters apart: the same steps as
    torch's AdamW, and checkpoints that load across the two (moments offloaded or not) and train on identically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from rl.run.checkpoint import _options, _state_dicts
    from rl.train.host_adamw import HostAdamW

    def fresh(host: bool):
        model = shard_policy(tiny_model(seed=3, vocab_size=259), d.mesh, d.device, gradient_checkpointing=False)
        kwargs = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
        cuda = torch.cuda.is_available()  # HostAdamW runs torch's fused kernel on CUDA, the single-tensor one off it
        optimizer = HostAdamW(model.parameters(), chunk_elements=997, **kwargs) if host else \
            torch.optim.AdamW(model.parameters(), foreach=False if not cuda else None, fused=cuda or None, **kwargs)
        return model, optimizer

    def steps(model, optimizer, seeds):
        for seed in seeds:
            ids = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(seed * 10 + d.rank)).to(d.device)
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer.param_groups[0]["lr"] *= 0.5  # a schedule: each step its own rate

    def same(a, b) -> bool:
        return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(training_state(*a), training_state(*b)))

    plain, host = fresh(False), fresh(True)
    for run in (plain, host):
        steps(*run, [1, 2, 3])
    results = {"host_adamw_exact": same(plain, host)}
    for source, target_host in ((plain, True), (host, False)):
        folder = out / f"ckpt_{target_host}"
        dcp.save(_state_dicts({"model": source}), checkpoint_id=str(folder))
        target = fresh(target_host)
        sds = _state_dicts({"model": target})
        dcp.load(sds, checkpoint_id=str(folder))
        set_state_dict(*target, model_state_dict=sds["model"], optim_state_dict=sds["optim"],
                       options=_options(target[0]))
        target[1].param_groups[0]["lr"] = source[1].param_groups[0]["lr"]
        steps(*source, [4])
        steps(*target, [4])
        results[f"host_adamw_loads_{'into' if target_host else 'from'}"] = same(source, target)
    return results


if __name__ == "__main__":
    main(sys.argv[1])
