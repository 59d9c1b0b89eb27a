"""The policy as a Hugging Face folder: at the end of every run (rl/run/checkpointer.py), and from any checkpoint
(`python -m rl.export`, rl/export.py).

A folder that `AutoModelForCausalLM.from_pretrained` and vLLM load as they are:
safetensors shards with an index, config.json, generation_config.json and the
tokenizer. `auto` writes the dtype of the model's config.json (what it was released
in), float32 when it names none. The run's final export gathers the FSDP2 shards a
bucket at a time, so rank 0 holds one shard file's worth of the model, never all of
it; the offline export of a checkpoint loads the whole model into host memory once.

With LoRA the adapters are merged into their layers (W + alpha/rank * B @ A). A LoRA
checkpoint holds the adapters alone, so its offline export reads the base weights from
the run's `model.path` again. `--adapter` (and `lora.export_adapter` for the run's
`<output_dir>/final_adapter`) writes the adapter alone, as PEFT loads it:
adapter_config.json and adapter_model.safetensors.

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

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rl.config import ConfigError, LoraConfig
from rl.run.checkpoint import HF_FILES, copy_hf_files
from rl.train.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_names,
    adapter_of,
    check_peft_experts,
    merged_weights,
    peft_config,
    peft_tensors,
)

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
    """The tensors a HF folder holds: the state dict's, less a tied lm_head (transformers re-ties it) and LoRA's
    adapters (merged into their layers' weights)."""
    names = set(model.state_dict().keys()) - adapter_names(model)
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
    with written_whole(out) as tmp:
        write_weights(tensors, tmp, shard_bytes)
        copy_hf_files(hf_sources, tmp)
        set_config_dtype(tmp, dtype)
        (tmp / MARKER).write_text(json.dumps({"source": source, "dtype": dtype_label(dtype)}, indent=2))
    return Path(out)


def write_adapter_folder(tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig, base_model: str, out: Path,
                         dtype: torch.dtype, source: str) -> Path:
    """Writes LoRA's (name, full tensor) pairs in the layout PEFT loads: adapter_model.safetensors under PEFT's
    names and adapter_config.json naming `base_model`, with the marker; written aside and renamed like an export."""
    with written_whole(out) as tmp:
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            weights |= {peft: t.contiguous() for peft, t in peft_tensors(name, tensor.detach().to("cpu", dtype))}
        save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base_model), indent=2))
        (tmp / MARKER).write_text(json.dumps({"source": source, "dtype": dtype_label(dtype), "adapter": True},
                                             indent=2))
    return Path(out)


@contextlib.contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out` to write a folder into, renamed to `out` when the block ends (move_into_place)
    and removed when it raises: a folder at `out` is always whole."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(out, "tmp")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    move_into_place(tmp, out)


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
    from rl.train.weights import iter_merged_weights

    # Every rank checks, before the gathers: a refusal on rank 0 alone would leave the others waiting in them.
    check_out(out, overwrite=True, remedy="the trained policy was not exported: move that folder away, then "
                                          "export the last checkpoint with python -m rl.export",
              unmarked_export_ok=True)  # the run's own final/ of an earlier version
    dtype = export_dtype(dtype_name, json.loads((hf_sources[0] / "config.json").read_text()))
    keep = saved_names(model)
    tensors = ((n, t) for n, t in iter_merged_weights(model, dtype, SHARD_BYTES) if n in keep)
    if not is_main:
        for _ in tensors:  # every rank takes part in every gather
            pass
        return None
    return write_hf_folder(tensors, hf_sources, out, dtype, source=f"the end of the run in {out.parent}")


def export_adapter(model: torch.nn.Module, lora: LoraConfig, base_model: str, out: Path, dtype_name: str,
                   config: dict, is_main: bool) -> Path | None:
    """LoRA's adapters alone, gathered (a collective) and written from rank 0 as PEFT loads them; `out` (the run's
    `final_adapter/`) may hold an earlier export; `config`: the model's config.json, for the `auto` dtype."""
    from rl.train.weights import iter_full_weights

    check_out(out, overwrite=True, remedy="the adapter was not exported: move that folder away, then export the "
                                          "last checkpoint with python -m rl.export --adapter")
    dtype = export_dtype(dtype_name, config)
    tensors = iter_full_weights(model, dtype, SHARD_BYTES, only=adapter_names(model))
    if not is_main:
        for _ in tensors:
            pass
        return None
    return write_adapter_folder(tensors, lora, base_model, out, dtype, source=f"the end of the run in {out.parent}")


# ---------------------------------------------------------------------------- from a checkpoint


def load_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's policy tensors (fp32, full, on the CPU), read without a process group and without running
    code: its `.metadata` pickle through rl/run/safe_load.py's allowlist, the tensors with weights_only=True."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rl.run.safe_load import DamagedCheckpoint, SafeReader, read_metadata

    try:
        entries = read_metadata(checkpoint / "model_optim").state_dict_metadata
    except DamagedCheckpoint as e:
        raise ConfigError(f"{checkpoint}: {e}") from None
    reader = SafeReader(str(checkpoint / "model_optim"))
    model = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    state = {"model": model}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: Path, out: Path, dtype_name: str = "auto", overwrite: bool = False,
                      adapter: bool = False) -> Path:
    """Writes the checkpoint's policy to `out` (`adapter`: a LoRA checkpoint's adapter alone, as PEFT loads it);
    ConfigError for a checkpoint or an `out` it cannot use."""
    checkpoint, out = Path(checkpoint), Path(os.path.abspath(out))  # "." has no name to put a sibling beside
    if not (checkpoint / "model_optim").is_dir() or not (checkpoint / "hf" / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is not a complete checkpoint folder "
                          f"(expected model_optim/ and hf/config.json; look under <output_dir>/checkpoints/)")
    check_out(out, overwrite, remedy="export into a new or empty folder")
    config = json.loads((checkpoint / "hf" / "config.json").read_text())
    state = load_model_state(checkpoint)
    dtype = export_dtype(dtype_name, config)
    lora = run_config = None
    if any(adapter_of(n) for n in state):  # LoRA: the checkpoint holds the adapters alone
        run_config = json.loads((checkpoint / "trainer_state.json").read_text())["config"]
        lora = LoraConfig(**run_config["lora"])
    if adapter:
        if lora is None:
            raise ConfigError(f"--adapter: {checkpoint} is a full-parameter checkpoint (its run had lora.rank=0)")
        check_peft_experts(config, state)
        return write_adapter_folder(sorted(state.items()), lora, run_config["model"]["path"], out, dtype,
                                    source=str(checkpoint.resolve()))
    if lora is not None:  # the frozen base is the run's model.path
        state = merged_state(state, run_config["model"]["path"], lora, checkpoint)
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = ((n, t.to(dtype)) for n, t in sorted(state.items()))
    return write_hf_folder(tensors, [checkpoint / "hf"], out, dtype, source=str(checkpoint.resolve()))


def merged_state(adapters: dict[str, torch.Tensor], base_path: str, lora: LoraConfig, checkpoint: Path
                 ) -> dict[str, torch.Tensor]:
    """The base model's weights read from `base_path` with the checkpoint's adapters merged in."""
    from safetensors import safe_open

    from rl.train.policy import weight_files

    if not (Path(base_path).expanduser() / "config.json").is_file():
        raise ConfigError(f"{checkpoint} holds LoRA adapters, and the base model of its run (model.path "
                          f"{base_path!r}) is not there to merge them into: run the export where that path resolves")
    base: dict[str, torch.Tensor] = {}
    for file in weight_files(base_path):
        with safe_open(file, framework="pt", device="cpu") as f:
            base.update({k: f.get_tensor(k).float() for k in f.keys() if not k.endswith("rotary_emb.inv_freq")})
    scales = {weight: lora.alpha / lora.rank for weight, leaf in filter(None, map(adapter_of, adapters))
              if leaf == "lora_A"}
    if any(name not in base for name in scales):  # adapted fused experts, and the base holds one tensor per expert
        base = fused_experts(base)
    return dict(merged_weights(list(base.items()) + list(adapters.items()), scales))


PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the hub's one tensor per expert (`<experts>.N.gate_proj.weight`, ...) as transformers 5's fused
    tensors, which its models also load: `<experts>.gate_up_proj` (E, 2 * I, H), each expert's gate rows then its up
    rows, and `<experts>.down_proj` (E, H, I)."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            prefix, expert, kind = match.groups()
            per_expert.setdefault(prefix, {}).setdefault(kind, {})[int(expert)] = tensor
    for prefix, kinds in per_expert.items():
        experts = range(len(kinds["down_proj"]))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]])
                                                     for e in experts])
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in experts])
    return out
