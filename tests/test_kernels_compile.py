"""The engine's Triton kernels with the model-family options (sliding windows, QK-norm, Gemma's (1 + w) norms, GeGLU)
compile for Hopper, as the engine launches them (argument types included), on a machine without a GPU: the
interpreter the other kernel tests run under does not type-check what the compiler does."""

from tests.test_logprob_kernels import compile_for_hopper

KERNELS = """
import rl.model.kernels.attention_triton as a
import rl.model.kernels.rms_norm_triton as r
import rl.model.kernels.rope_triton as p
import rl.model.kernels.silu_triton as s

decode = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
          "context_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "k_scale_ptr": "*fp32",
          "v_scale_ptr": "*fp32", "scale_log2": "fp32",
          "q_row_stride": "i32", "bt_row_stride": "i32", "num_splits": "i32", "window": "i32"}
prefill = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
           "starts_ptr": "*i64", "contexts_ptr": "*i64", "out_ptr": "*bf16", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32", "scale_log2": "fp32",
           "q_row_stride": "i32", "out_row_stride": "i32", "bt_row_stride": "i32", "length": "i32", "window": "i32"}
rope = {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64", "slot_ptr": "*i64",
        "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "q_out_ptr": "*bf16", "bias_ptr": "*bf16",
        "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
        "eps": "fp32", "row_stride": "i32", "part_stride": "i32",
        "q_out_stride": "i32"}
rounded = {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "norm_ptr": "*bf16",
           "eps": "fp32"}
norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32", "n_cols": "i32",
        "part_stride": "i32"}
silu = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "row_stride": "i32", "up_offset": "i32"}


def typed(signature, constants):
    return {**signature, **dict.fromkeys(constants, "constexpr")}


kernels = []
for split_tokens in (0, 512):
    c = {"GROUP": 4, "NUM_KV_HEADS": 1, "HEAD_DIM": 256, "PAGE": 16, "BLOCK_H": 16, "BLOCK_N": 64,
         "SPLIT_TOKENS": split_tokens, "DOT_PRECISION": "tf32", "FP8": False}
    kernels.append((a._decode_split_kernel, typed(decode, c), c))
c = {"NUM_HEADS": 4, "GROUP": 4, "NUM_KV_HEADS": 1, "HEAD_DIM": 256, "PAGE": 16, "BLOCK_M": 64, "BLOCK_N": 64,
     "DOT_PRECISION": "tf32", "FP8": False}
kernels.append((a._prefill_paged_kernel, typed(prefill, c), c))
for parts, qk_norm, plus_one in ((1, True, True), (2, True, False), (1, False, False)):
    c = {"NUM_HEADS": 4, "NUM_KV_HEADS": 1, "HEAD_DIM": 256, "BLOCK_H": 4, "BLOCK_KV": 1, "PARTS": parts,
         "HAS_BIAS": False, "QK_NORM": qk_norm, "PLUS_ONE": plus_one, "FP8": False}
    kernels.append((p._rope_store_kernel, typed(rope, c), c))
c = {"HEADS": 4, "HEAD_DIM": 256, "BLOCK_H": 4, "QK_NORM": True, "PLUS_ONE": True}
kernels.append((p._rope_rounded_kernel, typed(rounded, c), c))
for parts in (1, 2):
    c = {"HAS_RESIDUAL": parts == 1, "PARTS": parts, "BLOCK": 1024, "PLUS_ONE": True}
    kernels.append((r._add_rms_norm_kernel, typed(norm, c), c))
c = {"BLOCK": 1024, "GELU": True}
kernels.append((s._silu_mul_kernel, typed(silu, c), c))
"""


def test_the_engines_kernels_with_every_family_option_compile_for_hopper(tmp_path):
    assert compile_for_hopper(tmp_path, KERNELS) == (2 * ["_decode_split_kernel"] + ["_prefill_paged_kernel"]
                                                     + 3 * ["_rope_store_kernel"] + ["_rope_rounded_kernel"]
                                                     + 2 * ["_add_rms_norm_kernel"] + ["_silu_mul_kernel"])


ROUNDED_FUSED_MULTIPLY_ADDS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for fn, signature, constants in kernels:
    if fn in (p._rope_store_kernel, p._rope_rounded_kernel):
        signature = {name: signature[name] for name in fn.arg_names}
        for label, options in (("launched", p.ROUNDED_OPTIONS), ("fused", {"enable_fp_fusion": True})):
            ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                 target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
            print(f"{fn.__name__}:{label}:{ptx.count('fma.')}")
"""


def test_the_rounded_rope_kernels_compile_without_fused_multiply_adds(tmp_path):
    """The engine's RoPE (and the batch-invariant trainer's, which must give its bits) rounds every product and sum
    as the torch path does: with the options they are launched with, the compiler fuses none into a multiply-add.
    With fusion on (Triton's default through 3.9) the same kernels have fma.rn.bf16 in their PTX: the count sees
    them."""
    counts = [line.split(":") for line in compile_for_hopper(tmp_path, KERNELS, ROUNDED_FUSED_MULTIPLY_ADDS)]
    launched = {(name, i): int(n) for i, (name, label, n) in enumerate(counts) if label == "launched"}
    fused = [int(n) for _, label, n in counts if label == "fused"]
    assert sorted(name for name, _ in launched) == ["_rope_rounded_kernel"] + 3 * ["_rope_store_kernel"]
    assert not any(launched.values()), launched
    assert all(fused) and len(fused) == len(launched)
