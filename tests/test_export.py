"""rl.export writes only where nothing else lives: an empty or new folder, or (with --overwrite) an earlier export."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from rl.config import ConfigError
from rl.run.export import MARKER, export_policy, write_hf_folder
from tests.tiny import save_tiny_model_dir, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint folder as the run writes it, reduced to what rl.export reads: model_optim/ and hf/."""
    folder = tmp_path_factory.mktemp("run") / "checkpoints" / "rollout_2"
    save_tiny_model_dir(folder / "hf")
    model = tiny_model(seed=1)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(folder / "model_optim")),
             no_dist=True)
    return folder


def export(checkpoint, out, *flags):
    return subprocess.run([sys.executable, "-m", "rl.export", str(checkpoint), str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_into_a_new_folder_is_marked(checkpoint, tmp_path):
    proc = export(checkpoint, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / MARKER).is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it


def test_a_folder_with_other_files_is_refused_and_kept(checkpoint, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for flags in [(), ("--overwrite",)]:
        proc = export(checkpoint, out, *flags)
        assert proc.returncode == 1
        assert proc.stderr.strip() == (f"rl.export: {out} is not empty and holds no earlier export (no {MARKER}); "
                                       f"export into a new or empty folder")
        assert snapshot(out) == {Path("notes.txt"): b"keep me"}


def test_the_run_folder_is_refused_even_with_overwrite(checkpoint):
    run = checkpoint.parents[1]
    (run / "metrics.jsonl").write_text('{"rollout_id": 0}\n')
    (run / "config.json").write_text("{}")
    (run / ".lock").write_text("")
    before = snapshot(run)
    for flags in [(), ("--overwrite",)]:
        proc = export(checkpoint, run, *flags)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
        assert f"{run} holds a run (checkpoints, metrics.jsonl, .lock)" in proc.stderr
        assert snapshot(run) == before
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "config.json", "metrics.jsonl"]


def test_an_earlier_export_is_replaced_only_with_overwrite(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert export(checkpoint, out, "--dtype", "float32").returncode == 0
    proc = export(checkpoint, out, "--dtype", "bfloat16")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"rl.export: {out} holds an earlier export; pass --overwrite to replace it"
    assert next(iter(load_file(out / "model.safetensors").values())).dtype == torch.float32
    proc = export(checkpoint, out, "--dtype", "bfloat16", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert next(iter(load_file(out / "model.safetensors").values())).dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_write_leaves_the_earlier_export_whole(checkpoint, tmp_path):
    out = tmp_path / "final"
    write_hf_folder([("w", torch.ones(2))], [checkpoint / "hf"], out, torch.float32, source="first")
    before = snapshot(out)

    def tensors():  # a kill mid-export, as far as the folder can tell
        yield "w", torch.zeros(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_hf_folder(tensors(), [checkpoint / "hf"], out, torch.float32, source="second")
    assert snapshot(out) == before and [p.name for p in tmp_path.iterdir()] == ["final"]
    write_hf_folder([("w", torch.zeros(2))], [checkpoint / "hf"], out, torch.float32, source="again")
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.zeros(2))


def test_the_run_export_replaces_its_earlier_export(checkpoint, tmp_path):
    out = tmp_path / "final"  # a resumed run exports again into the final/ of its first end
    for seed in (0, 1):
        model = tiny_model(seed=seed)
        assert export_policy(model, [checkpoint / "hf"], out, "float32", is_main=True) == out
        assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], model.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_the_run_export_refuses_a_final_folder_it_did_not_write(checkpoint, tmp_path):
    out = tmp_path / "final"
    out.mkdir()
    (out / "model.safetensors").write_text("someone's")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no earlier export .* the trained policy was not exported"):
        export_policy(tiny_model(), [checkpoint / "hf"], out, "auto", is_main=True)
    assert snapshot(out) == {Path("model.safetensors"): b"someone's", Path("notes.txt"): b"mine"}


def test_the_run_export_replaces_a_final_folder_exported_before_the_marker(checkpoint, tmp_path):
    out = tmp_path / "final"  # a run that finished before exports were marked, resumed to train further
    export_policy(tiny_model(seed=0), [checkpoint / "hf"], out, "float32", is_main=True)
    (out / MARKER).unlink()
    model = tiny_model(seed=1)
    export_policy(model, [checkpoint / "hf"], out, "float32", is_main=True)
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], model.lm_head.weight)
    (out / MARKER).unlink()  # rl.export itself still wants the marker: the folder might be anyone's model
    proc = export(checkpoint, out, "--overwrite")
    assert proc.returncode != 0 and "holds no earlier export" in proc.stderr, proc.stderr
