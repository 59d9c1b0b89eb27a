"""The train phase alone: one optimizer step over a seed-sized batch, per model shape and option.

    python benchmarks/train.py [--models configs/models/qwen2.5-0.5b configs/models/qwen2.5-1.5b]
        [--micro-batch-tokens 16384 32768] [--gradient-checkpointing off on] [--repeats 2] [--profile]

256 samples (32 prompts x 8), prompts of 150-512 tokens, responses up to 1024 with the spread of an RL
batch (a third run to the limit, the rest spread below it), random weights, the trainer's own code path
(`build_schedule` + `train_on_rollout`, PPO with reused old logprobs as in the seed's default). For each
model x option it prints the step time (median of --repeats after one warm-up step), tokens/s, MFU (the
model FLOPs of rl/flops.py over the device's dense bf16 peak), the forward-only time of the same
micro-batches, the peak memory and, with --profile, the ten largest device-time entries of one step.
On a CPU (`--models tiny`) it runs a small model as a smoke test.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import AlgoConfig, ModelConfig, TrainConfig  # noqa: E402
from rl.data import Sample  # noqa: E402
from rl.flops import peak_bf16_flops, train_flops  # noqa: E402
from rl.policy import build_optimizer, build_policy  # noqa: E402
from rl.train import build_schedule, token_logprobs, train_on_rollout  # noqa: E402


def seed_batch(vocab: int, samples: int, max_response: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(samples // 8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(150, 512))]
        for k in range(8):
            n = max_response if rng.random() < 1 / 3 else rng.randint(max_response // 10, max_response - 1)
            s = Sample(prompt="", tokens=list(prompt), index=g * 8 + k, group_index=g)
            s.append_response_tokens([rng.randrange(3, vocab) for _ in range(n)], [-math.log(vocab)] * n)
            s.advantage = rng.choice([-1.0, 1.0]) * rng.random()
            out.append(s)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model_dir: str, mbt: int, checkpointing: bool, args, d: parallel.Dist) -> dict:
    policy = build_policy(ModelConfig(path=model_dir, random_init=True, gradient_checkpointing=checkpointing),
                          d.mesh, d.device, seed=0, max_context_len=2048)
    train = TrainConfig(global_batch_size=args.samples, micro_batch_tokens=mbt, lr=1e-6)
    algo = AlgoConfig(eps_clip_high=0.2)
    optimizer, scheduler = build_optimizer(policy, train)
    samples = seed_batch(policy.config.vocab_size, args.samples, args.max_response)
    steps, step_tokens, step_seqs, _ = build_schedule(samples, train, d.rank, d.world_size, d.device)
    times = []
    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    for i in range(args.repeats + 1):  # the first step warms the allocator and kernels up
        sync(d.device)
        t = time.perf_counter()
        train_on_rollout(policy, optimizer, scheduler, steps, step_tokens, d.world_size, train, algo, 1.0, step_seqs)
        sync(d.device)
        if i:
            times.append(time.perf_counter() - t)
    forward_s = 0.0
    for _ in range(2):  # the second pass is timed: the first picks no-grad kernels and allocates
        sync(d.device)
        t = time.perf_counter()
        with torch.no_grad():
            for mb in (mb for step in steps for mb in step):
                token_logprobs(policy, mb, 1.0)
        sync(d.device)
        forward_s = time.perf_counter() - t
    profile = ""
    if args.profile and d.device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            train_on_rollout(policy, optimizer, scheduler, steps, step_tokens, d.world_size, train, algo, 1.0,
                             step_seqs)
            sync(d.device)
        profile = prof.key_averages().table(sort_by="self_device_time_total", row_limit=10)
    lengths = [len(s.tokens) for s in samples]
    step_s = statistics.median(times)
    peak = peak_bf16_flops(d.device)
    row = {"model": Path(model_dir).name, "micro_batch_tokens": mbt, "checkpointing": checkpointing,
           "tokens": sum(lengths), "micro_batches": len(steps[0]), "step_s": step_s,
           "tokens_per_s": sum(lengths) / step_s,
           "mfu": train_flops(policy.config, lengths) / (step_s * d.world_size * peak) if peak else None,
           "forward_s": forward_s,
           "peak_gb": torch.cuda.max_memory_allocated(d.device) / 1e9 if d.device.type == "cuda" else None,
           "profile": profile}
    del policy, optimizer, scheduler, steps
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["configs/models/qwen2.5-0.5b", "configs/models/qwen2.5-1.5b"])
    p.add_argument("--micro-batch-tokens", nargs="+", type=int, default=[16384])
    p.add_argument("--gradient-checkpointing", nargs="+", choices=["off", "on"], default=["off"])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    d = parallel.init_distributed()
    models = list(args.models)
    if models == ["tiny"]:  # CPU smoke test
        from tests.tiny import save_tiny_model_dir
        models = [str(save_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny"))]
    rows = [run(m, mbt, gc == "on", args, d) for m, mbt, gc in
            itertools.product(models, args.micro_batch_tokens, args.gradient_checkpointing)]
    if d.is_main:
        print(f"device: {torch.cuda.get_device_name(d.device) if d.device.type == 'cuda' else 'cpu'}, "
              f"{d.world_size} rank(s), peak {peak_bf16_flops(d.device) or 0:.3g} FLOP/s, torch {torch.__version__}")
        print("| model | micro_batch_tokens | checkpointing | tokens | micro-batches | step s | tokens/s | MFU | "
              "forward-only s | peak GB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
            print(f"| {r['model']} | {r['micro_batch_tokens']} | {r['checkpointing']} | {r['tokens']:,} | "
                  f"{r['micro_batches']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                  f"{r['forward_s']:.2f} | {peak} |")
        for r in rows:
            if r["profile"]:
                print(f"\n{r['model']} micro_batch_tokens={r['micro_batch_tokens']} "
                      f"checkpointing={r['checkpointing']}\n{r['profile']}")
    parallel.teardown()


if __name__ == "__main__":
    main()
