"""Set-up for the whole test session, run before any test module is imported."""

import importlib.util
import os
import sys

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
