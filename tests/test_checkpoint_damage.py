"""Damaged checkpoints: every kind of damage is skipped with one line naming the checkpoint and the reason, the run
resumes from the newest readable one, and when none is readable it stops with one `rl: error:` line.

One 2-rank run writes five checkpoints; each case copies its folder and damages the copy differently."""

import dataclasses
import io
import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from rl.config import ConfigError
from rl.run import checkpoint, checkpointer
from tests.test_checkpoint import final_weights, launch
from tests.test_checkpoint_safety import Planted, planted_pickle
from tests.test_faults import one_line, rank_exit_code
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

ROLLOUTS = 5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    launch(inputs, out, 2, f"--train.num_rollout={ROLLOUTS}", "--checkpoint.interval=1",
           f"--checkpoint.keep_last={ROLLOUTS}")
    return out


def copy_of(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The trained run's folder before its export: a run with its policy in final/ has nothing left to load, and a
    relaunch of it stops before reading a checkpoint (rl/run/finished.py)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, ignore=lambda folder, names: ["final"] if Path(folder) == trained else [])
    return out, out / "checkpoints"


def resume(inputs, out: Path, num_rollout: int = 1) -> subprocess.CompletedProcess:
    """A resume; with num_rollout=1 the run has finished at any checkpoint, so it only loads one and stops."""
    return launch(inputs, out, 2, f"--train.num_rollout={num_rollout}", check=False)


def skipped(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("warning: checkpoint ")]


def assert_resumed_from(proc: subprocess.CompletedProcess, path: Path, reasons: dict[Path, str]) -> None:
    """Exit 0, resumed from `path`, one line for each skipped checkpoint naming it and its reason, no traceback."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"checkpoint: resumed from {path} " in proc.stdout
    lines = skipped(proc)
    assert len(lines) == len(reasons), lines
    for line, (damaged, reason) in zip(lines, reasons.items(), strict=True):
        assert line.startswith(f"warning: checkpoint {damaged} could not be loaded (") and reason in line, line
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def cut(file: Path, keep: float = 0.5) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def test_a_damaged_trainer_state_is_skipped(inputs, trained, tmp_path):
    out, ck = copy_of(trained, tmp_path)
    state = {n: ck / f"rollout_{n}" / "trainer_state.json" for n in range(ROLLOUTS)}
    cut(state[4])  # the newest: read before any load, for the model.path check
    state[3].unlink()
    state[2].write_text("rollout_id = 2\n")
    partial = json.loads(state[1].read_text())
    del partial["data"], partial["health"]
    state[1].write_text(json.dumps(partial))
    proc = resume(inputs, out)
    assert_resumed_from(proc, ck / "rollout_0", {
        ck / "rollout_4": "trainer_state.json is unreadable (JSONDecodeError: ",
        ck / "rollout_3": "trainer_state.json is missing",
        ck / "rollout_2": "trainer_state.json is unreadable (JSONDecodeError: ",
        ck / "rollout_1": "trainer_state.json lacks data, health"})


def test_damaged_dcp_metadata_or_shards_are_skipped_before_loading(inputs, trained, tmp_path):
    out, ck = copy_of(trained, tmp_path)
    (ck / "rollout_4" / "model_optim" / ".metadata").unlink()
    cut(ck / "rollout_3" / "model_optim" / ".metadata")
    (ck / "rollout_2" / "model_optim" / "__1_0.distcp").unlink()
    cut(ck / "rollout_1" / "model_optim" / "__0_3.distcp", keep=0.9)
    proc = resume(inputs, out)
    assert_resumed_from(proc, ck / "rollout_0", {
        ck / "rollout_4": "model_optim/.metadata is missing",
        ck / "rollout_3": "model_optim/.metadata is unreadable (",
        ck / "rollout_2": "model_optim/__1_0.distcp is missing",
        ck / "rollout_1": "model_optim/__0_3.distcp holds "})
    assert "metadata is not found" not in proc.stderr  # DCP's own report of the missing file stays unprinted


def zero_the_last_read_shards(model_optim: Path) -> None:
    """Zeroes, at full size, the shard file that each rank reads last, so that its load fails after the files read
    before it have gone into the model and the optimizer: damage only a full read finds."""
    metadata = FileSystemReader(str(model_optim)).read_metadata()
    order = list(metadata.state_dict_metadata)  # the order of the state dict, which the reads follow
    first_read: dict[str, int] = {}
    for index, item in metadata.storage_data.items():
        first_read[item.relative_path] = min(first_read.get(item.relative_path, len(order)), order.index(index.fqn))
    for rank in range(2):
        last = max((name for name in first_read if name.startswith(f"__{rank}_")), key=first_read.get)
        (model_optim / last).write_bytes(bytes((model_optim / last).stat().st_size))


def test_a_load_that_fails_part_way_is_overwritten_by_the_previous_checkpoint(inputs, trained, tmp_path):
    """The half-loaded model and optimizer are loaded again from rollout_3 and retrain rollout 4 to the very weights
    of the run that never stopped."""
    out, ck = copy_of(trained, tmp_path)
    zero_the_last_read_shards(ck / "rollout_4" / "model_optim")
    proc = resume(inputs, out, num_rollout=ROLLOUTS)
    assert_resumed_from(proc, ck / "rollout_3", {ck / "rollout_4": "Error: "})
    want, got = final_weights(trained), final_weights(out)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_missing_damaged_or_foreign_rng_states_make_the_checkpoint_damaged(inputs, trained, tmp_path):
    """An RNG file that is missing, cut or refused is a damaged checkpoint like any other file (not a quiet restart
    of that rank's RNG): skipped with its name; the RNG states of an earlier checkpoint's `.pt` form restore too,
    and the resumed run retrains to the very weights of the run that never stopped."""
    out, ck = copy_of(trained, tmp_path)
    cut(ck / "rollout_4" / "rng" / "rank_0.json")
    (ck / "rollout_3" / "rng" / "rank_1.json").unlink()
    (ck / "rollout_2" / "rng" / "rank_1.json").unlink()
    (ck / "rollout_2" / "rng" / "rank_1.pt").write_bytes(planted_pickle(tmp_path / "ran"))
    for rank in range(2):  # rollout_1 as a checkpoint of the earlier format
        rng = ck / "rollout_1" / "rng" / f"rank_{rank}.json"
        torch.save(checkpoint.read_rng(rng), rng.with_suffix(".pt"))
        rng.unlink()
    proc = resume(inputs, out, num_rollout=ROLLOUTS)
    assert_resumed_from(proc, ck / "rollout_1", {
        ck / "rollout_4": "rng/rank_0.json is unreadable (JSONDecodeError: ",
        ck / "rollout_3": "rng/rank_1.json is missing",
        ck / "rollout_2": "rng/rank_1.pt is refused: it holds more than tensors and plain values"})
    assert not (tmp_path / "ran").exists()
    want, got = final_weights(trained), final_weights(out)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def plant_in_a_value(model_optim: Path, fqn: str, marker: Path) -> None:
    """Points DCP's metadata for the non-tensor value `fqn` (saved with torch.save) at a pickle appended to its
    shard file that would create `marker`: a foreign checkpoint whose file sizes and metadata all check out."""
    metadata = FileSystemReader(str(model_optim)).read_metadata()
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn]
    shard = model_optim / info.relative_path
    blob = io.BytesIO()
    torch.save(Planted(marker), blob)
    info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
    with shard.open("ab") as f:
        f.write(blob.getvalue())
    metadata.storage_meta = None
    (model_optim / ".metadata").write_bytes(pickle.dumps(metadata))


def test_planted_pickles_in_dcp_files_are_refused_unrun(inputs, trained, tmp_path):
    out, ck = copy_of(trained, tmp_path)
    marker = tmp_path / "ran"
    (ck / "rollout_4" / "model_optim" / ".metadata").write_bytes(planted_pickle(marker))
    plant_in_a_value(ck / "rollout_3" / "model_optim", "optim.param_groups.0.lr", marker)
    proc = resume(inputs, out)
    assert_resumed_from(proc, ck / "rollout_2", {
        ck / "rollout_4": "model_optim/.metadata is refused: it names io.open, which DCP metadata never holds",
        ck / "rollout_3": ".distcp: its value optim.param_groups.0.lr is refused, it holds more than tensors"})
    assert not marker.exists()


def test_no_readable_checkpoint_is_one_error_line(inputs, trained, tmp_path):
    out, ck = copy_of(trained, tmp_path)
    for n in range(ROLLOUTS):
        cut(ck / f"rollout_{n}" / "trainer_state.json")
    proc = resume(inputs, out)
    assert rank_exit_code(proc) == 2
    line = one_line(proc, "rl: error:")
    assert line.startswith(f"rl: error: no checkpoint in {ck} could be loaded (rollout_4, rollout_3, ") and \
        "another log.output_dir" in line, line
    assert len(skipped(proc)) == ROLLOUTS
    assert "Traceback" not in proc.stdout and "CheckpointException" not in proc.stderr


# ---------------------------------------------------------------------------- which checkpoints a resume considers


def fake_checkpoint(out: Path, rollout_id: int, model_path: str) -> Path:
    """A checkpoint folder with only the trainer state, which is all resume_candidates reads."""
    path = out / "checkpoints" / f"rollout_{rollout_id}"
    (path / "model_optim").mkdir(parents=True)
    state = checkpoint.TrainerState(rollout_id=rollout_id, weight_version=rollout_id + 2,
                                    config={"model": {"path": model_path}}, world_size=1,
                                    parts={"data": {}, "scheduler": {}, "health": {}})
    (path / "trainer_state.json").write_text(json.dumps(state.to_json()))
    return path


def test_the_model_path_check_reads_the_newest_readable_state(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    older = fake_checkpoint(tmp_path, 0, str(model))
    newer = fake_checkpoint(tmp_path, 1, str(model))
    cut(newer / "trainer_state.json")
    assert checkpointer.resume_candidates(tmp_path, "auto", str(model)) == [older, newer]  # load_newest skips `newer`
    with pytest.raises(ConfigError, match=f"--checkpoint.resume={older} to start"):
        checkpointer.resume_candidates(tmp_path, "auto", str(tmp_path / "other"))


def test_the_same_model_path_spelled_differently_resumes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    saved = fake_checkpoint(tmp_path, 0, str(model))
    for spelling in (f"{model}/", str(tmp_path / "." / "model"), str(tmp_path / "model" / ".." / "model")):
        assert checkpointer.resume_candidates(tmp_path, "auto", spelling) == [saved]
    with pytest.raises(ConfigError, match="holds checkpoints of a run of model.path"):
        checkpointer.resume_candidates(tmp_path, "auto", str(tmp_path / "another"))


def test_the_trainer_state_holds_every_part_under_its_name(tmp_path):
    """A stateful part is saved under its name and read back by it; one the saving run did not have (or that is newer
    than the checkpoint) reads as None, the groups in flight go to a file of their own, and a trainer state without
    a part that every checkpoint holds is damage."""
    groups = {"admitted": 3, "consumed": 1, "groups": []}
    parts = {"data": {"epoch": 1}, "scheduler": {"last_epoch": 2}, "health": {}, "critic_scheduler": None,
             "rollout_buffer": groups}
    state = checkpoint.TrainerState(rollout_id=2, weight_version=3, config={"model": {"path": "m"}}, world_size=1,
                                    parts=parts)
    (tmp_path / "trainer_state.json").write_text(json.dumps(state.to_json()))
    (tmp_path / checkpoint.BUFFER_FILE).write_text(json.dumps(groups))
    assert json.loads((tmp_path / "trainer_state.json").read_text())["rollout_buffer"] is True
    read = checkpoint.read_trainer_state(tmp_path)
    assert (read.rollout_id, read.weight_version, read.world_size) == (2, 3, 1)
    assert {name: checkpoint.read_part(tmp_path, read, name) for name in parts} == parts
    assert checkpoint.read_part(tmp_path, read, "reward") is None
    del parts["health"], parts["scheduler"]
    (tmp_path / "trainer_state.json").write_text(json.dumps(dataclasses.replace(state, parts=parts).to_json()))
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^trainer_state.json lacks scheduler, health$"):
        checkpoint.read_trainer_state(tmp_path)
