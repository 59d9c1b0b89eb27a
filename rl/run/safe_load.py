"""Reading a checkpoint's files so that nothing in them runs code, whatever they hold (rl/run/checkpoint.py owns
the format; this file, how each part is read).

- RNG states: JSON (`rng_to_json`), the generators' byte states in hex and Python's state as a list of ints,
  each checked on a generator of its own before any is set; the `rng/rank_<r>.pt` files of earlier
  checkpoints load with `torch.load(weights_only=True)`, which builds only tensors and plain values.
- DCP's `.metadata` is a pickle: `SafeReader` unpickles it with `_MetadataUnpickler`, which builds only the
  classes DCP metadata holds (`_METADATA_GLOBALS`) and refuses the file at any other global, before looking it
  up.
- DCP's tensors load with weights_only=True already; its other values (the optimizer's lr, betas, ...) DCP
  would unpickle freely: `SafeLoadPlanner` loads them with weights_only=True too.

Every refusal is a DamagedCheckpoint whose message names the file.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class DamagedCheckpoint(Exception):
    """A checkpoint folder that cannot be loaded; the message names the file and what is wrong with it."""


def error_line(error: BaseException) -> str:
    """The error that stopped a read, on one line; DCP wraps each rank's error in a CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


# ---------------------------------------------------------------------------- RNG states


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


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """RNG states as JSON: the generators' byte states in hex, Python's state (a tuple of ints) as a list."""
    out = {k: bytes(v.numpy().tobytes()).hex() for k, v in state.items() if k != "python"}
    version, internal, gauss_next = state["python"]
    return out | {"python": [version, list(internal), gauss_next]}


def rng_from_json(saved: Any) -> dict[str, Any]:
    """The states rng_to_json wrote, checked on generators of their own (a foreign file raises, nothing is set)."""
    version, internal, gauss_next = saved["python"]
    state = {k: torch.frombuffer(bytearray.fromhex(v), dtype=torch.uint8) for k, v in saved.items() if k != "python"}
    return _checked_rng(state | {"python": (version, tuple(internal), gauss_next)})


def _checked_rng(state: dict[str, Any]) -> dict[str, Any]:
    if set(state) - {"torch", "cuda", "python"} or "torch" not in state:
        raise ValueError(f"keys {sorted(state)}, expected torch, python and maybe cuda")
    version, internal, gauss_next = state["python"]
    if not (type(version) is int and all(type(i) is int for i in internal) and type(gauss_next) in (float, type(None))):
        raise ValueError("Python's state holds other types than ints")
    random.Random().setstate(state["python"])
    torch.Generator().set_state(state["torch"])
    return state


def read_rng(file: Path) -> dict[str, Any]:
    """The RNG states of `file` (DamagedCheckpoint naming it otherwise); the `.pt` form of earlier checkpoints is
    read with weights_only=True: tensors and a tuple of ints, so nothing in it can run code."""
    name = f"rng/{file.name}"
    try:
        if file.suffix == ".pt":
            with warnings.catch_warnings():  # weights_only's note on a pickle protocol it was not written with
                warnings.simplefilter("ignore")
                state = torch.load(file, weights_only=True)
            return _checked_rng(state if isinstance(state, dict) else {})
        return rng_from_json(json.loads(file.read_text()))
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{name} is missing") from None
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):  # cut off
            raise DamagedCheckpoint(f"{name} is unreadable ({error_line(e)})") from None
        raise DamagedCheckpoint(f"{name} is refused: it holds more than tensors and plain values") from None
    except Exception as e:  # cut off, not JSON, the wrong types or sizes
        raise DamagedCheckpoint(f"{name} is unreadable ({error_line(e)})") from None


def rng_file(path: Path, rank: int) -> Path:
    """Rank `rank`'s RNG file in checkpoint `path`: the JSON one, or the `.pt` one of an earlier checkpoint."""
    file = path / "rng" / f"rank_{rank}.json"
    old = file.with_suffix(".pt")
    return old if not file.exists() and old.exists() else file


# ---------------------------------------------------------------------------- DCP, read without running code

# Every global a DCP `.metadata` pickle names besides torch's dtypes (listed from torch 2.13's full-parameter, LoRA
# and critic checkpoints; torch 2.11 pickles the same classes): the metadata dataclasses, torch.Size, the path it
# was saved to, a layout by name.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
}


class Refused(pickle.UnpicklingError):
    """A pickle in a checkpoint names a global that its kind of file never holds: it is not read further."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP metadata holds: any other global (a function a planted pickle would call) is refused
    before it is looked up, so no code of the file's choosing runs."""

    def find_class(self, module: str, name: str) -> Any:
        # A dtype is looked up in torch's own namespace: getattr(torch, name) may import a submodule.
        dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise Refused(f"it names {module}.{name}, which DCP metadata never holds")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by _MetadataUnpickler: the bytes checked are the bytes used."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise Refused(f"it holds a {type(metadata).__name__}, not DCP metadata")
        check_storage(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_storage(metadata: Metadata) -> None:
    """Where the metadata sends the reads: each item a plain file name of the checkpoint's own folder (not a path
    out of it, `/etc/...` or `../..`), at a non-negative offset and length, with no transform to apply. Only
    allowed classes were built, but their values are the file's choice."""
    for index, item in (getattr(metadata, "storage_data", None) or {}).items():
        name, offset, length = (getattr(item, key, None) for key in ("relative_path", "offset", "length"))
        if not (isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")):
            raise Refused(f"it sends a read of {getattr(index, 'fqn', index)} to {name!r}, not a file of its folder")
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise Refused(f"it gives {name} an offset {offset!r} and length {length!r}")
        if getattr(item, "transform_descriptors", None):
            raise Refused(f"it asks for transforms {item.transform_descriptors!r} of {name}, which no save here writes")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but the values saved as bytes (the optimizer's lr, betas, ...) load with weights_only=True,
    where DCP's own would unpickle anything; a refused value names its shard file."""

    def __init__(self, reader: SafeReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            shard = self.reader.storage_data[read_item.storage_index].relative_path
            raise DamagedCheckpoint(f"model_optim/{shard}: its value {read_item.dest_index.fqn} is refused, it "
                                    f"holds more than tensors and plain values") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(folder: Path) -> Metadata:
    """The DCP metadata of `folder`, read safely; DamagedCheckpoint naming the file when missing or refused."""
    try:
        return SafeReader(str(folder)).read_metadata()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{folder.name}/.metadata is missing") from None
    except Refused as e:
        raise DamagedCheckpoint(f"{folder.name}/.metadata is refused: {e}") from None
    except Exception as e:  # unpickling a cut-off file fails in many ways
        raise DamagedCheckpoint(f"{folder.name}/.metadata is unreadable ({error_line(e)})") from None
