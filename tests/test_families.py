"""Model families beyond Llama / Qwen2 in the native engine: each against `transformers`' own forward on a tiny
random config in float32 (logprobs to a tight tolerance, greedy generation token for token), and a family the
engine does not run refused at start-up with one line that names what is missing and the engine that serves it.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

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

PROMPTS = [list(range(1, 70)), [3, 4, 5], [7] * 20 + [9, 11, 13]]


def qwen3_config(tie: bool = False, layers: int = 2) -> Qwen3Config:
    # head_dim 64 with 4 heads of a 128-wide model: q is wider than the hidden state, as in Qwen3-4B and 8B.
    return Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)


def llama3_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                       rope_theta=50000.0, tie_word_embeddings=False)


def gemma3_config(layers: int = 3, softcap: float | None = None) -> Gemma3TextConfig:
    # Sliding layers around a global one, a 16-token window the prompts cross, its own attention scale; the
    # final soft-capping only some configs have (Gemma 2's; `softcap`).
    types = ["sliding_attention" if i % 3 != 1 else "full_attention" for i in range(layers)]
    return Gemma3TextConfig(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                            layer_types=types, max_position_embeddings=2048, query_pre_attn_scalar=24,
                            final_logit_softcapping=softcap)


FAMILIES = {"qwen3": qwen3_config, "qwen3_tied": lambda: qwen3_config(tie=True), "llama3": llama3_config,
            "gemma3": gemma3_config, "gemma3_softcap": lambda: gemma3_config(softcap=5.0)}


def random_model(config, seed: int = 0) -> torch.nn.Module:
    """The HF model with random weights, its norm weights too (HF starts them at one, which would hide a
    norm whose weight is dropped)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    model = random_model(FAMILIES[request.param]())
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=4, page_size=8,
                          max_context_len=256, seed=0)
    engine.load_weights(full_weights(model))
    return model, engine


def test_engine_logprobs_are_the_transformers_forward(family):
    model, engine = family
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, temperature=0.7))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == 24
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 0.7), abs=1e-4)


def test_greedy_generation_is_the_transformers_generation_token_for_token(family):
    model, engine = family
    assert_greedy_as_transformers(model, engine, PROMPTS, 16)


def test_a_turn_continued_from_kept_kv_scores_as_the_transformers_forward_of_the_whole(family):
    """A second turn prefills only its new tokens over the first turn's kept KV (past Gemma's window too)."""
    model, engine = family
    assert_kept_turn_as_transformers(model, engine, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))


def test_the_shape_counts_every_parameter_of_the_family():
    for make in FAMILIES.values():
        model = random_model(make())
        assert ModelShape.from_hf(model.config).num_params == sum(p.numel() for p in model.parameters())


def test_a_family_the_engine_does_not_run_is_one_line_naming_it_and_vllm():
    config = qwen3_config()
    config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"model.path 'm'.*sliding-window.*rollout.engine = 'vllm'"):
        check_native_architecture("m", config)
    config = gemma3_config()
    config.attn_logit_softcapping = 50.0
    with pytest.raises(ConfigError, match=r"attn_logit_softcapping=50.0 is not supported.*rollout.engine = 'vllm'"):
        check_native_architecture("m", config)
    config = qwen3_config()
    config.model_type = "gemma2"
    with pytest.raises(ConfigError, match=r"model_type.*gemma2.*rollout.engine = 'vllm'") as err:
        check_native_architecture("m", config)
    assert "\n" not in str(err.value)
    check_native_architecture("m", qwen3_config())  # a family it runs passes
    check_native_architecture("m", gemma3_config())


@pytest.mark.parametrize("make", [qwen3_config, gemma3_config], ids=["qwen3", "gemma3"])
def test_a_lora_policy_of_the_family_pushes_its_merged_weights_into_the_engine(make):
    from rl.config import LoraConfig
    from rl.train.lora import apply_lora, init_adapters
    from rl.train.weights import sync_weights
    from tests.test_lora import engine_vs_trainer, randomize_b

    model = random_model(make())
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    init_adapters(model, 0)
    randomize_b(model, 0)
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0)
    sync_weights(model, engine, torch.float32, bucket_mb=0.05)
    assert engine_vs_trainer(engine, model) < 1e-4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_pushed_weights_are_what_a_checkpoint_holds_not_computed_buffers(name):
    """An engine's loader knows a checkpoint's names: the push streams those and no buffer the model computes from
    its config (Gemma's `embed_scale`, the rotary `inv_freq`), which vLLM's Gemma 3 loader refuses by name."""
    from rl.train.weights import iter_merged_weights

    model = random_model(FAMILIES[name]())
    pushed = [n for n, _ in iter_merged_weights(model, torch.float32, 1 << 20)]
    assert sorted(pushed) == sorted(model.state_dict())
    if name.startswith("gemma3"):
        assert "model.embed_tokens.embed_scale" in dict(model.named_buffers())  # what the push leaves out
