"""Nothing a checkpoint holds runs code when it loads: RNG states and groups in flight are JSON, DCP's `.metadata`
is unpickled against an allowlist, DCP's non-tensor values load with weights_only=True. A planted pickle (one that
would create a marker file) is refused with one line naming its file, and the marker never appears.

The real checkpoints here (full-parameter, LoRA, PPO with a critic, partial rollouts) come from 1-rank runs."""

import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rl.config import ConfigError
from rl.data import Sample, Status
from rl.rollout.buffer import RolloutBuffer, check_plain, from_json, sample_from_dict, sample_to_dict, to_json
from rl.run import checkpoint
from tests.test_checkpoint import launch, rows
from tests.test_faults import one_line, rank_exit_code
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


class Planted:
    """Unpickled by a plain unpickler, this creates `marker`: what code planted in a checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def planted_pickle(marker: Path) -> bytes:
    return pickle.dumps({"torch": Planted(marker)})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


VARIANTS = {"full": (), "lora": ("--lora.rank=4", "--lora.alpha=8"), "critic": ("--algo.advantage_estimator=gae",)}


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    for name, overrides in VARIANTS.items():
        launch(inputs, root / name, 1, "--train.num_rollout=1", *overrides)
    return {name: root / name / "checkpoints" / "rollout_0" for name in VARIANTS}


# ---------------------------------------------------------------------------- DCP metadata and values


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_real_dcp_metadata_reads_through_the_allowlist_as_dcp_reads_it(runs, variant):
    folder = runs[variant] / "model_optim"
    safe = checkpoint.read_metadata(folder)
    plain = torch.distributed.checkpoint.FileSystemReader(str(folder)).read_metadata()
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.storage_data == plain.storage_data
    assert safe.planner_data == plain.planner_data
    assert any(k.startswith("critic.") for k in safe.state_dict_metadata) == (variant == "critic")


def test_a_planted_metadata_pickle_is_refused_unrun(runs, tmp_path):
    folder = tmp_path / "model_optim"
    shutil.copytree(runs["full"] / "model_optim", folder)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(planted_pickle(marker))
    refused = r"^model_optim/.metadata is refused: it names io.open, which DCP metadata never holds"
    with pytest.raises(checkpoint.DamagedCheckpoint, match=refused):
        checkpoint.check_shards(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))  # the global alone, at the top
    with pytest.raises(checkpoint.DamagedCheckpoint, match="is refused: it names io.open"):
        checkpoint.check_shards(folder)
    (folder / ".metadata").write_bytes(pickle.dumps({"a": 1}))  # only allowed things, but not DCP metadata
    with pytest.raises(checkpoint.DamagedCheckpoint, match="is refused: it holds a dict, not DCP metadata"):
        checkpoint.check_shards(folder)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["/etc/hostname", "../../trainer_state.json", "offset"])
def test_metadata_that_sends_reads_out_of_its_folder_is_refused(runs, tmp_path, where):
    """Built only of allowed classes, the metadata's values are still the file's: a read of a file outside the
    checkpoint (an absolute path, a way up) or at a negative offset is refused before anything is read."""
    folder = tmp_path / "model_optim"
    shutil.copytree(runs["full"] / "model_optim", folder)
    metadata = checkpoint.read_metadata(folder)
    index, item = next(iter(metadata.storage_data.items()))
    if where == "offset":
        item.offset = -1
    else:
        item.relative_path = where
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    refused = r"^model_optim/.metadata is refused: it (sends a read|gives)"
    with pytest.raises(checkpoint.DamagedCheckpoint, match=refused):
        checkpoint.check_shards(folder)


def test_the_export_of_a_checkpoint_reads_it_safely_too(runs, tmp_path):
    from rl.run.export import export_checkpoint

    folder = tmp_path / "rollout_0"
    shutil.copytree(runs["full"], folder)
    assert (export_checkpoint(folder, tmp_path / "exported") / "config.json").is_file()
    marker = tmp_path / "ran"
    (folder / "model_optim" / ".metadata").write_bytes(planted_pickle(marker))
    with pytest.raises(ConfigError, match=r"rollout_0: model_optim/.metadata is refused: it names io.open"):
        export_checkpoint(folder, tmp_path / "again")
    assert not marker.exists()


# ---------------------------------------------------------------------------- RNG states


def test_rng_states_round_trip_through_json_exactly(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    random.gauss(0, 1)  # leaves a gauss_next in Python's state
    file = tmp_path / "rank_0.json"
    file.write_text(json.dumps(checkpoint.rng_to_json(checkpoint.rng_state())))
    want = (torch.rand(5), random.random(), random.gauss(0, 1))
    torch.manual_seed(0)
    random.seed(0)
    checkpoint.set_rng_state(checkpoint.read_rng(file))
    got = (torch.rand(5), random.random(), random.gauss(0, 1))
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_an_earlier_pt_rng_file_reads_without_unpickling_and_a_planted_one_is_refused(tmp_path):
    legacy = tmp_path / "rank_0.pt"
    torch.save(checkpoint.rng_state(), legacy)  # the format before JSON: tensors and a tuple of ints
    assert torch.equal(checkpoint.read_rng(legacy)["torch"], torch.get_rng_state())
    marker = tmp_path / "ran"
    legacy.write_bytes(planted_pickle(marker))
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^rng/rank_0.pt is refused: it holds more than tensors"):
        checkpoint.read_rng(legacy)
    torch.save({"torch": Planted(marker), "python": random.getstate()}, legacy)  # torch.save's zip form
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^rng/rank_0.pt is refused"):
        checkpoint.read_rng(legacy)
    assert not marker.exists()


def foreign_rng_files() -> dict[str, str]:
    good = checkpoint.rng_to_json(checkpoint.rng_state())
    return {"{": "JSONDecodeError", json.dumps({**good, "torch": "00"}): "RuntimeError",  # a state of the wrong size
            json.dumps({**good, "torch": "zz"}): "ValueError",
            json.dumps({**good, "python": [3, [1, 2], None]}): "ValueError",
            json.dumps({**good, "python": [3, [1.5] * 625, None]}): "ValueError",
            json.dumps({"python": good["python"]}): "ValueError"}


@pytest.mark.parametrize("case", range(6))
def test_a_damaged_or_foreign_rng_json_names_the_file(tmp_path, case):
    content, error = list(foreign_rng_files().items())[case]
    file = tmp_path / "rank_1.json"
    file.write_text(content)
    with pytest.raises(checkpoint.DamagedCheckpoint, match=rf"^rng/rank_1.json is unreadable \({error}: "):
        checkpoint.read_rng(file)


# ---------------------------------------------------------------------------- groups in flight


def test_free_form_values_round_trip_through_json_type_for_type():
    value = {"a": (1, 2.5, None, -0.0), "b": {1: "x", (2, 3): [b"\x00\xff"]}, "__tuple__": [1e-300, 0.1 / 3],
             "c": [{"__items__": True}], "d": float("inf")}
    back = from_json(json.loads(json.dumps(to_json(value))))
    assert back == value and repr(back) == repr(value)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        to_json({"x": np.zeros(2)})


def sample(group: int) -> Sample:
    return Sample(prompt="p", tokens=[1, 2, 3, 4], response_length=1, loss_mask=[1], rollout_log_probs=[-0.1 / 3],
                  token_versions=[2], group_index=group, status=Status.ABORTED, label={"answer": (1, 2)},
                  metadata={"k": (1, 2), 3: b"x"}, columns={"id": 7})


def test_a_sample_survives_the_json_form_and_a_foreign_one_is_named():
    s = sample(0)
    assert sample_from_dict(json.loads(json.dumps(sample_to_dict(s)))) == s
    d = sample_to_dict(s)
    with pytest.raises(ValueError, match="expected"):
        sample_from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="tokens of the wrong type"):
        sample_from_dict({**d, "tokens": "1234"})


def test_groups_in_flight_holding_what_json_cannot_keep_stop_at_admission():
    buffer = RolloutBuffer(2, 1)
    buffer.admit([[sample(0), sample(0)]])
    bad = sample(1)
    bad.columns = {"emb": np.zeros(3)}
    with pytest.raises(ConfigError, match=r"prompt group 1: its columns holds a value of type numpy.ndarray"):
        check_plain([[bad]])


def write_buffer(path: Path, groups: list[list[Sample]]) -> None:
    buffer = RolloutBuffer(2, 1)
    buffer.admit(groups)
    (path / checkpoint.BUFFER_FILE).write_text(json.dumps(buffer.state_dict()))


def test_the_stash_reads_back_exactly_and_refuses_pickles_unrun(tmp_path):
    write_buffer(tmp_path, [[sample(0), sample(0)], [sample(1), sample(1)]])
    restored = RolloutBuffer(2, 1)
    restored.load_state_dict(checkpoint.read_rollout_buffer(tmp_path))
    assert restored.groups == [[sample(0), sample(0)], [sample(1), sample(1)]] and restored.admitted == 2
    marker = tmp_path / "ran"
    (tmp_path / checkpoint.BUFFER_FILE).write_bytes(planted_pickle(marker))
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^rollout_buffer.json is unreadable \(UnicodeDecodeError"):
        checkpoint.read_rollout_buffer(tmp_path)
    (tmp_path / checkpoint.BUFFER_FILE).rename(tmp_path / checkpoint.OLD_BUFFER_FILE)  # an earlier checkpoint's
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^rollout_buffer.pkl predates the pickle-free"):
        checkpoint.read_rollout_buffer(tmp_path)
    (tmp_path / checkpoint.BUFFER_FILE).write_text(json.dumps({"admitted": 2, "consumed": 0, "groups": [[{}]]}))
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"^rollout_buffer.json is unreadable \(ValueError: a "
                                                           r"sample with the keys"):
        checkpoint.read_rollout_buffer(tmp_path)
    assert not marker.exists()


PARTIAL = ("--rollout.partial_rollout=true", "--rollout.max_staleness=1", "--rollout.max_new_tokens=48",
           f"--rollout.stop_token_ids={list(range(100, 115))}")


def test_a_run_with_a_planted_stash_falls_back_and_then_stops_unrun(inputs, tmp_path):
    """Planted pickles in the newest checkpoint's stash and (as an earlier checkpoint's `.pkl`) the older one's:
    one line each, naming the file, then the run stops with one line; nothing planted ever ran."""
    out = tmp_path / "run"
    launch(inputs, out, 1, "--train.num_rollout=2", "--checkpoint.interval=1", "--checkpoint.keep_last=2", *PARTIAL)
    ck = out / "checkpoints"
    marker = tmp_path / "ran"
    (ck / "rollout_1" / checkpoint.BUFFER_FILE).write_bytes(planted_pickle(marker))
    (ck / "rollout_0" / checkpoint.BUFFER_FILE).unlink()
    (ck / "rollout_0" / checkpoint.OLD_BUFFER_FILE).write_bytes(planted_pickle(marker))
    proc = launch(inputs, out, 1, "--train.num_rollout=3", *PARTIAL, check=False)
    assert rank_exit_code(proc) == 2 and not marker.exists()
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: checkpoint ")]
    assert len(warnings) == 2, proc.stdout[-3000:]
    assert f"{ck / 'rollout_1'} could not be loaded (rollout_buffer.json is unreadable (" in warnings[0]
    assert f"{ck / 'rollout_0'} could not be loaded (rollout_buffer.pkl predates the pickle-free" in warnings[1]
    assert one_line(proc, "rl: error:").startswith(f"rl: error: no checkpoint in {ck} could be loaded")
    assert "Traceback" not in proc.stdout  # torchrun's own, on its stderr, shows the line as the root cause
    assert [r["rollout_id"] for r in rows(out)] == [0, 1]
