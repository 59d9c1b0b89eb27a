"""The policy as a Hugging Face folder: at the end of every run, and from any checkpoint.

    python -m rl.export CHECKPOINT OUT [--dtype auto|float32|bfloat16|float16] [--overwrite]

A folder that `AutoModelForCausalLM.from_pretrained` and vLLM load as they are:
safetensors shards with an index, config.json, generation_config.json and the
tokenizer. `auto` writes the dtype of the model's config.json (what it was released
in), float32 when it names none. The run's final export gathers the FSDP2 shards a
bucket at a time, so rank 0 holds one shard file's worth of the model, never all of
it; the offline export of a checkpoint loads the whole model into host memory once.

An export never deletes what it did not write. Every export holds `rl_export.json`
(where it came from, its dtype), and that file is how an earlier export is recognised:
only a folder that holds it, and nothing of a run (checkpoints/, metrics.jsonl, .lock),
is ever replaced. `rl.export` writes into a missing or empty OUT, replaces an earlier
export only with --overwrite, and refuses anything else; the run's own `final/` is
replaced when it holds an earlier export (a resumed run exports again). A folder
exported before `rl_export.json` existed is refused like any other (move it away), except
as the run's own `final/` when it holds nothing but what an export writes.
The new folder is written under a temporary sibling name and renamed into place, so
a kill mid-export leaves the earlier export complete (at OUT, or for the instant
between the two renames at `.OUT.old-*`), never a half folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from rl.checkpoint import HF_FILES, copy_hf_files
from rl.config import ConfigError

SHARD_BYTES = 2 << 30
MARKER = "rl_export.json"
INDEX = "model.safetensors.index.json"
RUN_FILES = ("checkpoints", "metrics.jsonl", ".lock")  # what a run folder holds and an export never does


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


def check_out(out: Path, overwrite: bool, remedy: str, unmarked_export_ok: bool = False) -> None:
    """Raises ConfigError naming `out` and ending in `remedy`, unless `out` is missing, an empty folder or,
    with `overwrite`, an earlier export (`unmarked_export_ok`: also one written before the marker existed,
    recognised by holding nothing but the files an export writes)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise ConfigError(f"{out} is a file; {remedy}")
    run = [name for name in RUN_FILES if (out / name).exists()]
    if run:
        raise ConfigError(f"{out} holds a run ({', '.join(run)}); {remedy}")
    if not (out / MARKER).is_file() and not (unmarked_export_ok and only_export_files(out)):
        raise ConfigError(f"{out} is not empty and holds no earlier export (no {MARKER}); {remedy}")
    if not overwrite:
        raise ConfigError(f"{out} holds an earlier export; pass --overwrite to replace it")


def only_export_files(folder: Path) -> bool:
    """Whether `folder` holds files an export writes and nothing else (no folder, no other file)."""
    return all(p.is_file() and (p.name in HF_FILES or p.name == INDEX or p.suffix == ".safetensors")
               for p in folder.iterdir())


def write_hf_folder(tensors: Iterable[tuple[str, torch.Tensor]], hf_sources: list[Path], out: Path,
                    dtype: torch.dtype, source: str, shard_bytes: int = SHARD_BYTES) -> Path:
    """Writes (name, full tensor) pairs as safetensors shards beside the config (naming `dtype`) and
    tokenizer files found in `hf_sources` (the first folder that has a file wins), and the marker naming
    `source`. `out` must be missing, empty or an earlier export (see `check_out`). The folder appears whole:
    it is written under a temporary sibling name and renamed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(out, "tmp")
    tmp.mkdir()
    try:
        write_weights(tensors, tmp, shard_bytes)
        copy_hf_files(hf_sources, tmp)
        set_config_dtype(tmp, dtype)
        (tmp / MARKER).write_text(json.dumps({"source": source, "dtype": dtype_label(dtype)}, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    move_into_place(tmp, out)
    return out


def move_into_place(new: Path, out: Path) -> None:
    """Renames `new` to `out`. An earlier export there (the only thing `check_out` lets a non-empty `out`
    hold) is renamed aside first and deleted last, so a kill leaves a complete folder at `out` or, between
    the two renames, at its `.old-` sibling."""
    if not out.is_dir() or not any(out.iterdir()):
        os.replace(new, out)  # rename(2) takes the place of a missing or empty folder and refuses any other
        return
    old = hidden_sibling(out, "old")
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old)


def hidden_sibling(out: Path, kind: str) -> Path:
    """A fresh name beside `out`, random so that it is never a folder someone else (or a killed export) left."""
    return out.with_name(f".{out.name}.{kind}-{secrets.token_hex(4)}")


def write_weights(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, shard_bytes: int) -> None:
    """Shards of about `shard_bytes`, named as transformers names them, with an index when there are several."""
    shards, shard, size = [], {}, 0
    for name, tensor in tensors:
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            shards.append(_write_shard(folder, len(shards), shard))
            shard, size = {}, 0
    if shard or not shards:
        shards.append(_write_shard(folder, len(shards), shard))
    weight_map, total = {}, 0
    for i, (file, names, nbytes) in enumerate(shards):
        final_name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / file, folder / final_name)
        weight_map.update(dict.fromkeys(names, final_name))
        total += nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2))


def _write_shard(folder: Path, i: int, tensors: dict[str, torch.Tensor]) -> tuple[str, list[str], int]:
    name = f"part-{i}.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return name, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are stored in."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    name = dtype_label(dtype)
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------- from the running policy


def export_policy(model: torch.nn.Module, hf_sources: list[Path], out: Path, dtype_name: str,
                  is_main: bool) -> Path | None:
    """Gathers the sharded policy (a collective: every rank calls it) and writes it from rank 0. `out` (the
    run's `final/`) may hold an earlier export, which it replaces; anything else there stops the run."""
    from rl.weights import iter_full_weights

    # Every rank checks, before the gathers: a refusal on rank 0 alone would leave the others waiting in them.
    check_out(out, overwrite=True, remedy="the trained policy was not exported: move that folder away, then "
                                          "export the last checkpoint with python -m rl.export",
              unmarked_export_ok=True)  # the run's own final/ of an earlier version
    dtype = export_dtype(dtype_name, json.loads((hf_sources[0] / "config.json").read_text()))
    keep = saved_names(model)
    tensors = ((n, t) for n, t in iter_full_weights(model, dtype, SHARD_BYTES) if n in keep)
    if not is_main:
        for _ in tensors:  # every rank takes part in every gather
            pass
        return None
    return write_hf_folder(tensors, hf_sources, out, dtype, source=f"the end of the run in {out.parent}")


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


def export_checkpoint(checkpoint: Path, out: Path, dtype_name: str = "auto", overwrite: bool = False) -> Path:
    """Writes the checkpoint's policy to `out`; ConfigError for a checkpoint or an `out` it cannot use."""
    checkpoint, out = Path(checkpoint), Path(os.path.abspath(out))  # "." has no name to put a sibling beside
    if not (checkpoint / "model_optim").is_dir() or not (checkpoint / "hf" / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is not a complete checkpoint folder "
                          f"(expected model_optim/ and hf/config.json; look under <output_dir>/checkpoints/)")
    check_out(out, overwrite, remedy="export into a new or empty folder")
    config = json.loads((checkpoint / "hf" / "config.json").read_text())
    state = load_model_state(checkpoint)
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    dtype = export_dtype(dtype_name, config)
    tensors = ((n, t.to(dtype)) for n, t in sorted(state.items()))
    return write_hf_folder(tensors, [checkpoint / "hf"], out, dtype, source=str(checkpoint.resolve()))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder: <output_dir>/checkpoints/rollout_<N>")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it holds an earlier export")
    args = parser.parse_args(argv)
    try:
        written = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype, args.overwrite)
    except ConfigError as e:
        raise SystemExit(f"rl.export: {e}") from None
    print(f"rl.export: wrote {written}")


if __name__ == "__main__":
    main(sys.argv[1:])
