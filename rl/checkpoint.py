"""Checkpoints: save a run and resume it exactly (the Hugging Face export is rl/export.py).

A checkpoint is one folder `<output_dir>/checkpoints/rollout_<N>/` holding everything the
loop needs to continue after rollout N as if it had never stopped:
- `model_optim/`: the policy and AdamW state, sharded with `torch.distributed.checkpoint`
  (DCP): each rank writes its own FSDP2 shards, and a later load reshards to any rank count;
  with LoRA the adapters and their AdamW state alone (the frozen base is `model.path`'s weights);
- `trainer_state.json`: rollout_id, weight_version, the data cursor, the LR schedule, the
  health counters and the resolved config (rank 0);
- `rng/rank_<r>.pt`: every rank's torch (and CUDA) and Python RNG states;
- `hf/`: the model's config, generation config and tokenizer files, so that
  `python -m rl.export` needs nothing but the checkpoint;
- `rollout_buffer.pkl`: with partial rollouts or max_staleness, the prompt groups in flight
  (rl/buffer.py), so that none is lost or trained twice across a resume.

Atomicity: all ranks write into `.rollout_<N>.tmp/`; once every rank is done, rank 0
renames it to `rollout_<N>` (one rename on one filesystem). Only complete folders are ever
named `rollout_<N>`, so a kill mid-save leaves every earlier checkpoint whole, and the
newest one is never deleted before a newer one is complete. Older checkpoints past
`keep_last` are renamed out of the way (`.rollout_<N>.old.*`) and deleted by a background
thread, so a slow filesystem never holds the other ranks at a barrier; leftovers of a kill
(`.tmp` or `.old` folders) are never read and are removed by the next save.

Loading tries the newest complete checkpoint and falls back to older ones, one warning line
for each it skips: before any tensor is read, each is checked cheaply (its trainer state
reads, the DCP metadata reads, every shard file the metadata names is there at full size),
so a torn or half-copied checkpoint is refused before it half-loads; damage inside a shard
is found by the load itself, and the next load overwrites whatever it left. When none can
be read, the run stops with one line saying what to do. A missing or unreadable RNG file
only restarts that rank's RNG states.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import random
import re
import shutil
import socket
import threading
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rl import parallel
from rl.config import ConfigError
from rl.lora import adapted_layers
from rl.metrics import read_metric_rows
from rl.parallel import print0

CHECKPOINTS = "checkpoints"
BUFFER_FILE = "rollout_buffer.pkl"
WRITER_THREADS = 8
_NAME = re.compile(r"rollout_(\d+)")
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
            "added_tokens.json")


@dataclass(frozen=True)
class TrainerState:
    """What the loop restores besides tensors: where it was and what it had counted."""

    rollout_id: int  # the last finished rollout
    weight_version: int
    data: dict[str, int]
    scheduler: dict[str, Any]
    health: dict[str, Any]
    config: dict[str, Any]
    world_size: int
    critic_scheduler: dict[str, Any] | None = None  # PPO with GAE: the critic's learning-rate schedule
    rollout_buffer: bool = False  # groups in flight are in rollout_buffer.pkl (partial rollouts, max_staleness)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints under `output_dir`, oldest first (temporary folders are not listed)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def rollout_of(path: Path) -> int:
    m = _NAME.fullmatch(path.name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint folder (expected rollout_<N>)")
    return int(m.group(1))


# ---------------------------------------------------------------------------- save


def save(output_dir: str | Path, state: TrainerState, model: torch.nn.Module, optimizer, hf_sources: list[Path],
         keep_last: int, critic: tuple[torch.nn.Module, Any] | None = None,
         rollout_buffer: dict[str, Any] | None = None) -> Path:
    """Writes the checkpoint of rollout `state.rollout_id` on every rank (a collective) and returns its path;
    `critic`: the value model and its optimizer (PPO with GAE), saved beside the policy's; `rollout_buffer`: the
    groups in flight (every rank holds the same), pickled whole so that their samples come back exactly."""
    root = checkpoint_root(output_dir)
    final = root / f"rollout_{state.rollout_id}"
    tmp = root / f".rollout_{state.rollout_id}.tmp"
    if dist.get_rank() == 0:
        if tmp.exists():
            retire([tmp])
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    # Several writer threads per rank: one thread writes ~1 GB/s, well below what the disks take.
    dcp.save(_state_dicts(model, optimizer, critic),
             storage_writer=dcp.FileSystemWriter(str(tmp / "model_optim"), thread_count=WRITER_THREADS))
    torch.save(rng_state(), tmp / "rng" / f"rank_{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        if rollout_buffer is not None:
            _write_pickle(tmp / BUFFER_FILE, rollout_buffer)
        _write_json(tmp / "trainer_state.json", {**state.__dict__, "rollout_buffer": rollout_buffer is not None})
        copy_hf_files(hf_sources, tmp / "hf")
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        if final.exists():  # a rerun of the same rollout (after a resume from an older one)
            retire([final])
        os.replace(tmp, final)
        _fsync_dir(root)
        prune(root, keep_last)
    dist.barrier()
    return final


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


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _write_pickle(path: Path, obj: Any) -> None:
    with path.open("wb") as f:
        pickle.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def read_rollout_buffer(path: Path) -> dict[str, Any]:
    """The groups in flight saved with checkpoint `path` (its trainer state says there are some)."""
    file = path / BUFFER_FILE
    try:
        with file.open("rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{BUFFER_FILE} is missing") from None
    except Exception as e:  # unpickling a cut-off file fails in many ways
        raise DamagedCheckpoint(f"{BUFFER_FILE} is unreadable ({type(e).__name__}: {e})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- load


class DamagedCheckpoint(Exception):
    """A checkpoint folder that cannot be loaded; the message names the file and what is wrong with it."""


def read_trainer_state(path: Path) -> TrainerState:
    file = path / "trainer_state.json"
    try:
        saved = json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file.name} is missing") from None
    except (OSError, ValueError) as e:  # ValueError: cut off, not JSON, not UTF-8
        raise DamagedCheckpoint(f"{file.name} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(f"{file.name} holds a JSON {type(saved).__name__}, not an object")
    missing = [f.name for f in fields(TrainerState) if f.default is MISSING and f.name not in saved]
    unknown = sorted(saved.keys() - {f.name for f in fields(TrainerState)})
    if missing:
        raise DamagedCheckpoint(f"{file.name} lacks {', '.join(missing)}")
    if unknown:
        raise DamagedCheckpoint(f"{file.name} holds keys this version does not know: {', '.join(unknown)}")
    return TrainerState(**saved)


def check_shards(folder: Path) -> None:
    """Raises DamagedCheckpoint when the DCP metadata of `folder` cannot be read, or a shard file it names is
    missing or shorter than the bytes it should hold (a torn write, a half-copied folder): found by file sizes,
    before any tensor is read."""
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{folder.name}/.metadata is missing") from None
    except Exception as e:  # unpickling a cut-off file fails in many ways
        raise DamagedCheckpoint(f"{folder.name}/.metadata is unreadable ({type(e).__name__}: {e})") from None
    ends: dict[str, int] = {}
    for item in metadata.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        shard = folder / name
        if not shard.is_file():
            raise DamagedCheckpoint(f"{folder.name}/{name} is missing")
        if shard.stat().st_size < end:
            raise DamagedCheckpoint(f"{folder.name}/{name} holds {shard.stat().st_size} bytes, its metadata "
                                    f"names {end}")


def damage(path: Path) -> str:
    """What makes checkpoint `path` unloadable, as far as is seen without reading a tensor ('' if nothing)."""
    try:
        if read_trainer_state(path).rollout_buffer:
            read_rollout_buffer(path)
        check_shards(path / "model_optim")
    except DamagedCheckpoint as e:
        return str(e)
    return ""


def _options(model: torch.nn.Module) -> StateDictOptions:
    """A model with frozen parameters (LoRA's base) keeps only what trains: the frozen ones are the model
    folder's weights, which the policy loads again at start-up, so a checkpoint holds the adapters and their
    AdamW state alone (and a load leaves the loaded base as it is)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _state_dicts(model: torch.nn.Module, optimizer, critic: tuple[torch.nn.Module, Any] | None) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    out = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        out["critic"], out["critic_optim"] = get_state_dict(*critic)
    return out


def load(path: Path, model: torch.nn.Module, optimizer, critic: tuple[torch.nn.Module, Any] | None = None
         ) -> TrainerState:
    """Restores model and optimizer (resharded to this run's ranks), and the critic's when given; a collective.
    The RNG states are restored apart (`restore_rng`), once nothing more of the start-up draws from them."""
    state = read_trainer_state(path)
    saved = state.config.get("algo", {}).get("advantage_estimator", "?")
    if critic is not None and state.critic_scheduler is None:
        raise ConfigError(f"checkpoint {path} holds no critic (its run had algo.advantage_estimator={saved!r}) and "
                          f"this run's algo.advantage_estimator='gae' needs one: resume with {saved!r}, or start "
                          f"the PPO run in another log.output_dir")
    if critic is None and state.critic_scheduler is not None:
        print0(f"checkpoint: {path} holds a critic (algo.advantage_estimator={saved!r} there); this run has none, "
               f"so it is not restored")
    check_lora(path, state.config.get("lora", {}), model)
    sds = _state_dicts(model, optimizer, critic)
    dcp.load(sds, checkpoint_id=str(path / "model_optim"))
    set_state_dict(model, optimizer, model_state_dict=sds["model"], optim_state_dict=sds["optim"],
                   options=_options(model))
    if critic is not None:
        set_state_dict(*critic, model_state_dict=sds["critic"], optim_state_dict=sds["critic_optim"])
    return state


def check_lora(path: Path, saved: dict[str, Any], model: torch.nn.Module) -> None:
    """A checkpoint of adapters resumes only into the same adapters (a full-parameter one only without)."""
    layers = adapted_layers(model)
    now = (next(iter(layers.values())).rank if layers else 0, sorted({p.rpartition(".")[2] for p in layers}))
    then = (saved.get("rank", 0), sorted(set(saved.get("target_modules", []))) if saved.get("rank", 0) else [])
    if now != then:
        raise ConfigError(f"checkpoint {path} was trained with lora.rank={then[0]} on {then[1] or 'no layers'}, and "
                          f"this run has lora.rank={now[0]} on {now[1] or 'no layers'}: resume with the checkpoint's "
                          f"[lora] keys, or start afresh in another log.output_dir")


def restore_rng(path: Path, state: TrainerState) -> None:
    """Every rank's RNG states as they were at the save, when the rank count is unchanged (a collective); a rank
    whose file is missing or unreadable starts afresh, and rank 0 says which."""
    if state.world_size != dist.get_world_size():
        print0(f"checkpoint: {path} was written by {state.world_size} ranks, resumed on {dist.get_world_size()}; "
               f"model, optimizer, schedule and data cursor are resharded, per-rank RNG states start afresh")
        return
    why_not = _set_rng_from(path / "rng" / f"rank_{dist.get_rank()}.pt")
    failed = [reason for reason in parallel.all_gather_objects([why_not]) if reason]
    if failed:
        print0(f"checkpoint: {path}: {'; '.join(failed)}: the RNG states of those ranks start afresh")


def _set_rng_from(file: Path) -> str:
    """Restores the RNG states saved in `file`; returns why it could not ('' when done)."""
    if not file.is_file():
        return f"rng/{file.name} is missing"
    try:
        set_rng_state(torch.load(file, weights_only=False))
    except Exception as e:  # a cut-off file fails to unpickle in many ways
        return f"rng/{file.name} is unreadable ({_one_line(e)})"
    return ""


def load_newest(candidates: list[Path], model: torch.nn.Module, optimizer,
                critic: tuple[torch.nn.Module, Any] | None = None) -> tuple[Path, TrainerState]:
    """Loads the newest of `candidates` that every rank can read (a collective), with one warning line for each one
    skipped; a ConfigError when none can be read.

    A load that fails part-way (damage inside a shard) leaves some of that checkpoint's tensors in the model and
    optimizer; the next load overwrites them all, since DCP fills every key of the state dict or raises."""
    newest_first = candidates[::-1]
    for i, path in enumerate(newest_first):
        failed = damage(path)
        if not _failed_anywhere(failed):  # every rank reaches dcp.load, a collective, or none does
            try:
                state = load(path, model, optimizer, critic)
            except ConfigError:  # the checkpoint is fine, the run does not fit it: an older one would not either
                raise
            except (Exception, CheckpointException) as e:  # damage inside a shard, or a file gone since the check
                failed = _one_line(e)
            if not _failed_anywhere(failed):
                return path, state
        older = f"; trying {newest_first[i + 1]} instead" if i + 1 < len(newest_first) else ""
        print0(f"warning: checkpoint {path} could not be loaded ({failed or 'another rank could not read it'}){older}")
    names = ", ".join(p.name for p in newest_first)
    raise ConfigError(f"no checkpoint in {candidates[-1].parent} could be loaded ({names}; the reasons are printed "
                      f"above): start afresh in another log.output_dir, or put a readable checkpoint there")


def _failed_anywhere(failed: str) -> bool:
    return bool(parallel.all_reduce_max(float(bool(failed))))


def _one_line(error: BaseException) -> str:
    """The error that stopped a read, on one line; DCP wraps each rank's error in a CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


# ---------------------------------------------------------------------------- the run folder


def resume_candidates(output_dir: str | Path, resume: str, model_path: str) -> list[Path]:
    """The checkpoints to resume from, newest last ([] for a fresh run), per `checkpoint.resume`.

    A folder that already holds a run is never written over silently: without a checkpoint to
    continue from, or with `resume = "never"`, the run stops and says what to pass."""
    out = Path(output_dir)
    complete = complete_checkpoints(out)
    rows = len(read_metric_rows(out / "metrics.jsonl")[0])
    if resume == "never":
        if complete or rows:
            raise ConfigError(f"log.output_dir {str(out)!r} already holds a run ({rows} metric rows, "
                              f"{len(complete)} checkpoints) and checkpoint.resume='never': pass "
                              f"--checkpoint.resume=auto to continue it, or another log.output_dir")
        return []
    if resume == "auto":
        if not complete:
            if rows:
                raise ConfigError(f"log.output_dir {str(out)!r} holds {rows} metric rows of an earlier run but no "
                                  f"complete checkpoint to resume from: pass another log.output_dir (or remove "
                                  f"that folder to start over there)")
            return []
        newest = newest_readable_state(complete)
        if newest is not None:
            path, state = newest
            written_for = state.config["model"]["path"]
            if os.path.realpath(written_for) != os.path.realpath(model_path):  # `/x/model/` is `/x/model`
                raise ConfigError(f"log.output_dir {str(out)!r} holds checkpoints of a run of model.path "
                                  f"{written_for!r}, not {model_path!r}: pass another log.output_dir, or "
                                  f"--checkpoint.resume={path} to start from it on purpose")
        return complete
    path = Path(resume)
    if not (path / "trainer_state.json").is_file() or not (path / "model_optim").is_dir():
        raise ConfigError(f"checkpoint.resume={resume!r}: not a complete checkpoint folder (expected "
                          f"trainer_state.json and model_optim/; they are under <output_dir>/checkpoints/rollout_<N>)")
    if path.resolve().parent == checkpoint_root(out).resolve():
        set_aside_newer(out, rollout_of(path))
    elif complete or rows:
        raise ConfigError(f"checkpoint.resume={resume!r} starts a run from another run's checkpoint, but "
                          f"log.output_dir {str(out)!r} already holds a run ({rows} metric rows, {len(complete)} "
                          f"checkpoints): pass a new log.output_dir")
    return [path]


def newest_readable_state(checkpoints: list[Path]) -> tuple[Path, TrainerState] | None:
    """The newest of `checkpoints` whose trainer state reads, with that state; the unreadable ones are left to
    load_newest, which skips them with a line each."""
    for path in reversed(checkpoints):
        try:
            return path, read_trainer_state(path)
        except DamagedCheckpoint:
            continue
    return None


def set_aside_newer(output_dir: Path, rollout_id: int) -> None:
    """A resume from an older checkpoint of the same run branches it: the newer checkpoints move to
    `checkpoints/abandoned_<time>/`, kept, but out of reach of `resume=auto` and of pruning."""
    newer = [p for p in complete_checkpoints(output_dir) if rollout_of(p) > rollout_id]
    if not newer:
        return
    aside = checkpoint_root(output_dir) / f"abandoned_{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    print(f"checkpoint: resuming from rollout_{rollout_id}: the newer checkpoints "
          f"{', '.join(p.name for p in newer)} are moved to {aside}", flush=True)


def lock_output_dir(output_dir: str | Path):
    """An exclusive lock on the run folder for as long as the returned file stays open (rank 0 holds it)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    handle = (out / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"log.output_dir {str(out)!r} is in use by a running job ({holder}): "
                          f"wait for it to end or pass another log.output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle
