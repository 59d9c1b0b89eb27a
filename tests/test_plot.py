"""rl.plot draws valid PNGs from a small metrics file with gaps, nulls and a cut-off last line."""

import json
import math
import subprocess
import sys

import matplotlib.image
import matplotlib.pyplot as plt
import pytest

from rl.plot import PlotError, line_panel, plot_runs, read_plottable_rows, with_minutes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ["length.png", "memory.png", "reward.png", "throughput.png", "time.png", "tools.png", "train.png"]


def write_run(path, rows, tail='{"rollout_id": 3, "rollout/rew'):
    path.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail  # a run killed mid-write
    (path / "metrics.jsonl").write_text(text)
    return path


def row(i, **extra):
    return {"rollout_id": i, "rollout/reward_mean": 0.1 * i, "rollout/response_length_mean": 20 + i,
            "rollout/truncated_frac": 0.0, "train/loss": 0.5 - 0.1 * i, "train/grad_norm": 1.0,
            "perf/rollout_s": 2.0, "perf/train_s": 1.0, **extra}


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "run_a", [
        row(0, **{"eval/accuracy": 0.1, "eval/pass@4": 0.3, "perf/eval_s": 0.5, "eval/tool_call_frac": 0.2,
                  "rollout/tool_calls_mean": 0.7, "rollout/turns_mean": 1.7}),
        row(1, **{"train/loss": None, "train/entropy": 1.2, "perf/rollout_tokens_per_s": 100.0}),
        row(2, **{"eval/accuracy": 0.4, "perf/eval_s": 0.4, "memory/rollout_peak_gb": 3.0,
                  "memory/rollout_device_used_gb": 5.0})])
    # No memory, eval or throughput keys in the second run: its lines are simply absent.
    b = write_run(tmp_path / "run_b", [{"rollout_id": 0, "rollout/reward_mean": 0.2},
                                       row(1, **{"rollout/reward_mean_all_scored": 0.15})], tail="")
    return [a, b]


def assert_pngs(folder, names):
    for name in names:
        data = (folder / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        height, width = matplotlib.image.imread(folder / name).shape[:2]
        assert height > 0 and width > 0


def test_plot_runs_writes_every_figure_into_each_run(runs):
    assert plot_runs(runs, runs) == FIGURES
    for run in runs:
        assert_pngs(run, FIGURES)


def test_cli_writes_into_out_only(runs, tmp_path):
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "rl.plot", *map(str, runs), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == FIGURES
    assert_pngs(out, FIGURES)
    assert not list(runs[0].glob("*.png"))


def test_missing_groups_are_skipped(tmp_path):
    run = write_run(tmp_path / "run", [{"rollout_id": 0, "rollout/reward_mean": 0.5}], tail="")
    assert plot_runs([run], [run]) == ["reward.png"]
    assert_pngs(run, ["reward.png"])


def test_a_run_without_rows_is_one_line_naming_the_file(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"rollout_id": 0, "rollo')
    with pytest.raises(PlotError, match="empty/metrics.jsonl"):
        plot_runs([runs[0], empty], [runs[0]])
    proc = subprocess.run([sys.executable, "-m", "rl.plot", str(runs[0]), str(empty)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"rl.plot: no metrics rows in {empty / 'metrics.jsonl'}"
    assert proc.stdout == ""


def test_a_null_breaks_the_line(runs):
    rows = {"run_a": read_plottable_rows(runs[0] / "metrics.jsonl")}  # train/loss is null at rollout 1
    fig, ax = plt.subplots()
    assert line_panel(ax, rows, ["train/loss", "eval/accuracy"], "loss")
    loss, accuracy = ax.get_lines()
    assert list(loss.get_xdata()) == [0, 1, 2]
    y = list(loss.get_ydata())
    assert y[0] == pytest.approx(0.5) and math.isnan(y[1]) and y[2] == pytest.approx(0.3)
    # eval rows come every few steps: the rows between them have no key and the line joins them
    assert list(accuracy.get_xdata()) == [0, 2] and list(accuracy.get_ydata()) == [0.1, 0.4]
    plt.close(fig)


def test_legend_names_training_and_eval_keys_apart():
    rows = {"run": [{"rollout_id": 0, "rollout/turns_mean": 1.5, "eval/turns_mean": 1.2, "train/loss": 0.1}]}
    fig, ax = plt.subplots()
    assert line_panel(ax, rows, ["rollout/turns_mean", "eval/turns_mean", "train/loss"], "turns")
    assert [line.get_label() for line in ax.get_lines()] == ["run: rollout/turns_mean", "run: eval/turns_mean",
                                                             "run: loss"]
    plt.close(fig)


def test_out_naming_a_file_is_one_line(runs, tmp_path):
    out = tmp_path / "plots.png"
    out.write_bytes(b"not a folder")
    proc = subprocess.run([sys.executable, "-m", "rl.plot", str(runs[0]), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"rl.plot: {out} is a file; the figures need a folder"
    assert out.read_bytes() == b"not a folder"


def test_minutes_place_each_row_after_the_steps_before_it(tmp_path):
    """--x minutes: a row (its eval measured before its step) sits at the sum of the steps before it, so runs of
    different speeds line up on wall-clock time; a step without a time adds nothing."""
    rows = [{"rollout_id": 0, "perf/step_s": 60.0, "eval/accuracy": 0.2}, {"rollout_id": 1, "perf/step_s": None},
            {"rollout_id": 2, "perf/step_s": 120.0}, {"rollout_id": 3, "eval/accuracy": 0.5}]
    assert [r["minutes"] for r in with_minutes(rows)] == [0.0, 1.0, 1.0, 3.0]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run([sys.executable, "-m", "rl.plot", str(run), "--x", "minutes"], check=True, capture_output=True)
    assert (run / "reward.png").is_file()
