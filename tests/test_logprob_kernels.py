"""The trainer's fused log-prob kernels (rl/logprob_kernels.py) against autograd through log_softmax.

On a machine without a GPU they run through Triton's interpreter (imported for it by tests/conftest.py), on a
private copy of the module imported under it, as tests/test_native_gpu.py does with the engine's kernels.
"""

import functools
import importlib.util

import pytest
import torch

from tests.test_native_gpu import ON_GPU, interpreted_triton

if not ON_GPU and not interpreted_triton():
    pytest.skip("needs a CUDA device, or Triton imported for its interpreter (tests/conftest.py)",
                allow_module_level=True)
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@functools.cache
def kernels():
    if ON_GPU:
        return importlib.import_module("rl.logprob_kernels")
    spec = importlib.util.find_spec("rl.logprob_kernels")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
    lp, h = kernels().FusedLogprobs.apply(logits, target, temperature)
    loss = sum((v * w).sum() for v, w in ((lp, w_lp), (h, w_h)) if w is not None)
    (grad,) = torch.autograd.grad(loss, logits)
    assert lp.dtype == h.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(lp.double(), want_lp, atol=2e-5)
    assert torch.allclose(h.double(), want_h, atol=2e-5)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # the gradient is rounded to the logits' dtype
    assert torch.allclose(grad.double(), want_grad, atol=tol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
