"""The policy as a Hugging Face folder: at the end of every run, and from any checkpoint.

    python -m rl.export CHECKPOINT OUT [--dtype auto|float32|bfloat16|float16]

A folder that `AutoModelForCausalLM.from_pretrained` and vLLM load as they are:
safetensors shards with an index, config.json, generation_config.json and the
tokenizer. `auto` writes the dtype of the model's config.json (what it was released
in), float32 when it names none. The run's final export gathers the FSDP2 shards a
bucket at a time, so rank 0 holds one shard file's worth of the model, never all of
it; the offline export of a checkpoint loads the whole model into host memory once.
The folder appears under its name only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from rl.checkpoint import copy_hf_files

SHARD_BYTES = 2 << 30


def export_dtype(name: str, config: dict) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    declared = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, declared) if isinstance(declared, str) and hasattr(torch, declared) else torch.float32


def saved_names(model: torch.nn.Module) -> set[str]:
    """The tensors a HF folder holds: the state dict's, less a tied lm_head (transformers re-ties it)."""
    names = set(model.state_dict().keys())
    if getattr(model.config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


def write_hf_folder(tensors: Iterable[tuple[str, torch.Tensor]], hf_sources: list[Path], out: Path,
                    dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> Path:
    """Writes (name, full tensor) pairs as safetensors shards beside the config (naming `dtype`) and
    tokenizer files found in `hf_sources` (the first folder that has a file wins). The folder appears
    whole: it is written under a temporary name, and an earlier one is moved away before it is deleted."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, shard, size = [], {}, 0
    for name, tensor in tensors:
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            shards.append(_write_shard(tmp, len(shards), shard))
            shard, size = {}, 0
    if shard or not shards:
        shards.append(_write_shard(tmp, len(shards), shard))
    weight_map, total = {}, 0
    for i, (file, names, nbytes) in enumerate(shards):
        final_name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp / file, tmp / final_name)
        weight_map.update(dict.fromkeys(names, final_name))
        total += nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copy_hf_files(hf_sources, tmp)
    set_config_dtype(tmp, dtype)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _write_shard(folder: Path, i: int, tensors: dict[str, torch.Tensor]) -> tuple[str, list[str], int]:
    name = f"part-{i}.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return name, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are stored in."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------- from the running policy


def export_policy(model: torch.nn.Module, hf_sources: list[Path], out: Path, dtype_name: str,
                  is_main: bool) -> Path | None:
    """Gathers the sharded policy (a collective: every rank calls it) and writes it from rank 0."""
    from rl.weights import iter_full_weights

    dtype = export_dtype(dtype_name, json.loads((hf_sources[0] / "config.json").read_text()))
    keep = saved_names(model)
    tensors = ((n, t) for n, t in iter_full_weights(model, dtype, SHARD_BYTES) if n in keep)
    if not is_main:
        for _ in tensors:  # every rank takes part in every gather
            pass
        return None
    return write_hf_folder(tensors, hf_sources, out, dtype)


# ---------------------------------------------------------------------------- from a checkpoint


def load_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's policy tensors (fp32, full, on the CPU), read without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / "model_optim"))
    entries = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    state = {"model": model}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: Path, out: Path, dtype_name: str = "auto") -> Path:
    checkpoint = Path(checkpoint)
    if not (checkpoint / "model_optim").is_dir() or not (checkpoint / "hf" / "config.json").is_file():
        raise SystemExit(f"rl.export: {checkpoint} is not a complete checkpoint folder "
                         f"(expected model_optim/ and hf/config.json; look under <output_dir>/checkpoints/)")
    config = json.loads((checkpoint / "hf" / "config.json").read_text())
    state = load_model_state(checkpoint)
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    dtype = export_dtype(dtype_name, config)
    tensors = ((n, t.to(dtype)) for n, t in sorted(state.items()))
    return write_hf_folder(tensors, [checkpoint / "hf"], Path(out), dtype)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder: <output_dir>/checkpoints/rollout_<N>")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    written = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype)
    print(f"rl.export: wrote {written}")


if __name__ == "__main__":
    main(sys.argv[1:])
