"""What a new micro-batch shape costs the train phase's attention, per SDPA backend (one CUDA device).

    python benchmarks/attention.py [--shapes 8]

The trainer's attention is SDPA, causal, over right-padded (rows, heads, width, head_dim) bf16 micro-batches
of ~32k tokens, forward and backward. cuDNN's backend builds an execution graph for every shape it has not
seen; flash attention has nothing to build. For the 0.5B (14/2 heads, d=64) and 1.5B (12/2, d=128) shapes,
each backend, and widths drawn at random or rounded up to a multiple of 64 (`rl.train.step.width_multiple`), it
prints the mean time of the first forward + backward of each new shape, of the same shapes once more, and
the first call under the backend (any shape).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128)}
TOKENS = 32768


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def attention(rows: int, width: int, heads: int, kv_heads: int, dim: int):
    def make(h):
        return torch.randn(rows, h, width, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = make(heads), make(kv_heads), make(kv_heads)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", type=int, default=8, help="new widths per row of the table")
    args = p.parse_args()
    rng = random.Random(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| model | backend | widths | first call under the backend ms | new shape, first call ms | "
          "same shape again ms |")
    print("|---|---|---|---|---|---|", flush=True)
    for model, (heads, kv_heads, dim) in SHAPES.items():
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            first_of_process = None
            for kind in ("random", "multiple of 64"):
                widths = [rng.randint(1100, 1536) for _ in range(args.shapes)]
                if kind != "random":
                    widths = [-(-w // 64) * 64 for w in widths]
                steps = [attention(TOKENS // w, w, heads, kv_heads, dim) for w in dict.fromkeys(widths)]
                with sdpa_kernel(backend):
                    if first_of_process is None:
                        first_of_process = timed(attention(4, 100, heads, kv_heads, dim))
                    new = [timed(s) for s in steps]
                    again = [timed(s) for s in steps]
                print(f"| {model} | {backend.name} | {kind} ({len(steps)}) | {first_of_process * 1e3:.0f} | "
                      f"{statistics.mean(new) * 1e3:.1f} | {statistics.mean(again) * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
