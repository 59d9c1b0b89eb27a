"""Faults around the run folder, each one line: a disk that fills during a save, a folder the run cannot write in,
a resume refused after the folder was claimed."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_checkpoint import checkpoints, launch, rows
from tests.test_faults import one_line, rank_exit_code
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


def test_a_disk_that_fills_during_a_save_stops_with_one_line_and_no_partial_folder(inputs, tmp_path):
    """Rank 1's shard writes of rollout 2 fail with ENOSPC: every rank stops, the `.tmp` folder is gone, the earlier
    checkpoints and every metrics row are kept, and the same command resumes once there is room."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    proc = launch(inputs, out, 2, "--train.num_rollout=4", "--checkpoint.interval=1", "--checkpoint.keep_last=3",
                  check=False, script=("tests/crash_in_save.py", "full:2"))
    assert rank_exit_code(proc) == 1
    line = one_line(proc, "rl: stopped:")
    assert line.startswith(f"rl: stopped: checkpoint {ck / 'rollout_2'} could not be written (ENOSPC: No space left "
                           f"on device writing {ck / '.rollout_2.tmp' / 'model_optim'}/__1_"), line
    assert "the earlier checkpoints (rollout_0, rollout_1) are as they were" in line, line
    assert "Traceback" not in proc.stdout and proc.stderr.count("Traceback") == 1  # torchrun's own
    assert "Exception in thread" not in proc.stderr
    assert checkpoints(out) == ["rollout_0", "rollout_1"]
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2]
    proc = launch(inputs, out, 2, "--train.num_rollout=4", "--checkpoint.interval=1", "--checkpoint.keep_last=3")
    assert f"checkpoint: resumed from {ck / 'rollout_1'} " in proc.stdout
    assert [r["rollout_id"] for r in rows(out)] == [0, 1, 2, 3]


def immutable(folder: Path, on: bool) -> None:
    """chattr +i: not even root may create a file in `folder` (root ignores a mode of 0o555)."""
    subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True, capture_output=True)


def test_a_checkpoint_folder_the_run_cannot_write_in_stops_before_the_model_loads(inputs, tmp_path):
    out = tmp_path / "run"
    launch(inputs, out, 1, "--train.num_rollout=1")
    ck = out / "checkpoints"
    try:
        immutable(ck, True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        proc = launch(inputs, out, 1, "--train.num_rollout=2", check=False)
    finally:
        immutable(ck, False)
    assert rank_exit_code(proc) == 2
    line = one_line(proc, "rl: error:")
    assert line.startswith(f"rl: error: log.output_dir {str(out)!r}: cannot write in {ck} (Operation not "
                           f"permitted)"), line
    assert "policy: built" not in proc.stdout  # nothing of the model was loaded
    assert [r["rollout_id"] for r in rows(out)] == [0]


LORA = ("--lora.rank=4", "--lora.alpha=8")


def test_a_refused_resume_leaves_the_run_folder_as_it_was(inputs, tmp_path):
    """A resume from an older checkpoint with other LoRA keys is refused before it writes its config.json or sets
    the newer checkpoints aside."""
    out = tmp_path / "run"
    ck = out / "checkpoints"
    launch(inputs, out, 1, "--train.num_rollout=2", "--checkpoint.interval=1", *LORA)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = launch(inputs, out, 1, "--train.num_rollout=3", f"--checkpoint.resume={ck / 'rollout_0'}", *LORA,
                  "--lora.rank=8", check=False)
    assert rank_exit_code(proc) == 2
    assert "was trained with lora.rank=4" in one_line(proc, "rl: error:")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before if k.name != ".lock")
    shutil.rmtree(out / "final")  # the same resume with the checkpoint's keys goes ahead, and branches the run
    proc = launch(inputs, out, 1, "--train.num_rollout=3", f"--checkpoint.resume={ck / 'rollout_0'}", *LORA)
    assert "the newer checkpoints rollout_1 are moved to" in proc.stdout
    assert len(list(out.glob("config.*.json"))) == 1  # train.num_rollout changed: the earlier config kept beside
