"""Checkpoints: save a run and resume it exactly (the Hugging Face export is rl/export.py).

A checkpoint is one folder `<output_dir>/checkpoints/rollout_<N>/` holding everything the
loop needs to continue after rollout N as if it had never stopped:
- `model_optim/`: the policy and AdamW state, sharded with `torch.distributed.checkpoint`
  (DCP): each rank writes its own FSDP2 shards, and a later load reshards to any rank count;
  with LoRA the adapters and their AdamW state alone (the frozen base is `model.path`'s weights);
  experts split by train.expert_parallel at their rows of the whole tensor, the optimizer's param groups as one,
  so that a resume may change train.expert_parallel too;
- `trainer_state.json`: rollout_id, weight_version, the resolved config and the rank count, and
  every stateful part's `state_dict()` under the part's name (the learning-rate schedules, the data
  cursor, the health counters: whatever the run hands RunCheckpointer.parts) (rank 0);
- `rng/rank_<r>.json`: every rank's torch (and CUDA) and Python RNG states, as JSON;
- `hf/`: the model's config, generation config and tokenizer files, so that
  `python -m rl.export` needs nothing but the checkpoint;
- `rollout_buffer.json`: with partial rollouts or max_staleness, the prompt groups in flight
  (rl/rollout/buffer.py), so that none is lost or trained twice across a resume.

Nothing in a checkpoint runs code when it loads (a checkpoint may come from elsewhere, or be
written over by code the run executed): the RNG states and the groups in flight are JSON, and
DCP's files are read through rl/run/safe_load.py (its `.metadata` pickle against an allowlist of the
classes DCP metadata holds, every value with `weights_only=True`). Checkpoints written before
these formats load as far as that allows: `rng/rank_<r>.pt` with `weights_only=True`, a
`rollout_buffer.pkl` never (its checkpoint counts as damaged).

Atomicity: all ranks write into `.rollout_<N>.tmp/`; once every rank is done, rank 0
renames it to `rollout_<N>` (one rename on one filesystem). Only complete folders are ever
named `rollout_<N>`, so a kill mid-save leaves every earlier checkpoint whole, and the
newest one is never deleted before a newer one is complete. Older checkpoints past
`keep_last` are renamed out of the way (`.rollout_<N>.old.*`) and deleted by a background
thread, so a slow filesystem never holds the other ranks at a barrier; leftovers of a kill
(`.tmp` or `.old` folders) are never read and are removed by the next save. A save that
fails on any rank (a full disk) removes its `.tmp` folder at once and stops the run with one
line naming the checkpoint and the cause.

Loading tries the newest complete checkpoint and falls back to older ones, one warning line
for each it skips: before any tensor is read, each is checked cheaply (its trainer state
reads, the DCP metadata reads, every shard file the metadata names is there at full size, the
groups in flight and every rank's RNG states read), so a torn, half-copied or foreign checkpoint
is refused before it half-loads; damage inside a shard is found by the load itself, and the next
load overwrites whatever it left. When none can be read, the run stops with one line saying what
to do. RNG states are restored only on the rank count that saved them (a resharded resume starts
them afresh, and says so).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from rl import parallel
from rl.config import ConfigError, RunStopped
from rl.parallel import print0
from rl.rollout.buffer import sample_from_dict
from rl.run.folder import checkpoint_root, complete_checkpoints, rollout_of  # noqa: F401 (this module's names too)
from rl.run.safe_load import (
    DamagedCheckpoint,
    SafeLoadPlanner,
    SafeReader,
    error_line,
    read_metadata,
    read_rng,
    rng_file,
    rng_state,
    rng_to_json,
    set_rng_state,
)
from rl.train.lora import adapted_names, adapter_names, lora_rank, selected_names

BUFFER_FILE = "rollout_buffer.json"
OLD_BUFFER_FILE = "rollout_buffer.pkl"  # written before the JSON form: never unpickled
WRITER_THREADS = 8
Models = dict[str, tuple[torch.nn.Module, Any]]  # name -> (model, its optimizer): the checkpoint's tensors
EXPERT_MESH = ("replica", "expert")  # rl/parallel.py's expert_parallel_mesh: the split experts' DTensors
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
            "added_tokens.json")


class Stateful(Protocol):
    """A part of the run that a checkpoint keeps: its state as plain JSON data (lists, dicts, numbers, strings)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


RUN_KEYS = ("rollout_id", "weight_version", "config", "world_size")
# Parts every checkpoint has held since the first format: a trainer state without one is damaged. A part added
# since is absent from older checkpoints, and starts afresh when one of them is resumed.
FIRST_PARTS = ("data", "scheduler", "health")
FILE_PARTS = {"rollout_buffer": BUFFER_FILE}  # parts too large for trainer_state.json, each in a file of its own


@dataclass(frozen=True)
class TrainerState:
    """What the loop restores besides tensors: where it was, and every stateful part's state by name (in
    trainer_state.json beside the run's keys; None for a part the saving run did not have; for a part of
    FILE_PARTS whether its file holds it)."""

    rollout_id: int  # the last finished rollout
    weight_version: int
    config: dict[str, Any]
    world_size: int
    parts: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        saved = {name: self.parts[name] is not None if name in FILE_PARTS else self.parts[name] for name in self.parts}
        return {"rollout_id": self.rollout_id, "weight_version": self.weight_version, "config": self.config,
                "world_size": self.world_size, **saved}


# ---------------------------------------------------------------------------- save


def save(output_dir: str | Path, state: TrainerState, models: Models, hf_sources: list[Path], keep_last: int) -> Path:
    """Writes the checkpoint of rollout `state.rollout_id` on every rank (a collective) and returns its path;
    `models`: each model and its optimizer by name (the policy as "model"; the critic of PPO with GAE), sharded;
    `state.parts`: every rank holds the same, written by rank 0.

    A write that fails on any rank (a full disk) removes the `.tmp` folder and raises RunStopped on every rank,
    naming the checkpoint and the cause; the earlier checkpoints are untouched."""
    root = checkpoint_root(output_dir)
    final = root / f"rollout_{state.rollout_id}"
    tmp = root / f".rollout_{state.rollout_id}.tmp"
    failed = _everywhere(_attempt(lambda: _begin(tmp)) if dist.get_rank() == 0 else "")
    if not failed:
        failed = _everywhere(_attempt(lambda: _write(tmp, state, models, hf_sources)))
    if failed:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # at once: what it holds may be what fills the disk
        dist.barrier()
        earlier = ", ".join(p.name for p in complete_checkpoints(output_dir)) or "none"
        raise RunStopped(f"checkpoint {final} could not be written ({failed}); its partial folder is removed, the "
                         f"earlier checkpoints ({earlier}) are as they were: free space and rerun the same command "
                         f"to resume")
    if dist.get_rank() == 0:
        if final.exists():  # a rerun of the same rollout (after a resume from an older one)
            retire([final])
        os.replace(tmp, final)
        _fsync_dir(root)
        prune(root, keep_last)
    dist.barrier()
    return final


def _begin(tmp: Path) -> None:
    if tmp.exists():
        retire([tmp])
    (tmp / "rng").mkdir(parents=True)


def _write(tmp: Path, state: TrainerState, models: Models, hf_sources: list[Path]) -> None:
    """Every rank's part of the checkpoint, into `tmp`; DCP's save is a collective that fails on every rank when
    one rank's write fails."""
    # Several writer threads per rank: one thread writes ~1 GB/s, well below what the disks take.
    dcp.save(_state_dicts(models),
             storage_writer=_Writer(str(tmp / "model_optim"), thread_count=WRITER_THREADS))
    _write_json(tmp / "rng" / f"rank_{dist.get_rank()}.json", rng_to_json(rng_state()))
    if dist.get_rank() == 0:
        for name, file in FILE_PARTS.items():
            if state.parts.get(name) is not None:
                _write_json(tmp / file, state.parts[name])
        _write_json(tmp / "trainer_state.json", state.to_json())
        copy_hf_files(hf_sources, tmp / "hf")


class _FailureKeepingFileSystem(FileSystem):
    """DCP's file system, keeping the first error of any write (into `failures`) instead of raising it where it
    happens: DCP writes from threads of its own, whose errors would print a traceback and leave the save to finish
    without their files."""

    def __init__(self):
        super().__init__()
        self.failures: list[BaseException] = []

    @contextmanager
    def create_stream(self, path, mode: str):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as e:
            self.failures.append(e)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, raising the first failed write on the calling thread (DCP then fails the save on every
    rank), whichever thread wrote it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fs = _FailureKeepingFileSystem()

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        self._raise_failures()
        return written

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._raise_failures()

    def _raise_failures(self) -> None:
        if self.fs.failures:
            raise self.fs.failures[0]


def _attempt(write) -> str:
    """Runs `write`; returns why it failed when the filesystem refused it ('' when done)."""
    try:
        write()
    except (OSError, CheckpointException) as e:
        return _write_cause(e)
    return ""


def _write_cause(error: BaseException) -> str:
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, OSError) and error.errno in errno.errorcode:
        where = f" writing {error.filename}" if error.filename else ""
        return f"{errno.errorcode[error.errno]}: {error.strerror or os.strerror(error.errno)}{where}"
    return error_line(error)


def prune(root: Path, keep_last: int) -> None:
    """Removes all but the newest `keep_last` complete checkpoints and any leftover of a killed save."""
    complete = complete_checkpoints(root.parent)
    leftovers = [p for p in root.glob(".rollout_*") if p.name.endswith(".tmp") or ".old." in p.name]
    retire(complete[: max(len(complete) - keep_last, 0)] + leftovers)


_removals: list[threading.Thread] = []


def retire(paths: list[Path]) -> None:
    """Renames each folder out of the checkpoint namespace at once (no later listing sees it), then
    deletes it in a background thread: deleting tens of GB can take minutes on a network filesystem."""
    moved = []
    for path in paths:
        if ".old." in path.name:
            moved.append(path)
            continue
        target = path.with_name(f".{path.name.lstrip('.')}.old.{time.time_ns()}")
        os.replace(path, target)
        moved.append(target)
    if moved:
        thread = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in moved], daemon=True)
        thread.start()
        _removals.append(thread)


def wait_for_removals() -> None:
    """Lets the background deletions finish (a process that exits first leaves them to the next save)."""
    while _removals:
        _removals.pop().join()


def copy_hf_files(sources: list[Path], out: Path) -> None:
    """The config, generation config and tokenizer files of the model (first source that has each)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        for folder in sources:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
                break


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def read_rollout_buffer(path: Path) -> dict[str, Any]:
    """The groups in flight saved with checkpoint `path` (its trainer state says there are some), in
    RolloutBuffer.state_dict's form, each sample checked; DamagedCheckpoint naming the file otherwise."""
    file = path / BUFFER_FILE
    if not file.exists() and (path / OLD_BUFFER_FILE).exists():
        raise DamagedCheckpoint(f"{OLD_BUFFER_FILE} predates the pickle-free {BUFFER_FILE} and is never "
                                f"unpickled (a pickle can run code)")
    try:
        saved = json.loads(file.read_text())
        counts = (saved["admitted"], saved["consumed"])
        if not all(type(c) is int for c in counts) or type(saved["groups"]) is not list:
            raise ValueError("admitted, consumed or groups of the wrong type")
        for group in saved["groups"]:
            [sample_from_dict(s) for s in group]
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{BUFFER_FILE} is missing") from None
    except Exception as e:  # cut off, not JSON, not samples
        raise DamagedCheckpoint(f"{BUFFER_FILE} is unreadable ({error_line(e)})") from None
    return saved


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- load


def read_trainer_state(path: Path) -> TrainerState:
    """The trainer state of checkpoint `path`; DamagedCheckpoint when it does not read, or lacks the run's keys or
    a part of FIRST_PARTS."""
    file = path / "trainer_state.json"
    try:
        saved = json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file.name} is missing") from None
    except (OSError, ValueError) as e:  # ValueError: cut off, not JSON, not UTF-8
        raise DamagedCheckpoint(f"{file.name} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(f"{file.name} holds a JSON {type(saved).__name__}, not an object")
    missing = [name for name in (*RUN_KEYS, *FIRST_PARTS) if name not in saved]
    if missing:
        raise DamagedCheckpoint(f"{file.name} lacks {', '.join(missing)}")
    return TrainerState(**{key: saved.pop(key) for key in RUN_KEYS}, parts=saved)


def read_part(path: Path, state: TrainerState, name: str) -> Any:
    """Part `name`'s state in checkpoint `path` (None when its run did not have it, or it predates the part), its
    own file read for a part of FILE_PARTS."""
    if name not in FILE_PARTS:
        return state.parts.get(name)
    return read_rollout_buffer(path) if state.parts.get(name) else None  # the one part in a file of its own


def check_shards(folder: Path) -> None:
    """Raises DamagedCheckpoint when the DCP metadata of `folder` cannot be read, or a shard file it names is
    missing or shorter than the bytes it should hold (a torn write, a half-copied folder): found by file sizes,
    before any tensor is read."""
    metadata = read_metadata(folder)
    ends: dict[str, int] = {}
    try:
        for item in metadata.storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        shards = [(folder / name, end) for name, end in sorted(ends.items())]
    except (AttributeError, TypeError) as e:  # built only of allowed classes, but not as DCP builds them
        raise DamagedCheckpoint(f"{folder.name}/.metadata is not DCP metadata ({error_line(e)})") from None
    for shard, end in shards:
        if not shard.is_file():
            raise DamagedCheckpoint(f"{folder.name}/{shard.name} is missing")
        if shard.stat().st_size < end:
            raise DamagedCheckpoint(f"{folder.name}/{shard.name} holds {shard.stat().st_size} bytes, its metadata "
                                    f"names {end}")


def damage(path: Path) -> str:
    """What makes checkpoint `path` unloadable on this rank, as far as is seen without reading a tensor ('' if
    nothing): its trainer state, the parts in files of their own, DCP metadata and shard sizes, and
    this rank's RNG states when they will be restored (the rank count is the one that saved them)."""
    try:
        state = read_trainer_state(path)
        for name in FILE_PARTS:
            read_part(path, state, name)
        check_shards(path / "model_optim")
        if state.world_size == dist.get_world_size():
            read_rng(rng_file(path, dist.get_rank()))
    except DamagedCheckpoint as e:
        return str(e)
    return ""


def _options(model: torch.nn.Module) -> StateDictOptions:
    """A model with frozen parameters (LoRA's base) keeps only what trains: the frozen ones are the model
    folder's weights, which the policy loads again at start-up, so a checkpoint holds the adapters and their
    AdamW state alone (and a load leaves the loaded base as it is)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _optim_key(name: str) -> str:
    return "optim" if name == "model" else f"{name}_optim"  # the policy's optimizer has always been "optim"


def _state_dicts(models: Models) -> dict[str, Any]:
    out = {}
    for name, (model, optimizer) in models.items():
        out[name], out[_optim_key(name)] = get_state_dict(model, optimizer, options=_options(model))
        _place_split_experts(model, out[name], out[_optim_key(name)])
        _merge_param_groups(out[_optim_key(name)])
    return out


def _merge_param_groups(optim_sd: dict[str, Any]) -> None:
    """The optimizer's param groups as one when they differ in their parameters alone (expert parallelism's
    split experts are a group of their own, rl/train/policy.py's `param_groups`): a checkpoint holds the same
    groups at any expert-parallel size, so that it resumes at another. `_split_param_groups` undoes it after a
    load. In place."""
    groups = optim_sd.get("param_groups", [])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    if len(groups) > 1 and all(h == hyper[0] for h in hyper):
        optim_sd["param_groups"] = [{**groups[0], "params": [fqn for g in groups for fqn in g["params"]]}]


def _split_param_groups(optim_sd: dict[str, Any], model: torch.nn.Module, optimizer) -> dict[str, Any]:
    """A loaded optimizer state dict of `_merge_param_groups`'s one group as the optimizer's own groups, each with
    the loaded hyperparameters."""
    groups = optim_sd.get("param_groups", [])
    if len(optimizer.param_groups) < 2 or len(groups) != 1:
        return optim_sd
    fqn = {id(p): name for name, p in model.named_parameters()}
    return {**optim_sd, "param_groups": [{**groups[0], "params": [fqn[id(p)] for p in g["params"]]}
                                         for g in optimizer.param_groups]}


def _place_split_experts(model: torch.nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Experts split by expert parallelism (rl/model/expert_parallel.py) are plain tensors, each rank's its own
    experts under the same name: in the state dicts, each (and its AdamW moments) becomes a DTensor of the whole
    tensor's shape on the (replica, expert) mesh, Shard(0) along "expert", so that DCP saves every slice at its
    global expert rows (once, over the replicas), and loads them resharded to any expert-parallel size or to
    FSDP2's shards. In place; `_local_split_experts` undoes it after a load."""
    split = {name: p for name, p in model.named_parameters() if hasattr(p, "expert_group")}
    state = optim_sd.get("state", {})
    for name, param in split.items():
        if name in model_sd:
            model_sd[name] = _on_expert_mesh(model_sd[name], param, model.expert_mesh)
        if name in state:  # a new dict: the optimizer's state_dict hands out its own per-parameter dicts
            state[name] = {key: _on_expert_mesh(value, param, model.expert_mesh)
                           if torch.is_tensor(value) and value.dim() > 0 else value
                           for key, value in state[name].items()}


def _on_expert_mesh(local: torch.Tensor, param: torch.Tensor, mesh) -> DTensor:
    shape = parallel.full_shape(param)
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), local.dtype)
    # same data, not a copy (from_local would move a host tensor, HostAdamW's moments, to the mesh's device)
    return DTensor(local, DTensorSpec(mesh, (Replicate(), Shard(0)), tensor_meta=meta), requires_grad=False)


def _local_split_experts(sd: dict[str, Any]) -> dict[str, Any]:
    """A loaded state dict with the split experts' DTensors (`_place_split_experts`) back to their local slices."""
    def local(v: Any) -> Any:
        return v.to_local() if isinstance(v, DTensor) and v.device_mesh.mesh_dim_names == EXPERT_MESH else v

    out = {k: local(v) for k, v in sd.items()}
    if isinstance(sd.get("state"), dict):
        out["state"] = {fqn: {k: local(v) for k, v in s.items()} for fqn, s in sd["state"].items()}
    return out


def load(path: Path, models: Models) -> TrainerState:
    """Restores every model and its optimizer (resharded to this run's ranks); a collective. Returns the trainer
    state for the caller to restore the parts; the RNG states are restored apart (`restore_rng`),
    once nothing more of the start-up draws from them."""
    state = read_trainer_state(path)
    check_critic(path, state, models)
    check_lora(path, state.config.get("lora", {}), models["model"][0])
    check_adapters_held(path, models["model"][0])
    sds = _state_dicts(models)
    reader = SafeReader(str(path / "model_optim"))
    dcp.load(sds, storage_reader=reader, planner=SafeLoadPlanner(reader))
    for name, (model, optimizer) in models.items():
        optim_sd = _split_param_groups(_local_split_experts(sds[_optim_key(name)]), model, optimizer)
        set_state_dict(model, optimizer, model_state_dict=_local_split_experts(sds[name]), optim_state_dict=optim_sd,
                       options=_options(model))
    return state


def check_critic(path: Path, state: TrainerState, models: Models) -> None:
    """A run with a critic (PPO with GAE) resumes only from a checkpoint that holds one; a critic this run does
    not have is left unread, with a line."""
    held = {key.partition(".")[0] for key in read_metadata(path / "model_optim").state_dict_metadata}
    saved = state.config.get("algo", {}).get("advantage_estimator", "?")
    if "critic" in models and "critic" not in held:
        raise ConfigError(f"checkpoint {path} holds no critic (its run had algo.advantage_estimator={saved!r}) and "
                          f"this run's algo.advantage_estimator='gae' needs one: resume with {saved!r}, or start "
                          f"the PPO run in another log.output_dir")
    if "critic" in held and "critic" not in models:
        print0(f"checkpoint: {path} holds a critic (algo.advantage_estimator={saved!r} there); this run has none, "
               f"so it is not restored")


def check_lora(path: Path, saved: dict[str, Any], model: torch.nn.Module) -> None:
    """A checkpoint of adapters resumes only into the same adapters (a full-parameter one only without): the same
    rank on the same layers and expert tensors (rl/train/lora.py's `adapted_names`; the saved run's targets that name
    nothing in this model adapted nothing and are left out of the comparison)."""
    now = (lora_rank(model), adapted_names(model))
    then = (saved.get("rank", 0), selected_names(model, saved.get("target_modules", [])) if saved.get("rank") else [])
    if now != then:
        raise ConfigError(f"checkpoint {path} was trained with lora.rank={then[0]} on {then[1] or 'no layers'}, and "
                          f"this run has lora.rank={now[0]} on {now[1] or 'no layers'}: resume with the checkpoint's "
                          f"[lora] keys, or start afresh in another log.output_dir")


def check_adapters_held(path: Path, model: torch.nn.Module) -> None:
    """A LoRA checkpoint holds every adapter of this run's policy. One written before a MoE model's experts took
    adapters has the same lora keys (its default targets adapted attention alone) and lacks the experts'."""
    held = read_metadata(path / "model_optim").state_dict_metadata
    missing = sorted(name for name in adapter_names(model) if f"model.{name}" not in held)
    if missing:
        raise ConfigError(f"checkpoint {path} holds no {missing[0]} ({len(missing)} of this run's adapters are not "
                          f"in it, as in one written when a MoE model's experts took no adapters); resume with "
                          f"lora.target_modules naming the layers it adapted (e.g. [\"q_proj\", \"k_proj\", "
                          f"\"v_proj\", \"o_proj\"]), or start afresh in another log.output_dir")


def restore_rng(path: Path, state: TrainerState) -> None:
    """Every rank's RNG states as they were at the save, when the rank count is unchanged (a collective); `damage`
    has read them before the load, so a file that fails here was changed since: one line naming it."""
    if state.world_size != dist.get_world_size():
        print0(f"checkpoint: {path} was written by {state.world_size} ranks, resumed on {dist.get_world_size()}; "
               f"model, optimizer, schedule and data cursor are resharded, per-rank RNG states start afresh")
        return
    try:
        set_rng_state(read_rng(rng_file(path, dist.get_rank())))
        failed = ""
    except DamagedCheckpoint as e:
        failed = str(e)
    if failed := _everywhere(failed):
        raise ConfigError(f"checkpoint {path}: {failed}, after its model and optimizer loaded: rerun the same "
                          f"command to resume from the checkpoint before it")


def load_newest(candidates: list[Path], models: Models) -> tuple[Path, TrainerState]:
    """Loads the newest of `candidates` that every rank can read (a collective), with one warning line for each one
    skipped; a ConfigError when none can be read.

    A load that fails part-way (damage inside a shard) leaves some of that checkpoint's tensors in the model and
    optimizer; the next load overwrites them all, since DCP fills every key of the state dict or raises."""
    newest_first = candidates[::-1]
    for i, path in enumerate(newest_first):
        failed = _everywhere(damage(path))
        if not failed:  # every rank reaches dcp.load, a collective, or none does
            try:
                state = load(path, models)
            except ConfigError:  # the checkpoint is fine, the run does not fit it: an older one would not either
                raise
            except (Exception, CheckpointException) as e:  # damage inside a shard, or a file gone since the check
                failed = error_line(e)
            if not (failed := _everywhere(failed)):
                return path, state
        older = f"; trying {newest_first[i + 1]} instead" if i + 1 < len(newest_first) else ""
        print0(f"warning: checkpoint {path} could not be loaded ({failed}){older}")
    names = ", ".join(p.name for p in newest_first)
    raise ConfigError(f"no checkpoint in {candidates[-1].parent} could be loaded ({names}; the reasons are printed "
                      f"above): start afresh in another log.output_dir, or put a readable checkpoint there")


def _everywhere(failed: str) -> str:
    """Every rank's reason, each said once, in rank order ('' when no rank failed): a collective."""
    return "; ".join(dict.fromkeys(r for r in parallel.all_gather_objects([failed]) if r))
