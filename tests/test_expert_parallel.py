"""Expert parallelism (rl/model/expert_parallel.py) on two CPU ranks over gloo, one torchrun launch of this file: with
the experts split over the ranks, each rank's block output and its input, router and expert gradients equal the
single-rank grouped forward's on the same tokens (the ranks holding different token counts, an expert getting no
tokens, a rank sending none to the other); routing replay's experts are the ones used; a whole model's logits and
every gradient match too, and the weight push gathers the split experts whole. On four ranks (two replicas of
each expert slice) the expert gradients average over the world as FSDP2's do, and the trainer with
train.expert_parallel=2 trains, loads, pushes and checkpoints as with 1 (tests/expert_parallel_training.py); rl.main
runs and resumes across the two."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXPERTS, TOP_K, HIDDEN, RANKS = 8, 2, 32, 2
TOKENS = (10, 6)  # per rank: uneven dispatch


def tiny_moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, initializer_range=0.1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max().detach()) if a.numel() else 0.0


def grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient (zeros where none reached it), a copy."""
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()


def block_case(reference, spread, rank, replay=None) -> dict:
    """Block 0 on every rank's tokens: the reference on all of them at once, the spread block on this rank's;
    the errors of the output and of every gradient (the router's summed over the ranks)."""
    import torch.distributed as dist

    from rl.model.moe import moe_routing, set_routing_replay
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(1, n, HIDDEN, generator=gen) for n in TOKENS]
    ups = [torch.randn(1, n, HIDDEN, generator=gen) for n in TOKENS]
    for model in (reference, spread):
        model.zero_grad(set_to_none=True)
        moe_routing(model).record_experts = True
    if replay is not None:
        set_routing_replay(reference, torch.cat(replay).unsqueeze(0).expand(2, -1, -1))
        set_routing_replay(spread, replay[rank].unsqueeze(0).expand(2, -1, -1))
    ref_block, ep_block = reference.model.layers[0].mlp, spread.model.layers[0].mlp
    x_all = torch.cat(xs, dim=1).requires_grad_()
    expected = ref_block(x_all)
    (expected * torch.cat(ups, dim=1)).sum().backward()
    x = xs[rank].clone().requires_grad_()
    out = ep_block(x)
    (out * ups[rank]).sum().backward()
    first = sum(TOKENS[:rank])
    mine = slice(first, first + TOKENS[rank])
    part = ep_block.expert_parallel
    experts = slice(part.first, part.first + part.local)
    router = grad(ep_block.gate.weight)
    dist.all_reduce(router)
    result = {"out": err(out, expected[:, mine]), "x_grad": err(x.grad, x_all.grad[:, mine]),
              "router_grad": err(router, ref_block.gate.weight.grad)}
    for name in ("gate_up_proj", "down_proj"):
        local, full = getattr(ep_block.experts, name), getattr(ref_block.experts, name)
        result[f"{name}_local"] = list(local.shape)
        result[f"{name}_grad"] = err(grad(local), full.grad[experts])
        gathered = [torch.empty_like(local) for _ in range(RANKS)]
        dist.all_gather(gathered, grad(local))
        result[f"{name}_grad_gathered"] = err(torch.cat(gathered), full.grad)
        result[f"{name}_zero_grad_experts"] = [i for i in range(EXPERTS) if not full.grad[i].abs().sum()]
    used = moe_routing(spread).experts[0]
    result["used"] = used.tolist()
    result["replayed_used"] = None if replay is None else bool(torch.equal(used, replay[rank]))
    if replay is not None:
        set_routing_replay(reference, None)
        set_routing_replay(spread, None)
    return result


def model_case(reference, spread, rank) -> dict:
    """The whole model on this rank's sequence (the reference on every rank's, its losses summed): logits, and every
    gradient (dense ones summed over the ranks, the experts' against their slice)."""
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 64, (1, n), generator=gen) for n in TOKENS]
    reference.zero_grad(set_to_none=True)
    spread.zero_grad(set_to_none=True)
    expected = [reference(input_ids=i).logits for i in ids]
    sum(e.square().mean() for e in expected).backward()
    logits = spread(input_ids=ids[rank]).logits
    logits.square().mean().backward()
    result = {"logits": err(logits, expected[rank])}
    worst = 0.0
    for (name, p), (_, q) in zip(spread.named_parameters(), reference.named_parameters()):
        got = grad(p)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            part = slice(rank * EXPERTS // RANKS, (rank + 1) * EXPERTS // RANKS)
            worst = max(worst, err(got, q.grad[part]))
        else:
            dist.all_reduce(got)
            worst = max(worst, err(got, q.grad))
    result["grads"] = worst
    return result


def main(out_dir: str) -> None:
    import torch.distributed as dist

    from rl.model.expert_parallel import shard_experts
    from rl.model.moe import use_grouped_moe
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference = tiny_moe()
    spread = copy.deepcopy(reference)
    use_grouped_moe(reference)
    for block in use_grouped_moe(spread):
        shard_experts(block, dist.group.WORLD)
    results = {"own": block_case(reference, spread, rank)}
    # Replay: rank 0's tokens to experts {0, 1, 2, 5}, rank 1's to {5, 6} only (it sends rank 0 nothing); experts 3,
    # 4 and 7 get no token.
    gen = torch.Generator().manual_seed(11)
    choices = (torch.tensor([0, 1, 2, 5]), torch.tensor([5, 6]))
    replay = [torch.stack([c[torch.randperm(len(c), generator=gen)[:TOP_K]] for _ in range(n)])
              for c, n in zip(choices, TOKENS)]
    results["replay"] = block_case(reference, spread, rank, replay)
    results["model"] = model_case(reference, spread, rank)
    # The weight push's gather: every tensor whole, the split experts gathered over the ranks.
    from rl.train.weights import iter_full_weights
    full = dict(iter_full_weights(spread, torch.float32, 20_000))
    expected = dict(reference.named_parameters())
    results["push_names"] = sorted(set(expected) ^ {n for n in full if n in dict(spread.named_parameters())})
    results["push"] = max(err(full[n], p) for n, p in expected.items())
    results["fsdp"] = fsdp_case(reference, rank)
    results["lora"] = lora_case(rank)
    (Path(out_dir) / f"results{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def sharded_step(reference, gen: torch.Generator, rank: int):
    """`reference` sharded by FSDP2 with its experts split (shard_policy's expert_parallel), one backward of this rank's
    sequence in it and of every rank's (their losses summed) in `reference`, the split experts' gradients reduced:
    (the sharded model, its logits' error against the reference's, the reference's parameters by name, this rank's
    slice of the experts)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rl.model.expert_parallel import reduce_expert_grads
    from rl.train.policy import shard_policy
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_policy(copy.deepcopy(reference), mesh, torch.device("cpu"), gradient_checkpointing=False,
                         expert_parallel=RANKS)
    ids = [torch.randint(0, 64, (1, n), generator=gen) for n in TOKENS]
    reference.zero_grad(set_to_none=True)
    expected = [reference(input_ids=i).logits for i in ids]
    sum(e.square().mean() for e in expected).backward()
    logits = model(input_ids=ids[rank]).logits
    logits.square().mean().backward()
    reduce_expert_grads(model, model.expert_groups[1])
    return model, err(logits, expected[rank]), dict(reference.named_parameters()), \
        slice(rank * EXPERTS // RANKS, (rank + 1) * EXPERTS // RANKS)


def grad_errors(model, full: dict, part: slice) -> tuple[float, list[str], list[str]]:
    """The sharded model's gradients against the reference's over the world (FSDP2 and reduce_expert_grads both
    average): the worst error, the names of the split (not DTensor) parameters, and the frozen ones given a gradient."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    world, worst, split, frozen = dist.get_world_size(), 0.0, [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            frozen += [name] if p.grad is not None else []
        elif isinstance(p, DTensor):
            worst = max(worst, err(p.grad.full_tensor(), full[name].grad / world))
        else:
            split.append(name)
            worst = max(worst, err(grad(p), full[name].grad[part] / world))
    return worst, split, frozen


def fsdp_case(reference, rank) -> dict:
    """The policy sharded by FSDP2 with the experts split (`sharded_step`): logits, every gradient (FSDP2 and
    reduce_expert_grads both average over the world) and the weight push, against the reference on every rank's
    sequence (its losses summed)."""
    from rl.train.weights import iter_full_weights
    model, logits_err, full, part = sharded_step(reference, torch.Generator().manual_seed(9), rank)
    worst, split, _ = grad_errors(model, full, part)
    pushed = dict(iter_full_weights(model, torch.float32, 20_000))
    return {"logits": logits_err, "grads": worst, "split": split,
            "push": max(err(pushed[n], p) for n, p in full.items())}


def lora_case(rank) -> dict:
    """LoRA's adapters (the default targets: attention, and each expert's on the fused tensors) in the policy sharded
    with the experts split (`sharded_step`), the adapters' split with their experts: logits, the adapters' gradients
    (FSDP2 and reduce_expert_grads both average over the world; the frozen base gets none) and the merged weight
    push, against the unsplit model on every rank's sequence (its losses summed)."""
    from rl.config import LoraConfig
    from rl.model.moe import use_grouped_moe
    from rl.train.lora import apply_lora, init_adapters
    from rl.train.weights import iter_merged_weights
    reference = tiny_moe()
    use_grouped_moe(reference)
    apply_lora(reference, LoraConfig(rank=4, alpha=8.0))
    init_adapters(reference, 0)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:  # B starts at zero: the update would be invisible
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model, logits_err, full, part = sharded_step(reference, gen, rank)
    worst, split, frozen = grad_errors(model, full, part)
    pushed = dict(iter_merged_weights(model, torch.float32, 20_000))
    with torch.no_grad():
        merged = dict(iter_merged_weights(reference, torch.float32, 20_000))
    return {"logits": logits_err, "grads": worst, "split": split, "frozen_grads": frozen,
            "push_names": sorted(set(pushed) ^ set(merged)), "push": max(err(pushed[n], t) for n, t in merged.items())}


def main_replicas(out_dir: str) -> None:
    """Four ranks, experts split over pairs: each expert slice has two replicas. After `reduce_expert_grads`, each
    rank's expert gradients are its slice of the single-rank gradient of the ranks' summed losses divided by the
    world size (FSDP2's average of the dense ones)."""
    import torch.distributed as dist

    from rl.model.expert_parallel import reduce_expert_grads, shard_experts
    from rl.model.moe import use_grouped_moe
    from rl.parallel import expert_parallel_mesh
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = expert_parallel_mesh(2)
    experts_group, replicas = mesh.get_group("expert"), mesh.get_group("replica")
    reference = tiny_moe()
    spread = copy.deepcopy(reference)
    use_grouped_moe(reference)
    for block in use_grouped_moe(spread):
        shard_experts(block, experts_group)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 64, (1, 3 + 2 * r), generator=gen) for r in range(world)]
    sum(reference(input_ids=i).logits.square().mean() for i in ids).backward()
    spread(input_ids=ids[rank]).logits.square().mean().backward()
    reduce_expert_grads(spread, replicas)
    place = dist.get_rank(experts_group)
    part = slice(place * EXPERTS // 2, (place + 1) * EXPERTS // 2)
    full = dict(reference.named_parameters())
    worst = max(err(grad(p), full[n].grad[part] / world) for n, p in spread.named_parameters()
                if hasattr(p, "expert_group"))
    result = {"experts_group": dist.get_process_group_ranks(experts_group),
              "replicas": dist.get_process_group_ranks(replicas), "expert_grads": worst}
    (Path(out_dir) / f"replicas{rank}.json").write_text(json.dumps(result))
    from tests.expert_parallel_training import training_checks
    training_checks(out_dir, {"hub": str(Path(out_dir) / "hub"), "fused": str(Path(out_dir) / "fused")})
    dist.destroy_process_group()


def model_folders(out: Path) -> None:
    """tiny_moe's folder as the hub holds it (one tensor per expert: transformers' save_pretrained), the same weights
    fused (one tensor per block and projection, transformers' own names), and its tensors by name (reference.pt)."""
    from safetensors.torch import save_file
    model = tiny_moe()
    model.save_pretrained(out / "hub")
    (out / "fused").mkdir()
    (out / "fused" / "config.json").write_bytes((out / "hub" / "config.json").read_bytes())
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, out / "fused" / "model.safetensors")
    torch.save(weights, out / "hub" / "reference.pt")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One launch of four ranks: the replicas' gradients (`main_replicas`), then the trainer with
    train.expert_parallel (tests/expert_parallel_training.py)."""
    from tests.test_distributed import torchrun
    out = tmp_path_factory.mktemp("ep4")
    model_folders(out)
    torchrun(4, "tests/test_expert_parallel.py", str(out), "replicas", timeout=300)
    return [json.loads((out / f"replicas{r}.json").read_text()) | json.loads((out / f"training{r}.json").read_text())
            for r in range(4)]


def test_replicas_average_the_expert_gradients_over_the_world(four_ranks):
    results = four_ranks
    assert [r["experts_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["replicas"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r in results:
        assert r["expert_grads"] <= 1e-6, r


def test_training_with_split_experts_matches_fsdp2_alone(four_ranks):
    """expert_parallel=2 (two replicas of each slice) against 1, two clipped AdamW steps: the same losses, grad norms
    (the clip's norm counts each slice once), pushed weights and AdamW state, which names every expert's moments."""
    for r in four_ranks:
        (loss_1, loss_2), (norm_1, norm_2) = r["losses"], r["norms"]
        assert loss_2 == pytest.approx(loss_1, rel=1e-6) and norm_2 == pytest.approx(norm_1, rel=1e-6), r
        assert min(norm_1) > 10 * 0.05  # the clip (0.05) scaled every step
        assert r["push"] <= 1e-6 and r["state"] <= 1e-6, r
        assert r["groups"] == 2  # the split experts apart from FSDP2's DTensors (fused AdamW refuses a mix)
        assert r["host_adamw"] == [True, 0.0], r  # train.optimizer_offload: the same steps, bitwise
        assert r["timeouts"] == [123.0, 123.0]  # train.collective_timeout_s reaches the experts' groups
        for layer in range(2):
            for name in ("gate_up_proj", "down_proj"):
                assert {f"optim.model.layers.{layer}.mlp.experts.{name}.{k}" for k in ("exp_avg", "exp_avg_sq")} \
                    <= set(r["state_keys"])


def test_lora_with_split_experts_trains_and_resumes_as_without(four_ranks):
    """LoRA's adapters on attention and on the experts, at expert_parallel=2 against 1: the same losses, grad norms
    (the split adapters counted once each), merged pushes and AdamW state, the split adapters a param group of their
    own; a checkpoint at 2 resumes at 1 with every adapter and moment as saved."""
    for r in four_ranks:
        (loss_1, loss_2), (norm_1, norm_2) = r["lora_losses"], r["lora_norms"]
        assert loss_2 == pytest.approx(loss_1, rel=1e-6) and norm_2 == pytest.approx(norm_1, rel=1e-6), r
        assert min(norm_2) > 5 * 0.05 and r["lora_groups"] == 2  # the clip (0.05) scaled every step
        assert r["lora_push"] <= 1e-6 and r["lora_state"] <= 1e-6 and r["lora_resume_ep1"] == 0.0, r
        keys = set(r["lora_state_keys"])
        assert {f"optim.model.layers.1.mlp.experts.down_proj_lora_{ab}.exp_avg" for ab in "AB"} <= keys
        assert not any(k.endswith(("experts.down_proj", "experts.gate_up_proj")) for k in keys)  # the frozen base


def test_each_rank_loads_its_own_experts(four_ranks):
    """From the hub's one tensor per expert and from the fused tensors, and drawn by model.random_init: the weight
    push of the split model is the folder's (the unsplit model's) exactly."""
    for r in four_ranks:
        assert r["load_hub"] == r["load_fused"] == r["random_init"] == 0.0, r


def test_a_checkpoint_under_expert_parallelism_resumes_exactly(four_ranks):
    """Saved at expert_parallel=2 and loaded into fresh policies: every weight and AdamW tensor as saved at
    expert_parallel 2, 1 and 4 and in the export's read of it; the next step of the resumed policy is the
    uninterrupted one's, bitwise."""
    for r in four_ranks:
        assert r["resume_ep2"] == r["resume_ep1"] == r["resume_ep4"] == r["export"] == 0.0, r
        resumed, original = r["resume_next_step"]
        assert resumed == original and r["resume_next_weights"] == 0.0, r


def moe_model_dir(path: Path) -> Path:
    """A tiny random Qwen3-MoE folder (8 experts, 2 a token) with the tiny tokenizer, as rl.main loads one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from rl.prepare import tiny_tokenizer
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    cfg = Qwen3MoeConfig(vocab_size=max(len(AutoTokenizer.from_pretrained(path)), 256), hidden_size=HIDDEN,
                         intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         norm_topk_prob=True, initializer_range=0.1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    return path


def test_the_main_loop_with_expert_parallelism_trains_and_resumes_as_without(tmp_path):
    """rl.main on two ranks, routing replay on: two rollouts at train.expert_parallel=1, then a resume at 2 for the
    third (its checkpoint's one param group split in two), give the rows of three rollouts at 2 (losses, grad norms,
    rewards: the engine samples from the pushed weights)."""
    from tests.test_distributed import torchrun
    from tests.tiny import write_arithmetic_jsonl
    model, data = moe_model_dir(tmp_path / "model"), write_arithmetic_jsonl(tmp_path / "train.jsonl")

    def run(out: str, ep: int, rollouts: int) -> str:
        return torchrun(2, "-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}",
                        f"--data.source={data}", f"--log.output_dir={tmp_path / out}", "--train.lr=1e-3",
                        "--reward.user_fn=tests.reward_fns:digit_fraction", "--train.routing_replay=true",
                        f"--train.expert_parallel={ep}", f"--train.num_rollout={rollouts}", "--checkpoint.interval=1",
                        timeout=300).stdout

    def rows(out: str) -> list[float]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)[k] for line in lines
                for k in ("rollout_id", "train/loss", "train/grad_norm", "rollout/reward_mean")]

    assert "split over groups" not in run("split", 1, 2)
    resumed = run("split", 2, 3)
    assert "changed keys train.expert_parallel" in resumed and "warning" not in resumed
    assert "split over groups of 2 ranks, 4 of 8 on each" in resumed and "split over groups" in run("whole", 2, 3)
    assert rows("split")[::4] == [0, 1, 2] and min(rows("whole")[2::4]) > 0
    assert rows("split") == pytest.approx(rows("whole"), rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.test_distributed import torchrun
    out = tmp_path_factory.mktemp("ep")
    torchrun(RANKS, "tests/test_expert_parallel.py", str(out), timeout=180)
    return [json.loads((out / f"results{r}.json").read_text()) for r in range(RANKS)]


GRADS = ("out", "x_grad", "router_grad", "gate_up_proj_grad", "down_proj_grad", "gate_up_proj_grad_gathered",
         "down_proj_grad_gathered")


@pytest.mark.parametrize("case", ["own", "replay"])
def test_each_rank_matches_the_single_rank_block(results, case):
    for rank, r in enumerate(results):
        got = r[case]
        assert got["gate_up_proj_local"][0] == got["down_proj_local"][0] == EXPERTS // RANKS
        assert {key: got[key] for key in GRADS} == pytest.approx({key: 0.0 for key in GRADS}, abs=1e-5), (rank, got)


def test_uneven_dispatch_and_idle_experts(results):
    own = [r["own"]["used"] for r in results]
    assert [len(u) for u in own] == list(TOKENS)
    replay = results[0]["replay"]
    assert replay["gate_up_proj_zero_grad_experts"] == replay["down_proj_zero_grad_experts"] == [3, 4, 7]
    assert {e for token in results[1]["replay"]["used"] for e in token} <= {5, 6}  # rank 1 sends rank 0 nothing


def test_routing_replay_uses_the_replayed_experts(results):
    for r in results:
        assert r["replay"]["replayed_used"] is True
        assert r["replay"]["used"] != r["own"]["used"]


def test_the_weight_push_gathers_the_split_experts_whole(results):
    for r in results:
        assert r["push_names"] == [] and r["push"] == 0.0


def test_fsdp2_with_split_experts(results):
    for r in results:
        got = r["fsdp"]
        assert sorted(got["split"]) == [f"model.layers.{i}.mlp.experts.{n}" for i in range(2)
                                        for n in ("down_proj", "gate_up_proj")]
        assert got["logits"] <= 1e-5 and got["grads"] <= 1e-6 and got["push"] == 0.0, got


def test_lora_adapters_split_with_their_experts(results):
    """Each rank holds its experts' adapters; the logits, the adapters' gradients and the merged push are the unsplit
    model's."""
    for r in results:
        got = r["lora"]
        assert got["split"] == [f"model.layers.{i}.mlp.experts.{n}_lora_{ab}" for i in range(2)
                                for n in ("gate_up_proj", "down_proj") for ab in "AB"]
        assert got["frozen_grads"] == [] and got["push_names"] == []
        assert got["logits"] <= 1e-5 and got["grads"] <= 1e-6 and got["push"] <= 1e-6, got


def test_whole_model_logits_and_gradients(results):
    for r in results:
        assert r["model"]["logits"] <= 1e-5 and r["model"]["grads"] <= 1e-5, r["model"]


def test_the_config_key_is_checked():
    from rl.config import ConfigError, check_expert_parallel_model, config_from_dict, resolve
    base = {"model": {"path": "m"}, "data": {"source": "d.jsonl"}}
    assert config_from_dict(base).train.expert_parallel == 1
    with pytest.raises(ConfigError, match=r"train.expert_parallel must be >= 1"):
        config_from_dict({**base, "train": {"expert_parallel": 0}})
    unchecked = config_from_dict({**base, "train": {"expert_parallel": 3}}, checked=False)
    with pytest.raises(ConfigError, match=r"train.expert_parallel \(3\) must divide the world size \(4\)"):
        resolve(unchecked, world_size=4)
    assert resolve(config_from_dict({**base, "train": {"expert_parallel": 2}}, checked=False),
                   world_size=4).train.expert_parallel == 2
    check_expert_parallel_model("m", {"num_experts": 8}, 2)
    check_expert_parallel_model("m", {"text_config": {"num_experts": 8}}, 4)
    check_expert_parallel_model("m", {"num_local_experts": 8}, 4)  # transformers 5's save_pretrained
    with pytest.raises(ConfigError, match=r"num_experts=6, which must be a positive multiple of 4"):
        check_expert_parallel_model("m", {"num_experts": 6}, 4)
    with pytest.raises(ConfigError, match=r"num_experts=0"):
        check_expert_parallel_model("m", {"model_type": "qwen3"}, 2)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main_replicas(sys.argv[1]) if sys.argv[2:] == ["replicas"] else main(sys.argv[1])
