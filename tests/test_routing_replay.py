"""MoE routing replay in the train step (train.routing_replay): the engine's recorded experts laid out in a
micro-batch's tokens (padded and packed rows) are the experts the trainer's forward uses at every token, prompt and
response; other recorded ids change the logprobs; train/routing_mismatch is 0 when the record is the trainer's own
routing and counts what replay hides otherwise; the router's aux loss is transformers' and joins the loss with its
coefficient; a run that cannot replay is refused in one line. Tiny random Qwen3-MoE / Qwen2-MoE models on the CPU
in float32."""

import copy
import json
import random

import pytest
import torch

from rl.config import ConfigError, RunStopped, TrainConfig, check_paths, resolve
from rl.data import Sample
from rl.model.moe import moe_routing, recorded_experts, use_grouped_moe
from rl.train.packing import use_packed_attention
from rl.train.step import (
    build_schedule,
    fill_old_logprobs,
    real_tokens,
    route_as_recorded,
    token_logprobs,
    train_metrics,
    train_on_rollout,
)
from tests.test_config import make
from tests.test_moe import EXPERTS, tiny_moe
from tests.test_zero_advantage_skip import RecordingSGD

CPU = torch.device("cpu")
LAYERS = 2  # tiny_moe's MoE layers


def moe(family: str = "qwen3_moe", packing: bool = False, **config) -> torch.nn.Module:
    model = tiny_moe(family, **config)
    assert len(use_grouped_moe(model)) == LAYERS
    if packing:
        use_packed_attention(model)
    return model


def rollout(n: int = 5, seed: int = 0) -> list[Sample]:
    """Samples of a few prompt and response tokens (the tiny model's vocabulary is 96), a loss on every response
    token but one masked out (an environment's tokens), without routing yet."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = Sample(prompt="", tokens=[rng.randrange(96) for _ in range(rng.randint(3, 7))], index=i, group_index=0)
        k = rng.randint(3, 8)
        s.append_response_tokens([rng.randrange(96) for _ in range(k)], [-4.0] * k)
        s.loss_mask[1] = 0
        s.advantage = rng.uniform(-1, 1)
        out.append(s)
    return out


def own_routing(model, samples: list[Sample]) -> None:
    """Each sample's routed_experts as an engine computing the trainer's own forward records it: the experts each
    layer used for each token fed alone, -1 for the last token (never fed)."""
    state = moe_routing(model)
    state.record_experts = True
    with torch.no_grad():
        for s in samples:
            model(torch.tensor([s.tokens]))
            ids = recorded_experts(model).to(torch.int16)
            ids[:, -1] = -1
            s.routed_experts = ids
    state.record_experts = False


def other_routing(samples: list[Sample], seed: int = 1) -> None:
    """Each fed token recorded with two experts drawn at random (mostly not the trainer's own)."""
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        first = torch.randint(0, EXPERTS, (LAYERS, len(s.tokens), 1), generator=g)
        ids = torch.cat([first, (first + torch.randint(1, EXPERTS, first.shape, generator=g)) % EXPERTS], dim=-1)
        ids[:, -1] = -1
        s.routed_experts = ids.to(torch.int16)


def schedule_of(samples, packing: bool, replay: bool = True, **train):
    train = dict(micro_batch_size=2, micro_batch_tokens=24 if packing else 0, clip_grad=0.0) | train
    cfg = TrainConfig(global_batch_size=len(samples), packing=packing, routing_replay=replay, **train)
    return cfg, build_schedule(samples, cfg, 0, 1, CPU)


def starts(mb) -> list[int]:
    """Where each sample's first token sits among the forward's flattened input tokens."""
    if mb.documents is None:
        return [row * mb.input_ids.shape[1] for row in range(len(mb.indices))]
    return mb.documents.cu_seqlens[: len(mb.indices)].tolist()


@pytest.mark.parametrize("family, packing", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", True)])
def test_a_micro_batch_replays_the_recorded_experts_at_every_token(family, packing):
    model, samples = moe(family, packing), rollout()
    other_routing(samples)
    by_index = {s.index: s for s in samples}
    _, schedule = schedule_of(samples, packing)
    assert len(schedule.micro_batches) > 1 and max(len(mb.indices) for mb in schedule.micro_batches) > 1
    moe_routing(model).record_experts = True
    for mb in schedule.micro_batches:
        route_as_recorded(model, mb, replay=True)
        token_logprobs(model, mb, 1.0)
        used = recorded_experts(model)
        for index, start in zip(mb.indices, starts(mb), strict=True):
            s = by_index[index]
            fed = len(s.tokens) - 1  # every token but the last, prompt and response
            assert torch.equal(used[:, start : start + fed], s.routed_experts[:, :fed].long()), (family, index)


def own_logprobs(model, samples) -> None:
    """The samples' rollout logprobs are the trainer's own (routing by its own choice): the engine's, had its
    routing been the trainer's."""
    _, schedule = schedule_of(samples, False, replay=False)
    for mb in schedule.micro_batches:
        with torch.no_grad():
            lp = token_logprobs(model, mb, 1.0)[0]
        for row, index in enumerate(mb.indices):
            s = samples[index]
            s.rollout_log_probs = lp[row, s.prompt_length - 1 : len(s.tokens) - 1].tolist()


def train_step(model, samples, replay: bool, packing: bool = False, **train) -> dict:
    """One optimizer step that moves nothing, with the last forward's experts recorded; the step's metrics."""
    cfg, schedule = schedule_of(samples, packing, replay, **train)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if cfg.num_iterations > 1:
        fill_old_logprobs(model, schedule.micro_batches, 1.0, replay)
    moe_routing(model).record_experts = True
    out = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=cfg, algo=resolve_algo(),
                           temperature=1.0)
    out["last"], out["used"], out["grads"] = schedule.micro_batches[-1], recorded_experts(model), optimizer.grads
    assert moe_routing(model).replay is None  # the model's own routing again after the step
    return out | train_metrics([out], 1)


def resolve_algo():
    return resolve(make()).algo


@pytest.mark.parametrize("packing", [False, True])
def test_the_train_step_replays_and_logs_the_mismatch_replay_hides(packing, one_cpu_thread):
    model, samples = moe(packing=packing), rollout()
    own_logprobs(model, samples)
    own_routing(model, samples)
    for replay in (True, False):  # the record is the trainer's own routing: nothing to hide, nothing changes
        out = train_step(model, samples, replay, packing)
        assert out["train/routing_mismatch"] == 0.0
        assert out["rollout/logprob_abs_diff_mean"] < 1e-5
    other_routing(samples)
    off = train_step(model, samples, replay=False, packing=packing)
    assert off["train/routing_mismatch"] > 0.5  # random records: most (layer, token) sets differ from the own
    assert off["rollout/logprob_abs_diff_mean"] < 1e-5  # its own routing: the same logprobs as before
    on = train_step(model, samples, replay=True, packing=packing)
    assert on["train/routing_mismatch"] > 0.5  # the router's own choice, before replay replaced it
    assert on["rollout/logprob_abs_diff_mean"] > 1e-3  # another network: the replayed experts are used
    mb, used = on["last"], on["used"]  # the train step's last forward ran on the recorded experts
    known = mb.routed_experts >= 0
    assert known.any() and torch.equal(used[known], mb.routed_experts[known].long())


def test_activation_checkpointing_recomputes_each_micro_batch_with_its_replay(one_cpu_thread):
    """The backward of a checkpointed layer runs its forward again: with replay on, each micro-batch's recomputation
    routes by its own record, so the step's gradients are those without checkpointing."""
    samples = rollout()
    other_routing(samples)
    grads = []
    for checkpointing in (False, True):
        model = moe()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        grads.append(train_step(model, samples, replay=True)["grads"])
    for with_checkpoints, without in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(with_checkpoints, without, rtol=0, atol=1e-6)


def test_the_old_logprob_pass_replays_and_counts_before_the_update(one_cpu_thread):
    model, samples = moe(), rollout()
    other_routing(samples)
    _, schedule = schedule_of(samples, False)
    own = [token_logprobs(model, mb, 1.0)[0].detach() for mb in schedule.micro_batches]
    fill_old_logprobs(model, schedule.micro_batches, 1.0, replay=True)
    assert moe_routing(model).replay is None
    for mb, rows in zip(schedule.micro_batches, own, strict=True):
        assert ((mb.old_logprobs - rows).abs() * mb.loss_mask).max() > 1e-3
        differ, counted = mb.routing_counts
        trained = sum(sum(samples[i].loss_mask[:-1]) for i in mb.indices)  # response tokens fed, the last one not
        assert counted == LAYERS * trained > 0 and 0 < differ <= counted
    fill_old_logprobs(model, schedule.micro_batches, 1.0, replay=False)
    for mb, rows in zip(schedule.micro_batches, own, strict=True):
        torch.testing.assert_close(mb.old_logprobs, rows, rtol=0, atol=1e-5)
    out = train_step(model, samples, replay=True, num_iterations=2)  # the old pass's mismatch is the one logged
    assert out["train/routing_mismatch"] > 0.5


def test_the_kl_reference_routes_as_recorded_too(one_cpu_thread):
    """With replay the reference's logprobs take the recorded experts as the policy's do: a LoRA policy's reference
    (its own base, adapters off) at the first step, before the adapters move, gives the policy's old logprobs
    exactly, so the KL starts at 0 and measures the weights' drift, not the routers' disagreement."""
    from rl.config import LoraConfig
    from rl.train.lora import apply_lora, init_adapters
    from rl.train.reference import BaseOfPolicy

    model, samples = moe(), rollout()
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    init_adapters(model, 0)  # B = 0: the adapted policy is its base
    other_routing(samples)
    _, schedule = schedule_of(samples, False)
    fill_old_logprobs(model, schedule.micro_batches, 1.0, replay=True)
    reference = BaseOfPolicy(model)
    for replay, close in ((True, True), (False, False)):
        ref_rows = reference.logprobs(schedule.micro_batches, 1.0, replay)
        for mb, rows in zip(schedule.micro_batches, ref_rows, strict=True):
            gap = float(((mb.old_logprobs - rows).abs() * mb.loss_mask).max())
            assert (gap < 1e-5) == close, (replay, gap)
    assert moe_routing(model).replay is None


def test_a_sample_without_routing_stops_a_replay_run():
    samples = rollout()
    other_routing(samples)
    samples[2].routed_experts = None
    with pytest.raises(RunStopped, match=r"train.routing_replay: 1 of 5 samples carry no recorded routing .*\[2\]"):
        schedule_of(samples, False)
    _, schedule = schedule_of(samples, True, replay=False)  # without replay its tokens route themselves, uncounted
    mb = next(mb for mb in schedule.micro_batches if 2 in mb.indices)
    start = starts(mb)[mb.indices.index(2)]
    assert (mb.routed_experts[:, start : start + len(samples[2].tokens)] == -1).all()
    assert not mb.routing_mask[start : start + len(samples[2].tokens)].any()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_routers_aux_loss_is_transformers_and_joins_the_loss(family, one_cpu_thread):
    """transformers' aux loss (load_balancing_loss_func over the real tokens) of each micro-batch, averaged by their
    trained tokens, times router_aux_loss_coef in the loss; logged unscaled as train/router_aux_loss."""
    reference = tiny_moe(family, output_router_logits=True, router_aux_loss_coef=0.5)
    model = copy.deepcopy(reference)
    use_grouped_moe(model)
    samples = rollout(4)
    other_routing(samples)
    for size in (4, 2):  # one micro-batch, then two
        _, schedule = schedule_of(samples, False, micro_batch_size=size)
        assert len(schedule.micro_batches) == 4 // size
        with torch.no_grad():
            expected = sum(reference(mb.input_ids, attention_mask=real_tokens(mb).long()).aux_loss
                           * mb.loss_mask.sum() / schedule.step_tokens[0] for mb in schedule.micro_batches)
        runs = {}
        for coef in (0.5, 0.0):
            model.config.router_aux_loss_coef = coef
            runs[coef] = train_step(model, samples, replay=False, micro_batch_size=size)
        with_aux, without = runs[0.5], runs[0.0]
        torch.testing.assert_close(torch.tensor(with_aux["train/router_aux_loss"]), expected, rtol=1e-5, atol=0)
        assert "train/router_aux_loss" not in without
        assert with_aux["train/loss"] == pytest.approx(without["train/loss"] + 0.5 * float(expected), rel=1e-5)
    assert not moe_routing(model).router_logits  # nothing held on the device after the step
    with torch.no_grad():
        model(schedule.micro_batches[0].input_ids)
    assert not moe_routing(model).router_logits  # a pass that trains nothing records none


def test_a_replay_the_run_cannot_do_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"train.routing_replay needs rollout.engine='native', got 'vllm'"):
        resolve(make(rollout={"engine": "vllm"}, train={"routing_replay": True}))
    resolve(make(train={"routing_replay": True}))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    for kind, ok in (("qwen2", False), ("llama", False), ("qwen3_moe", True), ("qwen2_moe", True)):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": kind}))
        cfg = make(model={"path": str(folder), "tokenizer": str(tok)}, train={"routing_replay": True})
        if ok:
            check_paths(cfg)
        else:
            with pytest.raises(ConfigError, match=rf"train.routing_replay: model.path .* has model_type '{kind}', not "
                                                  r"a mixture of experts"):
                check_paths(cfg)
        check_paths(make(model={"path": str(folder), "tokenizer": str(tok)}))  # without replay: any model
