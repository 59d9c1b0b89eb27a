"""FP8 KV cache (rollout.kv_precision = "fp8"): rl/model/fp8.py's KV quantization against e4m3's error bound, the
native engine with both caches in e4m3 against the fp32 forward (a dense model, and Gemma 3 with its window cache),
the memory plan's KV bytes, and the refusals. The Triton kernels' FP8 forms are checked against these torch paths in
tests/test_native_gpu.py."""

import dataclasses

import pytest
import torch

from rl.config import ConfigError
from rl.model import fp8
from rl.model.decoder import DecoderModel
from rl.rollout import SamplingParams
from rl.rollout.native import NativeEngine
from rl.rollout.vllm import engine_kwargs
from tests.test_config import make
from tests.test_engine import full_weights, reference_logprobs
from tests.test_families import gemma3_config, random_model
from tests.tiny import tiny_model

HALF_STEP = 2.0**-4  # e4m3 rounds to 3 mantissa bits: at most half a step, 2^-4 of the value
SUBNORMAL_STEP = 2.0**-10  # half of e4m3's subnormal spacing 2^-9, in units of the scale
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8], [2], list(range(3, 40))]
NEW_TOKENS = 24  # past Gemma 3's 16-token window, so the rings of the window cache wrap
V_GAIN = 16.0  # v_proj x 16, o_proj / 16: the same function, values 16 x the keys' magnitudes (see `model_with_big_v`)


def model_with_big_v(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every layer's v_proj (and bias) scaled by V_GAIN and o_proj by 1 / V_GAIN: its outputs are the
    same up to float32 rounding, but its values' scales are ~V_GAIN x its keys', so K and V scales mixed up show."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(V_GAIN)
            if attn.v_proj.bias is not None:
                attn.v_proj.bias.mul_(V_GAIN)
            attn.o_proj.weight.div_(V_GAIN)
    return model


@pytest.fixture(scope="module")
def models():
    """A tiny Qwen2 (dense, global layers) and a tiny Gemma 3 (sliding layers in the window cache), float32."""
    return {"qwen2": model_with_big_v(tiny_model(seed=1).eval()),
            "gemma3": model_with_big_v(random_model(gemma3_config(), seed=1))}


def engine_of(model, kv_precision: str) -> NativeEngine:
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0,
                          kv_precision=kv_precision)
    engine.load_weights(full_weights(model))
    return engine


# ------------------------------------------------------------------ the maths

@pytest.mark.parametrize("per_head", [True, False])
def test_kv_round_trip_is_within_e4m3_rounding_of_each_heads_scale(per_head):
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1.0, 30.0, 500.0])  # heads far apart, as a trained model's can be
    x = torch.randn(300, 4, 64, generator=g) * magnitudes[None, :, None]
    scale = fp8.kv_scales(x, per_head)
    assert scale.shape == (4,) and scale.dtype == torch.float32
    amax = x.abs().amax(dim=(0, 2))
    expected = amax if per_head else amax.max().expand(4)
    torch.testing.assert_close(scale, expected * fp8.KV_HEADROOM / fp8.E4M3_MAX)
    q = fp8.quantize_kv(x, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    back = fp8.dequantize_kv(q, scale, torch.float32)
    s = scale[:, None]
    assert ((back - x).abs() <= HALF_STEP * x.abs() + SUBNORMAL_STEP * s + 1e-6 * x.abs()).all()
    # a later value past 448 x its scale is clamped there, never NaN (e4m3fn has no infinity)
    big = fp8.dequantize_kv(fp8.quantize_kv(x * 10, scale), scale, torch.float32)
    assert torch.isfinite(big).all() and (big.abs() <= fp8.E4M3_MAX * s + 1e-6).all()


# ------------------------------------------------------------------ the engine

# Mean |logprob difference| of the FP8-KV engine's sampled tokens (24 a prompt) against the fp32 forward, measured on
# these models: 0.0031 (Qwen2; one KV head, so per-head and per-layer scales are one) and 0.055 per head / 0.050 per
# layer (Gemma 3, whose random tiny model has sharp logits); 0.0053 / 0.0056 on test_families' tiny Qwen3. The fp32-KV
# engine: ~1e-7. Greedy tokens equal to the fp32 forward's argmax on the engine's own prefix: 96% (Qwen2), 83% (Gemma
# 3; 81% per layer), 89% (Qwen3); the fp32-KV engine's: 100%.
LOGPROB_BOUND = {"qwen2": 0.01, "gemma3": 0.1}
GREEDY_AGREEMENT = 0.75


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_fp8_kv_engine_generates_near_the_fp32_forward(models, family):
    model = models[family]
    engine = engine_of(model, "fp8")
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, seed=3))
    assert engine.kv.dtype == torch.float8_e4m3fn
    if family == "gemma3":
        assert engine.window_layers and engine.kv_window.dtype == torch.float8_e4m3fn
    scales = engine.model.kv_scale
    assert engine.model.kv_scaled == set(range(model.config.num_hidden_layers))
    assert (scales[1] > 2 * scales[0]).all()  # V_GAIN: the values' scales, not the keys' (~3.5 x in Gemma 3)
    diffs = [abs(a - b) for p, o in zip(PROMPTS, outs, strict=True)
             for a, b in zip(o.logprobs, reference_logprobs(model, p, o.token_ids), strict=True)]
    assert len(diffs) == len(PROMPTS) * NEW_TOKENS
    mean = sum(diffs) / len(diffs)
    assert 1e-5 < mean < LOGPROB_BOUND[family]  # above the fp32-KV engine's ~1e-7: the cache is really FP8

    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, top_k=1))
    hits = 0
    for p, o in zip(PROMPTS, greedy, strict=True):
        with torch.no_grad():
            argmax = model(input_ids=torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1].argmax(-1)
        hits += int((argmax == torch.tensor(o.token_ids)).sum())
    assert hits >= GREEDY_AGREEMENT * len(PROMPTS) * NEW_TOKENS


def test_fp8_kv_scales_come_again_from_a_new_cache_and_kept_sequences_read_theirs(models):
    """Scales are set by each layer's first write into a new cache (after a wake-up), then fixed: a sequence kept
    across calls continues over its FP8 pages as the first call left them."""
    model = models["qwen2"]
    engine = engine_of(model, "fp8")
    first = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, seed=1), keep=["a", "b"])
    scales = engine.model.kv_scale.clone()
    prompts = [p + o.token_ids + [4, 4] for p, o in zip(PROMPTS[:2], first, strict=True)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=2), keep=["a", "b"])
    assert engine.stats.prefill_tokens < sum(map(len, prompts)) + sum(map(len, PROMPTS[:2]))  # continued
    assert torch.equal(engine.model.kv_scale, scales)
    diffs = [abs(a - b) for p, o in zip(prompts, outs, strict=True)
             for a, b in zip(o.logprobs, reference_logprobs(model, p, o.token_ids), strict=True)]
    assert sum(diffs) / len(diffs) < LOGPROB_BOUND["qwen2"]
    engine.sleep(2)
    engine.wake_up()
    assert not engine.model.kv_scaled
    engine.load_weights(full_weights(model))
    assert torch.equal(engine.model.kv_scale, torch.ones_like(scales))
    engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2, seed=1))
    assert torch.equal(engine.model.kv_scale, scales)  # the same first writes, the same scales


# ------------------------------------------------------------------ memory and refusals

def test_the_memory_plan_counts_one_byte_a_kv_element(models):
    from rl.model.shape import ModelShape
    from rl.run.memory import engine_terms

    for family, config in (("qwen2", models["qwen2"].config), ("gemma3", models["gemma3"].config)):
        s = ModelShape.from_hf(config)
        cfg = make(rollout={"max_batch_size": 8, "kv_precision": "fp8"})
        bf16 = engine_terms(make(rollout={"max_batch_size": 8}), s, 2, None)["KV cache"]
        fp8_kv = engine_terms(cfg, s, 2, None)["KV cache"]
        scales = 2 * 4 * s.num_layers * s.num_kv_heads
        assert fp8_kv - scales == bf16 / 2, family
        engine = NativeEngine(config, torch.device("cpu"), torch.bfloat16, max_batch_size=8, seed=0,
                              max_context_len=cfg.rollout.max_context_len, kv_precision="fp8")
        held = engine.kv.nbytes + engine.kv_window.nbytes + engine.model.kv_scale.nbytes
        assert held == fp8_kv, family


def test_the_keys_and_the_engine_refuse_what_fp8_kv_cannot_hold_in_one_line():
    assert make(rollout={"kv_precision": "fp8"}).rollout.kv_precision == "fp8"
    cases = [({"rollout": {"kv_precision": "fp16"}}, r"^rollout.kv_precision must be one of auto, fp8; got 'fp16'$"),
             ({"rollout": {"kv_precision": "fp8"}, "model": {"path": "m", "batch_invariant": True}},
              r"^model.batch_invariant and rollout.kv_precision='fp8': [^\n]*$"),
             ({"rollout": {"kv_precision": "fp8", "engine": "vllm", "vllm": {"kwargs": {"kv_cache_dtype": "auto"}}}},
              r"^rollout.vllm.kwargs sets kv_cache_dtype and rollout.kv_precision='fp8' sets it too: set one$")]
    for sections, message in cases:
        with pytest.raises(ConfigError, match=message):
            make(**sections)
    with pytest.raises(ValueError, match=r"^an FP8 KV cache cannot be batch-invariant[^\n]*$"):
        DecoderModel(tiny_model(seed=1).config, torch.device("cpu"), torch.float32, 64, batch_invariant=True,
                     kv_precision="fp8")


def test_vllm_gets_an_fp8_kv_cache_and_refuses_a_second_setting():
    cfg = make(rollout={"engine": "vllm", "kv_precision": "fp8"}).rollout
    assert engine_kwargs("m", cfg, torch.device("cpu"), torch.bfloat16, 0)["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in engine_kwargs("m", dataclasses.replace(cfg, kv_precision="auto"),
                                                 torch.device("cpu"), torch.bfloat16, 0)
    both = dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, kwargs={"kv_cache_dtype": "fp8_e5m2"}))
    with pytest.raises(ValueError, match=r"^rollout.vllm.kwargs sets kv_cache_dtype [^\n]*$"):
        engine_kwargs("m", both, torch.device("cpu"), torch.bfloat16, 0)
