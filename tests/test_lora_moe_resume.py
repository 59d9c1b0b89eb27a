"""A LoRA checkpoint of a MoE model resumes: the default targets' MLP projections name no layer of a Qwen3-MoE model
(its fused experts take no adapter), and rl/run/checkpoint.py's check_lora leaves them out of the comparison."""

import pytest

from rl.config import ConfigError, LoraConfig
from rl.run.checkpoint import check_lora
from rl.train.lora import apply_lora
from tests.test_expert_parallel import tiny_moe


def test_a_lora_checkpoint_of_a_moe_model_resumes_with_the_default_targets():
    model = tiny_moe()
    lora = LoraConfig(rank=4)
    apply_lora(model, lora)
    check_lora("ckpt", {"rank": 4, "target_modules": list(lora.target_modules)}, model)
    with pytest.raises(ConfigError, match=r"trained with lora.rank=4 on \['q_proj'\]"):
        check_lora("ckpt", {"rank": 4, "target_modules": ["q_proj"]}, model)
    with pytest.raises(ConfigError, match=r"trained with lora.rank=0"):
        check_lora("ckpt", {}, model)
