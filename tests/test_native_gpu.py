"""The native engine's Triton kernels against their torch definitions, and the CUDA engine against the CPU one.

Without a GPU the kernel tests run on the CPU through Triton's interpreter: tests/conftest.py imports
Triton for it, and this module imports its own copy of the kernel modules (rl/model/kernels/) under it. The
interpreter runs every program in Python, so there the decode-attention grid is cut to a Latin square and the sampler
draws fewer rows; its `tl.dot` multiplies bfloat16 tiles wrongly (Triton 3.9), so the bfloat16 cases
of the kernels built on it run on a GPU only, as do the tests of the whole CUDA engine.
"""

import dataclasses
import functools
import importlib.util
import sys

import pytest
import torch

from rl.model.decoder import DecoderModel, split_qkv
from rl.model.kernels.attention import paged_attention_reference, paged_prefill_reference
from rl.model.kernels.rms_norm import rms_norm_reference
from rl.model.kernels.silu import gelu_mul_reference
from rl.rollout import SamplingParams
from rl.rollout.native import NativeEngine
from rl.rollout.stop_text import StopText
from tests.test_engine import PROMPTS, full_weights
from tests.test_families import gemma3_config, qwen3_config, random_model
from tests.tiny import tiny_config, tiny_model


def interpreted_triton() -> bool:
    """Triton imported for its interpreter (tests/conftest.py does it on a machine without a GPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


ON_GPU = torch.cuda.is_available()
if ON_GPU:
    DEVICE = torch.device("cuda")
elif interpreted_triton():
    DEVICE = torch.device("cpu")
else:
    pytest.skip("needs a CUDA device, or Triton imported for its interpreter (tests/conftest.py)",
                allow_module_level=True)

needs_cuda = pytest.mark.skipif(not ON_GPU, reason="runs the whole engine on a CUDA device")
# Kernels whose products go through tl.dot: their bfloat16 cases need a GPU.
DOT_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ON_GPU, reason="Triton's interpreter multiplies bfloat16 tiles wrongly in tl.dot"))]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """On the CPU, TRITON_INTERPRET=1 while this module's tests run (the interpreter reads it as it
    goes, not only at import), and not after: the rest of the session runs without it."""
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@functools.cache
def kernel_module(name: str):
    """The module of Triton kernels `name`; on the CPU a private copy, imported under the interpreter (Triton
    picks compiled or interpreted when `@triton.jit` decorates a function) whatever imported it before, with
    private copies of the rl.model.kernels modules it imports (a kernel calls another module's jitted helpers)."""
    if ON_GPU:
        return importlib.import_module(name)
    package = importlib.import_module("rl.model.kernels")
    shared = {n: m for n, m in sys.modules.items() if n.startswith("rl.model.kernels.")}
    attributes = dict(vars(package))
    for n in shared:
        del sys.modules[n]
    try:
        return importlib.import_module(name)
    finally:  # the session's modules back in place, the copies held only by the returned module
        for n in [n for n in sys.modules if n.startswith("rl.model.kernels.")]:
            del sys.modules[n]
        sys.modules.update(shared)
        for n in set(vars(package)) - set(attributes):
            delattr(package, n)
        vars(package).update(attributes)


def kernels(op: str):
    """The Triton kernels of one operation, rl/model/kernels/<op>_triton.py."""
    return kernel_module(f"rl.model.kernels.{op}_triton")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits on a GPU. The interpreter multiplies tiles with numpy, whose rounding moves with
    a row's place in the tile, so there it is float32 rounding."""
    return torch.equal(a, b) if ON_GPU else torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def reference_model(dtype, **overrides) -> DecoderModel:
    """The torch definitions: a DecoderModel forced onto its unfused path."""
    model = DecoderModel(tiny_config(**overrides), DEVICE, dtype, max_positions=256)
    model.fused = False
    return model


def family_model(family: str, seed: int, layers: int = 2) -> torch.nn.Module:
    """The tiny Qwen2 model (tied or not), tests/test_families.py's tiny Qwen3 (QK-norm) or Gemma 3 (sliding
    windows, sandwich norms, GeGLU), or tests/test_qwen35_engine.py's tiny Qwen3.5 (linear attention), float32."""
    if family == "qwen3":
        return random_model(qwen3_config(layers=layers), seed=seed)
    if family == "gemma3":
        return random_model(gemma3_config(layers=max(layers, 3)), seed=seed)
    if family == "qwen35":  # three Gated DeltaNet layers and a gated full-attention one
        from tests.test_qwen35_engine import gated_model

        return gated_model(seed)
    return tiny_model(seed=seed, tie=family == "qwen2_tied", layers=layers).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("plus_one", [False, True])  # Gemma's (1 + w) scale
def test_add_rms_norm(dtype, with_residual, plus_one):
    model = reference_model(dtype)
    x = torch.randn(37, 128, device=DEVICE, dtype=dtype)
    res = torch.randn(37, 128, device=DEVICE, dtype=dtype) if with_residual else None
    w = torch.randn(128, device=DEVICE, dtype=dtype)
    want = rms_norm_reference(x if res is None else x + res, w, model.shape.rms_norm_eps, plus_one)
    want_res = x if res is None else x + res
    got, got_res = kernels("rms_norm").add_rms_norm(x, None if res is None else res.clone(), w,
                                                    model.shape.rms_norm_eps, plus_one)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got_res, want_res) < tol and rel_err(got, want) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 4])
def test_add_rms_norm_reduces_partial_sums(dtype, parts):
    """Float32 partial sums of a split-K GEMM: summed in order, rounded once, then added and normed."""
    model = reference_model(dtype)
    partials = torch.randn(parts, 37, 128, device=DEVICE)
    res = torch.randn(37, 128, device=DEVICE, dtype=dtype)
    w = torch.randn(128, device=DEVICE, dtype=dtype)
    x = partials[0]
    for p in partials[1:]:
        x = x + p
    want, want_res = model.add_rms_norm(x.to(dtype), res, w)
    got, got_res = kernels("rms_norm").add_rms_norm(partials, res.clone(), w, model.shape.rms_norm_eps)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and rel_err(got_res, want_res) < tol and rel_err(got, want) < tol
    if DEVICE.type == "cuda":  # (the interpreter rounds to bfloat16 its own way)
        assert torch.equal(got_res, want_res)


@needs_cuda
@pytest.mark.parametrize("parts", [2, 4])
def test_linear_split_k(parts):
    x = torch.randn(64, 2 * 4864, device=DEVICE, dtype=torch.bfloat16)[:, ::2]  # any strided view
    w = torch.randn(896, 4864, device=DEVICE, dtype=torch.bfloat16)
    partials = kernels("linear").linear_split_k(x, w, parts)
    assert partials.shape == (parts, 64, 896) and partials.dtype == torch.float32
    want = x.float() @ w.float().T
    assert rel_err(partials.sum(0), want) < 1e-5
    assert rel_err(kernels("linear").linear_split_k(x.T.contiguous().T, w, parts).sum(0), want) < 1e-5  # column-major x


def head_norms(model: DecoderModel, qk_norm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Random QK-norm weights of q and k heads (Qwen3's), or None."""
    d = model.shape.head_dim
    return tuple(torch.rand(d, device=DEVICE).add(0.5).to(model.dtype) for _ in "qk") if qk_norm else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True, "plus_one"])  # none, Qwen3's, Gemma's
def test_rope_and_store(dtype, qk_norm):
    model = reference_model(dtype)
    norms = head_norms(model, bool(qk_norm))
    plus_one = qk_norm == "plus_one"
    model.shape = dataclasses.replace(model.shape, norm_plus_one=plus_one)
    s = model.shape
    tokens, slots_total = 23, 64
    qkv = torch.randn(tokens, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 200, (tokens,), device=DEVICE)
    slots = torch.randperm(slots_total, device=DEVICE)[:tokens]
    cache = torch.randn(2, slots_total, s.num_kv_heads, s.head_dim, device=DEVICE, dtype=dtype)
    caches = [cache, cache.clone()]
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    model.rope_and_store(want_qkv, positions, slots, caches[0][0], caches[0][1], qk_norm=norms)
    kernels("rope").rope_and_store(got_qkv, positions, slots, *model.layer_tables[0], caches[1][0], caches[1][1],
                                   s.num_heads, s.num_kv_heads, s.head_dim,
                                   qk_norm=(*norms, s.rms_norm_eps) if norms else None, plus_one=plus_one)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got_qkv, want_qkv) < tol
    assert rel_err(caches[1], caches[0]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_store_from_partial_sums(dtype, with_bias, qk_norm):
    """Split-K partial sums of the qkv projection: summed with the bias and rounded once, then the
    same rotation and cache writes as from the rounded projection; q comes back as a new tensor."""
    model = reference_model(dtype)
    s = model.shape
    norms = head_norms(model, qk_norm)
    norms = (*norms, s.rms_norm_eps) if norms else None
    tokens, width = 23, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    partials = torch.randn(2, tokens, width, device=DEVICE)
    bias = torch.randn(width, device=DEVICE, dtype=dtype) if with_bias else None
    qkv = (partials[0] + partials[1] + (0 if bias is None else bias.float())).to(dtype)
    positions = torch.randint(0, 200, (tokens,), device=DEVICE)
    slots = torch.randperm(64, device=DEVICE)[:tokens]
    caches = [torch.zeros(2, 64, s.num_kv_heads, s.head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    args = model.layer_tables[0]
    want_q = kernels("rope").rope_and_store(qkv, positions, slots, *args, caches[0][0], caches[0][1], s.num_heads,
                                            s.num_kv_heads, s.head_dim, qk_norm=norms)
    got_q = kernels("rope").rope_and_store(partials, positions, slots, *args, caches[1][0], caches[1][1], s.num_heads,
                                           s.num_kv_heads, s.head_dim, bias=bias, qk_norm=norms)
    assert got_q.shape == (tokens, s.num_heads * s.head_dim) and got_q.dtype == dtype
    if dtype == torch.float32 or DEVICE.type == "cuda":  # (the interpreter rounds to bfloat16 its own way)
        assert torch.equal(got_q, want_q) and torch.equal(caches[1], caches[0])
    assert rel_err(got_q, want_q) < 1e-2 and rel_err(caches[1], caches[0]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_rounds_as_rope_and_store(dtype, qk_norm):
    """The trainer's RoPE kernel (batch-invariant mode) gives the bits the engine's fused RoPE + cache
    write gives, for q and for k (each head normalised first with QK-norm)."""
    model = reference_model(dtype)
    s = model.shape
    norms = head_norms(model, qk_norm)
    tokens = 50
    qkv = torch.randn(tokens, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 200, (tokens,), device=DEVICE)
    cache = torch.zeros(2, tokens, s.num_kv_heads, s.head_dim, device=DEVICE, dtype=dtype)
    q, k, _ = (t.clone() for t in split_qkv(qkv, s))
    kernels("rope").rope_and_store(qkv, positions, torch.arange(tokens, device=DEVICE), *model.layer_tables[0],
                                   cache[0], cache[1], s.num_heads, s.num_kv_heads, s.head_dim,
                                   qk_norm=(*norms, s.rms_norm_eps) if norms else None)
    cos, sin = (t[positions] for t in model.layer_tables[0])
    q_norm, k_norm = ((w, s.rms_norm_eps) for w in norms) if norms else (None, None)
    assert torch.equal(kernels("rope").rope_rounded(q, cos, sin, q_norm), split_qkv(qkv, s)[0])
    assert torch.equal(kernels("rope").rope_rounded(k, cos, sin, k_norm), cache[0])


def test_silu_mul():
    gate_up = torch.randn(9, 2 * 1500, device=DEVICE, dtype=torch.bfloat16)
    want = torch.nn.functional.silu(gate_up[:, :1500]) * gate_up[:, 1500:]
    assert rel_err(kernels("silu").silu_mul(gate_up), want) < 1e-2
    transposed = kernels("silu").silu_mul(gate_up.T.contiguous(), transposed=True)  # (2I, T) in, (I, T) out
    assert transposed.shape == (1500, 9) and torch.equal(transposed.T, kernels("silu").silu_mul(gate_up))
    gelu = kernels("silu").silu_mul(gate_up, gelu=True)  # Gemma's GeGLU
    assert rel_err(gelu, gelu_mul_reference(gate_up[:, :1500], gate_up[:, 1500:])) < 1e-2
    assert rel_err(gelu, want) > 0.05  # not SiLU's
    assert torch.equal(kernels("silu").silu_mul(gate_up.T.contiguous(), transposed=True, gelu=True).T, gelu)


HEAD_SHAPES = [(14, 2, 64), (12, 2, 128), (4, 4, 64)]  # (heads, kv_heads, head_dim)
NUM_SPLITS = [1, 3, 8]
PAGES = [(16, 32), (64, 32), (64, 64)]  # (page, block_n): blocks across pages, inside one page
# The whole grid on a GPU; under the interpreter (seconds a case) a Latin square of it: every value of
# each axis, and every pair of values of two axes, once.
DECODE_GRID = [(*shape, splits, *page) for i, shape in enumerate(HEAD_SHAPES) for j, splits in enumerate(NUM_SPLITS)
               for k, page in enumerate(PAGES) if ON_GPU or k == (i + j) % len(PAGES)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,num_splits,page,block_n", DECODE_GRID)
def test_decode_attention(dtype, heads, kv_heads, head_dim, num_splits, page, block_n):
    pages_total, batch = 40, 5
    k_cache = torch.randn(pages_total * page, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    context_lens = torch.tensor([1, 17, 64, 100, 150], dtype=torch.int32, device=DEVICE)
    block_tables = torch.stack([torch.randperm(pages_total, device=DEVICE)[:10] for _ in range(batch)]).int()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(batch, heads, head_dim)  # strided like the engine's view
    want = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, page)
    got = kernels("attention").decode_attention(q, k_cache, v_cache, block_tables, context_lens, page, head_dim ** -0.5,
                                                num_splits, block_n=block_n)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("window", [5, 40])
def test_decode_attention_in_a_sliding_window(dtype, window):
    """Each row sees its context's last `window` keys (contexts shorter and longer than it), across pages and
    splits, with its own scale; in fixed splits too, where splits before the window weigh nothing."""
    heads, kv_heads, head_dim, page = 4, 2, 64, 16
    k_cache = torch.randn(40 * page, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    context_lens = torch.tensor([1, 17, 64, 100, 150], dtype=torch.int32, device=DEVICE)
    block_tables = torch.stack([torch.randperm(40, device=DEVICE)[:10] for _ in range(5)]).int()
    q = torch.randn(5, heads, head_dim, device=DEVICE, dtype=dtype)
    want = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, page, 0.3, window)
    attention = kernels("attention")
    got = attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, page, 0.3, 3, block_n=32,
                                     window=window)
    fixed = attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, page, 0.3, 3, block_n=32,
                                       split_tokens=64, window=window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) < tol and rel_err(fixed, want) < tol
    assert rel_err(paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, page, 0.3), want) > 0.1


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_fixed_split_attention_does_not_depend_on_the_launch(dtype):
    """Fixed-length splits: a row's output is the same bits with any number of (empty) extra splits,
    in any batch, and matches the reference."""
    heads, kv_heads, head_dim, page = 14, 2, 64, 64
    k_cache = torch.randn(40 * page, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    context_lens = torch.tensor([1, 64, 65, 200, 700, 1000], dtype=torch.int32, device=DEVICE)
    block_tables = torch.stack([torch.randperm(40, device=DEVICE)[:16] for _ in range(6)]).int()
    q = torch.randn(6, heads, head_dim, device=DEVICE, dtype=dtype)

    def run(rows, splits):
        return kernels("attention").decode_attention(q[rows], k_cache, v_cache, block_tables[rows],
                                                     context_lens[rows], page, head_dim ** -0.5, splits,
                                                     split_tokens=128)

    full = run(slice(None), 8)
    assert torch.equal(run(slice(None), 12), full)
    assert torch.equal(run(slice(3, 5), 8), full[3:5])
    assert torch.equal(run(slice(0, 2), 1), full[:2])  # contexts within the first split
    want = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, page)
    assert rel_err(full, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page,window", [(14, 2, 64, 16, 0), (4, 4, 32, 64, 0),
                                                                 (4, 2, 32, 16, 7), (4, 2, 32, 16, 30)])
def test_prefill_attention_over_cached_tokens(dtype, heads, kv_heads, head_dim, page, window):
    """New tokens after cached ones (a continued sample, a kept turn) attend to their whole sequence through the
    block table, causally: starts inside and on page bounds, a fresh prompt (start 0), one new token, and pads;
    the pads' rows are left out."""
    starts, counts = [0, 5, 16, 40, 70], [37, 1, 20, 29, 6]
    length, pages_total = max(counts), 48
    k_cache = torch.randn(pages_total * page, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.stack([torch.randperm(pages_total - 1, device=DEVICE)[:9] + 1 for _ in starts]).int()
    starts_t = torch.tensor(starts, device=DEVICE)
    contexts = starts_t + torch.tensor(counts, device=DEVICE)
    qkv = torch.randn(len(starts) * length, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)  # strided like the engine's view
    got = kernels("attention").prefill_paged_attention(q, k_cache, v_cache, tables, starts_t, contexts, length, page,
                                                       0.2, block_m=16, block_n=16, window=window)
    want = paged_prefill_reference(q, k_cache, v_cache, tables, starts_t, contexts, length, page, 0.2, window)
    real = torch.cat([torch.arange(n * length, n * length + c) for n, c in enumerate(counts)]).to(DEVICE)
    assert got.isfinite().all()
    assert rel_err(got[real], want[real]) < (1e-5 if dtype == torch.float32 else 1e-2)


def fp8_caches(slots: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Random keys and values in e4m3 (rl/model/fp8.py) at scales that differ by head and between K and V."""
    from rl.model import fp8

    gains = torch.logspace(-2, 1, kv_heads, device=DEVICE)[:, None]
    k, v = (torch.randn(slots, kv_heads, head_dim, device=DEVICE) * gains * g for g in (1.0, 7.0))
    k_scale, v_scale = fp8.kv_scales(k), fp8.kv_scales(v)
    return fp8.quantize_kv(k, k_scale), fp8.quantize_kv(v, v_scale), k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("parts", [1, 2])
def test_rope_and_store_into_an_fp8_cache(dtype, qk_norm, parts):
    """rollout.kv_precision = "fp8": the kernel stores k and v quantized at their heads' scales as the torch path
    does (but a value that the last bits of the kernel's float32 division tip over an e4m3 rounding boundary), from
    a GEMM's result or its split-K partial sums."""
    config = tiny_config()
    config.num_key_value_heads = 2  # two heads, two scales
    model = DecoderModel(config, DEVICE, dtype, max_positions=256, kv_precision="fp8")
    model.fused = False
    norms = head_norms(model, qk_norm)
    s = model.shape
    tokens, slots_total = 23, 64
    width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    partial = torch.randn(parts, tokens, width, device=DEVICE) * torch.linspace(0.1, 5, width, device=DEVICE)
    qkv = partial.sum(0).to(dtype)
    positions = torch.randint(0, 200, (tokens,), device=DEVICE)
    slots = torch.randperm(slots_total, device=DEVICE)[:tokens]
    want = torch.zeros(2, slots_total, s.num_kv_heads, s.head_dim, device=DEVICE, dtype=torch.float8_e4m3fn)
    got = want.clone()
    want_qkv = qkv.clone()
    model.rope_and_store(want_qkv, positions, slots, want[0], want[1], qk_norm=norms)  # the first write: scales
    k_scale, v_scale = model.layer_scales(0)
    assert (k_scale != 1).all() and (v_scale != 1).all()
    q = kernels("rope").rope_and_store(qkv.clone() if parts == 1 else partial, positions, slots,
                                       *model.layer_tables[0], got[0], got[1], s.num_heads, s.num_kv_heads, s.head_dim,
                                       qk_norm=(*norms, s.rms_norm_eps) if norms else None, k_scale=k_scale,
                                       v_scale=v_scale, dtype=dtype)
    assert q.dtype == dtype
    assert rel_err(q, want_qkv[:, : s.num_heads * s.head_dim]) < (1e-5 if dtype == torch.float32 else 2e-2)
    got, want = got.float(), want.float()
    off = got != want
    if not ON_GPU:  # the interpreter's float32 -> e4m3 cast drops the carry of a round-up into the exponent (2 -> 1)
        off &= got != want / 2
    # Else where the kernel's x / scale (an approximate float32 division on a GPU) or, with QK-norm, its rsqrt differs
    # from the torch path's in the last bits and tips a value over an e4m3 rounding boundary: one step apart. The
    # rotation rounds as the torch path's does (rope_triton.ROUNDED_OPTIONS): a fused multiply-add there put bfloat16
    # keys whose rotation cancels several steps away. In bfloat16 the interpreter rounds its own way: only how often.
    if dtype == torch.float32 or ON_GPU:
        assert ((got - want).abs() <= torch.maximum(got.abs(), want.abs()) * 2**-3 + 2**-9)[off].all()
    assert off.float().mean() < (0.01 if dtype == torch.float32 else 0.05)
    assert want.abs().amax() > 100  # e4m3's range used, not its subnormals


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_decode_and_prefill_attention_over_an_fp8_cache(dtype, window):
    """The kernels dequantize e4m3 keys and values by their heads' scales as the torch references do."""
    heads, kv_heads, head_dim, page, pages_total = 4, 2, 32, 16, 40
    k_cache, v_cache, k_scale, v_scale = fp8_caches(pages_total * page, kv_heads, head_dim)
    attention = kernels("attention")
    context_lens = torch.tensor([1, 17, 64, 100, 150], dtype=torch.int32, device=DEVICE)
    block_tables = torch.stack([torch.randperm(pages_total, device=DEVICE)[:10] for _ in range(5)]).int()
    q = torch.randn(5, heads, head_dim, device=DEVICE, dtype=dtype)
    want = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, page, 0.3, window, k_scale,
                                     v_scale)
    got = attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, page, 0.3, 3, block_n=32,
                                     window=window, k_scale=k_scale, v_scale=v_scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) < tol
    starts, counts = [0, 5, 16, 40], [37, 1, 20, 29]
    length = max(counts)
    tables = torch.stack([torch.randperm(pages_total - 1, device=DEVICE)[:9] + 1 for _ in starts]).int()
    starts_t = torch.tensor(starts, device=DEVICE)
    contexts = starts_t + torch.tensor(counts, device=DEVICE)
    q = torch.randn(len(starts) * length, heads, head_dim, device=DEVICE, dtype=dtype)
    got = attention.prefill_paged_attention(q, k_cache, v_cache, tables, starts_t, contexts, length, page, 0.2,
                                            block_m=16, block_n=16, window=window, k_scale=k_scale, v_scale=v_scale)
    want = paged_prefill_reference(q, k_cache, v_cache, tables, starts_t, contexts, length, page, 0.2, window,
                                   k_scale, v_scale)
    real = torch.cat([torch.arange(n * length, n * length + c) for n, c in enumerate(counts)]).to(DEVICE)
    assert rel_err(got[real], want[real]) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_dim,value_dim", [(128, 128), (16, 40)])
def test_delta_rule_step_kernel_is_the_torch_step_on_live_rows(dtype, key_dim, value_dim):
    """The linear-attention decode step's kernel against `gated_delta_step` (the engine's CPU step): each row's
    output, the new state of a live row, a finished row's state left as it was; the state a view of one layer in
    the engine's rows (N, linear layers, H, K, V), the other layer untouched; value blocks cut short at 40."""
    from rl.model.linear_attention import gated_delta_step

    gen = torch.Generator().manual_seed(0)
    n, heads = 5, 3
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, key_dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, heads, value_dim, generator=gen).to(dtype)
    g = -torch.rand(n, heads, generator=gen) * 2  # the log decay, <= 0
    beta = torch.rand(n, heads, generator=gen).to(dtype)
    rows = torch.randn(n, 2, heads, key_dim, value_dim, generator=gen)
    live = torch.tensor([True, False, True, True, False])
    want_out, want_state = gated_delta_step(q, k, v, g, beta, rows[:, 1])
    before = rows.to(DEVICE)
    rows = before.clone()
    out = kernels("delta_rule").gated_delta_step_(*(x.to(DEVICE) for x in (q, k, v, g, beta)), rows[:, 1],
                                                  live.to(DEVICE))
    assert out.dtype == dtype and out.shape == want_out.shape
    assert torch.allclose(out.cpu().float(), want_out.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.allclose(rows[live, 1].cpu(), want_state[live], rtol=1e-5, atol=1e-5)
    assert torch.equal(rows[~live, 1], before[~live, 1])
    assert torch.equal(rows[:, 0], before[:, 0])
    assert not torch.allclose(rows[live, 1], before[live, 1])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_linear_is_batch_invariant(dtype):
    """A row's output does not depend on how many rows share the call or where it sits, nor a
    column's on how many weight rows are computed with it (fused q/k/v against separate)."""
    x = torch.randn(700, 192, device=DEVICE, dtype=dtype)
    w = torch.randn(300, 192, device=DEVICE, dtype=dtype) / 14
    b = torch.randn(300, device=DEVICE, dtype=dtype)
    full = kernels("linear").linear(x, w, b)
    for rows in (slice(0, 1), slice(0, 7), slice(0, 64), slice(100, 356), slice(333, 700)):
        assert same(kernels("linear").linear(x[rows], w, b), full[rows])
    assert same(kernels("linear").linear(x, w[100:228], b[100:228]), full[:, 100:228])
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert rel_err(full, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(kernels("linear").linear(x, w), want - b.float()) < (1e-5 if dtype == torch.float32 else 1e-2)


# Draws per sampler test: the interpreter draws a few rows a second; the frequency bounds widen to match.
SAMPLER_ROWS = 4096 if ON_GPU else 256


def test_sampler_matches_softmax_and_logprobs():
    torch.manual_seed(0)
    rows, vocab = SAMPLER_ROWS, 37
    logits = torch.randn(1, vocab, device=DEVICE).mul(2).expand(rows, vocab).contiguous().to(torch.bfloat16)
    inv_t = torch.full((1,), 1 / 0.7, device=DEVICE)
    seed = torch.zeros(1, dtype=torch.long, device=DEVICE)
    tokens, logprobs = kernels("sampling").sample(logits, inv_t, seed)
    full = torch.log_softmax(logits.float() / 0.7, -1)
    assert torch.allclose(logprobs, full.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    assert (freq - full[0].exp()).abs().max().item() < 0.03 * (4096 / rows) ** 0.5  # ~4 sigma
    assert seed.item() == 1
    again, _ = kernels("sampling").sample(logits, inv_t, seed)
    assert not torch.equal(again, tokens)  # the bumped seed draws new noise


def test_sampler_over_slices_never_picks_masked_tokens():
    """A wide vocabulary spans every slice; the mass sits in a few tokens far apart (first slice, a
    middle one, the very last token) and everything else is -inf, as after a top-k cut."""
    rows, vocab = SAMPLER_ROWS // 2, 5003
    live = torch.tensor([2, 1900, 3100, vocab - 1])
    row = torch.full((vocab,), float("-inf"))
    row[live] = torch.tensor([0.5, -0.3, 1.0, 0.0])
    logits = row.expand(rows, vocab).contiguous().to(DEVICE)
    seed = torch.full((1,), 7, dtype=torch.long, device=DEVICE)
    tokens, logprobs = kernels("sampling").sample(logits, torch.ones(1, device=DEVICE), seed)
    assert torch.isin(tokens.cpu(), live).all()
    want = torch.log_softmax(row[live], -1)
    got = torch.bincount(tokens.cpu(), minlength=vocab)[live].float() / rows
    assert (got - want.exp()).abs().max().item() < 0.045 * (2048 / rows) ** 0.5  # ~4 sigma
    assert torch.allclose(logprobs.cpu(), torch.log_softmax(row, -1)[tokens.cpu()], atol=1e-5)


@pytest.mark.parametrize("with_text,unused_stops", [(False, 0), (True, 0), (False, 298)],
                         ids=["ids", "ids+text", "300 ids"])
def test_advance_matches_torch_bookkeeping(with_text, unused_stops):
    """The fused end-of-step kernel against the engine's torch bookkeeping on the same random state, with a stop
    text's automaton (rl/rollout/stop_text.py) or without, and with the ids that fire last of 300."""
    import copy
    from types import SimpleNamespace

    from rl.rollout.native import NativeEngine, Rows

    gen = torch.Generator().manual_seed(0)
    rows, pages, width, page = 37, 6, 20, 8
    state = Rows.allocate(rows, pages, width, DEVICE)
    state.done.copy_(torch.rand(rows, generator=gen) < 0.3)
    state.n_gen.copy_(torch.randint(0, width - 2, (rows,), generator=gen))
    state.positions.copy_(torch.randint(0, pages * page - 1, (rows,), generator=gen))
    state.context_lens.copy_(state.positions.int() + 1)
    state.block_tables.copy_(torch.randperm(rows * pages, generator=gen).view(rows, pages).int())
    state.input_ids.copy_(torch.randint(0, 50, (rows,), generator=gen))
    state.stop_ids[: unused_stops + 2] = torch.tensor([*range(100, 100 + unused_stops), 3, 7])  # tokens are < 10
    state.max_new_tokens.fill_(12)
    tokens = torch.randint(0, 10, (rows,), generator=gen).to(DEVICE)
    logprobs = torch.randn(rows, generator=gen).to(DEVICE)
    table = None
    if with_text:  # token t spells "ab"[t % 2] (t < 8), "ba" ends a row; rows start in either state, or ended
        table = StopText.build(["ba"], ["a", "b"] * 4).table(12, DEVICE)
        state.stop_state.copy_(torch.randint(-1, 2, (rows,), generator=gen).int())
        state.stop_state[state.stop_state == -1] *= state.done[state.stop_state == -1].int()  # only done rows
    bucket = 32
    want, before = copy.deepcopy(state), copy.deepcopy(state)
    NativeEngine._advance(SimpleNamespace(rows=want, on_gpu=False, page_size=page, stop_table=table),
                          bucket, tokens[:bucket], logprobs[:bucket])
    kernels("advance").advance(tokens[:bucket], logprobs[:bucket], state.done[:bucket], state.n_gen[:bucket],
                               state.out_tokens[:bucket], state.out_logprobs[:bucket], state.input_ids[:bucket],
                               state.positions[:bucket], state.context_lens[:bucket], state.slots[:bucket],
                               state.block_tables[:bucket], state.stop_ids, state.max_new_tokens, page,
                               state.stop_state[:bucket], table)
    for name in ("done", "n_gen", "out_tokens", "out_logprobs", "input_ids", "positions", "context_lens", "slots",
                 "stop_state"):
        assert torch.equal(getattr(state, name), getattr(want, name)), name
    assert (want.done[:bucket] & ~before.done[:bucket]).any()  # the stop rules fired on some rows
    if with_text:  # and the text's did on some that no stop id or length ended
        by_text = (want.stop_state[:bucket] == -1) & ~before.done[:bucket]
        assert (by_text & (tokens[:bucket] != 3) & (tokens[:bucket] != 7) & (want.n_gen[:bucket] < 12)).any()


GROUPED = [p for p in PROMPTS + [list(range(3, 40)), list(range(7, 27))] for _ in range(3)]  # samples adjacent


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_the_engines_kernels_run_each_family_as_its_torch_forward(family):
    """The engine on its Triton kernels (batch-invariant mode: every op a kernel, on the CPU through the
    interpreter) samples what its torch forward samples, with the same logprobs: QK-norm in the RoPE kernel,
    Gemma's (1 + w) norms, GeGLU, windows and attention scale in prefill and decode."""
    model = family_model(family, seed=4)
    prompts = [list(range(1, 30)), [3, 4, 5]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1)
    outs = []
    for invariant in (False, True):
        engine = NativeEngine(model.config, DEVICE if invariant else torch.device("cpu"), torch.float32,
                              max_batch_size=2, page_size=8, max_context_len=64, batch_invariant=invariant)
        engine.load_weights(full_weights(model))
        outs.append(engine.generate(prompts, params))
    for want, got in zip(*outs):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "qwen3", "gemma3", "qwen35"])
def test_cuda_engine_matches_cpu_engine(family):
    model = family_model(family, seed=3)
    cpu = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=5, page_size=8)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1)
    cpu.load_weights(full_weights(model))
    want = cpu.generate(GROUPED, params)
    for graphs in (False, True):
        gpu = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=5, page_size=8, cuda_graphs=graphs,
                           steps_per_poll=4)
        gpu.load_weights(full_weights(model))
        for _ in range(2):  # the second call replays the graphs the first captured
            outs = gpu.generate(GROUPED, params)
            assert [o.token_ids for o in outs] == [o.token_ids for o in want]
            got, ref = torch.tensor([o.logprobs for o in outs]), torch.tensor([o.logprobs for o in want])
            assert (got - ref).abs().max().item() < 1e-4
        assert bool(gpu.graphs) == graphs


@needs_cuda
def test_cuda_engine_stops_at_text_as_the_cpu_engine():
    """Rows ended by stop text on the GPU (the automaton advanced in the fused step, inside graphs) are the CPU
    engine's, and some end before max_new_tokens. Token t spells "abcde"[t % 5]; "ab" and "dd" end a row."""
    model = tiny_model(seed=3).eval()
    stop = StopText.build(["ab", "dd"], ["abcde"[t % 5] for t in range(model.config.vocab_size)])
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, stop_text=stop)
    cpu = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=5, page_size=8)
    cpu.load_weights(full_weights(model))
    want = cpu.generate(GROUPED, params)
    assert any(o.finish_reason == "stop" for o in want)
    gpu = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=5, page_size=8, steps_per_poll=4)
    gpu.load_weights(full_weights(model))
    for _ in range(2):  # the second call replays the graphs the first captured
        outs = gpu.generate(GROUPED, params)
        assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in want]


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "qwen35"])
def test_cuda_engine_continues_kept_sequences_as_the_cpu_engine_prefills_them(family):
    """Turns continued from kept KV (and a Qwen3.5 model's kept linear-attention states) on the GPU (the prefill
    reads the kept prefix back from its pages, decode steps replay graphs) sample the CPU engine's tokens, with its
    logprobs, when it prefills every turn whole."""
    from tests.test_native_engine import episode_turns

    model = family_model(family, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1)
    cpu = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=5, page_size=8)
    cpu.load_weights(full_weights(model))
    want = episode_turns(cpu, params, keep=False, prompts=GROUPED)
    gpu = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=5, page_size=8, steps_per_poll=4)
    gpu.load_weights(full_weights(model))
    got = episode_turns(gpu, params, keep=True, prompts=GROUPED)
    for turn_want, turn_got in zip(want, got):
        assert [o.token_ids for o in turn_got] == [o.token_ids for o in turn_want]
        got_lp, want_lp = (torch.tensor([x for out in outs for x in out.logprobs]) for outs in (turn_got, turn_want))
        assert (got_lp - want_lp).abs().max().item() < 1e-4
    assert all(o.reused_tokens > 0 for o in got[1])


@needs_cuda
def test_cuda_engine_continues_samples_over_their_shared_prompt_pages(monkeypatch):
    """Samples of one prompt continued together (a partial rollout's) on the GPU: the prompt's full pages prefilled
    once and shared, each sample's rest prefilled over them; their tokens score as the HF forward scores them."""
    from rl.rollout import scheduler
    from tests.test_engine import reference_logprobs

    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 8)

    model = tiny_model(seed=3).eval()
    engine = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=8, page_size=8, steps_per_poll=4)
    engine.load_weights(full_weights(model))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    prompt = list(range(3, 27))  # 24 tokens: three full pages
    cuts = [1, 4, 9, 11]
    firsts = engine.generate([prompt] * len(cuts), params)
    sequences = [prompt + first.token_ids[:cut] for first, cut in zip(firsts, cuts)]
    rest = engine.generate(sequences, params, prior=cuts)
    for sequence, out, cut in zip(sequences, rest, cuts):
        assert len(out.token_ids) == 12 - cut
        assert out.logprobs == pytest.approx(reference_logprobs(model, sequence, out.token_ids), abs=1e-4)


@needs_cuda
def test_cuda_engine_top_p_top_k_in_graphs():
    model = tiny_model(seed=4).eval()
    engine = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=4, page_size=8)
    engine.load_weights(full_weights(model))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.8, top_k=20))
    ids = torch.tensor([PROMPTS[0] + outs[0].token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPTS[0]) - 1 : -1].float() / 0.9
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(outs[0].token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(outs[0].logprobs), want, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_batch_invariant_engine_and_trainer_forward_agree_bit_for_bit(family):
    """bf16 on the GPU: the engine in batch-invariant mode (CUDA graphs, decode batches that shrink
    as rows finish, contexts past one 512-token split) against the trainer's patched forward of the
    same sequences in one right-padded batch. The network's bits agree; what is left is the float32
    order of the two log-softmaxes (the default engine is ~1e-2 away from the HF bf16 forward)."""
    import copy

    from rl.model.invariant import make_batch_invariant

    hf = family_model(family, seed=3, layers=4).to(DEVICE, torch.bfloat16).eval()
    engine = NativeEngine(hf.config, DEVICE, torch.bfloat16, max_batch_size=16, seed=0, max_context_len=1024,
                          batch_invariant=True)
    engine.load_weights(full_weights(hf))
    torch.manual_seed(0)
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (600, 70, 5, 530)]
    seqs = [p for p in prompts for _ in range(4)]
    outs = engine.generate(seqs, SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=[7]))
    patched = make_batch_invariant(copy.deepcopy(hf), 1024)
    width = max(len(p) + len(o.token_ids) for p, o in zip(seqs, outs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=DEVICE)
    for i, (p, o) in enumerate(zip(seqs, outs)):
        ids[i, : len(p) + len(o.token_ids)] = torch.tensor(p + list(o.token_ids))
    with torch.no_grad():
        logp = torch.log_softmax(patched(input_ids=ids).logits.float(), -1)
    gaps = []
    for i, (p, o) in enumerate(zip(seqs, outs)):
        target = torch.tensor(o.token_ids, device=DEVICE)
        got = logp[i, len(p) - 1 : len(p) - 1 + len(target)].gather(-1, target[:, None]).squeeze(-1)
        gaps.append((got - torch.tensor(o.logprobs, device=DEVICE)).abs().max().item())
    assert max(gaps) < 1e-4, gaps


def mapped(buffer) -> list[bool]:
    """Whether the driver has memory behind the first and the last byte of a StableBuffer's addresses."""
    from rl.rollout import vmem

    return [vmem.is_mapped(buffer.address.value + offset) for offset in (0, buffer.nbytes - 1)]


@needs_cuda
@pytest.mark.whole_gpu  # the driver's free memory: alone on the GPU (tests/conftest.py)
def test_stable_buffer_keeps_its_address_across_unmap():
    from rl.rollout import vmem

    if not vmem.supported(DEVICE):
        pytest.skip("the CUDA driver offers no virtual memory management")
    buf = vmem.StableBuffer(3 << 20, DEVICE)
    buf.map()
    x = buf.view(1024, (4, 8), torch.float32)
    x.fill_(2.0)
    address = x.data_ptr()
    assert mapped(buf) == [True, True]
    free_mapped = torch.cuda.mem_get_info()[0]
    buf.unmap()
    assert torch.cuda.mem_get_info()[0] - free_mapped >= buf.nbytes  # the memory went back to the driver
    assert mapped(buf) == [False, False]
    buf.map()
    y = buf.view(1024, (4, 8), torch.float32)
    assert y.data_ptr() == address
    y.fill_(3.0)
    assert y.sum().item() == 96.0
    with pytest.raises(ValueError, match="outside"):
        buf.view(buf.nbytes - 4, (2,), torch.float32)
    buf.close()


def stable_engine(model) -> tuple[NativeEngine, SamplingParams, list[list[int]]]:
    """A small engine whose memory keeps its addresses across sleep (skips where the driver cannot), loaded with
    `model`, and its greedy answers to PROMPTS."""
    engine = NativeEngine(model.config, DEVICE, torch.float32, max_batch_size=4, page_size=8, steps_per_poll=4)
    if not engine.stable:
        pytest.skip("the CUDA driver offers no virtual memory management")
    engine.load_weights(full_weights(model))
    greedy = SamplingParams(max_new_tokens=12, top_k=1)
    return engine, greedy, [o.token_ids for o in engine.generate(PROMPTS, greedy)]


@needs_cuda
@pytest.mark.whole_gpu  # the driver's free memory: alone on the GPU (tests/conftest.py)
@pytest.mark.parametrize("family", ["qwen2", "qwen35"])
def test_sleep_keeps_decode_graphs_and_frees_memory(family):
    """At either level the engine's weights and KV cache go back to the driver: their addresses have no memory
    behind them (the driver's word for this process) and the device's free memory grows by both buffers. A
    Qwen3.5 model's rows keep their linear-attention states in the KV buffer, so those go back too, and its greedy
    answers after each wake-up (the states zeroed again) are those before."""
    model = family_model(family, seed=5)
    engine, greedy, want = stable_engine(model)
    graphs = dict(engine.graphs)
    assert graphs
    buffers = (engine.weight_buffer, engine.kv_buffer)
    for state in engine.rows.linear_states():
        assert engine.kv_buffer.address.value <= state.data_ptr() < engine.kv_buffer.address.value + \
            engine.kv_buffer.nbytes
    assert bool(engine.rows.linear_states()) == (family == "qwen35")
    held = sum(b.nbytes for b in buffers)
    for level in (1, 2):
        assert [mapped(b) for b in buffers] == [[True, True]] * 2
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep(level)
        assert [mapped(b) for b in buffers] == [[False, False]] * 2
        assert torch.cuda.mem_get_info()[0] - free_awake >= held
        engine.wake_up(["weights"])
        if level == 2:
            engine.load_weights(full_weights(model))
        engine.wake_up(["kv_cache"])
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want
        assert all(engine.graphs[key] is graph for key, graph in graphs.items())  # replayed, not re-captured
    engine.close()


@needs_cuda
@pytest.mark.whole_gpu  # takes all but 512 MiB of the driver's free memory: alone on the GPU (tests/conftest.py)
def test_a_wake_up_keeps_the_trainers_cached_blocks_unless_the_engine_needs_them():
    """The engine maps its memory outside PyTorch's allocator: a wake-up returns PyTorch's cached blocks (what a
    train phase used and freed) to the driver only when the free memory would not hold the mapping."""
    model = tiny_model(seed=5).eval()
    engine, greedy, want = stable_engine(model)

    def train_phase(nbytes: int) -> int:  # what a train phase leaves behind: a freed block, cached
        engine.sleep(2)
        torch.cuda.synchronize()
        del_me = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        del del_me
        return torch.cuda.memory_reserved()

    def wake() -> None:
        engine.wake_up(["weights"])
        engine.load_weights(full_weights(model))
        engine.wake_up(["kv_cache"])
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want

    reserved = train_phase(1 << 30)
    wake()
    assert torch.cuda.memory_reserved() >= reserved  # room enough: the block stays for the next train phase
    reserved = train_phase(torch.cuda.mem_get_info()[0] - (512 << 20))  # leaves less free than the mapping + 1 GiB
    wake()
    assert torch.cuda.memory_reserved() < reserved - (1 << 30)  # no room: the cached blocks went back first
    engine.close()


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_decode_graphs_replay_the_eager_steps(family):
    """bf16 on the GPU, where the experts run as torch's grouped GEMM: decode steps captured in CUDA graphs (and
    replayed by a second call) pick the eager engine's greedy tokens, with its logprobs, and record the same experts
    for every token; the routing is a graph's too (the experts' counts never reach the host)."""
    from tests.test_moe_engine import tiny_moe

    model = tiny_moe(family).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1)
    outs = {}
    for graphs in (False, True):
        engine = NativeEngine(model.config, DEVICE, torch.bfloat16, max_batch_size=5, page_size=8, cuda_graphs=graphs,
                              steps_per_poll=4)
        engine.load_weights(full_weights(model))
        outs[graphs] = [engine.generate(GROUPED, params) for _ in range(2)]
        assert bool(engine.graphs) == graphs
    for eager, captured in zip(outs[False], outs[True]):
        for a, b in zip(eager, captured):
            assert b.token_ids == a.token_ids
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-2)  # cuBLAS may choose other kernels under capture
            assert torch.equal(b.routed_experts, a.routed_experts)
