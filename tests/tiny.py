"""Tiny random-weight models and a tiny trained tokenizer, built offline for tests (rl.prepare's), and a
snapshot of training state for tests that move it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

# The tiny model and tokenizer are rl.prepare's (`python -m rl.prepare tiny DIR` writes the same folder).
from rl.prepare import save_tiny_model_dir, tiny_config, tiny_model, tiny_tokenizer  # noqa: F401


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
