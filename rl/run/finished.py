"""Whether the run folder holds a run that already finished, read before anything expensive: rl/main.py asks
before it imports torch, so a relaunch of a finished run says where its policy is in about a second, without
loading a model, starting the process group or opening a wandb run.

A run has finished when its newest checkpoint is of rollout `train.num_rollout - 1` or later and its policy is
exported (`<output_dir>/final`, which the export writes aside and renames, so it is there whole or not at all).
Anything less certain (a damaged checkpoint, another model.path, an explicit checkpoint.resume, a bad config)
goes the long way, through the full start-up that resumes, exports or says what is wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl.config import Config, load_config
from rl.run.folder import complete_checkpoints, rollout_of


def finished_line(cfg: Config) -> str | None:
    """The one line a relaunch of a finished run prints, or None when the run has more to do (or may have)."""
    out = Path(cfg.log.output_dir)
    if cfg.checkpoint.resume != "auto" or not (out / "final").is_dir():
        return None
    rollout_id = newest_checkpoint(out, cfg.model.path)
    if rollout_id is None or rollout_id + 1 < cfg.train.num_rollout:
        return None
    return (f"rl: the run in {out} already finished rollout {rollout_id} (train.num_rollout={cfg.train.num_rollout})"
            f": its trained policy is in {out / 'final'}; pass a larger --train.num_rollout to train further")


def newest_checkpoint(out: Path, model_path: str) -> int | None:
    """The rollout of the newest checkpoint, when its trainer state reads and names this model; else None."""
    complete = complete_checkpoints(out)
    if not complete:
        return None
    try:
        state = json.loads((complete[-1] / "trainer_state.json").read_text())
        written_for = state["config"]["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rollout_of(complete[-1]) if os.path.realpath(written_for) == os.path.realpath(model_path) else None


def exit_if_finished(argv: list[str]) -> None:
    """Prints the line (on rank 0) and exits 0 when the run of `argv` has finished; else returns."""
    try:  # unchecked (validation imports torch): only the run folder's keys are read here
        line = finished_line(load_config(argv, checked=False))
    except Exception:  # noqa: BLE001 (whatever it is, the full start-up reports it with its usual line)
        return
    if line is None:
        return
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    raise SystemExit(0)
