"""The trainer's fused log-prob kernels (rl/model/kernels/logprobs_triton.py) against autograd through log_softmax.

On a machine without a GPU they run through Triton's interpreter (imported for it by tests/conftest.py), on a
private copy of the module imported under it, as tests/test_native_gpu.py does with the engine's kernels.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl.train.step import TokenLogprobs
from tests.test_native_gpu import ON_GPU, interpreted_triton, interpreter, kernel_module  # noqa: F401 (a fixture)

if not ON_GPU and not interpreted_triton():
    pytest.skip("needs a CUDA device, or Triton imported for its interpreter (tests/conftest.py)",
                allow_module_level=True)
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def kernels():
    module = kernel_module("rl.model.kernels.logprobs_triton")
    if not ON_GPU:
        module.BLOCK_V = 64  # several loop steps over the small vocabulary, the last one short
    return module


def reference(logits, target, temperature, w_lp, w_h):
    """Autograd through float64 log_softmax: log p(target), the entropy, and d(w_lp . lp + w_h . H)/dlogits."""
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, target[:, None]).squeeze(-1)
    h = -(logp.exp() * logp).sum(-1)
    loss = sum(((v * w.double()).sum() for v, w in ((lp, w_lp), (h, w_h)) if w is not None), torch.zeros((),
                                                                                                 dtype=torch.double))
    (grad,) = torch.autograd.grad(loss, x)
    return lp, h, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("grads", ["logprobs", "entropy", "both"])
def test_fused_logprobs_match_log_softmax_and_its_gradient(dtype, temperature, grads):
    torch.manual_seed(0)
    rows, vocab = 7, 150  # 3 blocks of 64 lanes, the last one short
    logits = (3 * torch.randn(rows, vocab, device=DEVICE)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=DEVICE)
    target[0], target[1] = 0, vocab - 1  # the first and the last lane
    w_lp = torch.randn(rows, device=DEVICE) if grads != "entropy" else None
    w_h = torch.randn(rows, device=DEVICE) if grads != "logprobs" else None
    want_lp, want_h, want_grad = reference(logits, target, temperature, w_lp, w_h)
    lp, h = TokenLogprobs.apply(logits, target, temperature, 0, kernels())
    loss = sum((v * w).sum() for v, w in ((lp, w_lp), (h, w_h)) if w is not None)
    (grad,) = torch.autograd.grad(loss, logits)
    assert lp.dtype == h.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(lp.double(), want_lp, atol=2e-5)
    assert torch.allclose(h.double(), want_h, atol=2e-5)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # the gradient is rounded to the logits' dtype
    assert torch.allclose(grad.double(), want_grad, atol=tol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_kernels_compile_for_hopper(tmp_path):
    """Triton's compiler takes the kernels to a Hopper binary (no GPU needed): it refuses what the interpreter
    lets through, such as a global that is not a tl.constexpr. It runs in a fresh process with an empty cache:
    this session's Triton is set up for the interpreter, and a cached binary would skip the compiler."""
    assert compile_for_hopper(tmp_path, LOGPROB_KERNELS) == ["_forward_kernel"] + 3 * ["_backward_kernel"]


def compile_for_hopper(tmp_path, kernels: str, compile_code: str | None = None) -> list[str]:
    """Runs `kernels` (code that sets `kernels` to a list of (jit function, signature, constexprs)) and compiles
    each for sm_90 in a fresh process with an empty Triton cache; the names of the compiled functions (or, with
    `compile_code`, that code runs instead of the compiling and what it prints comes back, split)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", kernels + (compile_code or COMPILE_FOR_HOPPER)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for fn, signature, constants in kernels:
    signature = {name: signature[name] for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
    print(fn.__name__)
"""

LOGPROB_KERNELS = """
import rl.model.kernels.logprobs_triton as k

common = {"logits_ptr": "*bf16", "target_ptr": "*i64", "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "vocab": "i32",
          "row_stride": "i32", "inv_t": "fp32", "BLOCK": "constexpr"}
forward = {**common, "logprob_ptr": "*fp32"}
backward = {**common, "grad_lp_ptr": "*fp32", "grad_h_ptr": "*fp32", "grad_ptr": "*bf16", "grad_row_stride": "i32",
            "HAS_LP": "constexpr", "HAS_H": "constexpr"}
kernels = [(k._forward_kernel, forward, {"BLOCK": 2048})]
kernels += [(k._backward_kernel, backward, {"BLOCK": 2048, "HAS_LP": lp, "HAS_H": h})
            for lp, h in ((True, False), (False, True), (True, True))]
"""
