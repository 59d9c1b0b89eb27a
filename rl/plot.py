"""Training curves from `metrics.jsonl`, as PNGs, with several runs overlaid.

    python -m rl.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--x minutes]

Draws, against `rollout_id` (or, with `--x minutes`, the minutes of steps before each row: runs that step at
different speeds compared on wall-clock time), one figure per group:
  reward.png      training reward (after the filter, and over every scored sample) and held-out
                  eval accuracy / pass@k
  rewards.png     each reward term's mean (reward/<name>_mean: every function of reward.functions and the
                  group hook, as TRL's rewards/<name>/mean, and the built-in terms), a term of weight 0 marked
                  "(weight 0)" in the legend from the run's config.json; and the functions' log_metric values
  length.png      mean response length and truncated fraction
  train.png       loss, grad norm, clip fraction, entropy
  time.png        seconds per step as bars stacked by phase, one panel per run
  throughput.png  rollout and train tokens/s
  memory.png      torch's peak and the device memory in use, per phase (GPU runs only)
  tools.png       episodes with an environment (env.fn): tool calls and turns per episode, in training and
                  in the eval, and the eval's share of episodes that called a tool
Runs overlay on the same axes, the legend naming each run dir. A metric no run has is left out
(its panel, or a figure with no panel at all). A row whose value is null (a non-finite value)
breaks that line, so a step that logged nothing shows as a gap; a row without the key is passed
over (eval rows come every few steps, and their line joins them). The figures go into every run
dir, or only into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: runs on headless machines and in tests
import matplotlib.pyplot as plt  # noqa: E402

from rl.config import RewardConfig  # noqa: E402
from rl.env.reward import built_in_weights, function_names, function_weights  # noqa: E402

# The phases of one step in the order they run, so the stack reads bottom-up like the loop.
TIME_PHASES = ["rollout", "reward", "offload", "onload_train", "train", "onload_weights",
               "weight_sync", "offload_train", "onload_kv", "eval"]
DPI = 100


class PlotError(ValueError):
    """A run that cannot be drawn; the message is the one line the user sees."""


def read_plottable_rows(path: Path) -> list[dict]:
    """Rows of a metrics file; a line that does not parse (a run killed mid-write) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("rollout_id"), int):
            rows.append(row)
    return rows


def series(rows: list[dict], key: str, x: str = "rollout_id") -> tuple[list[float], list[float]]:
    """(x, value) of the rows that have key, NaN where the value is null or not a finite number:
    matplotlib breaks a line at NaN, where dropping the point would draw straight across it."""
    points = [(r[x], as_number(r[key])) for r in rows if key in r]
    return [x for x, _ in points], [y for _, y in points]


def as_number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def has_values(rows: list[dict], key: str) -> bool:
    """Whether some row holds a finite number for key: a panel of nulls alone is not drawn."""
    return any(not math.isnan(y) for y in series(rows, key)[1])


def keys_of(runs: dict[str, list[dict]], predicate) -> list[str]:
    """Every key some row of some run has that predicate accepts, sorted."""
    return sorted({k for rows in runs.values() for r in rows for k in r if predicate(k)})


def with_minutes(rows: list[dict]) -> list[dict]:
    """The rows (in rollout order), each with "minutes": the sum of perf/step_s of the rows before it, so a
    row's eval (measured before its step) sits at the time it was taken."""
    out, seconds = [], 0.0
    for r in rows:
        out.append({**r, "minutes": seconds / 60})
        step = as_number(r.get("perf/step_s", 0.0))
        seconds += step if math.isfinite(step) else 0.0
    return out


def line_panel(ax, runs: dict[str, list[dict]], keys: list[str], title: str, x: str = "rollout_id",
               unweighted: dict[str, set[str]] | None = None) -> bool:
    """One line per (run, key) present, "(weight 0)" after the keys of `unweighted[run]`; False when nothing was
    drawn."""
    drawn = False
    for name, rows in runs.items():
        for key in keys:
            if not has_values(rows, key):
                continue
            xs, y = series(rows, key, x)
            # Memory and reward-term keys are found in the file, so even a lone one needs its name in the legend.
            one_fixed_key = len(keys) == 1 and not key.startswith(("memory/", "reward/"))
            short = key.split("/", 1)[1]
            if sum(k.split("/", 1)[1] == short for k in keys) > 1:  # rollout/x beside eval/x: both named in full
                short = key
            label = (name if one_fixed_key else f"{name}: {short}") + (
                " (weight 0)" if key in (unweighted or {}).get(name, ()) else "")
            ax.plot(xs, y, marker="." if len(xs) < 50 else None, label=label)
            drawn = True
    if drawn:
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(x, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return drawn


def line_figure(runs: dict[str, list[dict]], panels: list[tuple[str, list[str]]], path: Path,
                x: str = "rollout_id", unweighted: dict[str, set[str]] | None = None) -> bool:
    """A figure of one line panel per (title, keys) that some run has; written only if non-empty."""
    present = [(title, keys) for title, keys in panels if any(has_values(rows, k) for rows in runs.values() for k in keys)]
    if not present:
        return False
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.5), squeeze=False)
    for ax, (title, keys) in zip(axes[0], present):
        line_panel(ax, runs, keys, title, x, unweighted)
    save(fig, path)
    return True


def time_figure(runs: dict[str, list[dict]], path: Path) -> bool:
    """Seconds per step stacked by phase; stacks do not overlay, so one panel per run."""
    phases = [p for p in TIME_PHASES if any(f"perf/{p}_s" in r for rows in runs.values() for r in rows)]
    with_time = {name: rows for name, rows in runs.items() if any(has_values(rows, f"perf/{p}_s") for p in phases)}
    if not with_time:
        return False
    fig, axes = plt.subplots(1, len(with_time), figsize=(5 * len(with_time), 3.5), squeeze=False, sharey=True)
    for ax, (name, rows) in zip(axes[0], with_time.items()):
        x = [r["rollout_id"] for r in rows]
        bottom = [0.0] * len(rows)
        for phase in phases:
            # A phase a row lacks (no eval that step, no offload without colocation) took no time.
            seconds = [r.get(f"perf/{phase}_s") or 0.0 for r in rows]
            ax.bar(x, seconds, bottom=bottom, width=1.0, label=phase)
            bottom = [b + s for b, s in zip(bottom, seconds)]
        ax.set_title(f"{name}: seconds per step", fontsize=9)
        ax.set_xlabel("rollout_id", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6, loc="upper left")
    save(fig, path)
    return True


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_runs(run_dirs: list[Path], out_dirs: list[Path], x: str = "rollout_id") -> list[str]:
    """Draws the figures of the runs (overlaid) into each of out_dirs; returns the file names written.

    Raises PlotError naming the file when a run has no metrics rows, or an out dir that cannot be a folder.
    """
    runs, unweighted = {}, {}
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        rows = read_plottable_rows(path) if path.is_file() else []
        if not rows:
            raise PlotError(f"rl.plot: no metrics rows in {path}")
        name = run_dir.resolve().name
        name = name if name not in runs else os.fspath(run_dir)
        runs[name] = with_minutes(sorted(rows, key=lambda r: r["rollout_id"]))
        unweighted[name] = unweighted_terms(run_dir / "config.json")
    evals = keys_of(runs, lambda k: k.startswith("eval/pass@"))
    terms = keys_of(runs, lambda k: k.startswith("reward/") and k.endswith("_mean") and k.count("/") == 1)
    memory_phases = keys_of(runs, lambda k: k.startswith("memory/") and k.endswith(("_peak_gb", "_device_used_gb")))
    groups = {
        "reward.png": [("training reward", ["rollout/reward_mean", "rollout/reward_mean_all_scored"]),
                       ("eval accuracy", ["eval/accuracy", *evals])],
        "rewards.png": [("reward per function (mean)", terms),
                        ("log_metric", keys_of(runs, lambda k: k.startswith("reward/logged/")))],
        "length.png": [("response length (mean)", ["rollout/response_length_mean"]),
                       ("truncated fraction", ["rollout/truncated_frac"])],
        "train.png": [("loss", ["train/loss"]), ("grad norm", ["train/grad_norm"]),
                      ("clip fraction", ["train/clip_frac"]), ("entropy", ["train/entropy"])],
        "throughput.png": [("rollout tokens/s", ["perf/rollout_tokens_per_s"]),
                           ("train tokens/s", ["perf/train_tokens_per_s"])],
        "memory.png": [("torch peak GB per phase", [k for k in memory_phases if k.endswith("_peak_gb")]),
                       ("device used GB per phase", [k for k in memory_phases if k.endswith("_device_used_gb")])],
        "tools.png": [("tool calls per episode", ["rollout/tool_calls_mean", "eval/tool_calls_mean"]),
                      ("eval episodes that called a tool", ["eval/tool_call_frac"]),
                      ("turns per episode", ["rollout/turns_mean", "eval/turns_mean"])],
    }
    written = []
    for out_dir in out_dirs:
        make_folder(out_dir)
        for name, panels in groups.items():
            if line_figure(runs, panels, out_dir / name, x, unweighted):
                written.append(name)
        if time_figure(runs, out_dir / "time.png"):
            written.append("time.png")
    return sorted(set(written))


def unweighted_terms(config_path: Path) -> set[str]:
    """The reward/<term>_mean keys of the terms that the run's config weighs 0: logged, but adding nothing to its
    reward. A run without a readable config.json marks none."""
    try:
        saved = json.loads(config_path.read_text())["reward"]
        cfg = RewardConfig(**{f.name: saved[f.name] for f in dataclasses.fields(RewardConfig) if f.name in saved})
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    weights = built_in_weights(cfg) | dict(zip(function_names(cfg), function_weights(cfg)))
    return {f"reward/{name}_mean" for name, weight in weights.items() if weight == 0}


def make_folder(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise PlotError(f"rl.plot: {path} is a file; the figures need a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission
        raise PlotError(f"rl.plot: cannot create the folder {path} ({e.strerror})") from e


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run folders, each with a metrics.jsonl")
    parser.add_argument("--out", type=Path, help="write the figures here instead of into each run dir")
    parser.add_argument("--x", choices=("rollout_id", "minutes"), default="rollout_id",
                        help="the x axis of the line figures: rollout_id, or minutes of steps before each row")
    args = parser.parse_args(argv)
    out_dirs = [args.out] if args.out else args.run_dirs
    try:
        written = plot_runs(args.run_dirs, out_dirs, args.x)
    except PlotError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    for out_dir in out_dirs:
        print(f"rl.plot: wrote {', '.join(written)} to {os.fspath(out_dir)}")


if __name__ == "__main__":
    main(sys.argv[1:])
