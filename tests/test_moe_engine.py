"""The native engine's MoE blocks (rl/model/decoder.py over rl/model/moe.py) against transformers' Qwen2-MoE and
Qwen3-MoE on CPU in float32: the logprobs of what it samples, greedy decoding token for token, and the expert ids
it records for every prompt and response token against those transformers' routers pick for the same tokens,
through continuous batching, continued samples and kept sequences."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from rl.model.decoder import Shape
from rl.model.moe import routing_mismatch, set_routing_replay, use_grouped_moe
from rl.rollout import SamplingParams, scheduler
from rl.rollout.native import NativeEngine
from rl.run.checks import check_native_architecture
from tests.test_engine import full_weights, reference_logprobs
from tests.tiny import tiny_model

FAMILIES = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig}
GREEDY = dict(temperature=1.0, top_k=1)
PROMPTS = [[1, 5, 9, 13, 2, 2, 7, 7, 3], [4, 4], [1, 5, 9, 13, 2, 2, 7, 7, 3], [6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [2]]


def tiny_moe(family: str, norm_topk_prob: bool = True, layers: int = 2, seed: int = 0, **kwargs) -> torch.nn.Module:
    """A random MoE causal LM, float32, its weights large enough that the router's top-k is decided."""
    cfg = FAMILIES[family](vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=norm_topk_prob, initializer_range=0.1, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def make_engine(model, **kwargs) -> NativeEngine:
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, **{"page_size": 4, **kwargs})
    engine.load_weights(full_weights(model))
    return engine


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """The expert ids transformers' routers pick for `tokens` in one forward, (MoE layers, tokens, k)."""
    picked = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: picked.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(picked)


def hf_greedy(model, prompt: list[int], response: list[int]) -> list[int]:
    """transformers' arg-max after the prompt and after each response token but the last."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1].argmax(-1).tolist()


def assert_routing(model, sequence: list[int], routed: torch.Tensor) -> None:
    """Every token but the last took the experts transformers picks for it; the last (never fed back) none."""
    expected = hf_routing(model, sequence)
    assert routed.shape == expected.shape
    assert torch.equal(routed[:, :-1].long(), expected[:, :-1])
    assert (routed[:, -1] == -1).all()


def assert_matches(model, prompts, outs, temperature: float = 1.0) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, temperature), abs=1e-5)
        assert_routing(model, prompt + out.token_ids, out.routed_experts)


CASES = [("qwen3_moe", True, {}), ("qwen3_moe", False, {}), ("qwen2_moe", True, {}), ("qwen2_moe", False, {}),
         ("qwen3_moe", True, dict(layers=4, decoder_sparse_step=2)),
         ("qwen2_moe", False, dict(layers=3, mlp_only_layers=[1]))]


@pytest.mark.parametrize("family,norm_topk_prob,kwargs", CASES)
def test_greedy_decoding_logprobs_and_routing_are_transformers_own(family, norm_topk_prob, kwargs):
    model = tiny_moe(family, norm_topk_prob, **kwargs)
    engine = make_engine(model, max_batch_size=2, steps_per_poll=3)  # rows finish, compact and refill
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, **GREEDY))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model, prompt, out.token_ids)
    assert_matches(model, PROMPTS, outs)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_tokens_record_the_experts_transformers_picks(family):
    model = tiny_moe(family, seed=3)
    engine = make_engine(model, max_batch_size=3)
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.8, seed=5))
    # Stop ids taken from the free-running outputs end rows at different steps (the same seed draws the same).
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5,
                            stop_token_ids=(free[0].token_ids[4], free[3].token_ids[2]))
    outs = engine.generate(PROMPTS, params)
    assert len({len(o.token_ids) for o in outs}) > 1  # rows stop at different steps
    assert_matches(model, PROMPTS, outs, temperature=0.8)


def test_the_sparse_layers_are_the_configs():
    assert Shape.from_hf(tiny_moe("qwen3_moe", layers=4, decoder_sparse_step=2).config).moe_layers == (1, 3)
    assert Shape.from_hf(tiny_moe("qwen2_moe", layers=3, mlp_only_layers=[1]).config).moe_layers == (0, 2)
    shape = Shape.from_hf(tiny_moe("qwen3_moe").config)
    assert shape.shared_expert_intermediate_size == 0 and shape.qk_norm  # Qwen3-MoE has no shared expert
    shape = Shape.from_hf(tiny_moe("qwen2_moe").config)
    assert shape.shared_expert_intermediate_size == 48 and shape.qkv_bias


def test_the_start_up_check_accepts_both_families():
    for family in FAMILIES:
        check_native_architecture("m", tiny_moe(family).config)


def test_every_parameter_is_loaded_and_counted():
    for family in FAMILIES:
        model = tiny_moe(family, layers=3, mlp_only_layers=[1])
        engine = NativeEngine(model.config, torch.device("cpu"), torch.float32)
        assert set(engine.model.name_map) == {n for n, _ in model.named_parameters()}
        assert Shape.from_hf(model.config).num_params == sum(p.numel() for p in model.parameters())
        engine.load_weights([(n, p) for n, p in full_weights(model) if "experts.down_proj" not in n])
        with pytest.raises(RuntimeError, match="experts.down_proj"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_continued_samples_record_their_prior_tokens_routing():
    model = tiny_moe("qwen2_moe", seed=1)
    engine = make_engine(model, max_batch_size=4)
    first = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, **GREEDY))
    prompts = [p + o.token_ids for p, o in zip(PROMPTS[:2], first)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=9, **GREEDY), prior=[4, 4])
    assert_matches(model, prompts, outs)


@pytest.mark.parametrize("fresh", [False, True])
def test_continued_samples_that_share_a_base_take_its_routing(monkeypatch, fresh):
    """Continued samples of one prompt prefill its full pages once as a shared base (the call's fresh sample of the
    prompt, when it has one): the routing of those tokens comes from the base's prefill."""
    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 4)
    model = tiny_moe("qwen3_moe", seed=4)
    engine = make_engine(model, max_batch_size=8)
    prompt = PROMPTS[3]  # 12 tokens: three full pages
    firsts = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))
    cuts = [2, 3, 5]
    sequences = [prompt + first.token_ids[:cut] for first, cut in zip(firsts, cuts)] + ([prompt] if fresh else [])
    before = engine.stats.prefill_tokens
    outs = engine.generate(sequences, SamplingParams(max_new_tokens=8, **GREEDY), prior=cuts + [0] * fresh)
    assert engine.stats.prefill_tokens - before == len(prompt) + sum(cuts)  # the base once, then each one's own
    assert_matches(model, sequences, outs)


def test_kept_sequences_hand_their_routing_to_the_next_turn():
    model = tiny_moe("qwen3_moe", seed=2)
    engine = make_engine(model, max_batch_size=4)
    params = SamplingParams(max_new_tokens=5, **GREEDY)
    first = engine.generate(PROMPTS[:2], params, keep=["a", "b"])
    prompts = [p + o.token_ids + [11, 12] for p, o in zip(PROMPTS[:2], first)]  # the environment's turn appended
    outs = engine.generate(prompts, params, keep=["a", "b"])
    assert all(o.reused_tokens for o in outs)  # the kept KV was used, not prefilled again
    assert_matches(model, prompts, outs)


def test_an_early_end_hands_back_the_routing_of_what_was_generated():
    model = tiny_moe("qwen3_moe")
    engine = make_engine(model, max_batch_size=3, steps_per_poll=2)
    free = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=10, **GREEDY))
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(free[1].token_ids[1],), **GREEDY)
    outs = engine.generate(PROMPTS, params, on_finish=lambda _: True)
    aborted = [(p, o) for p, o in zip(PROMPTS, outs) if o.finish_reason == "abort" and o.token_ids]
    assert aborted
    for prompt, out in aborted:
        assert_routing(model, prompt + out.token_ids, out.routed_experts)


def test_the_trainer_replays_the_recorded_routing_as_its_own():
    """The completion's routing in the layout rl/model/moe.py's replay takes: the grouped trainer forward of the
    sequence with it replayed disagrees with its own choice on no token, and gives transformers' logits."""
    model = tiny_moe("qwen2_moe", seed=5)
    engine = make_engine(model)
    prompt = PROMPTS[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))[0]
    trainer = copy.deepcopy(model)
    use_grouped_moe(trainer)
    ids = torch.tensor([prompt + out.token_ids])
    known = torch.ones(ids.shape, dtype=torch.bool)
    known[0, -1] = False  # the last token was never fed back: no record, the trainer routes it itself
    set_routing_replay(trainer, out.routed_experts[:, None], mask=known)
    with torch.no_grad():
        logits = trainer(input_ids=ids).logits
        expected = model(input_ids=ids).logits
    assert routing_mismatch(trainer) == 0.0
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_a_dense_model_records_no_routing():
    engine = make_engine(tiny_model(seed=0).eval())
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].routed_experts is None


# ---------------------------------------------------------------------------- routing on the sample


def test_a_continued_sample_keeps_the_routing_its_tokens_were_generated_with():
    """A sample of a 3-token prompt takes 2 tokens, then is continued with 2 more (under new weights, say): the 4
    tokens it had fed keep their first routing, the new record gives the rest (the 5th token, fed only now, too)."""
    from rl.data import Sample
    from rl.rollout import Completion, append_completions

    class Text:  # decode_responses' slow path
        def batch_decode(self, ids, skip_special_tokens):
            return ["" for _ in ids]

    sample = Sample(prompt="p", tokens=[1, 2, 3])
    first = torch.arange(2 * 5 * 2, dtype=torch.int16).reshape(2, 5, 2)
    first[:, -1] = -1
    append_completions([sample], [Completion([4, 5], [-0.5, -0.5], "abort", routed_experts=first)], 0, Text())
    assert torch.equal(sample.routed_experts, first)
    second = 100 + torch.arange(2 * 7 * 2, dtype=torch.int16).reshape(2, 7, 2)
    append_completions([sample], [Completion([6, 7], [-0.5, -0.5], "length", routed_experts=second)], 1, Text())
    assert sample.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(sample.routed_experts[:, :4], first[:, :4])
    assert torch.equal(sample.routed_experts[:, 4:], second[:, 4:])
    with pytest.raises(RuntimeError, match="sample -1: the engine recorded routing for 7 tokens of its 9"):
        append_completions([sample], [Completion([8, 9], [-0.5, -0.5], "length", routed_experts=second)], 2, Text())


def test_a_samples_routing_survives_the_checkpoints_json_and_a_wrong_one_is_named():
    import json

    from rl.data import Sample
    from rl.rollout.buffer import from_json, sample_from_dict, sample_to_dict, to_json

    routed = torch.tensor([[[0, 7], [3, 1], [-1, -1]]], dtype=torch.int16)
    sample = Sample(prompt="p", tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.25],
                    token_versions=[0], routed_experts=routed)
    back = sample_from_dict(json.loads(json.dumps(sample_to_dict(sample))))
    assert back == sample and back.routed_experts.dtype == torch.int16 and torch.equal(back.routed_experts, routed)
    assert sample_from_dict({k: v for k, v in sample_to_dict(sample).items() if k != "routed_experts"}) == sample
    short = sample_to_dict(Sample(prompt="p", tokens=[1, 2], routed_experts=routed))
    with pytest.raises(ValueError, match="routed_experts of the wrong type"):
        sample_from_dict(short)
    with pytest.raises(ValueError, match=r"a tensor of int16 \[1, 3, 2\] held in 9 bytes"):
        from_json({"__tensor__": ["int16", [1, 3, 2], to_json(routed)["__tensor__"][2][:-4]]})
    with pytest.raises(TypeError, match="torch.Tensor"):
        to_json(torch.zeros(2))
