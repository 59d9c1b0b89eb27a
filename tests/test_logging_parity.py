"""What a run logs, held to what a TRL user reads: each reward function's score per sample in the sample dumps and
a wandb completions table, each function's mean reward plotted, a function of weight 0 logged but not counted,
and a finished run that says so at once when launched again."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest

from rl import plot
from rl.config import RewardConfig, RolloutConfig, load_config
from rl.data import Sample, Status
from rl.env.reward import RewardResult, gather
from rl.env.reward import metrics as reward_metrics
from rl.rollout.collect import Collector, dump_rollout
from rl.run import metrics as metrics_module
from rl.run.finished import finished_line
from rl.run.metrics import MetricsLogger, NullLogger
from tests.test_distributed import ROOT
from tests.test_faults import rl_main
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


def sample(group, index, scores, label="7", reward=1.0, advantage=0.5):
    return Sample(prompt=f"prompt {group}", tokens=[1, 2, 3], label=label, response=f"response {index}",
                  response_length=1, loss_mask=[1], rollout_log_probs=[-0.5], reward=reward, advantage=advantage,
                  status=Status.COMPLETED, group_index=group, index=index, token_versions=[1], scores=scores)


# ---------------------------------------------------------------------------- sample dumps


def test_the_dump_has_a_column_per_reward_function_and_a_missing_label_is_null(tmp_path):
    samples = [sample(0, 0, {"accuracy": 1.0, "reward": 0.25, "format_ok": None}, label=None),
               sample(0, 1, {"accuracy": 0.0, "reward": 0.75, "format_ok": 1.0}, label=12)]
    dump_rollout(samples, {}, tmp_path / "rollout_0.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rollout_0.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == [None, "12"]
    assert [r["accuracy"] for r in rows] == [1.0, 0.0]
    assert [r["format_ok"] for r in rows] == [None, 1.0]  # the function passed on the first sample
    # A function named like a column of the dump keeps its own column beside it.
    assert [(r["reward"], r["reward/reward"]) for r in rows] == [(1.0, 0.25), (1.0, 0.75)]


def test_scoring_keeps_each_functions_own_score_on_the_sample():
    class Pool:
        def score(self, inputs):
            return RewardResult(rewards=[2.0, 0.5], terms={"correct": [2.0, 0.5], "format": [0.0, 0.0],
                                                           "length": [0.0, 0.0], "accuracy": [1.0, 0.0],
                                                           "brevity": [None, 1.0]}, extra=[{}, {}])

    dist = types.SimpleNamespace(rank=0, world_size=1, is_main=True)
    collector = Collector(engine=None, pool=Pool(), tokenizer=None, ro=RolloutConfig(), dist=dist)
    samples = [sample(0, 0, {}), sample(0, 1, {})]
    collector.score(samples, "reward")
    assert [s.scores for s in samples] == [{"accuracy": 1.0, "brevity": None}, {"accuracy": 0.0, "brevity": 1.0}]
    assert [s.reward for s in samples] == [2.0, 0.5]


def outcome(functions):
    """A scored input as score_group returns it, its functions' values by name."""
    return {"correct": 0.0, "format": 0.0, "length": 0.0, "reward": 0.0, "functions": functions}


def test_a_function_of_weight_0_is_logged_but_does_not_score_a_response():
    cfg = RewardConfig(functions=["m:judge", "m:monitor"], function_weights=[1.0, 0.0])
    result = gather([outcome({"judge": None, "monitor": 1.0}), outcome({"judge": 1.0, "monitor": 0.0})], 0, cfg)
    # The weighted function passed on the first response: it has no reward, whatever the monitor said of it.
    assert math.isnan(result.rewards[0]) and result.num_unscored == 1
    logged = reward_metrics(result)
    assert logged["reward/monitor_mean"] == 0.5  # as TRL logs every function's mean, whatever its weight
    assert logged["reward/judge_mean"] == 1.0


# ---------------------------------------------------------------------------- the wandb completions table


class FakeWandb:
    """wandb as the logger uses it: init() hands out a run whose log() calls are kept."""

    def __init__(self):
        self.logged = []

    def init(self, **kwargs):
        return types.SimpleNamespace(id="run1", log=lambda data, step: self.logged.append((step, data)),
                                     finish=lambda: None)

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def test_the_completions_table_holds_whole_groups_with_each_functions_score(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(metrics_module, "COMPLETIONS_ROWS", 5)
    samples = [sample(g, 2 * g + k, {"accuracy": float(k), "reward": None}, reward=float(k), advantage=k - 0.5)
               for g in range(4) for k in range(2)]
    samples[1].reward = math.nan  # nothing scored it
    logger = MetricsLogger(str(tmp_path), {}, use_wandb=True, project="p", run_name="", start_rollout=0)
    logger.log_completions(3, samples)
    [(step, data)] = wandb.logged
    table = data["completions"]
    assert step == 3
    assert table.columns == ["step", "prompt", "completion", "accuracy", "reward/reward", "reward", "advantage"]
    assert table.data == [[3, "prompt 0", "response 0", 0.0, None, 0.0, -0.5],
                          [3, "prompt 0", "response 1", 1.0, None, None, 0.5],
                          [3, "prompt 1", "response 2", 0.0, None, 0.0, -0.5],
                          [3, "prompt 1", "response 3", 1.0, None, 1.0, 0.5]]  # two groups of 2 fit in 5 rows


def test_no_table_without_wandb(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    MetricsLogger(str(tmp_path), {}, use_wandb=False, project="p", run_name="", start_rollout=0).log_completions(
        0, [sample(0, 0, {})])
    NullLogger().log_completions(0, [sample(0, 0, {})])
    assert wandb.logged == []


# ---------------------------------------------------------------------------- the plot of each function


def test_the_reward_plot_draws_each_functions_mean_and_marks_weight_0(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"rollout_id": i, "rollout/reward_mean": 0.1 * i, "reward/accuracy_mean": 0.2 * i,
             "reward/monitor_mean": 0.5, "reward/logged/seen": float(i), "reward/num_errors": 0.0} for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = RewardConfig(functions=["m:accuracy", "m:monitor"], function_weights=[1.0, 0.0])
    (run / "config.json").write_text(json.dumps({"reward": dataclasses.asdict(reward)}))
    figures = {}
    monkeypatch.setattr(plot, "save", lambda fig, path: figures.setdefault(path.name, fig))
    assert "rewards.png" in plot.plot_runs([run], [tmp_path / "out"])
    means, logged = figures["rewards.png"].axes
    assert [line.get_label() for line in means.get_lines()] == ["run: accuracy_mean", "run: monitor_mean (weight 0)"]
    assert list(means.get_lines()[0].get_ydata()) == pytest.approx([0.0, 0.2, 0.4])
    assert [line.get_label() for line in logged.get_lines()] == ["run: logged/seen"]


# ---------------------------------------------------------------------------- a finished run


def finished_folder(tmp_path, model, rollout_id=1, export=True):
    out = tmp_path / "run"
    state = out / "checkpoints" / f"rollout_{rollout_id}"
    state.mkdir(parents=True)
    config = config_of(model, out).to_dict()
    (state / "trainer_state.json").write_text(json.dumps({"rollout_id": rollout_id, "weight_version": 3,
                                                          "config": config, "world_size": 1}))
    if export:
        (out / "final").mkdir()
    return out


def config_of(model, out, *overrides):
    return load_config(tiny_args(model, out, *overrides))


def tiny_args(model, out, *overrides):
    return ["--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}", "--data.source=train.jsonl",
            f"--log.output_dir={out}", *overrides]


def test_a_run_has_finished_only_when_its_last_rollout_is_saved_and_its_policy_exported(tmp_path):
    model = tmp_path / "model"
    out = finished_folder(tmp_path, model)
    assert "already finished rollout 1" in finished_line(config_of(model, out))
    assert finished_line(config_of(model, out, "--train.num_rollout=3")) is None  # more to train
    assert finished_line(config_of(model, out, "--checkpoint.resume=never")) is None  # the start-up refuses it
    assert finished_line(config_of(tmp_path / "other", out)) is None  # another model: the start-up says so
    (out / "final").rmdir()
    assert finished_line(config_of(model, out)) is None  # not exported yet: the start-up exports
    (out / "final").mkdir()
    (out / "checkpoints" / "rollout_1" / "trainer_state.json").write_text("{")
    assert finished_line(config_of(model, out)) is None  # damaged: the start-up falls back to an older one


def test_relaunching_a_finished_run_prints_one_line_and_loads_nothing(tmp_path):
    """torch and transformers cannot even be imported here, and the model folder does not exist: the line can only
    come before either is needed."""
    model = tmp_path / "no_model"
    out = finished_folder(tmp_path, model)
    blocked = tmp_path / "blocked"
    for name in ("torch", "transformers", "wandb"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} was imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "rl.main", *tiny_args(model, out, "--log.wandb=true")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"rl: the run in {out} already finished rollout 1 (train.num_rollout=2): "
                                        f"its trained policy is in {out / 'final'}; pass a larger "
                                        f"--train.num_rollout to train further"]
    assert proc.stderr == ""


# ---------------------------------------------------------------------------- through a run


FAKE_WANDB = '''
import json, os


class Table:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


class Run:
    id = "fake"

    def log(self, data, step):
        tables = {k: {"columns": v.columns, "rows": v.data} for k, v in data.items() if isinstance(v, Table)}
        with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
            f.write(json.dumps({"step": step, "tables": tables}) + "\\n")

    def finish(self):
        pass


def init(**kwargs):
    return Run()
'''


def test_a_run_dumps_and_tables_each_functions_score(tmp_path):
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    inputs = save_tiny_model_dir(tmp_path / "model"), write_arithmetic_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "FAKE_WANDB_LOG": str(tmp_path / "wandb.jsonl")}
    proc = subprocess.run([sys.executable, *rl_main(inputs, out, "--reward.user_fn=", "--train.num_rollout=1",
                                                    "--reward.functions=['tests.trl_rewards:longer_is_better', "
                                                    "'tests.reward_fns:record']", "--reward.function_weights=[1.0, 0]",
                                                    "--log.sample_interval=1", "--log.wandb=true")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumped = [json.loads(line) for line in (out / "samples" / "rollout_0.jsonl").read_text().splitlines()]
    assert len(dumped) == 32
    assert all(s["longer_is_better"] == s["response_length"] and s["record"] == s["response_length"] for s in dumped)
    assert all(s["reward"] == s["longer_is_better"] for s in dumped)  # record weighs 0
    lines = (tmp_path / "wandb.jsonl").read_text().splitlines()
    [logged] = [json.loads(line) for line in lines if '"tables": {"' in line]
    table = logged["tables"]["completions"]
    assert logged["step"] == 0
    assert table["columns"] == ["step", "prompt", "completion", "longer_is_better", "record", "reward", "advantage"]
    by_response = {(s["prompt"], s["response"]): s for s in dumped}
    assert len(table["rows"]) == 32  # 8 groups of 4
    for step, prompt, completion, longer, record, reward, advantage in table["rows"]:
        s = by_response[prompt, completion]
        assert (step, longer, record, reward, advantage) == (0, s["longer_is_better"], s["record"], s["reward"],
                                                              s["advantage"])


def test_a_sample_saved_before_scores_were_kept_still_resumes():
    from rl.rollout.buffer import sample_from_dict, sample_to_dict

    s = sample(0, 0, {})
    older = {k: v for k, v in sample_to_dict(s).items() if k != "scores"}  # a checkpoint's groups in flight
    assert sample_from_dict(older) == s
