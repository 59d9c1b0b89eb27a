"""The native engine's decode step against the rows it runs: its fixed part, its part a row, and what they are made of.

    python benchmarks/decode_step.py [--model configs/models/qwen2.5-0.5b] [--context 768] [--rows 8 16 ... 512]

Partial rollouts under a staleness bound run ~100-250 rows a decode step on the bundled task (benchmarks/RESULTS.md,
"A natural long tail on the real model"), where a step's fixed part weighs most: this measures it on its own. For
each rows count, `rows / samples` random prompts of `context` tokens, each taken `samples` times (a group's samples
share their prompt's pages, as in a rollout), generate with no stop ids, so every row lives through every step:

- wall ms a step: (a call of 1 + steps tokens - a call of 1 token) / the decode steps between them, with the
  engine's CUDA graphs and polls as a rollout runs them (the median of `--repeats`);
- device ms a step: the sum of the step's kernel times (the profiler over eager steps: a graph replays the same
  kernels), and the kernels a step; wall minus device is what the device waits between kernels.

Then a least-squares line over the rows counts for each (fixed ms + us a row), and the kernels that make up the
step at the fewest and the most rows. Random bf16 weights. On a CPU it runs for the wiring (no graphs, no kernel
profile).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rollout import all_weights, decode_kernels, random_prompts, sync  # noqa: E402

from rl.rollout import SamplingParams  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402


def wall_ms(engine: NativeEngine, prompts: list[list[int]], steps: int, repeats: int) -> float:
    """Milliseconds a decode step: a call of 1 + steps tokens less a call of 1 (the prefill and its token)."""
    def call(tokens: int) -> tuple[float, int]:
        before = engine.stats.decode_steps
        sync(engine.device)
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=tokens, temperature=1.0))
        sync(engine.device)
        return time.perf_counter() - start, engine.stats.decode_steps - before

    call(1 + steps)  # warm-up: the bucket's graph captured, kernels compiled
    per_step = []
    for _ in range(repeats):
        (short, short_steps), (long, long_steps) = call(1), call(1 + steps)
        per_step.append((long - short) / (long_steps - short_steps) * 1e3)
    return statistics.median(per_step)


def fit(rows: list[int], ms: list[float]) -> tuple[float, float]:
    """Least squares ms = fixed + rows x per_row: (fixed ms, us a row)."""
    slope, intercept = statistics.linear_regression(rows, ms)
    return intercept, slope * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "configs/models/qwen2.5-0.5b"), help="a config folder")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 192, 256, 384, 512])
    p.add_argument("--context", type=int, default=768, help="tokens of each prompt (a row's context)")
    p.add_argument("--samples", type=int, default=8, help="rows that share a prompt")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed a call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels listed at the fewest and the most rows")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if any(r % args.samples for r in args.rows):
        p.error(f"--rows: each a multiple of --samples ({args.samples})")
    cfg = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    engine = NativeEngine(cfg, device, dtype, max_batch_size=max(args.rows), seed=0,
                          max_context_len=args.context + args.steps + 16)
    engine.load_weights(all_weights(model))
    del model
    profiled = device.type == "cuda"
    results, kernels = [], {}
    for rows in args.rows:
        distinct = random_prompts(cfg.vocab_size, rows // args.samples, args.context, args.context)
        prompts = [prompt for prompt in distinct for _ in range(args.samples)]
        ms = wall_ms(engine, prompts, args.steps, args.repeats)
        kernels[rows] = decode_kernels(engine, prompts, min(args.steps, 32)) if profiled else {}
        device_ms = sum(k[0] for k in kernels[rows].values())
        launches = sum(k[1] for k in kernels[rows].values())
        results.append((rows, ms, device_ms, launches))
        print(f"rows {rows}: {ms:.3f} ms a step, device {device_ms:.3f} ms, {launches:.0f} kernels", flush=True)

    print(f"\n{cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; {args.context}-token "
          f"contexts, {args.samples} rows a prompt; {torch.cuda.get_device_name(device) if profiled else 'cpu'}\n")
    print("| rows | wall ms a step | tokens/s | device ms a step | kernels a step | waits ms a step |")
    print("|---|---|---|---|---|---|")
    for rows, ms, device_ms, launches in results:
        waits = f"{ms - device_ms:.3f}" if profiled else "-"
        print(f"| {rows} | {ms:.3f} | {rows / ms * 1e3:,.0f} | {device_ms:.3f} | {launches:.0f} | {waits} |")
    counts = [r[0] for r in results]
    if len(counts) > 1:
        fixed, per_row = fit(counts, [r[1] for r in results])
        print(f"\nwall: {fixed:.3f} ms + {per_row:.2f} us a row", end="")
        if profiled:
            fixed, per_row = fit(counts, [r[2] for r in results])
            print(f"; device: {fixed:.3f} ms + {per_row:.2f} us a row", end="")
        print()
    for rows in sorted({min(counts), max(counts)}) if profiled else []:
        top = sorted(kernels[rows].items(), key=lambda kv: -kv[1][0])[: args.top]
        print(f"\nkernels at {rows} rows (ms a step, launches a step):")
        for name, (ms, count) in top:
            print(f"  {ms:7.4f}  {count:5.1f}  {name}")


if __name__ == "__main__":
    main()
