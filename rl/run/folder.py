"""A run folder's checkpoints by name: where they are, which are complete, and the rollout each one ends. Names only
and no torch, so rl/run/finished.py can read a run folder before anything heavy loads; rl/run/checkpoint.py,
which writes the folders, lists them through here too."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"rollout_(\d+)")  # a complete checkpoint; `.rollout_<N>.tmp` and `.old` folders never match


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
