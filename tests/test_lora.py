"""LoRA (rl/train/lora.py): the adapted layer against a hand-built LoRA forward, the frozen base, the merged weights the
engine receives, and a 2-rank run that resumes exactly and exports a merged folder and a PEFT adapter."""

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from rl.config import ConfigError, LoraConfig, TrainConfig
from rl.data import Sample
from rl.rollout import SamplingParams
from rl.rollout.native import NativeEngine
from rl.run.export import export_checkpoint
from rl.train.lora import ADAPTER_WEIGHTS, LoRALinear, adapted_layers, apply_lora, init_adapters, merge
from rl.train.policy import build_optimizer
from rl.train.step import collate, token_logprobs
from rl.train.weights import iter_merged_weights, sync_weights
from tests.test_checkpoint import launch, rows
from tests.tiny import save_tiny_model_dir, tiny_model, write_arithmetic_jsonl

LORA = LoraConfig(rank=4, alpha=8.0)


def lora_model(seed: int = 0, cfg: LoraConfig = LORA, **kwargs) -> torch.nn.Module:
    """The tiny model with adapters whose B is random too (B starts at zero: the update would be invisible)."""
    model = tiny_model(seed, **kwargs)
    apply_lora(model, cfg)
    init_adapters(model, seed)
    randomize_b(model, seed)
    return model


def randomize_b(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)


def test_the_adapted_layer_is_the_hand_built_lora_forward_with_its_gradients():
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 24)
    layer = LoRALinear(base, rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(4, 16))
        layer.lora_B.copy_(torch.randn(24, 4))
    x = torch.randn(3, 5, 16)
    # y = x @ W.T + b + scale * (x @ A.T) @ B.T, scale = alpha / rank, on leaf copies of every tensor
    w, b = base.weight.detach().clone(), base.bias.detach().clone()
    a_ref = layer.lora_A.detach().clone().requires_grad_()
    b_ref = layer.lora_B.detach().clone().requires_grad_()
    expected = x @ w.T + b + (8.0 / 4) * (x @ a_ref.T) @ b_ref.T
    out = layer(x)
    torch.testing.assert_close(out, expected)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(layer.lora_A.grad, a_ref.grad)
    torch.testing.assert_close(layer.lora_B.grad, b_ref.grad)
    assert layer.weight.grad is None and layer.bias.grad is None  # the base is frozen: no gradient is ever built
    assert layer.weight is base.weight  # the replaced layer's own tensor, not a copy
    torch.testing.assert_close(merge(w, a_ref.detach(), b_ref.detach(), 2.0), w + 2.0 * b_ref.detach() @ a_ref.detach())


def test_dropout_acts_only_in_the_passes_that_train():
    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(16, 24), rank=4, alpha=8.0, dropout=0.5)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(4, 16))
        layer.lora_B.copy_(torch.randn(24, 4))
    x = torch.randn(8, 16)
    layer.train()
    with torch.no_grad():  # old-logprob and reference passes: the deterministic model the engine samples from
        first, second = layer(x), layer(x)
    layer.eval()
    plain = layer(x).detach()
    layer.train()
    assert torch.equal(first, second) and torch.equal(first, plain)
    assert not torch.equal(layer(x), plain)  # a pass that builds a graph drops inputs of the adapters


def test_adapters_start_as_the_base_and_merge_into_the_same_model():
    ids = torch.tensor([[1, 5, 9, 13, 40, 41, 7]])
    plain = tiny_model(0)
    adapted = tiny_model(0)
    names = apply_lora(adapted, LORA)
    assert len(names) == 2 * 7 and all(n.rpartition(".")[2] in LORA.target_modules for n in names)
    init_adapters(adapted, seed=3)
    again = tiny_model(0)
    apply_lora(again, LORA)
    init_adapters(again, seed=3)
    for (_, a), (_, b) in zip(adapted_layers(adapted).items(), adapted_layers(again).items()):
        assert torch.equal(a.lora_A, b.lora_A) and a.lora_A.abs().max() > 0 and not a.lora_B.any()
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, plain(ids).logits)  # B = 0: the base model exactly
        randomize_b(adapted, 3)
        merged = dict(iter_merged_weights(adapted, torch.float32, 1 << 16))  # several buckets
        assert set(merged) == set(plain.state_dict())  # a checkpoint's names, no computed buffer
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
        assert (plain(ids).logits - tiny_model(0)(ids).logits).abs().max() > 1e-3


def test_the_optimizer_holds_the_adapters_alone_and_the_base_never_moves():
    model = lora_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {id(p) for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
    optimizer, _ = build_optimizer(model, TrainConfig(lr=1e-2), fused=False)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == adapters
    model(torch.tensor([[1, 5, 9, 13]])).logits.square().mean().backward()
    optimizer.step()
    assert {id(p) for p in optimizer.state} == adapters
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in adapters), name
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_bad_lora_keys_and_a_resume_into_other_adapters_are_one_line_each(tmp_path):
    from rl.config import config_from_dict
    from rl.run.checkpoint import check_lora

    base = {"model": {"path": "m"}, "data": {"source": "d.jsonl"}}
    for lora, key in (({"rank": -1}, "lora.rank"), ({"rank": 4, "dropout": 1.0}, "lora.dropout"),
                      ({"rank": 4, "alpha": 0}, "lora.alpha"),
                      ({"rank": 4, "target_modules": []}, "lora.target_modules")):
        with pytest.raises(ConfigError, match=key):
            config_from_dict({**base, "lora": lora})
    with pytest.raises(ConfigError, match=r"lora.target_modules: no layer of Qwen2ForCausalLM is named \['qkv'\]"):
        apply_lora(tiny_model(0), LoraConfig(rank=4, target_modules=["qkv", "q_proj"]))
    with pytest.raises(ConfigError, match="tied"):
        apply_lora(tiny_model(0, tie=True), LoraConfig(rank=4, target_modules=["lm_head"]))
    model = lora_model()
    check_lora(tmp_path, {"rank": 4, "target_modules": list(LORA.target_modules)}, model)
    with pytest.raises(ConfigError, match="was trained with lora.rank=8 .* this run has lora.rank=4"):
        check_lora(tmp_path, {"rank": 8, "target_modules": list(LORA.target_modules)}, model)
    with pytest.raises(ConfigError, match="lora.rank=0 on no layers"):
        check_lora(tmp_path, {}, model)


def test_the_kl_reference_of_a_lora_policy_is_its_own_base_with_the_adapters_off():
    from rl.train.reference import BaseOfPolicy
    from rl.train.step import logprob_rows

    model = lora_model()
    samples = []
    for i, tokens in enumerate([[1, 5, 9, 13, 40, 41], [1, 7, 7, 3]]):
        s = Sample(prompt="", tokens=tokens[:3], index=i, group_index=i)
        s.append_response_tokens(tokens[3:], [0.0] * len(tokens[3:]))
        samples.append(s)
    micro_batches = [collate(samples, torch.device("cpu"))]
    (adapted,) = logprob_rows(model, micro_batches, 1.0)
    (reference,) = BaseOfPolicy(model).logprobs(micro_batches, 1.0)
    (base,) = logprob_rows(tiny_model(0), micro_batches, 1.0)
    assert reference.shape == base.shape == (2, 5)  # both samples' rows
    assert torch.equal(reference, base)
    assert float((adapted - base).abs().max()) > 1e-3  # the adapters did something
    (again,) = logprob_rows(model, micro_batches, 1.0)  # and are back on after the reference pass
    assert torch.equal(again, adapted)


class Recorder:
    """An engine in front of the native one that remembers the names each push sent."""

    def __init__(self, engine):
        self.engine, self.names = engine, []

    def load_weights(self, weights):
        self.names.append([])

        def seen():
            for name, tensor in weights:
                self.names[-1].append(name)
                yield name, tensor
        self.engine.load_weights(seen())


def engine_vs_trainer(engine: NativeEngine, model: torch.nn.Module) -> float:
    """The largest |engine logprob - trainer logprob| over 4 sampled responses."""
    prompts = [[1, 5 + i, 9, 13] for i in range(4)]
    samples = []
    for i, (p, o) in enumerate(zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=6)))):
        s = Sample(prompt="", tokens=list(p), index=i, group_index=i)
        s.append_response_tokens(o.token_ids, o.logprobs)
        samples.append(s)
    mb = collate(samples, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, mb, 1.0)
    return float(((lp - mb.rollout_logprobs).abs() * mb.loss_mask).max())


def test_the_engine_generates_with_the_merged_weights_after_a_full_and_a_changed_only_push():
    model = lora_model()
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0)
    pushes = Recorder(engine)
    sync_weights(model, pushes, torch.float32, bucket_mb=0.05)
    assert engine_vs_trainer(engine, model) < 1e-4
    randomize_b(model, 7)  # the adapters move; the base does not
    before = engine_vs_trainer(engine, model)
    sync_weights(model, pushes, torch.float32, bucket_mb=0.05, changed_only=True)
    assert before > 1e-3 and engine_vs_trainer(engine, model) < 1e-4
    adapted = set(adapted_layers(model))
    assert sorted(pushes.names[1]) == sorted(f"{p}.weight" for p in adapted)  # merged weights, no adapters
    assert len(pushes.names[0]) > len(pushes.names[1]) and not any("lora" in n for n in pushes.names[0])


# ---------------------------------------------------------------------------- 2 ranks: the run, its resume, exports

RUN = ("--lora.rank=4", "--lora.alpha=8", "--lora.dropout=0.1", "--lora.export_adapter=true", "--train.lr=1e-2",
       "--model.gradient_checkpointing=true", "--train.packing=true", "--train.micro_batch_tokens=256",
       "--rollout.sleep_level=1", "--checkpoint.interval=1", "--algo.kl_coef=0.01")
COMPARED = ["rollout_id", "weight_version", "rollout/reward_mean", "train/loss", "train/grad_norm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 rollouts straight, and the same run resumed from the straight run's first checkpoint in a new folder."""
    root = tmp_path_factory.mktemp("lora")
    inputs = save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")
    straight, resumed = root / "straight", root / "resumed"
    launch(inputs, straight, 2, "--train.num_rollout=2", *RUN)
    launch(inputs, resumed, 2, "--train.num_rollout=2", *RUN,
           f"--checkpoint.resume={straight / 'checkpoints' / 'rollout_0'}")
    return inputs[0], straight, resumed


def test_a_lora_run_on_two_ranks_resumes_exactly_from_a_checkpoint_of_adapters_alone(runs):
    _, straight, resumed = runs
    a, b = rows(straight), rows(resumed)
    assert [r["rollout_id"] for r in a] == [0, 1] and [r["rollout_id"] for r in b] == [1]
    assert {k: a[1][k] for k in COMPARED} == {k: b[0][k] for k in COMPARED}
    assert all(r["train/grad_norm"] > 0 for r in a)
    # The KL reference is the policy's base with the adapters off: 0 before the first update, then not
    assert a[0]["train/kl_ref"] == 0 and a[1]["train/kl_ref"] > 0
    for folder, file in (("final_adapter", "adapter_model.safetensors"), ("final", "model.safetensors")):
        wa, wb = load_file(straight / folder / file), load_file(resumed / folder / file)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), folder
    import torch.distributed.checkpoint as dcp
    saved = dcp.FileSystemReader(str(straight / "checkpoints" / "rollout_1" / "model_optim")).read_metadata()
    tensors = [k for k in saved.state_dict_metadata if not k.startswith("optim.param_groups")]
    assert tensors and all(".lora_A" in k or ".lora_B" in k for k in tensors)  # no base weight, no base moments


def test_a_resume_into_other_adapters_stops_with_one_line(runs, tmp_path):
    import shutil

    base, straight, _ = runs
    copy = tmp_path / "run"
    shutil.copytree(straight, copy)
    proc = launch((base, straight.parent / "train.jsonl"), copy, 2, "--train.num_rollout=3", *RUN, "--lora.rank=8",
                  check=False)
    assert proc.returncode != 0
    assert "was trained with lora.rank=4" in proc.stdout + proc.stderr


def trainer_logits(base_dir, adapter_dir, ids: torch.Tensor) -> torch.Tensor:
    """The trainer's LoRA forward (base + LoRALinear layers) with the exported adapter's A and B."""
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    apply_lora(model, LoraConfig(rank=config["r"], alpha=config["lora_alpha"], target_modules=config["target_modules"]))
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(saved[f"base_model.model.{name}.weight"])
        return model(ids).logits


def test_the_merged_export_loads_with_transformers_as_the_trained_lora_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    base, straight, _ = runs
    ids = torch.tensor([[1, 5, 9, 13, 40, 41, 7, 3]])
    with torch.no_grad():
        final = AutoModelForCausalLM.from_pretrained(straight / "final").eval()(ids).logits
        initial = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
    torch.testing.assert_close(final, trainer_logits(base, straight / "final_adapter", ids), rtol=1e-5, atol=1e-5)
    assert (final - initial).abs().max() > 1e-3  # trained, not the base
    assert not any("lora" in k for k in load_file(straight / "final" / "model.safetensors"))
    # Offline, from the last checkpoint (`python -m rl.export [--adapter]`): the base read from model.path again, the
    # same folders bit for bit.
    last = straight / "checkpoints" / "rollout_1"
    for adapter, folder, file in ((False, "final", "model.safetensors"), (True, "final_adapter", ADAPTER_WEIGHTS)):
        out = export_checkpoint(last, tmp_path / folder, adapter=adapter)
        got, want = load_file(out / file), load_file(straight / folder / file)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), folder


def test_peft_loads_the_exported_adapter(runs):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base, straight, _ = runs
    ids = torch.tensor([[1, 5, 9, 13, 40, 41, 7, 3]])
    with torch.no_grad():
        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), straight / "final_adapter")
        adapted = model.eval()(ids).logits
        final = AutoModelForCausalLM.from_pretrained(straight / "final").eval()(ids).logits
    torch.testing.assert_close(adapted, final, rtol=1e-5, atol=1e-5)


def test_the_memory_plan_counts_gradients_and_moments_of_the_adapters_alone():
    from rl.config import config_from_dict
    from rl.run import memory
    from tests.test_memory import H200, TINY, seed_batch, shapes

    cfg = config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl"}, "lora": {"rank": 2}})
    # TINY (hidden 4, MLP 8, 2 heads of 2, 1 KV head), rank 2, per block: q 2 x (4 + 4), k and v 2 x (4 + 2) each,
    # o 2 x (4 + 4), gate and up 2 x (4 + 8) each, down 2 x (8 + 4): 128; 2 blocks: 256
    assert memory.lora_block_params(TINY, 2, cfg.lora.target_modules) == 16 + 12 + 12 + 16 + 24 + 24 + 24 == 128
    train = memory.plan_memory(cfg, memory.Models(TINY), world_size=1, device_type="cuda")["train"]
    assert train["policy params"] == 4 * (388 + 256)  # the base stays, fp32, beside the adapters
    assert train["policy AdamW"] == 2 * 4 * 256
    assert train["policy grads"] == 4 * 256 + 128 * (2 + 4)  # fp32 shards + one block's bf16 and fp32 copies
    # 7B on one H200 at the seed batch: refused full-parameter, fits with rank-64 adapters
    lora = dataclasses.replace(seed_batch(), lora=LoraConfig(rank=64))
    with pytest.raises(ConfigError):
        memory.check_fits(seed_batch(), shapes("qwen2.5-7b"), 1, H200)
    memory.check_fits(lora, shapes("qwen2.5-7b"), 1, H200)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_generates_with_the_merged_weights_after_each_push(tmp_path):
    from tests.test_distributed import run_loop

    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--rollout.engine=vllm",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--reward.user_fn=tests.reward_fns:digit_fraction",
                    "--lora.rank=4", "--lora.alpha=32", "--train.lr=1e-2", "--rollout.sleep_level=1")
    assert [r["weight_version"] for r in rows] == [2, 3]
    # sleep level 1: the engine keeps the base, and the push after rollout 0 sends the adapted layers alone, merged
    for row in rows:  # rollout 1 samples from the weights merged after rollout 0's update
        assert row["rollout/logprob_abs_diff_max"] < 1e-3


def test_compiled_lora_blocks_compile_no_more_graphs_than_full_parameter_ones():
    """With the base frozen, the first decoder block's input (the embeddings') asked for no gradient while every
    later block's did, so compiled blocks built a second train graph for it: at 0.5B the first step took 45 s
    against 12 s. LoRA's compiled blocks now compile as many graphs as full-parameter ones, and train the same
    adapters' gradients as uncompiled blocks."""
    from rl.config import AlgoConfig
    from rl.model.rope import unfuse_rope
    from rl.train.measure import graphs_compiled
    from rl.train.packing import use_packed_attention
    from rl.train.policy import compile_blocks
    from rl.train.step import build_schedule, train_on_rollout
    from tests.test_train_options import samples
    from tests.test_zero_advantage_skip import RecordingSGD

    batch = samples(12, seed=7)  # packed rows, as the recipes run compiled blocks (one row shape)
    train = TrainConfig(global_batch_size=12, micro_batch_tokens=96, clip_grad=0.0, packing=True)
    schedule = build_schedule(batch, train, 0, 1, torch.device("cpu"))

    def graphs_and_grads(model, compiled: bool):
        optimizer = RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        use_packed_attention(model)
        if compiled:
            compile_blocks(model)
        counts: dict[str, float] = {}
        try:
            with graphs_compiled(counts, "graphs"):
                with torch.no_grad():
                    token_logprobs(model, schedule.steps[0][0], 1.0)
                train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=train,
                                 algo=AlgoConfig(eps_clip_high=0.2), temperature=1.0)
        finally:
            unfuse_rope()
        return counts["graphs"], optimizer.grads

    torch._dynamo.reset()
    full_graphs, _ = graphs_and_grads(tiny_model(seed=0), True)
    lora_graphs, grads = graphs_and_grads(lora_model(), True)
    _, want = graphs_and_grads(lora_model(), False)  # the same adapters, uncompiled
    torch._dynamo.reset()  # later tests count the graphs they compile from none
    assert lora_graphs == full_graphs == 2  # one no-grad graph and one train graph
    assert len(grads) == len(want) == 2 * len(adapted_layers(lora_model()))
    assert all(torch.allclose(got, ref, atol=1e-5) for got, ref in zip(grads, want))


def test_compiled_blocks_take_their_floats_as_constants():
    """With dynamic shapes Dynamo passed each Python float a decoder block reads (LoRA's alpha / rank, the norms'
    epsilon) into the compiled graph as a float64 CPU tensor input: on an H200, Inductor's code generation for the
    0.5B LoRA block took 43 s against 3 s with them as constants, and the first train step 62 s against 21 s.
    Compiled blocks now meet no float64 input, with adapters or without."""
    from rl.model.rope import unfuse_rope
    from rl.train.policy import compile_blocks

    inputs: list[torch.dtype] = []

    def record(graph: torch.fx.Graph) -> None:  # Inductor's hook on each graph it compiles
        inputs.extend(n.meta["val"].dtype for n in graph.nodes
                      if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))

    for model in (tiny_model(seed=0), lora_model()):
        torch._dynamo.reset()
        compile_blocks(model)
        try:
            with torch._inductor.config.patch(post_grad_custom_pre_pass=record, force_disable_caches=True):
                ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
                model(input_ids=ids, use_cache=False).logits.float().sum().backward()
        finally:
            unfuse_rope()
            torch._dynamo.reset()
        assert inputs and torch.float64 not in inputs
        inputs.clear()


def test_lora_on_a_qwen2_moe_model_adapts_attention_shared_expert_and_experts_and_the_engine_follows():
    """Qwen2-MoE: the default targets put adapters on attention, the shared expert's linear layers and the routed
    experts' fused tensors (tests/test_lora_moe.py checks those against a hand merge), and the merged push brings the
    engine to the trainer's logprobs, routing included."""
    from rl.model.moe import use_grouped_moe
    from tests.test_moe_engine import tiny_moe

    model = tiny_moe("qwen2_moe")
    use_grouped_moe(model)
    adapted = apply_lora(model, LORA)
    assert sorted({path.split(".", 3)[3] for path in adapted}) == [
        "mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.shared_expert.down_proj",
        "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "self_attn.k_proj", "self_attn.o_proj",
        "self_attn.q_proj", "self_attn.v_proj"]
    init_adapters(model, 0)
    randomize_b(model, 3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_lora_B"):  # the experts' (randomize_b draws the linear layers')
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0, page_size=4)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    assert engine_vs_trainer(engine, model) < 1e-4


def test_lora_on_a_qwen35_model_adapts_attention_and_mlp_and_the_engine_follows():
    """Qwen3.5 (Gated DeltaNet layers beside gated full attention): the default targets put adapters on the full-
    attention layers' projections and every layer's MLP, none on the linear-attention projections, and the merged
    push (its buckets split between layers) brings the engine to the trainer's logprobs."""
    from rl.model.linear_attention import use_packed_linear_attention
    from tests.test_qwen35_engine import gated_model

    model = gated_model(seed=2)
    use_packed_linear_attention(model)
    adapted = apply_lora(model, LORA)
    assert not any(".linear_attn." in path for path in adapted)
    attention = [path for path in adapted if ".self_attn." in path]
    assert {path.rpartition(".")[2] for path in attention} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    full = {i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"}
    assert full and {int(path.split(".")[2]) for path in attention} == full
    layers = model.config.num_hidden_layers
    assert {int(p.split(".")[2]) for p in adapted if ".mlp." in p} == set(range(layers))
    init_adapters(model, 0)
    randomize_b(model, 3)
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0, page_size=4)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    assert engine_vs_trainer(engine, model) < 1e-4
