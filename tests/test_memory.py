"""The memory plan against numbers worked out by hand, its refusal line, and the out-of-memory stop."""

import dataclasses
import os
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from rl import launch, main
from rl.config import ConfigError, RunStopped, config_from_dict
from rl.model.shape import ModelShape
from rl.rollout import vmem
from rl.run import memory
from rl.run.memory import FP32, GB, Models

ROOT = Path(__file__).resolve().parents[1]
H200 = 141e9
SEVEN_B, HALF_B = 7_615_616_512, 494_032_768  # the parameters Qwen2.5-7B and -0.5B publish

# vocab 10, hidden 4, MLP 8, 2 layers, 2 heads of 2 over 1 KV head, untied head
TINY = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=2)


def make(**sections):
    raw = {"model": {"path": "m"}, "data": {"source": "d.jsonl"}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def seed_batch(**train):
    """benchmarks/loop.sh's run: 32 prompts x 8 samples, prompts <= 512 and responses <= 1024 tokens, micro-batches
    of 32768 tokens, gradient checkpointing, the policy offloaded while the engine runs."""
    return make(model={"gradient_checkpointing": True}, data={"max_prompt_len": 512},
                rollout={"rollout_batch_size": 32, "n_samples_per_prompt": 8, "max_new_tokens": 1024,
                         "max_context_len": 1600},
                train={"micro_batch_tokens": 32768, "offload": True, **train})


def shapes(name: str) -> Models:
    return Models(ModelShape.from_hf(AutoConfig.from_pretrained(ROOT / "configs" / "models" / name)))


def test_parameter_counts_are_the_published_ones():
    assert shapes("qwen2.5-7b").policy.num_params == SEVEN_B
    assert shapes("qwen2.5-0.5b").policy.num_params == HALF_B
    # TINY: a block is q, k, v 4 x (4 + 2 + 2) + o 4 x 4 + MLP 3 x 4 x 8 + 2 norms of 4; the root the embedding
    # 10 x 4, the final norm 4 and the untied head 10 x 4
    assert TINY.block_params == 32 + 16 + 96 + 8 == 152
    assert TINY.num_params == 40 + 4 + 40 + 2 * 152 == 388


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_one_shape_counts_the_parameters_of_the_model_and_of_the_engine(model_type):
    """rl/model/shape.py's counts against a real model of each layout the native engine runs (a Llama with
    attention_bias has q, k, v and o biases, and a tied head here), and against the native engine's own tensors."""
    from math import prod

    from transformers import AutoModelForCausalLM

    from rl.model.decoder import Shape, internal_shapes

    config = AutoConfig.for_model(model_type, vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=model_type == "llama",
                                  **({"attention_bias": True} if model_type == "llama" else {}))
    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert sum(prod(size) for size in internal_shapes(Shape.from_hf(config)).values()) == shape.num_params
    assert shape.kv_bytes_per_token(2) == 2 * 2 * (2 * 4) * 2  # K and V, 2 layers, 2 heads of 4, 2 bytes


def test_activations_and_logits_by_hand():
    # bf16, per token and block: 2 norms x (fp32 input 16 + output 8 + the next linear's input 8) = 64; q and k after
    # RoPE, v, the attention output and its copy 2 x (3 x 4 + 2 x 2) + fp32 log-sum-exp 2 x 4 = 40; MLP 4 x 2 x 8 = 64
    assert memory.block_activation_bytes(TINY, 2) == 64 + 40 + 64 == 168
    final_norm = 16 + 16
    assert memory.activation_bytes(TINY, 10, 2, checkpointing=False) == 10 * (2 * 168 + final_norm) == 3680
    # checkpointed: each block keeps its bf16 input (8 bytes a token), one block is rebuilt at a time
    assert memory.activation_bytes(TINY, 10, 2, checkpointing=True) == 10 * (2 * 8 + 168 + final_norm) == 2160
    # compiled blocks: 2 norms x (bf16 input 8 + output 8) = 32, attention as above 40, MLP gate, up, product 3 x 2 x 8
    assert memory.block_activation_bytes(TINY, 2, compiled=True) == 32 + 40 + 48 == 120
    assert memory.activation_bytes(TINY, 10, 2, checkpointing=False, compiled=True) == 10 * (2 * 120 + final_norm)
    # logits and their gradient, bf16 (10 tokens x vocab 10); unfused fp32 adds two chunks of the 10 rows
    assert memory.logits_bytes(TINY, 10, 2, fused=True) == 2 * 10 * 10 * 2 == 400
    assert memory.logits_bytes(TINY, 10, 4, fused=False) == 2 * 10 * 10 * 4 + 2 * 10 * 10 * 4 == 1600


def test_tiny_plan_by_hand():
    cfg = make(rollout={"max_batch_size": 2, "max_context_len": 128, "native": {"kv_cache_tokens": 64},
                            "max_new_tokens": 8},
               data={"max_prompt_len": 64}, train={"micro_batch_tokens": 128}, weights={"bucket_mb": 1.0})
    plan = memory.plan_memory(cfg, Models(TINY), world_size=2, device_type="cuda")
    shard = 4 * 388 / 2  # fp32 over 2 ranks
    assert plan["train"] == {"policy params": shard, "policy AdamW": 2 * shard,
                             "policy grads": shard + 152 * (2 + 4),  # + one block's bf16 gradient and fp32 copy
                             "policy gathered": 388 * 2,  # bf16, kept through the step (reshard_after_forward false)
                             "activations": 128 * (2 * 168 + 32), "logits": 2 * 128 * 10 * 2}
    kv_tokens = (1 + 1) * 64  # one page of 64 tokens and the scratch page
    assert plan["rollout"] == {"policy params": shard, "policy AdamW": 2 * shard, "engine weights": 388 * 2,
                               "KV cache": kv_tokens * 2 * 2 * 1 * 2 * 2,  # K and V, 2 layers, 1 head of 2, bf16
                               "engine workspace": 16384 * 2 * (8 + 4 + 4 + 24) + 2 * 2 * 10 * 4}
    assert plan["push"] == {"policy params": shard, "policy AdamW": 2 * shard, "engine weights": 388 * 2,
                            "push buckets": (2**20 + 10 * 4 * 2) * (1 + 1 / 2)}
    # The engine sleeping through training unless rollout.sleep_level = 0; train.offload empties the rollout phase.
    awake = memory.plan_memory(memory._with(cfg, "rollout", sleep_level=0), Models(TINY), 2)
    assert awake["train"]["KV cache"] == plan["rollout"]["KV cache"] and "KV cache" not in plan["train"]
    parked = memory.plan_memory(memory._with(cfg, "train", offload=True), Models(TINY), 2)
    assert "policy params" not in parked["rollout"] and "policy params" in parked["train"]


def test_reference_and_critic_phases():
    cfg = make(algo={"kl_coef": 0.1, "advantage_estimator": "gae"}, train={"micro_batch_tokens": 128},
               rollout={"max_context_len": 128, "max_new_tokens": 8}, data={"max_prompt_len": 64})
    critic = ModelShape(**{**TINY.__dict__, "num_layers": 3, "value_head": True})  # a critic of its own folder
    plan = memory.plan_memory(cfg, Models(TINY, TINY, critic), world_size=1, device_type="cuda")
    assert list(plan) == ["rollout", "reference", "train", "critic", "push"]
    # the value head is (hidden -> 1): the embedding, the final norm, 4 weights and the blocks
    assert critic.num_params == 40 + 4 + 4 + 3 * 152 == 504
    assert plan["reference"]["reference"] == 4 * 388 + 2 * 388 + 128 * 2 * (2 * 4 + 3 * 8 + 10)
    assert plan["train"]["critic"] == 3 * 4 * 504  # its parameters and moments wait on the device
    # its state, gradients (one block reduced), its whole bf16 copy (rl/train/critic.py keeps it gathered), its
    # activations and one value per token with its gradient
    assert plan["critic"]["critic"] == (3 * 4 * 504 + 4 * 504 + 152 * 6 + 2 * 504
                                        + 128 * (3 * 168 + 32) + 2 * 128 * 1 * 2)


def test_7b_state_is_16_bytes_a_parameter_on_one_rank():
    plan = memory.plan_memory(seed_batch(), shapes("qwen2.5-7b"), world_size=1, device_type="cuda",
                              device_total=H200)["train"]
    state = plan["policy params"] + plan["policy AdamW"] + plan["policy grads"] - 233_057_792 * 6
    assert state == 16 * SEVEN_B  # 121.9 GB (113.5 GiB): fp32 parameters, gradients and two moments
    # checkpointed activations of 32768 tokens: 28 block inputs of 7168 bytes, one block rebuilt (232560 bytes a
    # token), the final norm's 28672
    assert memory.block_activation_bytes(shapes("qwen2.5-7b").policy, 2) == 232_560
    assert plan["activations"] == 32768 * (28 * 7168 + 232_560 + 28_672)


def test_7b_seed_batch_on_one_h200_is_refused_with_the_keys_that_fit(monkeypatch):
    models = shapes("qwen2.5-7b")
    with pytest.raises(ConfigError) as e:
        memory.check_fits(seed_batch(), models, 1, H200)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("memory plan: the train (173.5 GB) phase needs more than the 133.9 GB usable per device")
    assert "model.reshard_after_forward=true saves 12.1 GB in train;" in line
    # the two moments of 7.6e9 parameters leave for host memory; 1 GB of stream buffers come instead
    assert f"train.optimizer_offload=true saves {(8 * SEVEN_B - 2**30) / GB:.1f} GB in train (enough alone);" in line
    assert "; 2 ranks (the training state shards over them);" in line
    assert line.endswith("or train.memory_check=false to run anyway if the estimate is wrong")
    memory.check_fits(seed_batch(optimizer_offload=True), models, 1, H200)
    # Without the host's help no single key fits it: the line names a set that fits together.
    monkeypatch.setattr(memory, "SWITCHES", [k for k in memory.SWITCHES if k[1] != "optimizer_offload"])
    with pytest.raises(ConfigError) as e:
        memory.check_fits(seed_batch(), models, 1, H200)
    line = str(e.value)
    # Together: the switch and the largest micro-batch budget that fits, which fits where 64 tokens more do not.
    tokens = int(line.split("together: model.reshard_after_forward=true train.micro_batch_tokens=")[1].split(";")[0])
    together = seed_batch(micro_batch_tokens=tokens)
    together = memory._with(together, "model", reshard_after_forward=True)
    memory.check_fits(together, models, 1, H200)
    with pytest.raises(ConfigError):
        memory.check_fits(memory._with(together, "train", micro_batch_tokens=tokens + 64), models, 1, H200)
    memory.check_fits(seed_batch(), models, 2, H200)  # the state shards over two ranks


def test_7b_without_checkpointing_names_its_saving():
    cfg = memory._with(seed_batch(), "model", gradient_checkpointing=False)
    with pytest.raises(ConfigError) as e:
        memory.check_fits(cfg, shapes("qwen2.5-7b"), 1, H200)
    saving = 32768 * (28 * 232_560 - (28 * 7168 + 232_560)) / GB  # every block's activations but one, less inputs
    assert f"model.gradient_checkpointing=true saves {saving:.1f} GB in train;" in str(e.value)


def test_rollout_phase_over_names_the_kv_cache_size_that_fits():
    cfg = make(rollout={"max_batch_size": 256, "max_context_len": 1600, "max_new_tokens": 1024},
               data={"max_prompt_len": 512}, train={"micro_batch_tokens": 4096},
               model={"gradient_checkpointing": True, "reshard_after_forward": True})
    models, small = shapes("qwen2.5-0.5b"), 12e9
    with pytest.raises(ConfigError, match=r"the rollout \(13.0 GB\) phase needs .*: train.offload=true saves 5.9 GB "
                                          r"in rollout \(enough alone\); train.optimizer_offload=true saves 4.0 GB in "
                                          r"rollout \(enough alone\); rollout.native.kv_cache_tokens=") as e:
        memory.check_fits(cfg, models, 1, small)
    assert "micro_batch_tokens" not in str(e.value)  # it does not shrink the rollout
    tokens = int(str(e.value).split("rollout.native.kv_cache_tokens=")[1].split(" ")[0])
    memory.check_fits(memory._with(cfg, "rollout.native", kv_cache_tokens=tokens), models, 1, small)
    with pytest.raises(ConfigError):
        memory.check_fits(memory._with(cfg, "rollout.native", kv_cache_tokens=tokens + 64), models, 1, small)
    assert 0.5 * 425_984 < tokens < 425_984  # the default: 256 rows of 26 pages of 64


def test_compiled_blocks_are_planned_at_the_peaks_an_h200_measured():
    """benchmarks/train.py's replay on one H200 (packed 32768-token rows, compiled blocks, the state on the device)
    peaked at 63.4 GB at 0.5B and 120.2 GB at 1.5B; the eager counts planned 75.7 and 146.1 GB and refused 1.5B."""
    def train_peak(name: str, compile: bool) -> float:
        cfg = make(model={"compile": compile}, data={"max_prompt_len": 512},
                   rollout={"rollout_batch_size": 32, "n_samples_per_prompt": 8, "max_new_tokens": 1024,
                            "max_context_len": 1600}, train={"micro_batch_tokens": 32768, "packing": True})
        return memory.peaks(memory.plan_memory(cfg, shapes(name), 1))["train"] / 1e9

    for name, measured in (("qwen2.5-0.5b", 63.4), ("qwen2.5-1.5b", 120.2)):
        assert abs(train_peak(name, compile=True) / measured - 1) < 0.05
        assert train_peak(name, compile=False) > 1.15 * measured  # eager blocks save more: not this measurement


def test_half_b_seed_batch_fits_one_h200():
    memory.check_fits(seed_batch(), shapes("qwen2.5-0.5b"), 1, H200)
    memory.check_fits(seed_batch(offload=False), shapes("qwen2.5-0.5b"), 1, H200)


def test_start_up_check_prints_on_cuda_refuses_unless_told_and_stays_quiet_off_cuda(monkeypatch, capsys):
    hf = AutoConfig.from_pretrained(ROOT / "configs" / "models" / "qwen2.5-7b")
    memory.check_memory_plan(seed_batch(), hf, 1, torch.device("cpu"))
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=H200))
    with pytest.raises(ConfigError, match="memory plan: the train"):
        memory.check_memory_plan(seed_batch(), hf, 1, torch.device("cuda"))
    table = capsys.readouterr().out
    assert "memory plan per rank (GB; device 141.0 GB, 133.9 usable):" in table
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["engine", "KV", "engine", "policy", "policy",
                                                                     "policy", "policy", "activations", "logits",
                                                                     "push", "total"]
    memory.check_memory_plan(seed_batch(memory_check=False), hf, 1, torch.device("cuda"))
    table = capsys.readouterr().out.splitlines()
    assert "173.5" in table[-2]
    assert table[-1].startswith("host memory plan per node: 91.4 GB pinned by 1 rank (parked training state 91.4)")


IN_USE = {"allocated": 128e9, "reserved": 131e9, "used": 139.5e9, "total": 141e9}


def test_an_out_of_memory_error_becomes_one_line_naming_phase_memory_and_keys(monkeypatch):
    monkeypatch.setattr(memory, "memory_in_use", lambda device: IN_USE)
    cfg = seed_batch()
    with pytest.raises(RunStopped) as e, memory.stop_on_oom("train", cfg, torch.device("cpu")):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
    assert str(e.value) == (
        "out of device memory in the train phase (128.0 GB allocated by PyTorch, 131.0 GB reserved, 139.5 of 141.0 GB "
        "of the device in use): lower train.micro_batch_tokens (now 32768), model.reshard_after_forward=true, more "
        "ranks (the training state shards over them); nothing of this step was saved: the same command resumes from "
        "the last checkpoint")
    with pytest.raises(RunStopped, match=r"in the rollout phase .*lower rollout.native.kv_cache_tokens \(now 425984\), lower "
                                         r"rollout.max_batch_size \(now 256\)"), \
            memory.stop_on_oom("rollout", cfg, torch.device("cpu")):
        raise torch.OutOfMemoryError("CUDA out of memory")
    # train.offload empties the device of the training state while the engine runs, not while it trains
    resident = seed_batch(offload=False)
    assert "train.offload=true" in memory.oom_message("push", resident, None)
    assert "train.offload" not in memory.oom_message("train", resident, None)
    assert "(memory in use unknown)" in memory.oom_message("train", resident, None)
    with pytest.raises(ValueError), memory.stop_on_oom("push", cfg, torch.device("cpu")):
        raise ValueError("not a memory error: passes through")
    with pytest.raises(RuntimeError, match="shape mismatch"), memory.stop_on_oom("push", cfg, torch.device("cpu")):
        raise RuntimeError("shape mismatch: passes through")


def test_vllms_out_of_memory_at_wake_up_is_the_same_one_line_naming_its_cache():
    """vLLM's sleep-mode allocator maps the KV cache back outside PyTorch and raises a plain RuntimeError."""
    cfg = seed_batch(offload=False)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, engine="vllm", vllm=dataclasses.replace(cfg.rollout.vllm, gpu_memory_utilization=0.35)))
    with pytest.raises(RunStopped) as e, memory.stop_on_oom("push", cfg, torch.device("cpu")):
        raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")
    assert str(e.value).startswith("out of device memory in the push phase (memory in use unknown): lower "
                                   "weights.bucket_mb")
    assert "lower rollout.vllm.gpu_memory_utilization (now 0.35), train.offload=true" in str(e.value)
    # the native engine's memory that keeps its addresses (rl/rollout/vmem.py), at start-up or at a wake-up
    native = seed_batch(offload=False)
    with pytest.raises(RunStopped) as e, memory.stop_on_oom("engine start-up", native, torch.device("cpu")):
        raise RuntimeError("cuMemCreate of 12.38 GiB on cuda:0 failed: CUDA_ERROR_OUT_OF_MEMORY")
    assert str(e.value).startswith("out of device memory in the engine start-up phase (memory in use unknown): lower "
                                   "rollout.native.kv_cache_tokens")
    assert "train.offload=true" in str(e.value)


def fake_device_memory(monkeypatch, free: int, order: list) -> None:
    """The driver reports `free` bytes free; returning PyTorch's cached blocks is recorded in `order`."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 100 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))


@pytest.mark.parametrize("engine, environ, want", [
    ("native", {}, "expandable_segments:True"),
    ("native", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "backend:cudaMallocAsync"),
    ("native", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, None),
    ("vllm", {}, None),
])
def test_native_runs_grow_expandable_segments_unless_the_user_or_vllm_say_otherwise(engine, environ, want):
    memory.choose_allocator(engine, environ)
    assert environ.get("PYTORCH_CUDA_ALLOC_CONF") == want


def test_the_allocator_is_chosen_before_the_process_group_starts_cuda(monkeypatch, tmp_path):
    """The setting is read once, when CUDA's allocator starts: chosen after that it would do nothing."""
    seen = []

    def init_distributed():
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise RunStopped("stop here")

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(main, "check_paths", lambda cfg: None)
    monkeypatch.setattr(main.parallel, "init_distributed", init_distributed)
    with pytest.raises(RunStopped):
        main.main(["--model.path", str(tmp_path), "--data.source", str(tmp_path / "d.jsonl")])
    assert seen == ["expandable_segments:True"]


@pytest.mark.parametrize("free, emptied", [(10 << 30, False), (8 << 30, False), ((8 << 30) - 1, True), (3 << 30, True)])
def test_a_wake_up_gives_back_the_cached_blocks_only_when_what_it_maps_would_not_fit(monkeypatch, free, emptied):
    """7 GiB to map outside PyTorch's allocator: with 8 GiB free or more (the mapping and its 1 GiB of headroom) the
    trainer's cached blocks stay cached (the next train phase reuses them); with a byte less they go back first."""
    order = []
    fake_device_memory(monkeypatch, free, order)
    assert vmem.make_room(torch.device("cuda", 0), 7 << 30) is emptied
    assert order == (["empty_cache"] if emptied else [])
    assert vmem.make_room(torch.device("cuda", 0), 0) is False  # nothing to map


@pytest.mark.parametrize("free_gib", [2, 64])
def test_the_vllm_engine_makes_room_for_its_unmapped_pools_before_it_maps_them_back(monkeypatch, free_gib):
    """A KV cache that fit at start-up must fit after a train phase: when the device's free memory would not hold
    vLLM's sleeping pools (it allocates outside PyTorch), PyTorch's cached blocks go back before vLLM maps them."""
    from rl.rollout import vllm as vllm_engine
    from rl.rollout.engine import Engine

    order = []
    engine = object.__new__(vllm_engine.VllmEngine)
    engine.llm = types.SimpleNamespace(wake_up=lambda tags: order.append(f"wake_up({','.join(tags)})"))
    Engine.__init__(engine, max_context_len=256)
    engine.asleep, engine.device = {"weights": True, "kv_cache": True}, torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(vmem, "unmapped_allocator_bytes", lambda device: (40 << 30, 42 << 30))
    fake_device_memory(monkeypatch, free_gib << 30, order)
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    engine.wake_up(["kv_cache"])  # awake already: nothing to map, nothing to give back
    give_back = ["empty_cache"] if free_gib < 43 else []
    assert order == [*give_back, "wake_up(weights)", *give_back, "wake_up(kv_cache)"]


@pytest.mark.parametrize("free_gib", [2, 64])
def test_the_native_engine_makes_room_for_its_memory_before_it_maps_it_back(monkeypatch, free_gib):
    """The same for the native engine, whose weights and KV cache are mapped outside PyTorch's allocator too (the
    7B run with AdamW's moments in host memory stopped at its first push: 30.7 GB allocated, 134.7 GB reserved)."""
    from rl.rollout.engine import Engine
    from rl.rollout.native import NativeEngine

    order = []
    engine = object.__new__(NativeEngine)
    Engine.__init__(engine, max_context_len=256)
    engine.on_gpu, engine.asleep, engine.stable = True, {"weights": True, "kv_cache": True}, True
    engine.weight_buffer = types.SimpleNamespace(nbytes=6 << 30)
    engine.kv_buffer = types.SimpleNamespace(nbytes=30 << 30)
    engine._new_weights = lambda: order.append("map weights") or {}
    engine.host_weights, engine.device, engine.model = None, torch.device("cuda", 0), types.SimpleNamespace()
    fake_device_memory(monkeypatch, free_gib << 30, order)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine.wake_up(["weights"])
    engine.wake_up(["weights"])  # awake already: nothing to map, nothing to give back
    assert order == (["empty_cache"] if free_gib < 7 else []) + ["map weights"]


class Loop:
    """Just enough of main.Run for main.train to reach each phase; `oom_in` raises the device's OOM error there."""

    def __init__(self, oom_in: str):
        def phase(name, result):
            def call(*args, **kwargs):
                self.calls.append(name)
                if name == oom_in:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                return result
            return call

        self.calls = []
        self.cfg = seed_batch()
        self.dist = types.SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1, is_main=True)
        self.start, self.weight_version, self.restart_stats, self.eval_prompts = 0, 1, {}, []
        self.dataset = self.sampling = self.stop = None
        self.collector = types.SimpleNamespace(rollout=phase("rollout", ([], {"rollout/num_scored": 0})))
        self.health = types.SimpleNamespace(after_rewards=lambda *a: None)
        self.engine = types.SimpleNamespace(sleep=phase("sleep", None))
        self.learner = types.SimpleNamespace(train=phase("train", None), push=phase("push", {}))
        self.checkpointer = types.SimpleNamespace(maybe_save=phase("save", None))


@pytest.mark.parametrize("phase", ["rollout", "train", "push"])
def test_the_loop_stops_on_out_of_memory_with_its_phase_and_saves_nothing(phase, monkeypatch, capsys):
    monkeypatch.setattr(memory, "memory_in_use", lambda device: IN_USE)
    run = Loop(oom_in=phase)

    def loop(argv):
        main.train(run, logger=None)

    assert launch.cli(loop, []) == 1  # RunStopped: one line, exit 1, no traceback
    assert capsys.readouterr().err.startswith(f"rl: stopped: out of device memory in the {phase} phase (128.0 GB")
    assert run.calls[-1] == phase and "save" not in run.calls  # the last checkpoint stays the run's state


def test_the_memory_page_shows_the_line_the_plan_prints():
    section = (ROOT / "docs/memory.md").read_text()
    shown = " ".join(section.split("```")[1].split())  # wrapped there to be read
    with pytest.raises(ConfigError) as e:
        memory.check_fits(seed_batch(), shapes("qwen2.5-7b"), 1, H200)
    assert shown == f"rl: error: {e.value}"


def saved_bytes(forward, exclude) -> int:
    """The bytes of the tensors `forward()` saves for backward (PyTorch's own hooks, every storage once), those of
    `exclude` (the weights) left out."""
    skip, saved = {p.untyped_storage().data_ptr() for p in exclude}, {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(n for ptr, n in saved.items() if ptr not in skip)


def test_the_plan_against_what_the_tiny_model_holds():
    """The plan's counts against the tensors a real model holds: its parameters, AdamW's state after a step (16
    bytes a parameter in fp32), and the activations its forward saves for backward (by PyTorch's own hooks, every
    storage once), within 20% (no gradient checkpointing, fp32 on the CPU, SDPA attention)."""
    from rl.run.memory import activation_bytes
    from tests.tiny import tiny_model

    model = tiny_model(0)
    shape = ModelShape.from_hf(model.config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, model.config.vocab_size, (1, 16))).logits.float().pow(2).mean().backward()
    optimizer.step()
    state = sum(t.nbytes for p in model.parameters() for t in (p, p.grad, *(v for v in optimizer.state[p].values()
                                                                            if v.dim() > 0)))
    assert state == 16 * shape.num_params
    for tokens in (64, 256):
        ids = torch.randint(0, model.config.vocab_size, (1, tokens))
        measured = saved_bytes(lambda: model.model(input_ids=ids), model.parameters())
        assert abs(activation_bytes(shape, tokens, FP32, checkpointing=False) / measured - 1) < 0.2, (tokens, measured)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])
def test_the_plan_against_what_the_trainers_moe_and_linear_attention_forwards_hold(family):
    """As above for the trainer's own forwards (fp32 on the CPU): a Qwen3-MoE's grouped experts (each expert's
    output kept for the weighted sum, the sorted outputs once more by the unsorting copy), and a Qwen3.5 of three
    linear-attention layers, which keep only their input, and a full-attention layer with QK-norm and an output
    gate; and one linear-attention layer's tensors while its backward computes it again, against
    `linear_recompute_bytes`. Each within 20%: leaving the experts' outputs or that layer out of the plan fails it,
    and so does a linear-attention layer that keeps its tensors instead of computing them again."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rl.model.linear_attention import gated_deltanet_forward, use_packed_linear_attention, weights_from_module
    from rl.model.moe import use_grouped_moe
    from rl.run.memory import activation_bytes, linear_recompute_bytes
    from tests.test_linear_attention import tiny_causal_lm

    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=96, hidden_size=64, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=8))
        use_grouped_moe(model)
    else:
        model = tiny_causal_lm("qwen3_5")
        modules = use_packed_linear_attention(model)
    shape = ModelShape.from_hf(model.config)
    for tokens in (128, 256):
        ids = torch.randint(0, model.config.vocab_size, (1, tokens))
        layer = 0  # the one layer computed again during backward, on top of what the blocks keep
        if family == "qwen3_5":
            hidden = torch.randn(1, tokens, shape.hidden_size)
            layer = saved_bytes(lambda: gated_deltanet_forward(hidden, weights_from_module(modules[0])),
                                model.parameters())
            recompute = linear_recompute_bytes(shape, FP32) * tokens
            assert abs(recompute / layer - 1) < 0.2, (tokens, recompute, layer)
        measured = layer + saved_bytes(lambda: model.model(input_ids=ids, use_cache=False), model.parameters())
        planned = activation_bytes(shape, tokens, FP32, checkpointing=False)
        assert abs(planned / measured - 1) < 0.2, (tokens, planned, measured)


def test_host_plan_counts_the_pinned_state_of_a_nodes_ranks_and_refuses_what_the_host_cannot_hold(capsys):
    models = shapes("qwen2.5-7b")
    moments = 8 * SEVEN_B
    assert memory.host_plan(seed_batch(offload=False), models, 1) == {}
    assert memory.host_plan(seed_batch(optimizer_offload=True), models, 2) == {
        "AdamW moments": moments / 2, "parked training state": 4 * SEVEN_B / 2}  # parameters only: moments stay
    assert memory.host_plan(seed_batch(), models, 1) == {"parked training state": 12 * SEVEN_B}
    memory.check_host(seed_batch(optimizer_offload=True), models, 2, 2, 135e9)  # 91.4 GB of 135
    assert capsys.readouterr().out.startswith("host memory plan per node: 91.4 GB pinned by 2 ranks")
    with pytest.raises(ConfigError) as e:
        memory.check_host(seed_batch(optimizer_offload=True), models, 1, 1, 100e9)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("memory plan: the ranks of a node would pin 91.4 GB of host memory (AdamW moments "
                                   "60.9, parked training state 30.5), more than 85% of the host's 100.0 GB; to fit: "
                                   "train.offload=false; train.optimizer_offload=false; more nodes")
    memory.check_host(memory._with(seed_batch(optimizer_offload=True), "train", memory_check=False), models, 1, 1,
                      100e9)  # printed, not refused


def test_a_disk_without_room_for_a_checkpoint_and_the_export_stops_the_run_before_it_starts(capsys):
    models = shapes("qwen2.5-7b")
    full, lora = seed_batch(), memory._with(seed_batch(), "lora", rank=64)
    assert memory.checkpoint_bytes(full, models) == 12 * SEVEN_B  # fp32 parameters and two moments: 91.4 GB
    adapters = 28 * memory.lora_block_params(models.policy, 64, list(memory.LORA_SHAPES))
    assert memory.checkpoint_bytes(lora, models) == 12 * adapters  # the base is the model folder's
    with pytest.raises(ConfigError) as e:  # the 7B run with its moments in host memory, on a disk with 48 GB free
        memory.check_disk(full, models, 2, 48e9)
    assert "\n" not in str(e.value)
    assert str(e.value) == ("disk: runs/default has 48.0 GB free, less than one checkpoint and the final export need "
                            "(a checkpoint takes 91.4 GB, the final export 15.2 GB): free space there or set "
                            "log.output_dir on a larger disk")
    memory.check_disk(full, models, 2, 200e9)  # room for one, not for keep_last=2 and the one being written
    assert capsys.readouterr().out.startswith("disk warning: runs/default has 200.0 GB free, less than the 289.4 GB that "
                                              "checkpoint.keep_last=2 needs")
    memory.check_disk(lora, models, 2, 48e9)
    memory.check_disk(full, models, 2, 300e9)
    assert capsys.readouterr().out == ""
    # checkpoint.interval=-1 writes no checkpoint: the export alone needs room, and the run says what it gives up
    never = memory._with(full, "checkpoint", interval=-1)
    memory.check_disk(never, models, 2, 48e9)
    assert capsys.readouterr().out.startswith("checkpoint.interval=-1: this run writes no checkpoint")
    with pytest.raises(ConfigError, match=r"^disk: runs/default has 10.0 GB free, less than the final export needs "
                                          r"\(15.2 GB\)"):
        memory.check_disk(never, models, 2, 10e9)


def test_checkpoint_interval_minus_one_saves_nothing_not_even_the_last_rollout_or_on_a_stop():
    from rl.run.checkpointer import RunCheckpointer

    saved = []
    for interval, want in ((-1, []), (0, [3]), (2, [1, 3])):
        saved.clear()
        ckpt = RunCheckpointer.__new__(RunCheckpointer)
        ckpt.cfg = memory._with(seed_batch(), "checkpoint", interval=interval)
        ckpt.save = lambda rollout_id, weight_version: saved.append(rollout_id)
        for rollout_id in range(4):
            ckpt.maybe_save(rollout_id, rollout_id + 1, force=rollout_id == 3)
        assert saved == want, interval
    with pytest.raises(ConfigError, match="checkpoint.interval must be >= -1"):
        make(checkpoint={"interval": -2})


def test_the_start_up_check_reads_the_free_space_under_the_output_dir(monkeypatch, tmp_path):
    hf = AutoConfig.from_pretrained(ROOT / "configs" / "models" / "qwen2.5-7b")
    cfg = memory._with(seed_batch(), "log", output_dir=str(tmp_path))
    asked = []
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: asked.append(path) or types.SimpleNamespace(free=48e9))
    with pytest.raises(ConfigError, match=r"^disk: .* has 48.0 GB free, .*\(a checkpoint takes 91.4 GB, the final "
                                          r"export 15.2 GB\)"):
        memory.check_disk_space(cfg, hf)  # the model folder says bfloat16: 2 bytes a parameter in the export
    assert asked == [str(tmp_path)]


def test_the_plan_of_a_moe_model_counts_what_its_experts_hold():
    """A Qwen3-MoE shape (hidden 64; q 64, k and v 32; 8 experts of 32, 2 a token; 2 layers): a token's MLP width is
    its two experts' 64; FP8 engine weights hold q, k, v, o alone in FP8 (the experts stay in bf16: 2 x 12,288
    matrix weights, 2 x 192 per-channel scales); the largest pushed tensor is a block's fused gate_up (2 x 8 x 32 x 64
    = 32,768 weights, past the 96 x 64 embedding); a micro-batch's routing record is 2 layers x 2 slots of int64 and
    a mask byte per token."""
    from transformers import Qwen3MoeConfig

    s = ModelShape.from_hf(Qwen3MoeConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32,
                                          intermediate_size=500, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2))
    assert memory.mlp_width(s) == 64
    assert memory.engine_weight_bytes(s, 2, "fp8", "channel") == (s.num_params - 24_576) * 2 + 24_576 + 4 * 384
    assert memory.push_bytes(s, 0, 2, 1) == 2 * 32_768 * 2
    assert memory.routing_record_bytes(s, 10) == 10 * (2 * 2 * 8 + 1)
    assert memory.forward_bytes(s, 1, 2) == 2 * (2 * 64 + 3 * 64 + 96)


def test_expert_parallelism_holds_its_share_of_the_experts_whole():
    """train.expert_parallel=2 on 4 ranks, the MoE shape above: each rank holds FSDP2's quarter of all but the routed
    experts (2 layers x 8 x 3 x 64 x 32 = 98,304 weights) and half of those, for parameters, gradients and AdamW
    moments; the block FSDP2 gathers has no experts, their bf16 copies take half the experts' weights; a checkpoint
    still holds every expert once."""
    from transformers import Qwen3MoeConfig

    s = ModelShape.from_hf(Qwen3MoeConfig(vocab_size=96, hidden_size=64, moe_intermediate_size=32,
                                          intermediate_size=500, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2))
    experts = 98_304
    assert memory.split_expert_params(s, 2) == experts and memory.split_expert_params(s, 1) == 0
    plain, split = (memory.plan_memory(make(train={"expert_parallel": ep}), Models(s), 4)["train"] for ep in (1, 2))
    held = FP32 * ((s.num_params - experts) / 4 + experts / 2)
    assert plain["policy params"] == FP32 * s.num_params / 4
    assert split["policy params"] == held and split["policy AdamW"] == 2 * held
    assert split["policy grads"] == held + (s.block_params - experts / 2) * (2 + FP32)
    assert split["policy gathered"] == (s.num_params - experts + experts / 2) * 2  # kept through the step
    assert memory.checkpoint_bytes(make(train={"expert_parallel": 2}), Models(s)) == 3 * FP32 * s.num_params
    host = memory.host_plan(make(train={"expert_parallel": 2, "optimizer_offload": True}), Models(s), 4)
    assert host["AdamW moments"] == 2 * held
