"""Rollout throughput: the native engine and vLLM against each other and HF `generate`, on one device.

    python benchmarks/rollout.py --out rollout.json            # Qwen2.5-0.5B and 1.5B shapes, bf16, on CUDA
    python benchmarks/rollout.py --engines native vllm --hf-steps -1   # both engines on the same batch

The seed's scenario: 32 prompts x 8 samples, prompts of random length up to 512 tokens, 1024 new
tokens per sample with EOS ignored, so every engine does identical work. Weights are random
(built from the config folders in configs/models), which changes nothing about the work done.
Per model and engine the table gives output tokens/s and time to finish the batch (the second of two
calls; the first is shown beside it), HF `generate` on the same inputs in the same run, and the
decode roofline: the bytes every decode step must read
(weights + each sequence's KV) over the device-to-device copy bandwidth measured in the same run,
with the fraction of it the engine achieved (over its whole batch time, prefill included). Per
engine it also times a weight load (the engine's side of a weight sync: the model is unsharded, so
nothing is gathered), checks the engine's logprobs against a bf16 training forward of the same
sequences, and that sleep(2) returns the engine's memory (by the driver's count; torch's count of
a sleeping vLLM is shown beside it) and that wake + load reproduces greedy outputs.

Each vLLM engine runs as the trainer runs it (rl/rollout/vllm.py, in-process, a process group of
one), in a child process of its own (vLLM's sleep allocator serves one engine per process);
`--vllm-variants` takes JSON objects of extra `vllm.LLM` arguments (`rollout.vllm.kwargs`), one
engine per object, e.g. '{}' '{"enable_prefix_caching": false}' '{"enforce_eager": true}'. For each
vLLM engine the batch is also generated with each of the engine's per-call choices undone (`VLLM_CALLS`:
without logprobs, with vLLM's per-token logprob dicts, with a generator per request), for what each costs.
`--native-variants` does the same for the native engine with `NativeEngine` arguments; the keys `precision`,
`kv_precision` and `fp8_scale` set either engine as the same `rollout.*` keys set it in a run. BF16 against FP8:

    python benchmarks/rollout.py --engines native vllm --hf-steps -1 \
        --native-variants '{}' '{"precision": "fp8"}' '{"precision": "fp8", "kv_precision": "fp8"}' \
        --vllm-variants '{}' '{"precision": "fp8"}' '{"precision": "fp8", "kv_precision": "fp8"}'

    python benchmarks/rollout.py --batch-invariant --hf-steps -1   # the same in model.batch_invariant mode

measures the engine in batch-invariant mode and its logprobs against the trainer's forward in that
mode (rl/model/invariant.py), the HF forward then being a reference column.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.config import RolloutConfig, VllmEngineConfig  # noqa: E402
from rl.model.invariant import make_batch_invariant  # noqa: E402
from rl.rollout import SamplingParams, derive_seed, vmem  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402
from rl.train.weights import iter_full_weights  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes(device: torch.device) -> int:
    """Device memory free by the driver's count (0 off CUDA): it also sees memory outside torch's allocator."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.randn(512 * 2**20, device=device, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def all_weights(model: torch.nn.Module):
    """Every state_dict name and tensor (no computed buffer), as a weight sync pushes them (the model is unsharded)."""
    return iter_full_weights(model, model.dtype, 1 << 30)


def random_prompts(vocab_size: int, num: int, min_len: int, max_len: int) -> list[list[int]]:
    """The benchmark's distinct prompts: random lengths in [min_len, max_len], random ids (seeded)."""
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, vocab_size // 2, (n,), generator=gen).tolist() for n in lens]


def roofline(model, prompt_lens: list[int], n_samples: int, new_tokens: int, bandwidth: float) -> dict:
    """Least bytes the decode steps must read, and the time that takes at `bandwidth`."""
    cfg = model.config
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    if not cfg.tie_word_embeddings:
        weight_bytes -= embed.numel() * embed.element_size()  # a decode step reads lm_head, not the embedding
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * embed.element_size()
    steps = new_tokens - 1  # the first token comes out of the prefill
    arith = steps * (steps + 1) // 2  # sum over steps of the tokens generated before each
    per_seq = sum(p * steps + arith for p in prompt_lens) * n_samples  # context tokens read, all steps
    shared = sum(p * steps + n_samples * arith for p in prompt_lens)  # prompt KV read once per group
    total = steps * weight_bytes + kv_token * per_seq
    total_shared = steps * weight_bytes + kv_token * shared
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token, "decode_bytes": total,
            "decode_bytes_shared_prompt": total_shared, "roofline_s": total / bandwidth,
            "roofline_shared_prompt_s": total_shared / bandwidth}


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Seconds for HF generate to sample `new_tokens` for every prompt (left-padded, EOS suppressed)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    sync(device)
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start


@torch.no_grad()
def reference_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], batch: int, device: torch.device
                       ) -> list[torch.Tensor]:
    """Training-forward logprobs of each sequence's generated tokens, `batch` right-padded rows at a time."""
    out = []
    for i in range(0, len(seqs), batch):
        rows = seqs[i : i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        for j, (row, start) in enumerate(zip(rows, prompt_lens[i : i + batch])):
            target = ids[j, start : len(row)]
            out.append(logp[j, start - 1 : len(row) - 1].gather(-1, target[:, None]).squeeze(-1))
    return out


@torch.no_grad()
def logprob_parity(model, prompts: list[list[int]], outs, device: torch.device, max_context: int = 0) -> dict:
    """|engine logprob - training-forward logprob| over the generated tokens (model dtype forward, one
    sequence per forward), and, for scale, the same forward's own spread: batched 8 rows at a time vs
    one at a time, with HF's eager attention instead of SDPA (the same model and dtype, only another
    attention kernel), and engine and bf16 forward each against a float32 forward of the same weights.

    `max_context` > 0: the engine ran batch-invariant, and the training forward is the trainer's in
    that mode (`make_batch_invariant`, 8 right-padded rows per forward); the HF forward becomes a
    reference column."""
    seqs, lens = [p + o.token_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    engine = torch.cat([torch.tensor(o.logprobs, device=device) for o in outs])
    single = torch.cat(reference_logprobs(model, seqs, lens, 1, device))
    trainer = single
    if max_context:
        patched = make_batch_invariant(copy.deepcopy(model), max_context)
        trainer = torch.cat(reference_logprobs(patched, seqs, lens, 8, device))
        del patched
    batched = torch.cat(reference_logprobs(model, seqs, lens, 8, device))
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    other_attention = torch.cat(reference_logprobs(eager, seqs, lens, 1, device))
    del eager
    exact = torch.cat(reference_logprobs(copy.deepcopy(model).float(), seqs, lens, 8, device))
    d = (engine - trainer).abs()
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item(), "tokens": d.numel(),
            "exactly_equal_frac": (engine == trainer).float().mean().item(),
            "engine_vs_hf_forward_mean_abs": (engine - single).abs().mean().item(),
            "bf16_batched_vs_single_mean_abs": (batched - single).abs().mean().item(),
            "bf16_sdpa_vs_eager_mean_abs": (other_attention - single).abs().mean().item(),
            "engine_vs_fp32_mean_abs": (engine - exact).abs().mean().item(),
            "bf16_vs_fp32_mean_abs": (single - exact).abs().mean().item()}


def sleep_round_trip(engine, model, prompts: list[list[int]], new_tokens: int,
                     device: torch.device, free_before_engine: int) -> dict:
    """Greedy outputs before sleep(2) and after wake + load; device memory the engine held awake and
    asleep (from the driver's free memory: the engine's weights and cache may live outside torch's
    allocator); torch's reserved bytes asleep, and how much of them has no memory behind it (a
    sleeping vLLM's pools); whether the native engine's decode graphs survived the sleep."""
    greedy = SamplingParams(max_new_tokens=new_tokens, top_k=1)
    before = [o.token_ids for o in engine.generate(prompts, greedy)]
    graphs = dict(engine.graphs) if isinstance(engine, NativeEngine) else {}
    sync(device)
    free_awake = free_bytes(device)
    engine.sleep(2)
    sync(device)
    free_asleep = free_bytes(device)
    reserved_asleep = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    unmapped_asleep = vmem.unmapped_allocator_bytes(device)[1]
    engine.wake_up(["weights"])
    engine.load_weights(all_weights(model))
    engine.reset_prefix_cache()
    engine.wake_up(["kv_cache"])
    unmapped_awake = vmem.unmapped_allocator_bytes(device)[1]
    after = [o.token_ids for o in engine.generate(prompts, greedy)]
    return {"engine_bytes_awake": free_before_engine - free_awake,
            "engine_bytes_asleep": free_before_engine - free_asleep,
            "torch_reserved_asleep": reserved_asleep, "torch_unmapped_asleep": unmapped_asleep,
            "torch_unmapped_awake": unmapped_awake,
            "greedy_identical_after_wake": before == after,
            "graphs_kept": bool(graphs) and all(engine.graphs.get(k) is g for k, g in graphs.items())}


def time_weight_loads(engine, model, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of engine.load_weights over every parameter (the engine's side of a weight sync)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        engine.load_weights(all_weights(model))
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


VLLM_CALLS = {  # what the engine's per-call choices cost or save (rl/rollout/vllm.py's docstring): the same batch
    "no logprobs": lambda s: setattr(s, "logprobs", None),
    "logprob dicts": lambda s: setattr(s, "flat_logprobs", False),
    "a seed per request": lambda s: setattr(s, "seed", next(REQUEST_SEEDS)),
}
REQUEST_SEEDS = itertools.count(1)


def vllm_call_s(engine, prompts: list[list[int]], params: SamplingParams, change, device: torch.device) -> float:
    """Seconds for the vLLM engine to generate the batch as `engine.generate` asks it, with one of its per-call
    choices changed (`VLLM_CALLS`: a function of one request's vLLM sampling parameters)."""
    requests, sampling, _ = engine.requests(prompts, params)  # and the prompt groups they stand for
    for s in sampling:
        change(s)
    sync(device)
    start = time.perf_counter()
    outs = engine.llm.generate(requests, sampling, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == len(prompts) * params.max_new_tokens
    return seconds


def kernel_times(engine: NativeEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, tuple[float, int]]:
    """Device milliseconds and launches by kernel name over one generate() call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0))
    times = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        us = getattr(evt, "self_cuda_time_total", 0) if us is None else us
        if us > 0:  # the runtime's launch calls (cuLaunchKernelEx, ...) are listed too, with no device time
            times[evt.key[:90]] = (us / 1e3, evt.count)
    return times


def decode_kernels(engine: NativeEngine, prompts: list[list[int]], steps: int) -> dict[str, tuple[float, float]]:
    """Per kernel name: (device ms, launches) a decode step, a call of 1 + steps tokens less a call of 1 (the
    prefill and its token), over eager steps: the captured graphs are set aside, so a step finds none, runs
    eagerly and captures none (a graph replays the same kernels)."""
    use_graphs, graphs = engine.use_graphs, engine.graphs
    engine.use_graphs, engine.graphs = False, {}
    try:
        before = engine.stats.decode_steps
        prefill = kernel_times(engine, prompts, 1)
        middle = engine.stats.decode_steps
        full = kernel_times(engine, prompts, 1 + steps)
        decoded = (engine.stats.decode_steps - middle) - (middle - before)
    finally:
        engine.use_graphs, engine.graphs = use_graphs, graphs
    out = {}
    for name, (ms, count) in full.items():
        ms0, count0 = prefill.get(name, (0.0, 0))
        if count > count0:
            out[name] = ((ms - ms0) / decoded, (count - count0) / decoded)
    return out


def profile_decode(engine: NativeEngine, prompts: list[list[int]], steps: int = 32) -> list[tuple[str, float]]:
    """Device ms a decode step by kernel, the 25 largest."""
    rows = [(name, ms) for name, (ms, _) in decode_kernels(engine, prompts, steps).items()]
    return sorted([r for r in rows if r[1] > 0.0005], key=lambda r: -r[1])[:25]


def build(name: str, path: str, cfg, args, device: torch.device, dtype: torch.dtype, batch: int, variant: dict):
    max_context = args.max_prompt_len + args.max_new_tokens
    if name == "native":
        return NativeEngine(cfg, device, dtype, max_batch_size=batch, seed=0, max_context_len=max_context,
                            batch_invariant=args.batch_invariant, **variant)
    from rl.rollout.vllm import VllmEngine

    # The rollout keys of the native engine's arguments set vLLM's as a run does; the rest are vllm.LLM arguments.
    keys = {k: variant[k] for k in ("precision", "kv_precision", "fp8_scale") if k in variant}
    rollout = RolloutConfig(engine="vllm", max_context_len=max_context, max_batch_size=batch, **keys,
                            vllm=VllmEngineConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                                                  kwargs={k: v for k, v in variant.items() if k not in keys}))
    return VllmEngine(path, rollout, device, dtype, seed=0)


def bench_engine(name: str, variant: dict, path: str, model, prompts: list[list[int]], distinct: list[list[int]],
                 args, device: torch.device, dtype: torch.dtype, bandwidth: float) -> dict:
    cfg, batch = model.config, len(prompts)
    lens = [len(p) for p in distinct]
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the previous run left cached is not this engine's
    free_base = free_bytes(device)
    start = time.perf_counter()
    engine = build(name, path, cfg, args, device, dtype, batch, variant)
    engine.load_weights(all_weights(model))
    # No stop ids: EOS ignored. A call seed, as the loop passes one.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=derive_seed(0, 1))
    # warm-up: kernels compiled, graph captured
    engine.generate(prompts, SamplingParams(max_new_tokens=min(16, args.max_new_tokens)))
    sync(device)
    startup_s = time.perf_counter() - start
    times = []
    for _ in range(2):  # the batch's time is the second call's: vLLM's first full batch once took 12 s against 7 s
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(device)
        times.append(time.perf_counter() - start)
    first_s, engine_s = times
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == batch * args.max_new_tokens
    engine_bytes = free_base - free_bytes(device)

    label = name + (" " + json.dumps(variant, separators=(",", ":")) if variant else "")
    row = {"model": Path(path).name + (" (batch-invariant)" if args.batch_invariant else ""), "engine": label,
           "vllm_kwargs": variant, "batch": batch, "prompt_lens": lens, "new_tokens": args.max_new_tokens,
           "startup_s": startup_s, "first_call_s": first_s, "engine_s": engine_s, "engine_tok_s": tokens / engine_s,
           "engine_bytes": engine_bytes}
    row |= roofline(model, lens, args.n_samples, args.max_new_tokens, bandwidth)
    row["roofline_tok_s"] = tokens / row["roofline_s"]
    row["roofline_frac"] = row["roofline_s"] / engine_s
    row["roofline_shared_prompt_frac"] = row["roofline_shared_prompt_s"] / engine_s
    if name == "vllm" and args.vllm_calls:
        row["call_s"] = {label: vllm_call_s(engine, prompts, params, change, device)
                         for label, change in VLLM_CALLS.items()}
    row["load_weights_s"] = time_weight_loads(engine, model, device)
    if args.profile and device.type == "cuda" and name == "native":
        row["profile_ms_per_step"] = profile_decode(engine, prompts)
        for kernel, ms in row["profile_ms_per_step"]:
            print(f"{ms:8.3f} ms/step  {kernel}")
    # Before the parity check: what its forwards leave in the allocator's segments is not the engine's.
    row["sleep"] = sleep_round_trip(engine, model, distinct, min(64, args.max_new_tokens), device, free_base)
    row["sleep"]["freed_frac"] = 1 - row["sleep"]["engine_bytes_asleep"] / max(row["sleep"]["engine_bytes_awake"], 1)
    picks = list(range(0, batch, args.n_samples))[: args.parity_sequences]
    row["logprob_parity"] = logprob_parity(model, [prompts[i] for i in picks], [outs[i] for i in picks], device,
                                           args.max_prompt_len + args.max_new_tokens if args.batch_invariant else 0)
    engine.sleep(2)
    engine.close()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def vllm_in_child(path: str, variant: str) -> dict:
    """One vLLM engine measured in a process of its own, as the trainer runs one per process (vLLM's sleep
    allocator serves a single engine per process); the same arguments, this model and variant only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--models", path, "--engines", "vllm",
                        "--vllm-variants", variant, "--hf-steps", "-1", "--out", "", "--vllm-child", str(out)],
                       check=True)
        return json.loads(out.read_text())


def bench_model(path: str, args, device: torch.device, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    distinct = random_prompts(cfg.vocab_size, args.num_prompts, args.min_prompt_len, args.max_prompt_len)
    prompts = [p for p in distinct for _ in range(args.n_samples)]
    rows = []
    for name in args.engines:
        for variant in (args.vllm_variants if name == "vllm" else args.native_variants):
            if name == "vllm" and not args.vllm_child:
                rows.append(vllm_in_child(path, variant))
            else:
                rows.append(bench_engine(name, json.loads(variant), path, model, prompts, distinct, args, device,
                                         dtype, bandwidth))
            if not args.vllm_child:
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "prompt_lens"}), flush=True)

    if args.hf_steps >= 0:
        hf_generate(model, prompts[:8], 4, device)  # warm-up
        hf_new = args.hf_steps or args.max_new_tokens
        hf_s = hf_generate(model, prompts, hf_new, device)
        for row in rows:
            row["hf_new_tokens"], row["hf_s"], row["hf_tok_s"] = hf_new, hf_s, len(prompts) * hf_new / hf_s
            row["speedup"] = row["engine_tok_s"] / row["hf_tok_s"]
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s",
             "| model | engine | batch x new | tok/s | s | first call s | "
             + " | ".join(f"{c} s" for c in VLLM_CALLS) + " | start-up s | load weights s | "
             "HF generate tok/s | HF s | speedup | decode roofline tok/s | of roofline | of shared-prompt roofline |",
             "|---" * (14 + len(VLLM_CALLS)) + "|"]
    for r in rows:
        if "hf_s" in r:
            label = "" if r["hf_new_tokens"] == r["new_tokens"] else f" (first {r['hf_new_tokens']} steps)"
            hf = f"{r['hf_tok_s']:,.0f}{label} | {r['hf_s']:.1f} | {r['speedup']:.1f}x"
        else:
            hf = "- | - | -"
        calls = " | ".join(f"{r['call_s'][c]:.2f}" if c in r.get("call_s", {}) else "-" for c in VLLM_CALLS)
        lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} x {r['new_tokens']} | {r['engine_tok_s']:,.0f} | "
                     f"{r['engine_s']:.2f} | {r.get('first_call_s', float('nan')):.2f} | {calls} | "
                     f"{r['startup_s']:.1f} | {r['load_weights_s']:.4f} | {hf} | "
                     f"{r['roofline_tok_s']:,.0f} | {100 * r['roofline_frac']:.0f}% | "
                     f"{100 * r['roofline_shared_prompt_frac']:.0f}% |")
    lines += ["", "| model | engine | logprob mean abs diff | max abs diff | tokens | bitwise equal | "
              "engine vs HF forward | forward batched vs single | forward SDPA vs eager attention | "
              "engine vs fp32 forward | forward vs fp32 forward | sleep(2) freed | engine memory awake -> asleep | "
              "torch reserved asleep (unmapped) | greedy identical after wake | graphs kept |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, s = r["logprob_parity"], r["sleep"]
        lines.append(f"| {r['model']} | {r['engine']} | {p['mean_abs']:.2e} | {p['max_abs']:.2e} | {p['tokens']} | "
                     f"{100 * p['exactly_equal_frac']:.1f}% | {p['engine_vs_hf_forward_mean_abs']:.2e} | "
                     f"{p['bf16_batched_vs_single_mean_abs']:.2e} | {p['bf16_sdpa_vs_eager_mean_abs']:.2e} | "
                     f"{p['engine_vs_fp32_mean_abs']:.2e} | {p['bf16_vs_fp32_mean_abs']:.2e} | "
                     f"{100 * s['freed_frac']:.1f}% | {s['engine_bytes_awake'] / 2**30:.2f} -> "
                     f"{s['engine_bytes_asleep'] / 2**30:.2f} GiB | {s['torch_reserved_asleep'] / 2**30:.2f} "
                     f"({s['torch_unmapped_asleep'] / 2**30:.2f}) GiB | {s['greedy_identical_after_wake']} | "
                     f"{s['graphs_kept']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["configs/models/qwen2.5-0.5b", "configs/models/qwen2.5-1.5b"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--min-prompt-len", type=int, default=256)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--hf-steps", type=int, default=0,
                        help="HF generate decode steps: 0 = all of them, N = only the first N, -1 = skip HF")
    parser.add_argument("--parity-sequences", type=int, default=32)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="engine and training forward in batch-invariant mode (model.batch_invariant)")
    parser.add_argument("--profile", action="store_true", help="print device time per decode step by kernel")
    parser.add_argument("--engines", nargs="+", default=["native"], choices=["native", "vllm"])
    parser.add_argument("--vllm-variants", nargs="+", default=["{}"],
                        help="JSON objects of extra vllm.LLM arguments (rollout.vllm.kwargs), one engine each")
    parser.add_argument("--native-variants", nargs="+", default=["{}"],
                        help="JSON objects of NativeEngine arguments, one engine each, e.g. '{}' "
                             "'{\"precision\": \"fp8\"}' '{\"precision\": \"fp8\", \"kv_precision\": \"fp8\"}' "
                             "(rollout.precision, rollout.kv_precision, rollout.fp8_scale)")
    parser.add_argument("--no-vllm-calls", dest="vllm_calls", action="store_false",
                        help="skip generating the batch again with each of vLLM's per-call choices undone")
    parser.add_argument("--gpu-memory-utilization", type=float, default=VllmEngineConfig.gpu_memory_utilization,
                        help="vLLM's share of the device (default: the trainer's, rollout.vllm.gpu_memory_utilization)")
    parser.add_argument("--vllm-child", default="", help=argparse.SUPPRESS)  # vllm_in_child's row file
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.vllm_child:  # vLLM joins the process group the trainer would have made: here, one of one
        from rl import parallel

        os.environ.setdefault("MASTER_PORT", "29641")
        device = parallel.init_distributed().device
    bandwidth = copy_bandwidth(device)
    rows = []
    for path in args.models:
        rows += bench_model(path, args, device, dtype, bandwidth)
    if args.vllm_child:
        Path(args.vllm_child).write_text(json.dumps(rows[0]))
        return
    print(table(rows, bandwidth))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                              else "cpu", "copy_bandwidth": bandwidth, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
