"""Qwen3.5's text model (and Qwen3-Next's, the same layers with sparse MoE blocks) in the native engine against
`transformers`' own forward, on a tiny random float32 config of three Gated DeltaNet layers and one gated full-
attention layer: logprobs to a tight tolerance, greedy tokens token for token, several prompts with several samples
each in one call (no state leaking between rows or calls), a turn continued from a kept sequence and samples
continued over a shared prompt base scoring as a fresh prefill of the same tokens."""

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig

from rl.config import ConfigError
from rl.model.shape import ModelShape
from rl.rollout import SamplingParams
from rl.rollout.native import NativeEngine
from rl.run.checks import check_native_architecture
from tests.test_engine import (
    assert_greedy_as_transformers,
    assert_kept_turn_as_transformers,
    full_weights,
    reference_logprobs,
)
from tests.test_families import random_model

# 70 tokens: past one 64-token chunk of the delta rule.
PROMPTS = [list(range(1, 71)), [3, 4, 5], [7] * 20 + [9, 11, 13]]


def qwen35_config(layers: int = 4) -> Qwen3_5TextConfig:
    # head_dim 32 with a quarter of it rotated (the default partial_rotary_factor), a full-attention layer every 4th.
    return Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)


def gated_model(seed: int = 0) -> torch.nn.Module:
    """random_model, with every norm's weight moved to around 0 too (Qwen3.5's norms scale by 1 + w, which random
    weights in [0.5, 1.5] would already exercise) and A_log, dt_bias spread so heads decay at different rates."""
    model = random_model(qwen35_config(), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
    return model


@pytest.fixture(scope="module")
def model():
    return gated_model()


def make_engine(model, max_batch_size: int = 4) -> NativeEngine:
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=max_batch_size,
                          page_size=8, max_context_len=256, seed=0)
    engine.load_weights(full_weights(model))
    return engine


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model)


def test_the_shape_counts_every_parameter_and_the_kv_of_the_attention_layers_alone(model):
    s = ModelShape.from_hf(model.config)
    assert s.num_params == sum(p.numel() for p in model.parameters())
    assert s.linear_layers == (0, 1, 2) and s.attention_layers == 1 and s.rotary_dim == 8
    assert s.kv_bytes_per_token(4) == 2 * 1 * s.kv_size * 4
    assert make_engine(model).kv_shape[1] == 1  # the attention layer's KV alone
    assert s.linear_state_bytes(4) == 3 * 4 * (128 * 3 + 4 * 16 * 16)  # conv channels 2 * 2 * 16 + 4 * 16
    check_native_architecture("m", model.config)  # accepted


def test_the_rope_tables_come_from_one_row_of_positions_per_section(model, monkeypatch):
    """Qwen3.5's RoPE is multimodal: its model's forward hands the rotary module positions (3, B, T), one row per
    section, and transformers 5.17's rotary takes no other shape (later versions broadcast (B, T) too). The engine's
    tables ask it so, held here to 5.17's contract whatever version runs, and are the model's cos/sin of text."""
    from rl.model.kernels.rope import rope_tables

    rotary = type(model.model.rotary_emb)
    forward = rotary.forward

    def forward_of_three_rows(self, x, position_ids):
        assert position_ids.dim() == 3 and position_ids.shape[0] == 3, tuple(position_ids.shape)
        return forward(self, x, position_ids)

    monkeypatch.setattr(rotary, "forward", forward_of_three_rows)
    cos, sin = rope_tables(model, 32, torch.device("cpu"), torch.float32)
    half = model.config.head_dim // 8  # a quarter of the head rotated: half of it in a half table
    assert cos.shape == sin.shape == (32, half)
    # text has every section at the same position: plain RoPE of the rotated quarter
    rotary = model.model.rotary_emb
    angles = torch.arange(32, dtype=torch.float32)[:, None] * rotary.inv_freq[None, :].float()
    assert rotary.inv_freq.numel() == half
    torch.testing.assert_close(cos, angles.cos() * rotary.attention_scaling, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin() * rotary.attention_scaling, rtol=0, atol=1e-6)


def test_engine_logprobs_are_the_transformers_forward(model, engine):
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0.7))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == 24
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 0.7), abs=1e-4)


def test_greedy_generation_is_the_transformers_generation_token_for_token(model, engine):
    assert_greedy_as_transformers(model, engine, PROMPTS, 16)


def test_several_samples_of_several_prompts_in_one_call_each_score_as_its_own_sequence(model):
    """Four samples of each of three prompts through two rows: rows refill from the queue (each new sequence starts
    from its prompt's state, never the last occupant's), the samples of a prompt share its prefill and diverge."""
    engine = make_engine(model, max_batch_size=2)
    prompts = [p for p in PROMPTS for _ in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=[5]))
    assert len({tuple(o.token_ids) for o in outs[:4]}) > 1  # the samples differ
    for prompt, out in zip(prompts, outs):
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids), abs=1e-4)


def test_a_turn_continued_from_kept_state_scores_as_the_transformers_forward_of_the_whole(model, engine):
    """Rows stop at different steps (a third of the vocabulary stops them): a row that stopped early stays in the
    batch, feeding its last token again, until the others do, and its kept state must not move meanwhile."""
    first = assert_kept_turn_as_transformers(model, engine, PROMPTS, SamplingParams(
        max_new_tokens=8, temperature=1.0, seed=1, stop_token_ids=list(range(0, 256, 3))))
    assert len({len(o.token_ids) for o in first}) > 1


def test_continued_samples_over_a_shared_base_score_as_a_fresh_prefill(model, monkeypatch):
    """A partial rollout's continued samples of one prompt share its full pages (and its state there) as a base;
    each goes on from a copy of the base's state."""
    from rl.rollout import scheduler

    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 8)
    engine = make_engine(model)
    original = PROMPTS[0]
    prior = [[9, 8, 7], [1, 2], [6, 6, 6, 6, 6]]
    prompts = [original + p for p in prior]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0), prior=[len(p) for p in prior])
    for prompt, out in zip(prompts, outs):
        assert out.reused_tokens == len(original) // 8 * 8  # the base's full pages
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids), abs=1e-4)


def test_batch_invariant_mode_and_fp8_are_refused_in_one_line(model):
    for kwargs in ({"batch_invariant": True}, {"precision": "fp8"}):
        with pytest.raises(ValueError, match=r"qwen3_5_text: .*linear-attention layers have no") as err:
            NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=2, max_context_len=64,
                         **kwargs)
        assert "\n" not in str(err.value)


def test_a_multimodal_qwen35_folder_stops_the_start_up_checks_in_one_line(tmp_path):
    """The engine builds its model from the folder's own config: a multimodal Qwen3.5 wrapping the text model is
    refused at start-up (not at the engine's build), vLLM named."""
    from transformers import Qwen3_5Config

    from rl.config import ModelConfig, RolloutConfig
    from rl.run.checks import check_model_and_tokenizer

    config = Qwen3_5Config(text_config=qwen35_config().to_dict())
    with pytest.raises(ConfigError, match=r"model_type 'qwen3_5' wraps a 'qwen3_5_text'.*rollout.engine = 'vllm'"):
        check_model_and_tokenizer(ModelConfig(path=str(tmp_path)), RolloutConfig(max_context_len=128), config, None)


def test_sleep_drops_the_states_with_the_kv_and_a_wake_starts_clean(model):
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=1)
    before = engine.generate(PROMPTS, params, keep=[0, 1, 2])
    engine.sleep(1)
    engine.wake_up()
    assert not engine.kept
    after = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def qwen3_next_config() -> Qwen3NextConfig:
    # Sparse blocks of 4 experts (2 a token) with the shared expert, but a dense MLP in layer 1; q, k, v, z fused.
    return Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, mlp_only_layers=[1], max_position_embeddings=512)


@pytest.fixture(scope="module")
def next_model():
    model = random_model(qwen3_next_config(), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "mlp.gate.weight")):
                p.uniform_(-1.0, 1.0)
    return model


def test_qwen3_next_scores_as_the_transformers_forward_fresh_and_continued(next_model):
    s = ModelShape.from_hf(next_model.config)
    assert s.num_params == sum(p.numel() for p in next_model.parameters())
    assert s.moe_layers == (0, 2, 3) and s.linear_interleaved
    engine = make_engine(next_model)
    keys = list(range(len(PROMPTS)))
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.7, seed=1,
                                                    stop_token_ids=list(range(0, 256, 3))), keep=keys)
    for prompt, out in zip(PROMPTS, first):
        assert out.logprobs == pytest.approx(reference_logprobs(next_model, prompt, out.token_ids, 0.7), abs=1e-4)
    turn_2 = [p + o.token_ids + [4, 4, 4] for p, o in zip(PROMPTS, first)]
    second = engine.generate(turn_2, SamplingParams(max_new_tokens=8, temperature=1.0), keep=keys)
    for prompt, out in zip(turn_2, second):
        assert out.reused_tokens == len(prompt) - 4
        assert out.logprobs == pytest.approx(reference_logprobs(next_model, prompt, out.token_ids), abs=1e-4)
    assert_greedy_as_transformers(next_model, engine, PROMPTS, 12)
