"""The policy built on the meta device and loaded shard by shard equals a plain `from_pretrained` model,
on 2 gloo ranks: untied, tied and sharded-safetensors folders, random init, and a folder whose weights
do not match its config."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import rewrite_safetensors, save_sharded_tiny_model_dir, save_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("policy_load")
    save_tiny_model_dir(out / "plain", seed=1)
    save_tiny_model_dir(out / "tied", seed=2, tie=True)
    save_sharded_tiny_model_dir(out / "sharded", seed=3)
    broken = save_tiny_model_dir(out / "broken", seed=4)
    rewrite_safetensors(broken, drop=("model.layers.1.mlp.down_proj.weight",),
                        add={"model.layers.7.extra.weight": torch.zeros(2)})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if importlib.util.find_spec("triton") is not None:
        env["TRITON_INTERPRET"] = "1"  # Triton's interpreter runs the batch-invariant kernels on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(27000 + os.getpid() % 1000), "tests/policy_load_checks.py", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"results{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("folder", ["plain", "tied", "sharded"])
def test_weights_and_logits_equal_from_pretrained(results, folder):
    for rank in results:
        r = rank[folder]
        assert r["weights_differ"] == [] and r["params_not_in_files"] == []
        assert r["buffers_differ"] == []  # RoPE's inv_freq recomputed after to_empty
        assert r["logits_max_diff"] == 0.0
        assert r["tied"] == (folder == "tied")


def test_random_init_is_seeded_and_identical_on_every_rank(results):
    for rank in results:
        r = rank["random_init"]
        assert r["weights_differ"] == []  # the one-process CPU draws, on each of the 2 ranks
        assert abs(r["q_proj_std"] - r["initializer_range"]) < 0.1 * r["initializer_range"]
        assert r["norms_one"] and r["biases_zero"] and r["other_seed_differs"] and r["logits_finite"]


def test_missing_and_unexpected_weights_stop_with_their_names(results):
    for rank in results:
        message = rank["broken"]
        assert "missing 1 (model.layers.1.mlp.down_proj.weight)" in message, message
        assert "unexpected 1 (model.layers.7.extra.weight)" in message, message


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_batch_invariant_patch_on_the_meta_model(results):
    assert all(rank["batch_invariant"]["logits_max_diff"] == 0.0 for rank in results)


def test_random_init_of_a_model_with_saved_buffers_is_one_line():
    from rl.config import ConfigError
    from rl.train.policy import init_random_weights

    with pytest.raises(ConfigError, match=r"^model.random_init: the model has a saved buffer running_mean"):
        init_random_weights(torch.nn.BatchNorm1d(3), 0, 0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_computed_buffers_of_a_gemma3_built_on_meta_are_those_of_one_built_whole(dtype):
    """After `to_empty`, Gemma 3's computed buffers are recomputed: its RoPEs' inv_freq from their config, and its
    scaled embedding's `embed_scale`, sqrt(hidden_size) in the model's dtype, by a module with no config."""
    from transformers import AutoModelForCausalLM

    from rl.train.policy import init_non_persistent_buffers
    from tests.test_families import gemma3_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma3_config(), dtype=dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float("nan"))  # what to_empty left, whatever its memory held
    init_non_persistent_buffers(model)
    got = dict(model.named_buffers())
    want = dict(AutoModelForCausalLM.from_config(gemma3_config(), dtype=dtype).named_buffers())
    assert got.keys() == want.keys() and "model.embed_tokens.embed_scale" in got
    for name, buffer in want.items():
        assert buffer.dtype == got[name].dtype and torch.equal(got[name], buffer), name


def test_a_computed_buffer_with_nothing_to_rebuild_it_from_stops_with_its_name():
    from rl.train.policy import init_non_persistent_buffers

    scale = torch.nn.Module()
    scale.register_buffer("embed_scale", torch.tensor(2.0), persistent=False)  # no float kept beside it, no config
    with pytest.raises(ValueError, match=r"non-persistent buffers \['embed_scale'\] of 0 \(Module\): it has no config"):
        init_non_persistent_buffers(torch.nn.Sequential(scale))
