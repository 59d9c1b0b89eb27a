"""Start-up checks of rl.run.checks: each bad combination stops with one line naming the cause."""

import pytest
from transformers import GenerationConfig

from rl.config import ConfigError, ModelConfig, RolloutConfig
from rl.run.checks import check_model_and_tokenizer
from tests.tiny import tiny_config, tiny_tokenizer


def model_folder(path, eos=None, **config_kwargs):
    """config.json (and generation_config.json when `eos` is given), no weights: the checks read no tensors."""
    config = tiny_config(**config_kwargs)
    config.save_pretrained(path)
    if eos is not None:
        GenerationConfig(eos_token_id=eos).save_pretrained(path)
    return config


class Tok:
    """A tokenizer as the checks see it: a length and an EOS id."""

    def __init__(self, size: int, eos):
        self.size, self.eos_token_id = size, eos

    def __len__(self):
        return self.size


def run(path, config, tokenizer, **rollout):
    return check_model_and_tokenizer(ModelConfig(path=str(path)), RolloutConfig(max_context_len=512, **rollout),
                                     config, tokenizer)


def test_a_matching_tokenizer_passes_with_its_eos(tmp_path):
    tokenizer = tiny_tokenizer()  # 259 tokens
    config = model_folder(tmp_path, vocab_size=259)
    assert run(tmp_path, config, tokenizer) == [tokenizer.eos_token_id]


def test_tokenizer_larger_than_the_embedding(tmp_path):
    config = model_folder(tmp_path, vocab_size=200)
    with pytest.raises(ConfigError, match=r"the tokenizer has 259 tokens but the model .* has vocab_size 200"):
        run(tmp_path, config, tiny_tokenizer())


def test_no_eos_anywhere(tmp_path):
    config = model_folder(tmp_path)
    with pytest.raises(ConfigError, match="no EOS token.*set rollout.stop_token_ids"):
        run(tmp_path, config, Tok(256, None))
    assert run(tmp_path, config, Tok(256, None), stop_token_ids=[7]) == [7]  # a stop id is enough


def test_eos_the_model_cannot_produce(tmp_path):
    config = model_folder(tmp_path, eos=300)
    with pytest.raises(ConfigError, match=r"EOS ids \[256, 300\] .* vocab_size 256"):
        run(tmp_path, config, Tok(256, 256))
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids \[999\]"):
        run(tmp_path, config, Tok(256, 2), stop_token_ids=[5, 999])


def test_eos_ids_are_the_union_with_generation_config(tmp_path):
    config = model_folder(tmp_path, eos=[2, 7, 400])
    assert run(tmp_path, config, Tok(256, 2), stop_token_ids=[9, 7]) == [2, 7, 9]  # 400 is dropped
    single = tmp_path / "single"
    config = model_folder(single, eos=11)
    assert run(single, config, Tok(256, None)) == [11]


def test_context_past_the_model_positions(tmp_path):
    config = model_folder(tmp_path)  # max_position_embeddings 512
    assert run(tmp_path, config, Tok(256, 2)) == [2]
    with pytest.raises(ConfigError, match=r"rollout.max_context_len \(1024\) exceeds max_position_embeddings \(512\)"):
        check_model_and_tokenizer(ModelConfig(path=str(tmp_path)), RolloutConfig(max_context_len=1024), config,
                                  Tok(256, 2))


def test_a_family_the_native_engine_does_not_run_stops_the_start_up_checks_and_vllm_passes_them(tmp_path):
    """What the run's start-up calls: the native engine refuses Gemma 2 with one line; vLLM serves it."""
    from transformers import Gemma2Config
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024)
    with pytest.raises(ConfigError, match=r"model_type.*gemma2.*rollout.engine = 'vllm'") as err:
        run(tmp_path, config, Tok(256, 1))
    assert "\n" not in str(err.value)
    assert run(tmp_path, config, Tok(256, 1), engine="vllm") == [1]
