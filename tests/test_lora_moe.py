"""LoRA on a MoE model's fused experts (rl/train/lora.py's `add_expert_adapters`, rl/model/moe.py's `ExpertLoRA`):
per-expert adapters computed inside the grouped expert matmuls, checked against transformers' own experts (a loop
over the experts) with each expert's weight merged by hand, W[e] + alpha / rank * B[e] @ A[e]; the merged weights a
push sends the engine; the adapters alone train; the targets that select the experts; a checkpoint round trip on one
rank; the memory plan's count."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rl.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from rl.model.moe import use_grouped_moe
from rl.rollout.native import NativeEngine
from rl.train.lora import adapted_experts, adapters_off, apply_lora, init_adapters
from rl.train.policy import build_optimizer
from rl.train.weights import sync_weights
from tests.test_lora import engine_vs_trainer
from tests.test_moe_engine import tiny_moe

EXPERTS_ONLY = LoraConfig(rank=4, alpha=8.0, target_modules=["gate_up_proj", "down_proj"])
IDS = torch.tensor([[1, 5, 9, 13, 40, 41, 7, 3], [2, 8, 8, 30, 31, 60, 61, 62]])


def moe_lora(cfg: LoraConfig = EXPERTS_ONLY, family: str = "qwen3_moe") -> torch.nn.Module:
    """tiny_moe with grouped blocks and adapters, as build_policy makes them (B = 0)."""
    model = tiny_moe(family)
    use_grouped_moe(model)
    apply_lora(model, cfg)
    init_adapters(model, seed=0)
    return model


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Every A and B random (B starts at zero: the update would be invisible)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def hand_merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each adapted expert tensor with its adapter merged one expert at a time: W[e] + scale * B[e] @ A[e]
    (differentiable in A and B)."""
    merged = {}
    for path, experts in adapted_experts(model).items():
        for name in experts.lora_tensors:
            w, a, b = (getattr(experts, n) for n in (name, f"{name}_lora_A", f"{name}_lora_B"))
            merged[f"{path}.{name}"] = torch.stack([w[e] + experts.lora_scale * b[e] @ a[e] for e in range(len(w))])
    return merged


def reference_logits(model: torch.nn.Module, family: str = "qwen3_moe") -> torch.Tensor:
    """transformers' own MoE forward (a loop over the experts) with the hand-merged expert weights."""
    return torch.func.functional_call(tiny_moe(family), hand_merged(model), (IDS,)).logits


def test_expert_adapters_start_as_the_base_and_equal_the_hand_merged_experts():
    """B = 0: the base exactly; random A and B: the hand merge; adapters_off (the KL reference): the base again."""
    model = moe_lora()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_lora_A.shape == (8, 4, 64) and experts.gate_up_proj_lora_B.shape == (8, 64, 4)
    assert experts.down_proj_lora_A.shape == (8, 4, 32) and experts.down_proj_lora_B.shape == (8, 64, 4)
    base = tiny_moe("qwen3_moe")
    use_grouped_moe(base)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)  # B = 0: the base model exactly
        randomize_adapters(model, 1)
        adapted = model(IDS).logits
        torch.testing.assert_close(adapted, reference_logits(model), rtol=1e-5, atol=1e-5)
        assert (adapted - base(IDS).logits).abs().max() > 1e-2
        with adapters_off(model):  # the KL reference of a LoRA policy: its base, the experts' adapters off too
            assert torch.equal(model(IDS).logits, base(IDS).logits)
        assert torch.equal(model(IDS).logits, adapted)  # and back on after


def test_the_adapters_gradients_are_those_of_the_hand_merged_experts():
    model = moe_lora()
    randomize_adapters(model, 2)
    upstream = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(3))
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    (model(IDS).logits * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in adapters.items()}
    model.zero_grad(set_to_none=True)
    (reference_logits(model) * upstream).sum().backward()
    assert len(grads) == 2 * 2 * 2  # A and B of gate_up and down, 2 blocks
    for name, p in adapters.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
        assert grads[name].abs().max() > 0, name


def test_only_the_adapters_train_and_the_fused_experts_never_move():
    model = moe_lora(LoraConfig(rank=4, alpha=8.0))  # the default targets: attention and the experts
    randomize_adapters(model, 4)
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * (4 * 2 + 2 * 2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in adapters}
    optimizer, _ = build_optimizer(model, TrainConfig(lr=1e-2), fused=False)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == adapters
    model(IDS).logits.square().mean().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in adapters), name
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


class Recorder:
    """An engine in front of the native one that keeps a copy of every tensor each push sent."""

    def __init__(self, engine):
        self.engine, self.pushes = engine, []

    def load_weights(self, weights):
        self.pushes.append({})

        def seen():
            for name, tensor in weights:
                self.pushes[-1][name] = tensor.clone()
                yield name, tensor
        self.engine.load_weights(seen())


def test_the_push_merges_each_experts_adapter_and_the_engine_follows():
    model = moe_lora(LoraConfig(rank=4, alpha=8.0))
    randomize_adapters(model, 5)
    engine = Recorder(NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0,
                                   page_size=4))
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)  # several buckets
    with torch.no_grad():
        expected = hand_merged(model)
    first = engine.pushes[0]
    assert not any("lora" in name for name in first) and len(expected) == 4
    for name, tensor in expected.items():
        torch.testing.assert_close(first[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    assert engine_vs_trainer(engine.engine, model) < 1e-4
    randomize_adapters(model, 6)  # the adapters move; the base does not
    before = engine_vs_trainer(engine.engine, model)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05, changed_only=True)
    assert before > 1e-3 and engine_vs_trainer(engine.engine, model) < 1e-4
    assert sorted(engine.pushes[1]) == sorted([f"model.layers.{i}.self_attn.{p}.weight" for i in range(2)
                                               for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + list(expected))


def test_the_targets_that_select_the_experts():
    from rl.run.checkpoint import check_lora

    def adapted(cfg: LoraConfig, family: str = "qwen3_moe") -> list[str]:
        model = tiny_moe(family)
        use_grouped_moe(model)
        return sorted({path.split(".", 3)[3] for path in apply_lora(model, cfg)})

    # The default: attention, Qwen2-MoE's shared expert, and both fused expert tensors (PEFT's MLP names select them)
    assert adapted(LoraConfig(rank=4)) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "self_attn.k_proj",
                                           "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert "mlp.shared_expert.gate_proj" in adapted(LoraConfig(rank=4), "qwen2_moe")
    assert adapted(LoraConfig(rank=4, target_modules=["q_proj"])) == ["self_attn.q_proj"]
    assert adapted(LoraConfig(rank=4, target_modules=["down_proj"])) == ["mlp.experts.down_proj"]
    assert adapted(EXPERTS_ONLY) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    with pytest.raises(ConfigError, match=r"lora.target_modules names \['gate_proj'\] alone: .* fuse gate_proj"):
        adapted(LoraConfig(rank=4, target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(ValueError, match="use_grouped_moe before apply_lora"):
        apply_lora(tiny_moe("qwen3_moe"), LoraConfig(rank=4))
    with pytest.raises(ConfigError, match=r"lora.export_adapter: PEFT does not load .* \(qwen2_moe\)"):
        adapted(LoraConfig(rank=4, export_adapter=True), "qwen2_moe")
    # A resume compares what the targets adapt in this model: the default's MLP names are the experts here
    model = moe_lora(LoraConfig(rank=4))
    check_lora("ckpt", {"rank": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                      "down_proj"]}, model)
    with pytest.raises(ConfigError, match=r"trained with lora.rank=4 on \['q_proj'\], and this run has lora.rank=4 on "
                                          r"\['down_proj', 'gate_up_proj', 'k_proj', 'o_proj', 'q_proj', 'v_proj'\]"):
        check_lora("ckpt", {"rank": 4, "target_modules": ["q_proj"]}, model)
    with pytest.raises(ConfigError, match=r"trained with lora.rank=0"):
        check_lora("ckpt", {}, model)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_checkpoint_keeps_the_expert_adapters_and_exports_them(one_rank, tmp_path):
    """build_policy's sharded policy (the hub's one tensor per expert loaded into the fused experts), one AdamW step,
    checkpoint.save; a fresh policy (other adapters: another seed) loads it: every adapter and moment as saved, and
    the checkpoint holds the adapters alone. `python -m rl.export` of it: the merged folder (the base's experts fused,
    the adapters merged) loads in transformers as the trained policy, and so does the adapter alone in PEFT. A
    checkpoint without the experts' adapters (written when they took none) is refused in one line."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from rl.run import checkpoint
    from rl.run.export import export_checkpoint
    from rl.train.policy import build_policy
    from tests.expert_parallel_training import full_state

    folder = tmp_path / "model"
    tiny_moe("qwen3_moe").save_pretrained(folder)
    cfg, lora = ModelConfig(path=str(folder), attn_implementation="sdpa"), LoraConfig(rank=4, alpha=8.0)

    def policy(seed: int):
        model = build_policy(cfg, one_rank, torch.device("cpu"), seed, 64, lora=lora)
        return model, build_optimizer(model, TrainConfig(lr=1e-2), fused=False)[0]

    def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().clone() for n, p in model.named_parameters() if "lora_" in n}

    model, optimizer = policy(seed=0)
    model(IDS).logits.square().mean().backward()
    optimizer.step()
    saved = full_state(model, optimizer) | adapters(model)
    state = checkpoint.TrainerState(0, 1, {"lora": dataclasses.asdict(lora), "model": {"path": str(folder)}}, 1,
                                    {"data": {}, "scheduler": {}, "health": {}})
    path = checkpoint.save(tmp_path / "run", state, {"model": (model, optimizer)}, [folder], keep_last=1)
    fresh = policy(seed=1)
    assert not torch.equal(fresh[0].model.layers[0].mlp.experts.down_proj_lora_A.full_tensor(),
                           saved["model.layers.0.mlp.experts.down_proj_lora_A"])
    checkpoint.load(path, {"model": fresh})
    resumed = full_state(*fresh) | adapters(fresh[0])
    assert "optim.model.layers.1.mlp.experts.gate_up_proj_lora_B.exp_avg" in saved and saved.keys() == resumed.keys()
    assert [k for k in saved if not torch.equal(saved[k], resumed[k])] == []
    written = dcp.FileSystemReader(str(path / "model_optim")).read_metadata().state_dict_metadata
    tensors = [k for k in written if not k.startswith("optim.param_groups")]
    assert any("experts.down_proj_lora_A" in k for k in tensors) and all("lora_" in k for k in tensors)

    peft = pytest.importorskip("peft")
    with torch.no_grad():
        trained = model(IDS).logits
        base = AutoModelForCausalLM.from_pretrained(folder).eval()
        merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(path, tmp_path / "merged")).eval()
        torch.testing.assert_close(merged(IDS).logits, trained, rtol=1e-5, atol=1e-5)
        assert (base(IDS).logits - trained).abs().max() > 1e-3
        adapter = export_checkpoint(path, tmp_path / "adapter", adapter=True)
        torch.testing.assert_close(peft.PeftModel.from_pretrained(base, adapter).eval()(IDS).logits, trained,
                                   rtol=1e-5, atol=1e-5)

    # A checkpoint of the default targets written when the experts took no adapters (attention's alone): one line
    attention = LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    old = build_policy(cfg, one_rank, torch.device("cpu"), 0, 64, lora=attention)
    old_path = checkpoint.save(tmp_path / "old", state, {"model": (old, build_optimizer(old, TrainConfig())[0])}, [],
                               keep_last=1)
    with pytest.raises(ConfigError, match=r"holds no model.layers.0.mlp.experts.down_proj_lora_A \(8 of this run"):
        checkpoint.load(old_path, {"model": policy(seed=0)})


def test_the_memory_plan_counts_the_expert_adapters():
    from rl.model.shape import ModelShape
    from rl.run import memory

    s = ModelShape(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, moe_layers=(0, 1), num_experts=8, experts_per_token=2, moe_intermediate_size=32)
    # rank 4 per expert: gate_up 4 x (64 + 64), down 4 x (32 + 64); 8 experts
    assert memory.expert_lora_params(s, 4, ["gate_up_proj", "down_proj"]) == 8 * (512 + 384)
    model = moe_lora(LoraConfig(rank=4))
    counted = sum(memory.lora_layer_params(s, 4, list(LoraConfig().target_modules)))
    assert counted == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    # train.expert_parallel=2 splits the experts' adapters with their experts; FSDP2 shards the rest over 4 ranks
    experts = 2 * 8 * (512 + 384)
    assert memory.rank_lora_params(s, 4, ["q_proj", "gate_up_proj", "down_proj"], 4, 2) == \
        (2 * 4 * (64 + 64)) / 4 + experts / 2


def test_lora_on_qwen3_next_adapts_its_experts_and_the_engine_follows():
    """Qwen3-Next (linear-attention layers, MoE blocks with a shared expert beside a dense layer): the default targets
    adapt the full-attention projections, the MLPs and the routed experts, and the merged push brings the engine to
    the trainer's logprobs."""
    from rl.model.linear_attention import use_packed_linear_attention
    from tests.test_families import random_model
    from tests.test_qwen35_engine import qwen3_next_config

    model = random_model(qwen3_next_config(), seed=1)
    use_grouped_moe(model)
    use_packed_linear_attention(model)
    adapted = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    assert sorted(p for p in adapted if ".experts." in p) == [f"model.layers.{i}.mlp.experts.{name}"
                                                              for i in (0, 2, 3) for name in ("down_proj",
                                                                                              "gate_up_proj")]
    init_adapters(model, 0)
    randomize_adapters(model, 7)
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, page_size=8,
                          max_context_len=256, seed=0)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    assert engine_vs_trainer(engine, model) < 1e-4
