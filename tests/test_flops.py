"""The FLOP count behind perf/train_mfu, against a count by hand for the tiny model."""

import pytest
import torch

from rl.model.flops import decoder_matmul_params, forward_flops, train_flops
from tests.tiny import tiny_config, tiny_model


def test_flops_by_hand():
    """hidden 128, MLP 200, 2 layers, 2 heads of 64, 1 KV head, vocab 256.
    Per layer: q 128x128 + k 128x64 + v 128x64 + o 128x128 = 49,152; MLP 3 x 128 x 200 = 76,800 -> 125,952;
    2 layers 251,904; lm_head 128 x 256 = 32,768; 284,672 weights. Sequences of 3 and 5 tokens: 8 tokens,
    2 x 284,672 x 8 = 4,554,752; causal pairs 3*4/2 + 5*6/2 = 21, attention 2 layers x 4 x 2 heads x 64 x 21
    = 21,504; forward 4,576,256; training (x3) 13,728,768, plus a forward-only pass 18,305,024."""
    config = tiny_config()
    assert decoder_matmul_params(config) == 251_904
    assert forward_flops(config, [3, 5]) == 4_576_256
    assert train_flops(config, [3, 5]) == 13_728_768
    assert train_flops(config, [3, 5], passes=4 / 3) == pytest.approx(18_305_024)


def test_decoder_matmul_params_are_the_models_linear_weights():
    model = tiny_model()
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert decoder_matmul_params(model.config) == linear


def test_moe_flops_count_the_routed_experts_only():
    """A Qwen3-MoE block, hidden 64, 4 heads of 16, 2 KV heads, 8 experts of 32, 2 a token, no shared expert.
    Per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288; router 64 x 8 = 512; two experts 2 x 3 x 64 x 32
    = 12,288 -> 25,088; 2 layers 50,176; lm_head 64 x 96 = 6,144; 56,320 weights. One sequence of 4 tokens:
    2 x 56,320 x 4 = 450,560; 10 causal pairs, attention 2 layers x 4 x 64 x 10 = 5,120; forward 455,680."""
    from transformers import Qwen3MoeConfig
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2)
    assert decoder_matmul_params(config) == 50_176
    assert forward_flops(config, [4]) == 455_680


def test_sliding_and_linear_layers_count_what_they_compute():
    """A sliding window of 3 over 5 tokens sees 1 + 2 + 3 + 3 + 3 = 12 pairs, not 15. A Qwen3.5-shaped model (3
    Gated DeltaNet layers, 1 full-attention layer of 4 heads of 16; linear layers of 4 value heads, key and value dims
    8) over 4 tokens: attention 1 layer x 4 x 64 x 10 pairs = 2,560; the delta rules 3 layers x 6 x 4 x 8 x 8 x 4
    tokens = 18,432."""
    from transformers import Qwen3_5TextConfig

    from rl.model.flops import visible_pairs
    assert visible_pairs([5], 3) == 12 and visible_pairs([5, 2], 3) == 12 + 3 and visible_pairs([5]) == 15
    config = Qwen3_5TextConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=["linear_attention"] * 3 + ["full_attention"])
    weights = decoder_matmul_params(config) + 32 * 96
    assert forward_flops(config, [4]) - 2 * weights * 4 == 2_560 + 18_432
