"""The lock that keeps tests reading the GPU's free memory alone on it (tests/conftest.py): shared holders run
together, an exclusive one waits for them, and a wait that outlasts its limit stops with one line."""

import time

import pytest

from tests.conftest import gpu_lock


def test_shared_holders_run_together_and_an_exclusive_one_waits_for_them(tmp_path):
    path = tmp_path / "gpu.lock"
    with gpu_lock(path, False, wait=5), gpu_lock(path, False, wait=5):  # two shared at once
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"^the GPU lock {path} was not free after 0 s"):
            with gpu_lock(path, True, wait=0.3):
                pass
        assert time.monotonic() - start < 5
    with gpu_lock(path, True, wait=5):  # free again once the shared holders let go
        with pytest.raises(TimeoutError):
            with gpu_lock(path, False, wait=0.3):
                pass
