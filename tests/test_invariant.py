"""Batch-invariant mode (`model.batch_invariant`): the engine and the patched trainer forward.

On the CPU the Triton kernels run through Triton's interpreter in float32 (a subprocess, since the
interpreter is chosen when Triton is imported): this checks the wiring (token rows, fixed splits
and their merge, right padding, the patched modules and their gradients). That the two sides then
agree to the bit in bf16 is checked on a GPU by tests/test_native_gpu.py.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import ConfigError, load_config, resolve

ROOT = Path(__file__).resolve().parents[1]


FAMILIES = ["qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def invariant_checks(tmp_path_factory):
    """Starts tests/invariant_checks.py for every family at once (the interpreter keeps one core busy each) and
    gives each test a wait for its own family's results."""
    root = tmp_path_factory.mktemp("invariant")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    procs = {}
    for family in FAMILIES:
        with open(root / f"{family}.log", "w") as log:
            procs[family] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "invariant_checks.py"),
                                              str(root / f"{family}.json"), family], cwd=ROOT, env=env,
                                             stdout=log, stderr=subprocess.STDOUT)

    def results(family: str) -> dict:
        assert procs[family].wait(timeout=900) == 0, (root / f"{family}.log").read_text()[-3000:]
        return json.loads((root / f"{family}.json").read_text())

    yield results
    for proc in procs.values():
        proc.kill()
        proc.wait()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_and_trainer_forward_agree_in_batch_invariant_mode(invariant_checks, family):
    r = invariant_checks(family)
    assert r["tokens"] == 32
    assert max(r["lengths"]) > 64 or family != "qwen2"  # contexts cross the (test-sized) 64-token splits
    assert r["engine_vs_trainer"] < 1e-5  # the rest is the float32 order of the two log-softmaxes
    # A sequence scores the same alone and in a padded batch. Bitwise on a GPU (tests/test_native_gpu.py checks
    # the GEMM over row slices); here the interpreter's tl.dot is numpy's matmul, whose CPU kernels may sum a
    # tile in another order for another row count, so the last float32 bit can move.
    assert r["batched_vs_alone"] < 1e-5
    assert r["trainer_vs_hf"] < 1e-5  # the patched forward computes the same function as the HF one
    assert r["grad_names"] > 20 and r["grad_rel"] < 1e-4  # and its gradients
    # A turn continued from kept KV (its new tokens are rows of the same kernel) scores as one prefilled whole.
    assert r["continued_reused"] == [n - 1 for n in r["lengths"]] and r["continued_same_tokens"]
    assert r["continued_vs_whole"] < 1e-5


def test_batch_invariant_needs_the_native_engine_and_auto_dtype():
    base = ["--model.path=m", "--data.source=d.jsonl", "--model.batch_invariant=true"]
    with pytest.raises(ConfigError, match="model.batch_invariant needs rollout.engine='native'"):
        resolve(load_config([*base, "--rollout.engine=vllm"]))
    with pytest.raises(ConfigError, match="model.batch_invariant needs rollout.dtype='auto'"):
        resolve(load_config([*base, "--rollout.dtype=float32"]))
    assert resolve(load_config(base)).model.batch_invariant
