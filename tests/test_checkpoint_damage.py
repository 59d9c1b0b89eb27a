"""Which checkpoints a resume considers: the model.path check reads the newest readable trainer state and compares
resolved paths."""

import json
from pathlib import Path

import pytest

from rl import checkpoint
from rl.config import ConfigError


def cut(file: Path, keep: float = 0.5) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def fake_checkpoint(out: Path, rollout_id: int, model_path: str) -> Path:
    """A checkpoint folder with only the trainer state, which is all resume_candidates reads."""
    path = out / "checkpoints" / f"rollout_{rollout_id}"
    (path / "model_optim").mkdir(parents=True)
    state = checkpoint.TrainerState(rollout_id=rollout_id, weight_version=rollout_id + 2, data={}, scheduler={},
                                    health={}, config={"model": {"path": model_path}}, world_size=1)
    (path / "trainer_state.json").write_text(json.dumps(state.__dict__))
    return path


def test_the_model_path_check_reads_the_newest_readable_state(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    older = fake_checkpoint(tmp_path, 0, str(model))
    newer = fake_checkpoint(tmp_path, 1, str(model))
    cut(newer / "trainer_state.json")
    assert checkpoint.resume_candidates(tmp_path, "auto", str(model)) == [older, newer]  # load_newest skips `newer`
    with pytest.raises(ConfigError, match=f"--checkpoint.resume={older} to start"):
        checkpoint.resume_candidates(tmp_path, "auto", str(tmp_path / "other"))


def test_the_same_model_path_spelled_differently_resumes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    saved = fake_checkpoint(tmp_path, 0, str(model))
    for spelling in (f"{model}/", str(tmp_path / "." / "model"), str(tmp_path / "model" / ".." / "model")):
        assert checkpoint.resume_candidates(tmp_path, "auto", spelling) == [saved]
    with pytest.raises(ConfigError, match="holds checkpoints of a run of model.path"):
        checkpoint.resume_candidates(tmp_path, "auto", str(tmp_path / "another"))
