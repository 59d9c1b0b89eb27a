"""What keeping the decode graphs across sleep saves: one generate per batch-size bucket, before a
sleep(2) and after wake + load, with the engine's stable memory on (graphs kept) and off (graphs
dropped at sleep and captured again on first use).

    python benchmarks/sleep_graphs.py [--models configs/models/qwen2.5-0.5b ...]

Random bf16 weights, 256 random prompts of 256-512 tokens (32 x 8 samples), 16 new tokens per call;
prints a table. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import all_weights, random_prompts  # noqa: E402

from rl.rollout import SamplingParams  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402


def walk(engine: NativeEngine, prompts: list[list[int]], sizes: list[int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in sizes:
        engine.generate(prompts[:n], SamplingParams(max_new_tokens=16, temperature=1.0))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["configs/models/qwen2.5-0.5b", "configs/models/qwen2.5-1.5b"])
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| model | graphs across sleep | walk over every bucket s | same walk after sleep(2) + wake + load s |")
    print("|---|---|---|---|")
    for path in args.models:
        cfg = AutoConfig.from_pretrained(path)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        prompts = [p for p in random_prompts(cfg.vocab_size, 32, 256, 512) for _ in range(8)]
        for stable in (True, False):
            engine = NativeEngine(cfg, device, torch.bfloat16, max_batch_size=256, seed=0, max_context_len=1536,
                                  stable_memory=stable)
            engine.load_weights(all_weights(model))
            walk(engine, prompts, engine.buckets[::-1])  # compiles kernels, captures every bucket
            before = walk(engine, prompts, engine.buckets[::-1])
            engine.sleep(2)
            engine.wake_up(["weights"])
            engine.load_weights(all_weights(model))
            engine.wake_up(["kv_cache"])
            after = walk(engine, prompts, engine.buckets[::-1])
            print(f"| {Path(path).name} | {'kept' if engine.stable else 'dropped'} | {before:.2f} | {after:.2f} |",
                  flush=True)
            engine.close()
            del engine
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
