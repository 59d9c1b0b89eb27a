"""Set-up for the whole test session, run before any test module is imported."""

import contextlib
import fcntl
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch


def import_triton_for_its_interpreter() -> None:
    """On a machine without a GPU, tests/test_native_gpu.py runs the engine's Triton kernels through
    Triton's interpreter. Triton picks compiled or interpreted when `@triton.jit` decorates a function,
    its own library's (tl.sum, tl.max, ...) at `import triton`, and test modules import it early
    (transformers does), so it is imported here under TRITON_INTERPRET=1. The variable is put back at
    once: nothing else in the session, subprocesses included, runs under the interpreter."""
    if torch.cuda.is_available() or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


import_triton_for_its_interpreter()

# One lock per machine for its GPUs, taken by every test of every pytest process there (xdist's workers included).
GPU_LOCK = Path(tempfile.gettempdir()) / f"rl-tests-gpu-{os.getuid()}.lock"


def pytest_configure(config):
    config.addinivalue_line("markers", "whole_gpu: reads the device's free memory (torch.cuda.mem_get_info), a "
                                       "count of every process on it: on a CUDA machine no other test runs meanwhile")


@contextlib.contextmanager
def gpu_lock(path: Path, exclusive: bool, wait: float):
    """Holds `path` locked, shared or exclusive, across processes. Both kinds pass a gate first, so an exclusive
    holder waiting for the shared ones to finish keeps new ones out (flock alone would let them starve it). Waits
    `wait` seconds at most, then raises one line naming the lock: a test stuck where its own timeout cannot reach
    it (a blocked CUDA call) must not stall every other worker behind the gate."""
    deadline = time.monotonic() + wait
    with open(path.with_suffix(".gate"), "a") as gate, open(path, "a") as lock:
        take(gate, fcntl.LOCK_EX, deadline, path, wait)
        try:
            take(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline, path, wait)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the file releases the lock


def take(file, mode: int, deadline: float, path: Path, wait: float) -> None:
    while True:
        try:
            return fcntl.flock(file, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the GPU lock {path} was not free after {wait:.0f} s: a test that holds it is "
                                   "stuck (its worker's log names it)") from None
            time.sleep(0.05)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """On a CUDA machine each test (its fixtures' set-up and teardown, and the processes it starts, included) holds
    the GPU lock shared, and a `whole_gpu` test exclusive: the free memory such a test reads moves only with what
    it does, not with what 11 other workers allocate meanwhile (by GBs: an engine's sleep read as freeing -2 GB)."""
    if not torch.cuda.is_available():
        return (yield)
    wait = float(item.config.getini("timeout") or 900)  # pytest-timeout's limit: the wait is outside its timer
    with gpu_lock(GPU_LOCK, item.get_closest_marker("whole_gpu") is not None, wait):
        return (yield)


@pytest.fixture
def one_cpu_thread():
    """Tests that compare two computations of the same gradients at rel 1e-5 run them on one CPU thread. With
    two, the first float32 cos, sin or exp of a process that splits across threads comes back from the second
    thread with errors up to 1.5e-4 in some processes (torch 2.13+cpu on a 2-core x86 host: 4 of 30 fresh
    processes, RoPE's cos over (10, 20, 64); the same call repeated is exact), which a comparison of two
    paths reads as their difference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
