"""Paged decode attention (rl/rollout/kernels.py) on the seed's batch layout, over kernel settings.

    python benchmarks/decode_attention.py

One layer's decode attention for 256 sequences (32 prompts x 8 samples sharing their prompt
pages, prompts of 256-512 tokens, 512 tokens generated so far), for the Qwen2.5-0.5B and 1.5B
head layouts. Prints microseconds per call and bandwidth two ways: counting every sequence's
context (what the kernel logically reads) and counting shared prompt pages once (the bytes that
must come from HBM at best).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.rollout.kernels import decode_attention  # noqa: E402
from rl.rollout.model import paged_attention_reference  # noqa: E402


def layout(groups: int, n: int, page: int, generated: int, gen: torch.Generator):
    """Block tables where each group's samples share its prompt's full pages; returns tables, lengths, pages used."""
    tables, lengths, next_page = [], [], 1
    for _ in range(groups):
        prompt = int(torch.randint(256, 513, (1,), generator=gen))
        shared = list(range(next_page, next_page + prompt // page))
        next_page += len(shared)
        for _ in range(n):
            own = -(-(prompt % page + generated) // page)
            tables.append(shared + list(range(next_page, next_page + own)))
            next_page += own
            lengths.append(prompt + generated)
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, torch.tensor(lengths, dtype=torch.int32), next_page


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    page, groups, n, generated = 64, 32, 8, 512
    tables, lengths, pages = layout(groups, n, page, generated, gen)
    tables, lengths = tables.to(dev), lengths.to(dev)
    print("| heads/kv x dim | block_n | warps | stages | splits | us | GB/s all contexts | GB/s unique |")
    print("|---|---|---|---|---|---|---|---|")
    for heads, kv_heads, dim in [(14, 2, 64), (12, 2, 128)]:
        k_cache = torch.randn(pages * page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
        q = qkv[:, : heads * dim].view(-1, heads, dim)
        want = paged_attention_reference(q, k_cache, v_cache, tables, lengths, page)
        per_token = 2 * kv_heads * dim * 2
        logical = int(lengths.sum()) * per_token
        unique = pages * page * per_token
        for block_n, warps, stages, splits in itertools.product((32, 64), (2, 4), (2, 3), (1, 2, 4, 8)):
            def run():
                return decode_attention(q, k_cache, v_cache, tables, lengths, page, dim ** -0.5, splits,
                                        block_n=block_n, num_warps=warps, num_stages=stages)
            err = ((run().float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, err
            us = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
            print(f"| {heads}/{kv_heads} x {dim} | {block_n} | {warps} | {stages} | {splits} | {us:.1f} | "
                  f"{logical / us / 1e3:.0f} | {unique / us / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
