"""One flat dict of metrics per rollout step: stdout, `<output_dir>/metrics.jsonl`, wandb.

Only rank 0 writes; other ranks get a `NullLogger`, so the loop never branches on
rank. wandb runs offline unless `WANDB_API_KEY` is set, and a resumed run continues the
folder's wandb run (its id is kept in `<output_dir>/wandb_run_id`). The JSONL file is
always valid JSON Lines: a non-finite value is written as `null`, each row goes out in one
write and is flushed to disk, a row that fails to write (a full disk) is cut back off and
stops the run, a cut-off last line left by a crash is dropped when the file is opened
again, and a resumed run drops the rows past its checkpoint before appending.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rl.env.reward import score_column
from rl.run.health import RunStopped

PRINT_KEYS = ("rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm",
              "train/clip_frac", "perf/step_s", "perf/rollout_s", "perf/train_s", "perf/weight_sync_s")


def format_line(metrics: dict[str, Any]) -> str:
    parts = [f"rollout {metrics['rollout_id']}"]
    for key in PRINT_KEYS:
        if key in metrics:
            parts.append(f"{key.split('/', 1)[1]}={metrics[key]:.4g}")
    return " | ".join(parts)


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN or Infinity: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metric_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics file and how many lines could not be read (a cut-off last line)."""
    rows, bad = [], 0
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return rows, bad


def keep_rows_before(path: Path, rollout_id: float) -> tuple[int, int, Path | None]:
    """Rewrites `path` with only its readable rows of rollouts before `rollout_id`; the others move to
    a file beside it. Returns (rows moved, unreadable lines dropped, the file they moved to)."""
    rows, bad = read_metric_rows(path)
    kept = [r for r in rows if r.get("rollout_id", -1) < rollout_id]
    moved_to = None
    if len(kept) != len(rows):
        moved_to = path.with_name(f"{path.stem}.replaced_{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        with moved_to.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows if r.get("rollout_id", -1) >= rollout_id))
    if len(kept) != len(rows) or bad or (path.is_file() and path.read_bytes()[-1:] not in (b"\n", b"")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return len(rows) - len(kept), bad, moved_to


WANDB_RUN_ID = "wandb_run_id"


def start_wandb(output_dir: Path, project: str, run_name: str, config: dict[str, Any]):
    """The wandb run of the run folder: the first one's id is kept in `<output_dir>/wandb_run_id`, so that a resumed
    run continues its own wandb run rather than starting a new one."""
    import wandb

    if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"
    id_file = output_dir / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    run = wandb.init(project=project, name=run_name or None, config=config, dir=str(output_dir), id=run_id or None,
                     resume="allow")
    if not run_id:
        id_file.write_text(run.id + "\n")
    return run


class MetricsLogger:
    def __init__(self, output_dir: str, config: dict[str, Any], use_wandb: bool, project: str, run_name: str,
                 start_rollout: int | None = 0):
        """`start_rollout`: the first rollout this run writes (rows from it on move aside); None keeps every row."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        moved, bad, moved_to = keep_rows_before(self.path, math.inf if start_rollout is None else start_rollout)
        if moved:
            print(f"metrics: {moved} row(s) of rollouts >= {start_rollout} in {self.path} were written after the "
                  f"checkpoint the run resumes from; they are moved to {moved_to}", flush=True)
        if bad:
            print(f"metrics: dropped {bad} cut-off line(s) from {self.path}", flush=True)
        self.wandb_run = start_wandb(self.path.parent, project, run_name, config) if use_wandb else None

    def log(self, metrics: dict[str, Any]) -> None:
        line = (json.dumps({k: finite_or_none(v) for k, v in metrics.items()}, allow_nan=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:  # unbuffered: a failed write leaves nothing behind that a later flush could retry
                if os.write(fd, line) != len(line):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            except OSError as e:
                os.ftruncate(fd, size)  # never leave half a row for the next one to run into
                raise RunStopped(f"cannot write {self.path} ({e.strerror or e}): the run stops rather than lose "
                                 f"metrics; free space and rerun the same command to resume") from e
        finally:
            os.close(fd)
        print(format_line(metrics), flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=metrics["rollout_id"])

    def log_completions(self, rollout_id: int, samples: list) -> None:
        """With wandb, a table of the rollout's first groups under "completions" (as TRL's log_completions)."""
        if self.wandb_run is None:
            return
        import wandb

        columns, rows = completions_table(samples, rollout_id, COMPLETIONS_ROWS)
        self.wandb_run.log({"completions": wandb.Table(columns=columns, data=rows)}, step=rollout_id)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


COMPLETIONS_ROWS = 64  # of a wandb completions table: whole prompt groups up to this many samples (at least one)


def completions_table(samples: list, rollout_id: int, max_rows: int) -> tuple[list[str], list[list[Any]]]:
    """The columns and rows of a completions table: step, prompt, completion, each reward function's own score
    (null where it passed), the reward (null where nothing scored it) and the advantage, over the first whole
    groups of `samples` that fit in `max_rows`."""
    shown: list = []
    for _, group in itertools.groupby(samples, key=lambda s: s.group_index):
        group = list(group)
        if shown and len(shown) + len(group) > max_rows:
            break
        shown += group
    functions = list(dict.fromkeys(name for s in shown for name in s.scores))
    own = ["step", "prompt", "completion", "reward", "advantage"]
    columns = [*own[:3], *(score_column(name, own) for name in functions), *own[3:]]
    rows = [[rollout_id, s.prompt, s.response, *(s.scores.get(name) for name in functions),
             finite_or_none(s.reward), s.advantage] for s in shown]
    return columns, rows


class NullLogger:
    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def log_completions(self, rollout_id: int, samples: list) -> None:
        pass

    def close(self) -> None:
        pass


def make_logger(is_main: bool, output_dir: str, config: dict[str, Any], use_wandb: bool, project: str,
                run_name: str, start_rollout: int | None = 0):
    return MetricsLogger(output_dir, config, use_wandb, project, run_name, start_rollout) if is_main else NullLogger()
