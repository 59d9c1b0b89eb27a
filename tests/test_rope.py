"""RoPE as one op (rl/model/rope.py) and its float32 Triton kernel (rl/model/kernels/rope_triton.py) against HF's
apply_rotary_pos_emb.

On a machine without a GPU the kernel runs through Triton's interpreter (imported for it by tests/conftest.py),
on a private copy of the module, as tests/test_logprob_kernels.py does (and like it, skips without Triton).
"""

import copy

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

import rl.model.rope
from rl.model.rope import computes_rope, fuse_rope, rope, unfuse_rope
from rl.train.policy import compile_blocks
from tests.test_logprob_kernels import compile_for_hopper
from tests.test_native_gpu import ON_GPU, interpreter, kernel_module  # noqa: F401 (a fixture)
from tests.test_train_options import close, loss_and_grads, samples
from tests.tiny import tiny_model

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
HF = getattr(modeling_qwen2.apply_rotary_pos_emb, "original", modeling_qwen2.apply_rotary_pos_emb)


@pytest.fixture
def kernels(monkeypatch, hf_rope):
    """The op runs the Triton kernel (interpreted on a CPU)."""
    module = kernel_module("rl.model.kernels.rope_triton")
    monkeypatch.setattr(rl.model.rope, "kernels", lambda x: module)
    return module


@pytest.fixture
def hf_rope():
    """HF's function before and after the test."""
    unfuse_rope()
    assert modeling_qwen2.apply_rotary_pos_emb is HF
    yield
    unfuse_rope()


def qk_cos_sin(dtype, rows=2, length=5, dim=12, cos_rows=2, seed=0):
    """q (3 heads) and k (1 head) as HF has them: transposed views of (rows, length, heads, dim) projections."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, length, 3, dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(rows, length, 1, dim, generator=g).to(DEVICE, dtype).transpose(1, 2)
    half = torch.randn(cos_rows, length, dim // 2, generator=g)
    cos = torch.cat([half, half], -1).to(DEVICE, dtype)  # HF's tables repeat their halves
    sin = torch.cat([half.sin(), half.sin()], -1).to(DEVICE, dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,cos_rows", [(12, 2), (16, 1)])  # half 6 (lanes masked) and 8; cos per row or shared
def test_kernel_is_hf_rope_and_its_transpose(kernels, dtype, dim, cos_rows):
    q, k, cos, sin = qk_cos_sin(dtype, dim=dim, cos_rows=cos_rows)
    want_q, want_k = HF(q.double(), k.double(), cos.double(), sin.double())
    for x, want in ((q, want_q), (k, want_k)):
        got = kernels.rope_float32(x, cos, sin)
        assert got.stride() == x.stride() and got.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the float32 result
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol)
    # the inverse is the transpose: <rope(x), g> == <x, rope^T(g)>
    g = torch.randn_like(q)
    lhs = (kernels.rope_float32(q.double(), cos.double(), sin.double()) * g.double()).sum()
    rhs = (q.double() * kernels.rope_float32(g.double(), cos.double(), sin.double(), inverse=True)).sum()
    assert torch.allclose(lhs, rhs)


def test_the_op_gives_hf_values_and_gradients(kernels):
    q, k, cos, sin = qk_cos_sin(torch.float32)
    for x in (q, k):
        x = x.detach().requires_grad_()
        g = torch.randn_like(x)
        (want,) = torch.autograd.grad((HF(x, x, cos, sin)[0] * g).sum(), x)
        (got,) = torch.autograd.grad((rope(x, cos, sin, False) * g).sum(), x)
        assert torch.allclose(got, want, atol=1e-6)


def test_tables_the_kernel_cannot_index_are_not_read_as_if_it_could(kernels):
    """cos and sin of other rows or another length go to the torch formula, which refuses them, instead of the
    kernel reading past them."""
    q, _, cos, sin = qk_cos_sin(torch.float32, rows=2, cos_rows=3)
    with pytest.raises(RuntimeError):
        rope(q, cos, sin, False)
    q, _, cos, sin = qk_cos_sin(torch.float32, length=5)
    with pytest.raises(RuntimeError):
        rope(q[:, :, :4], cos, sin, False)


def test_compiled_blocks_with_the_rope_kernel_give_the_eager_loss_and_gradients(kernels):
    eager = tiny_model(seed=4, layers=2).to(DEVICE)
    want_loss, want = loss_and_grads(eager, samples(3, seed=4))
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    assert modeling_qwen2.apply_rotary_pos_emb.original is HF
    got_loss, got = loss_and_grads(compiled, samples(3, seed=4))
    assert torch.allclose(got_loss, want_loss, rtol=1e-5)
    assert close(got, want, 1e-4)


def test_only_standard_rope_is_swapped(monkeypatch, hf_rope):
    assert computes_rope(HF)

    def scale_only(q, k, cos, sin, unsqueeze_dim=1):  # not a rotation
        return q * cos.unsqueeze(unsqueeze_dim), k * cos.unsqueeze(unsqueeze_dim)

    assert not computes_rope(scale_only)
    with monkeypatch.context() as m:
        m.setattr(modeling_qwen2, "apply_rotary_pos_emb", scale_only)
        assert not fuse_rope(tiny_model(seed=0)) and modeling_qwen2.apply_rotary_pos_emb is scale_only
    assert fuse_rope(tiny_model(seed=0)) and modeling_qwen2.apply_rotary_pos_emb.original is HF
    assert fuse_rope(tiny_model(seed=0)) and modeling_qwen2.apply_rotary_pos_emb.original is HF  # swapped once
    unfuse_rope()
    assert modeling_qwen2.apply_rotary_pos_emb is HF


def test_kernel_compiles_for_hopper(tmp_path):
    kernels = """
import rl.model.kernels.rope_triton as k
ints = ["length", "heads", "half", "xb", "xh", "xt", "ob", "oh", "ot", "cb", "ct"]
signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", **dict.fromkeys(ints, "i32"),
             "INVERSE": "constexpr", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr"}
kernels = [(k._rope_float32_kernel, signature, {"INVERSE": inverse, "BLOCK_H": 16, "BLOCK_D": 32})
           for inverse in (False, True)]
"""
    assert compile_for_hopper(tmp_path, kernels) == ["_rope_float32_kernel", "_rope_float32_kernel"]


def test_the_rounded_rope_kernels_are_launched_with_fusion_off(monkeypatch):
    """tests/test_kernels_compile.py compiles the rounded kernels with `ROUNDED_OPTIONS`; this one sees both wrappers
    hand them to the launch (a wrapper that drops them would compile with Triton's default, fusion on)."""
    p = kernel_module("rl.model.kernels.rope_triton")  # on a CPU a private copy, as the interpreter runs it
    launched = {}
    for name in ("_rope_store_kernel", "_rope_rounded_kernel"):
        monkeypatch.setattr(getattr(p, name), "run", lambda *args, name=name, **kwargs:
                            launched.__setitem__(name, kwargs.get("enable_fp_fusion", "default")), raising=False)
    tokens, heads, kv_heads, dim = 2, 4, 2, 8
    cos = sin = torch.zeros(tokens, dim // 2)
    p.rope_rounded(torch.zeros(tokens, heads, dim), cos, sin)
    cache = torch.zeros(16, kv_heads, dim)
    p.rope_and_store(torch.zeros(tokens, (heads + 2 * kv_heads) * dim), torch.zeros(tokens, dtype=torch.long),
                     torch.arange(tokens), cos, sin, cache, cache.clone(), heads, kv_heads, dim)
    assert launched == {"_rope_store_kernel": False, "_rope_rounded_kernel": False}
