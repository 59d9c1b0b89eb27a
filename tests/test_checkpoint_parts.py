"""A stateful part added to RunCheckpointer.parts on one line is saved with the checkpoint and restored by the resume,
with nothing else to edit, and a saved state it cannot take is one line naming the file and the part; one rank in this
process (gloo), a linear layer for the policy."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rl.config import ConfigError, config_from_dict
from rl.parallel import Dist
from rl.run.checkpointer import RunCheckpointer

ONE_RANK = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


class Counter:
    """A part the run never had: its whole state is one number."""

    def __init__(self):
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


class TinyLearner:
    """The learner's side of the checkpoint, as small as RunCheckpointer uses it: a model, its optimizer, the
    learning-rate schedule."""

    def __init__(self):
        self.policy = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.AdamW(self.policy.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.critic_state = None

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "critic_scheduler": None}

    def load_state_dict(self, state: dict, saved_config: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_checkpointer(out: Path, model: Path, counter: Counter) -> RunCheckpointer:
    cfg = config_from_dict({"model": {"path": str(model)}, "data": {"source": str(model / "train.jsonl")},
                           "log": {"output_dir": str(out)}})
    checkpointer = RunCheckpointer(cfg, ONE_RANK, restarted=False)
    checkpointer.learner = TinyLearner()
    checkpointer.parts.update(data=None, health=None, rollout_buffer=None)  # the run's own parts, not needed here
    checkpointer.parts["counter"] = counter  # the one line that adds a part
    return checkpointer


def test_a_part_added_on_one_line_is_saved_and_restored(one_rank, tmp_path):
    out, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    saving = run_checkpointer(out, model, Counter())
    assert saving.resume() == (0, 1)
    saving.parts["counter"].count = 7
    saving.save(rollout_id=4, weight_version=5)
    saving.close()

    resumed = run_checkpointer(out, model, Counter())
    assert resumed.resume() == (5, 5)
    assert resumed.parts["counter"].count == 7
    resumed.close()


def test_a_part_state_of_another_shape_is_one_line_naming_the_file_and_the_part(one_rank, tmp_path):
    out, model = tmp_path / "run", tmp_path / "model"
    model.mkdir()
    saving = run_checkpointer(out, model, Counter())
    saving.resume()
    saving.save(rollout_id=0, weight_version=1)
    saving.close()
    file = out / "checkpoints" / "rollout_0" / "trainer_state.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "counter": {"total": 3}}))  # hand-edited, or foreign

    resumed = run_checkpointer(out, model, Counter())
    with pytest.raises(ConfigError, match=r"rollout_0: trainer_state.json holds a counter state this run cannot "
                                          r"restore \(KeyError: 'count'\): resume from an earlier checkpoint"):
        resumed.resume()
    resumed.close()
