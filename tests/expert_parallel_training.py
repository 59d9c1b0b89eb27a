"""train.expert_parallel in the trainer, on gloo CPU ranks: started (four ranks) by tests/test_expert_parallel.py's
launch, which calls `training_checks`. The policy is built from a model folder (the hub's one tensor per expert, and
the fused layout) or drawn at random, with the experts split over pairs of ranks (expert_parallel=2, each slice on
two replicas) and without (expert_parallel=1, FSDP2 shards them); both train two optimizer steps through
rl/train/step.py's `optimizer_steps` (clipped), and their losses, grad norms, pushed weights and AdamW state are
compared (and with train.optimizer_offload's HostAdamW); a checkpoint written under expert_parallel=2 is resumed into
expert_parallel 2, 1 and 4. LoRA's adapters (the experts' split with them) train, push and resume alike."""

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rl import parallel
from rl.config import LoraConfig, ModelConfig, TrainConfig
from rl.run import checkpoint, export
from rl.train.policy import build_optimizer, build_policy
from rl.train.step import optimizer_steps
from rl.train.weights import iter_full_weights, iter_merged_weights

VOCAB, LR, CLIP, EPS = 64, 1e-3, 0.05, 1e-6


def policy(folder: str, ep: int, random_init: bool = False, seed: int = 0, optimizer_offload: bool = False,
           lora: LoraConfig | None = None):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # the split model recomputes its blocks in the backward (their all-to-alls too) and reshards after each forward
    cfg = ModelConfig(path=folder, random_init=random_init, attn_implementation="sdpa", gradient_checkpointing=ep > 1,
                      reshard_after_forward=ep > 1)
    model = build_policy(cfg, mesh, torch.device("cpu"), seed, 64, lora=lora, expert_parallel=ep)
    train = TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS, optimizer_offload=optimizer_offload)
    optimizer, scheduler = build_optimizer(model, train)
    return model, optimizer, scheduler


def pushed(model) -> dict[str, torch.Tensor]:
    """What the weight push sends the engine (rl/train/weights.py): every tensor whole."""
    return {n: t.clone() for n, t in iter_full_weights(model, torch.float32, 30_000)}


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The checkpoint's state dicts (rl/run/checkpoint.py), every tensor whole: weights and AdamW state by name."""
    sds = checkpoint._state_dicts({"model": (model, optimizer)})
    out = {f"model.{k}": v for k, v in sds["model"].items()}
    for fqn, state in sds["optim"]["state"].items():
        out |= {f"optim.{fqn}.{k}": v for k, v in state.items()}
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in out.items()
            if torch.is_tensor(v)}


def train(model, optimizer, scheduler, seeds: list[int]) -> tuple[list[float], list[float]]:
    """One clipped optimizer step per seed, each rank on sequences of its own (its own lengths); the losses (summed
    over the ranks) and grad norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [[torch.randint(0, VOCAB, (2, 5 + 3 * rank), generator=torch.Generator().manual_seed(10 * s + rank))]
               for s in seeds]
    losses = []

    def loss(k, ids, totals):
        logits = model(input_ids=ids).logits[:, :-1].float()
        value = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) / world
        summed = value.detach().clone()
        dist.all_reduce(summed)
        losses.append(float(summed))
        return value

    norms, skipped = optimizer_steps(model, optimizer, scheduler, batches, [None] * len(seeds), world, CLIP, loss)
    assert not any(skipped)
    return losses, norms


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two tensors of the same name (inf where the names or shapes differ)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def load_checks(folders: dict[str, str], reference: dict[str, torch.Tensor]) -> dict:
    """The split experts' slices loaded from either layout of the folder, and drawn by model.random_init: the pushed
    weights equal the folder's (exactly), and the random ones expert_parallel=1's."""
    def named(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # the folder's tensors (no buffers)
        return {k: weights[k] for k in reference if k in weights}

    out = {f"load_{layout}": worst(named(pushed(policy(folder, 2)[0])), reference)
           for layout, folder in folders.items()}
    out["random_init"] = worst(pushed(policy(folders["hub"], 2, random_init=True)[0]),
                               pushed(policy(folders["hub"], 1, random_init=True)[0]))
    return out


def resume_checks(out_dir: Path, folder: str, run, saved: dict[str, torch.Tensor]) -> dict:
    """A checkpoint of the expert_parallel=2 run, written by rl/run/checkpoint.py's `save` and loaded by its `load`
    into fresh policies (other random weights): every weight and AdamW tensor as saved, at expert_parallel 2, 1 and
    4, and whole in what `python -m rl.export` reads; the resumed expert_parallel=2 policy's next step equals the
    original's."""
    model, optimizer, scheduler = run
    state = checkpoint.TrainerState(0, 1, {"train": {"expert_parallel": 2}}, dist.get_world_size(),
                                    {"data": {}, "scheduler": scheduler.state_dict(), "health": {}})
    path = checkpoint.save(out_dir / "run", state, {"model": (model, optimizer)}, [], keep_last=1)
    exported = {f"model.{k}": v for k, v in export.load_model_state(path).items()}  # python -m rl.export's read
    out = {"export": worst(exported, {k: v for k, v in saved.items() if k.startswith("model.")})}
    for ep in (2, 1, 4):
        fresh = policy(folder, ep, random_init=True, seed=5)
        checkpoint.load(path, {"model": fresh[:2]})
        fresh[2].load_state_dict(scheduler.state_dict())
        out[f"resume_ep{ep}"] = worst(full_state(*fresh[:2]), saved)
        if ep == 2:
            out["resume_next_step"] = [train(*fresh, [3]), train(*run, [3])]
            out["resume_next_weights"] = worst(pushed(fresh[0]), pushed(model))
    return out


def lora_checks(out_dir: Path, folder: str) -> dict:
    """LoRA on attention and the experts at expert_parallel=2 (each rank its experts' adapters) against 1: two clipped
    AdamW steps give the same losses, grad norms, merged push and adapter AdamW state; a checkpoint written at 2
    resumes at 1 (fresh adapters of another seed) with every adapter and moment as saved."""
    lora = LoraConfig(rank=4, alpha=8.0)
    runs = {ep: policy(folder, ep, lora=lora) for ep in (1, 2)}
    trained = {ep: train(*run, [1, 2]) for ep, run in runs.items()}
    states = {ep: full_state(*run[:2]) for ep, run in runs.items()}
    merged = {ep: {n: t.clone() for n, t in iter_merged_weights(run[0], torch.float32, 30_000)}
              for ep, run in runs.items()}
    model, optimizer, scheduler = runs[2]
    parts = {"data": {}, "scheduler": scheduler.state_dict(), "health": {}}
    state = checkpoint.TrainerState(0, 1, {"train": {"expert_parallel": 2}, "lora": dataclasses.asdict(lora)},
                                    dist.get_world_size(), parts)
    path = checkpoint.save(out_dir / "lora_run", state, {"model": (model, optimizer)}, [], keep_last=1)
    fresh = policy(folder, 1, seed=5, lora=lora)
    checkpoint.load(path, {"model": fresh[:2]})
    return {"lora_losses": [trained[1][0], trained[2][0]], "lora_norms": [trained[1][1], trained[2][1]],
            "lora_push": worst(merged[2], merged[1]), "lora_state": worst(states[2], states[1]),
            "lora_state_keys": sorted(states[2]), "lora_groups": len(optimizer.param_groups),
            "lora_resume_ep1": worst(full_state(*fresh[:2]), states[2])}


def training_checks(out_dir: str, folders: dict[str, str]) -> None:
    """Writes `training<rank>.json`: the differences between expert_parallel=2 and 1 (losses, grad norms, pushed
    weights, AdamW state after two steps; HostAdamW's against torch's AdamW at expert_parallel=2), the loads and the
    resumes."""
    reference = torch.load(Path(folders["hub"]) / "reference.pt")
    runs = {ep: policy(folders["hub"], ep) for ep in (1, 2)}
    runs["host"] = policy(folders["hub"], 2, optimizer_offload=True)  # HostAdamW's moments (train.optimizer_offload)
    trained = {ep: train(*run, [1, 2]) for ep, run in runs.items()}
    states = {ep: full_state(*run[:2]) for ep, run in runs.items()}
    result = {"losses": [trained[1][0], trained[2][0]], "norms": [trained[1][1], trained[2][1]],
              "push": worst(pushed(runs[2][0]), pushed(runs[1][0])), "state": worst(states[2], states[1]),
              "state_keys": sorted(states[2]), "groups": len(runs[2][1].param_groups),
              "host_adamw": [trained["host"] == trained[2], worst(states["host"], states[2])]}
    result |= load_checks(folders, reference)
    parallel.set_collective_timeout(123.0)  # what rl.main sets after its first step: the experts' groups too
    result["timeouts"] = [group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                          for group in runs[2][0].expert_groups]
    result |= resume_checks(Path(out_dir), folders["hub"], runs[2], states[2])
    result |= lora_checks(Path(out_dir), folders["hub"])
    (Path(out_dir) / f"training{dist.get_rank()}.json").write_text(json.dumps(result))
