"""The grouped MoE forward (rl/model/moe.py) against transformers' own Qwen3-MoE and Qwen2-MoE blocks: outputs, the
whole model's logits and every gradient; routing replay (own ids change nothing, other ids are used with this forward's
router weights, the mismatch fraction); the auxiliary load-balancing loss; the policy built with its blocks, loaded
from fused or per-expert checkpoints (each rank stacking its own experts) and exported to a folder transformers
loads."""

import copy

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import rl.model.moe
from rl.config import ModelConfig
from rl.model.moe import (
    load_balancing_loss,
    moe_forward,
    moe_routing,
    recorded_experts,
    route,
    router_aux_loss,
    routing_mismatch,
    set_routing_replay,
    use_grouped_moe,
)
from rl.train.policy import build_policy
from tests.tiny import tiny_model

FAMILIES = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig}
EXPERTS, TOP_K, HIDDEN = 8, 2, 64


def tiny_moe(family: str, norm_topk_prob: bool = True, seed: int = 0, **kwargs) -> torch.nn.Module:
    """A 2-layer random MoE causal LM, float32, with weights large enough that the router's top-k is decided
    (transformers' 0.02 leaves its softmax nearly flat)."""
    cfg = FAMILIES[family](vocab_size=96, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           norm_topk_prob=norm_topk_prob, initializer_range=0.1, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def pair(family: str, norm_topk_prob: bool = True, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' model and a copy of it with the grouped blocks."""
    reference = tiny_moe(family, norm_topk_prob, **kwargs)
    patched = copy.deepcopy(reference)
    assert len(use_grouped_moe(patched)) == 2
    return reference, patched


def block(model: torch.nn.Module, layer: int = 0) -> torch.nn.Module:
    return model.model.layers[layer].mlp


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters()}


def hidden(tokens: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, tokens // 2, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_and_its_gradients_are_transformers_own(family, norm_topk_prob):
    reference, patched = pair(family, norm_topk_prob)
    x = hidden()
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, out = block(reference)(x_ref), block(patched)(x_new)
    assert (out - expected).abs().max() <= 1e-5
    upstream = torch.randn_like(out)
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=0, atol=1e-5)
    ours, theirs = grads(block(patched)), grads(block(reference))
    assert ours.keys() == theirs.keys() and "gate.weight" in ours  # the module's own parameters, by their names
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)
    assert ours["gate.weight"].abs().max() > 1e-3  # the router learns


@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_model_is_transformers_own_in_logits_and_gradients(family):
    reference, patched = pair(family)
    assert block(patched).forward.__func__ is moe_forward and block(reference).forward.__func__ is not moe_forward
    assert_same_model(reference, patched, torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(2)))


def assert_same_model(reference, patched, tokens: torch.Tensor) -> torch.Tensor:
    """The patched model's logits and every parameter's gradient of a cross-entropy are the reference's; returns its
    logits."""
    expected, logits = reference(tokens).logits, patched(tokens).logits
    assert (logits - expected).abs().max() <= 1e-5
    torch.nn.functional.cross_entropy(expected.flatten(0, 1), tokens.flatten()).backward()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    ours, theirs = grads(patched), grads(reference)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)
    return expected.detach()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_grouped_mm_path_computes_the_same(family, monkeypatch):
    """torch._grouped_mm runs on the CPU in float32 too (torch 2.9 and later, 16-byte aligned rows): the kernel the
    GPU takes in bf16, with the same offsets and weight layout, against transformers' loop."""
    monkeypatch.setattr(rl.model.moe, "_grouped_mm_supported", lambda x, weight: True)
    reference, patched = pair(family)
    x = hidden(tokens=40)
    expected, out = block(reference)(x), block(patched)(x)
    assert (out - expected).abs().max() <= 1e-5
    upstream = torch.randn_like(out)
    (expected * upstream).sum().backward()
    (out * upstream).sum().backward()
    theirs = grads(block(reference))
    for name, grad in grads(block(patched)).items():
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_models_own_experts_changes_nothing(family):
    _, model = pair(family)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    moe_routing(model).record_experts = True
    own = model(tokens).logits
    experts = recorded_experts(model)
    assert experts.shape == (2, 18, TOP_K)
    set_routing_replay(model, experts.view(2, 2, 9, TOP_K))
    assert torch.equal(model(tokens).logits, own)
    assert routing_mismatch(model) == 0.0
    set_routing_replay(model, torch.full_like(experts, -1))  # no record anywhere: every token routes itself
    assert torch.equal(model(tokens).logits, own)
    set_routing_replay(model, None)
    assert torch.equal(model(tokens).logits, own)


def expert_mlp(moe: torch.nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ moe.experts.gate_up_proj[e].T).chunk(2)
    return moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_experts_are_used_with_this_routers_weights(family, norm_topk_prob):
    _, model = pair(family, norm_topk_prob)
    moe = block(model)
    x = hidden()
    flat = x.view(-1, HIDDEN)
    probs = torch.softmax(flat @ moe.gate.weight.T, dim=-1)
    own = probs.topk(TOP_K).indices
    replay = own.clone()
    changed = [0, 5, 17]  # each of these tokens gets its two least likely experts: not its own pick
    for t in changed:
        replay[t] = probs[t].topk(TOP_K, largest=False).indices
    set_routing_replay(model, replay.unsqueeze(0).expand(2, -1, -1))
    out = moe(x).view(-1, HIDDEN)
    assert routing_mismatch(model) == pytest.approx(len(changed) / flat.shape[0])
    # token 5 by hand: its replayed experts, weighted by the softmax at those experts (renormalised or not)
    weights = probs[5, replay[5]]
    weights = weights / weights.sum() if norm_topk_prob else weights
    expected = sum(w * expert_mlp(moe, int(e), flat[5]) for w, e in zip(weights, replay[5]))
    if family == "qwen2_moe":
        expected = expected + torch.sigmoid(moe.shared_expert_gate(flat[5])) * moe.shared_expert(flat[5])
    torch.testing.assert_close(out[5], expected, rtol=0, atol=1e-5)
    out.square().sum().backward()
    assert moe.gate.weight.grad.abs().max() > 1e-3  # the router still learns under replay
    assert all(moe.experts.down_proj.grad[e].abs().max() > 0 for e in replay[5])


def test_the_recomputation_of_activation_checkpointing_replays_too():
    """The backward of a checkpointed layer runs its forward again: it must route to the replayed experts, so the
    gradients are those of the replayed forward without checkpointing."""
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    replay = torch.randint(0, EXPERTS, (2, 18, 1), generator=torch.Generator().manual_seed(7))
    replay = torch.cat([replay, (replay + 3) % EXPERTS], dim=-1)  # two distinct experts per token
    runs = []
    for checkpointing in (False, True):
        _, model = pair("qwen3_moe")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        set_routing_replay(model, replay)
        model(tokens).logits.square().mean().backward()
        runs.append(grads(model))
    for name, grad in runs[0].items():
        torch.testing.assert_close(runs[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_the_mismatch_counts_only_masked_tokens_with_a_record():
    _, model = pair("qwen3_moe")
    moe, x = block(model), hidden()
    probs = torch.softmax(x.view(-1, HIDDEN) @ moe.gate.weight.T, dim=-1)
    replay = probs.topk(TOP_K).indices.flip(-1)  # each token's own experts in the other order: the same set
    replay[1] = probs[1].topk(TOP_K, largest=False).indices  # differs: counted
    replay[2] = probs[2].topk(TOP_K, largest=False).indices  # differs, but masked out
    replay[3] = -1  # no record: its own experts, not counted
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    mask.view(-1)[2] = False
    set_routing_replay(model, replay.unsqueeze(0).expand(2, -1, -1), mask)
    moe(x)
    assert routing_mismatch(model) == pytest.approx(1 / (replay.shape[0] - 2))


def test_replay_of_the_wrong_shape_stops_with_the_shapes():
    _, model = pair("qwen3_moe")
    with pytest.raises(ValueError, match=r"the model wants \(2 MoE layers, ..., 2\)"):
        set_routing_replay(model, torch.zeros(3, 10, TOP_K, dtype=torch.long))
    with pytest.raises(ValueError, match="expert id 8, the model has 8 experts"):
        set_routing_replay(model, torch.full((2, 10, TOP_K), EXPERTS))
    set_routing_replay(model, torch.zeros(2, 10, TOP_K, dtype=torch.long))
    with pytest.raises(ValueError, match="holds 10 tokens per layer, the forward has 24"):
        block(model)(hidden())


def test_route_renormalises_the_top_k_where_the_config_says():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    experts, weights, own = route(logits, 2, norm_topk_prob=True)
    probs = torch.softmax(logits, -1)[0]
    assert experts.tolist() == own.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], probs[:2] / probs[:2].sum())
    torch.testing.assert_close(route(logits, 2, norm_topk_prob=False)[1][0], probs[:2])
    replayed, weights, _ = route(logits, 2, norm_topk_prob=True, replay=torch.tensor([[3, 1]]))
    assert replayed.tolist() == [[3, 1]]
    torch.testing.assert_close(weights[0], probs[[3, 1]] / probs[[3, 1]].sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_aux_loss_is_transformers_load_balancing_loss(family):
    reference, model = pair(family, output_router_logits=True, router_aux_loss_coef=0.01)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    out = model(tokens, attention_mask=mask)  # transformers' recorders still see the router (its aux_loss)
    expected = load_balancing_loss_func(out.router_logits, EXPERTS, TOP_K, mask)
    assert moe_routing(model).record_logits  # on from the config's output_router_logits
    torch.testing.assert_close(router_aux_loss(model, mask), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.aux_loss, reference(tokens, attention_mask=mask).aux_loss, rtol=1e-5, atol=0)
    logits = tuple(torch.randn(30, EXPERTS, generator=torch.Generator().manual_seed(s)) for s in range(3))
    torch.testing.assert_close(load_balancing_loss(logits, EXPERTS, TOP_K),
                               load_balancing_loss_func(logits, EXPERTS, TOP_K), rtol=1e-6, atol=0)
    model(tokens, attention_mask=mask)  # the logits are read once: a fresh forward for the gradient
    router_aux_loss(model, mask).backward()
    assert block(model).gate.weight.grad.abs().max() > 0


def test_a_dense_model_is_left_as_it_is():
    model = tiny_model(0)
    assert use_grouped_moe(model) == [] and not hasattr(model, "moe_routing")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    dist.destroy_process_group()


def test_the_policy_is_built_with_the_grouped_blocks(one_rank, tmp_path):
    reference = tiny_moe("qwen2_moe")
    # The module's own names (experts fused), which the policy's loader reads; transformers' save_pretrained
    # writes the per-expert layout of the hub's checkpoints instead.
    (tmp_path / "model").mkdir()
    reference.config.save_pretrained(tmp_path / "model")
    save_file({n: t.contiguous() for n, t in reference.state_dict().items()}, tmp_path / "model/model.safetensors")
    policy = build_policy(ModelConfig(path=str(tmp_path / "model")), one_rank, torch.device("cpu"), seed=0,
                          max_context_len=64)
    assert all(block(policy, i).forward.__func__ is moe_forward for i in range(2))
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (policy(tokens).logits - reference(tokens).logits).abs().max() <= 1e-5


# ---------------------------------------------------------------------------- checkpoint layouts of the experts
# transformers 5 holds the experts fused (experts.gate_up_proj (E, 2I, H), gate rows first; experts.down_proj
# (E, H, I)); the hub's checkpoints, and transformers' own save_pretrained, hold one tensor per expert.


def per_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in the hub's layout, written by hand: experts.N.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, down in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def write_sharded(state: dict[str, torch.Tensor], folder, config) -> None:
    """`state` in two safetensors shards with an index (a layer's experts spread over both), beside config.json."""
    import json
    folder.mkdir()
    config.save_pretrained(folder)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, folder / file)
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def policy_of(folder, mesh) -> torch.nn.Module:
    return build_policy(ModelConfig(path=str(folder)), mesh, torch.device("cpu"), seed=0, max_context_len=64)


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_of_transformers_save_pretrained_loads_to_its_logits(one_rank, tmp_path, family):
    reference = tiny_moe(family)
    reference.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    expected = logits_of(loaded)
    assert (expected - logits_of(reference)).abs().max() <= 1e-5
    assert (logits_of(policy_of(tmp_path / "model", one_rank)) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_per_expert_folder_is_stacked_into_the_fused_experts(one_rank, tmp_path, family):
    reference = tiny_moe(family)
    state = per_expert_state(reference)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in state
    assert not any(k.endswith("gate_up_proj") for k in state)
    write_sharded(state, tmp_path / "model", reference.config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    expected = logits_of(loaded)
    policy = policy_of(tmp_path / "model", one_rank)
    for layer in range(2):  # the exact tensors, gate rows first, not just logits that happen to agree
        for name in ("gate_up_proj", "down_proj"):
            own = getattr(block(policy, layer).experts, name).full_tensor()  # one rank: its shard is the whole
            assert torch.equal(own, getattr(block(reference, layer).experts, name))
    assert (logits_of(policy) - expected).abs().max() <= 1e-5


def test_a_missing_expert_stops_naming_the_folder_and_the_tensor(one_rank, tmp_path):
    from rl.config import ConfigError
    reference = tiny_moe("qwen3_moe")
    state = per_expert_state(reference)
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    write_sharded(state, tmp_path / "model", reference.config)
    with pytest.raises(ConfigError) as e:
        policy_of(tmp_path / "model", one_rank)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "model") in message
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in message and "experts.gate_up_proj" in message


def test_an_expert_the_model_does_not_have_is_unexpected(one_rank, tmp_path):
    from rl.config import ConfigError
    reference = tiny_moe("qwen2_moe")
    state = per_expert_state(reference)
    extra = state["model.layers.0.mlp.experts.0.down_proj.weight"].clone()
    state["model.layers.0.mlp.experts.8.down_proj.weight"] = extra  # the model has experts 0..7
    write_sharded(state, tmp_path / "model", reference.config)
    with pytest.raises(ConfigError, match=r"unexpected 1 \(model\.layers\.0\.mlp\.experts\.8\.down_proj\.weight\)"):
        policy_of(tmp_path / "model", one_rank)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_of_a_per_expert_policy_loads_in_transformers_to_the_same_logits(one_rank, tmp_path, family):
    from rl.run.export import export_policy
    reference = tiny_moe(family)
    reference.save_pretrained(tmp_path / "model")
    policy = policy_of(tmp_path / "model", one_rank)
    export_policy(policy, [tmp_path / "model"], tmp_path / "final", "float32", is_main=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    expected = logits_of(reference)
    assert (logits_of(exported) - expected).abs().max() <= 1e-5
    assert (logits_of(policy_of(tmp_path / "final", one_rank)) - expected).abs().max() <= 1e-5


def _two_rank_load(rank: int, folder: str, store: str, out: str) -> None:
    """One of two ranks: builds the policy from `folder` and writes its own expert rows and the whole tensors."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        policy = policy_of(folder, mesh)
        experts = block(policy, 1).experts
        torch.save({"local": experts.gate_up_proj.to_local().clone(), "full": experts.gate_up_proj.full_tensor(),
                    "down": experts.down_proj.full_tensor(), "logits": logits_of(policy)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_each_rank_stacks_its_own_experts(tmp_path):
    import torch.multiprocessing as mp
    reference = tiny_moe("qwen3_moe")
    write_sharded(per_expert_state(reference), tmp_path / "model", reference.config)
    mp.spawn(_two_rank_load, args=(str(tmp_path / "model"), str(tmp_path / "store"), str(tmp_path / "out")),
             nprocs=2, join=True)
    fused = block(reference, 1).experts
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert torch.equal(got["local"], fused.gate_up_proj[4 * rank : 4 * rank + 4])  # 8 experts over 2 ranks
        assert torch.equal(got["full"], fused.gate_up_proj) and torch.equal(got["down"], fused.down_proj)
        assert (got["logits"] - logits_of(reference)).abs().max() <= 1e-5


def test_a_record_with_a_missing_slot_routes_the_token_by_its_own_choice_whole():
    """Logits that make experts 5 then 2 the top two: a record [2, -1] must not become [2, 2] (expert 2 alone, one
    expert chosen twice) but the token's own [5, 2]."""
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, 4.0], [1.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    replay = torch.tensor([[2, -1], [0, 4]])
    experts, weights, own = route(logits, 2, True, replay)
    assert experts.tolist() == [[5, 2], [0, 4]] and own[0].tolist() == [5, 2]
    probs = torch.softmax(logits, -1)
    assert weights[1].tolist() == pytest.approx((probs[1, [0, 4]] / probs[1, [0, 4]].sum()).tolist())


def test_qwen3_next_blocks_are_grouped_and_replayed():
    """Qwen3-Next's sparse blocks (Qwen2-MoE's layout: a shared expert behind a sigmoid gate) take the grouped forward:
    the whole hybrid model's logits and gradients are transformers' own, and replaying its own experts changes
    nothing while other experts change the logits."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                          linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                          initializer_range=0.1)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    patched = copy.deepcopy(reference)
    assert len(use_grouped_moe(patched)) == 2
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    expected = assert_same_model(reference, patched, tokens)
    moe_routing(patched).record_experts = True
    with torch.no_grad():
        patched(tokens)
        own = recorded_experts(patched).view(2, 2, 9, TOP_K)
        set_routing_replay(patched, own)
        assert (patched(tokens).logits - expected).abs().max() <= 1e-5 and routing_mismatch(patched) == 0.0
        set_routing_replay(patched, (own + 1) % EXPERTS)
        assert (patched(tokens).logits - expected).abs().max() > 1e-3 and routing_mismatch(patched) > 0.5
        set_routing_replay(patched, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM's own path: CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_decoder_block_on_cuda_is_one_graph(family):
    """The trainer compiles each decoder block (`model.compile`); on CUDA in bf16 its grouped MoE block takes
    torch's grouped GEMM, whose segments stay on the device, so nothing in the block needs the host and Dynamo
    traces it whole. A graph break costs a step of many small micro-batches host time at every block, forward
    and backward."""
    from rl.model.rope import fuse_rope, unfuse_rope
    model = tiny_moe(family).to("cuda", torch.bfloat16)
    use_grouped_moe(model)
    fuse_rope(model)
    layer = model.model.layers[0]
    seen = {}
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    try:
        model(torch.randint(0, 96, (2, 24), device="cuda"))
        handle.remove()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer.forward)(*seen["args"], **seen["kwargs"])
    finally:
        unfuse_rope()
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
