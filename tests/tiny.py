"""Tiny random-weight models and a tiny trained tokenizer, built offline for tests, and a snapshot of
training state for tests that move it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(vocab_size: int = 256, tie: bool = False, layers: int = 2,
                intermediate_size: int = 200) -> Qwen2Config:
    # head_dim 64 like real models (and what CPU attention backends expect); sizes not divisible by
    # 3 ranks exercise FSDP2's uneven shards.
    return Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=intermediate_size,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=512, tie_word_embeddings=tie, rope_theta=10000.0)


def tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    corpus = [f"What is {a} + {b}? Answer with just the number. {a + b}" for a in range(30) for b in range(30)]
    corpus += ["system user assistant You are a helpful assistant. The answer is \\boxed{7} #### 12"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(**kwargs), dtype=torch.float32,
                                            attn_implementation="sdpa")


def save_tiny_model_dir(path: Path, seed: int = 0, **kwargs) -> Path:
    """A folder like a downloaded HF model: config, safetensors weights, tokenizer with a chat template."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    model = tiny_model(seed, vocab_size=max(len(tokenizer), 256), **kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Loaded beside a Qwen2 config, the tokenizer may gain that family's <|endoftext|>: the embedding must cover it.
    loaded = len(AutoTokenizer.from_pretrained(path))
    if loaded > model.config.vocab_size:
        model = tiny_model(seed, vocab_size=loaded, **kwargs)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
    return path


def write_arithmetic_jsonl(path: Path, rows: int = 64) -> Path:
    with path.open("w") as f:
        for i in range(rows):
            a, b = i % 10, (3 * i) % 10
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 tensor, or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def training_state(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """Copies of this rank's parameter shards and optimizer state tensors, in a fixed order."""
    tensors = [local_tensor(p).detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [local_tensor(v).clone() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensors


def save_sharded_tiny_model_dir(path: Path, seed: int = 0, max_shard_size: str = "100KB", **kwargs) -> Path:
    """`save_tiny_model_dir` with the weights split over several safetensors files and an index."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tiny_model(seed, vocab_size=max(len(tokenizer), 256), **kwargs).save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path


def rewrite_safetensors(path: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrites a folder's single model.safetensors without the `drop` tensors and with the `add` ones."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if k not in drop}
    save_file({**tensors, **(add or {})}, file, metadata={"format": "pt"})
