"""Paged decode attention (rl/rollout/kernels.py) on the seed's batch layout, over kernel settings.

    python benchmarks/decode_attention.py [--out FILE.json]

One layer's decode attention for 256 sequences (32 prompts x 8 samples, prompts of 256-512
tokens, 512 tokens generated so far), for the Qwen2.5-0.5B and 1.5B head layouts, in two cache
layouts: the engine's, where a group's samples share their prompt's pages, and one where every
sample has its own copy (same bytes per sequence, 8x the distinct prompt bytes). The gap between
the two is what the shared prompt pages already save through L2.

Prints microseconds per call and bandwidth two ways: counting every sequence's context (what the
kernel logically reads) and counting distinct cache pages once (the bytes that must come from HBM
at best).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.rollout.kernels import decode_attention  # noqa: E402
from rl.rollout.model import paged_attention_reference  # noqa: E402


def layout(groups: int, n: int, page: int, generated: int, shared: bool, gen: torch.Generator):
    """Block tables where each group's samples share their prompt's full pages (or each sample
    has its own copy); returns tables, lengths, pages used."""
    tables, lengths, next_page = [], [], 1
    for _ in range(groups):
        prompt = int(torch.randint(256, 513, (1,), generator=gen))
        prompt_pages = prompt // page
        shared_pages = list(range(next_page, next_page + prompt_pages))
        next_page += prompt_pages
        for _ in range(n):
            own_prompt = shared_pages
            if not shared:
                own_prompt = list(range(next_page, next_page + prompt_pages))
                next_page += prompt_pages
            own = -(-(prompt % page + generated) // page)
            tables.append(own_prompt + list(range(next_page, next_page + own)))
            next_page += own
            lengths.append(prompt + generated)
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, torch.tensor(lengths, dtype=torch.int32), next_page


SETTINGS = list(itertools.product((32, 64), (4, 8), (2, 3), (1, 2, 4)))  # block_n, warps, stages, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dev = torch.device(args.device)
    page, groups, n, generated = 64, 32, 8, 512
    rows = []
    print("| heads/kv x dim | prompt pages | block_n | warps | stages | splits | us | GB/s all contexts "
          "| GB/s distinct pages |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (heads, kv_heads, dim), shared in itertools.product([(14, 2, 64), (12, 2, 128)], (True, False)):
        tables, lengths, pages = layout(groups, n, page, generated, shared, torch.Generator().manual_seed(0))
        tables, lengths = tables.to(dev), lengths.to(dev)
        k_cache = torch.randn(pages * page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
        q = qkv[:, : heads * dim].view(-1, heads, dim)
        want = paged_attention_reference(q, k_cache, v_cache, tables, lengths, page)
        per_token = 2 * kv_heads * dim * 2
        logical, distinct = int(lengths.sum()) * per_token, pages * page * per_token
        for block_n, warps, stages, splits in SETTINGS:
            def run():
                return decode_attention(q, k_cache, v_cache, tables, lengths, page, dim ** -0.5, splits,
                                        block_n=block_n, num_warps=warps, num_stages=stages)
            err = ((run().float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, (block_n, warps, stages, splits, err)
            us = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
            rows.append({"heads": heads, "kv_heads": kv_heads, "dim": dim, "shared_prompt": shared,
                         "block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "us": us})
            print(f"| {heads}/{kv_heads} x {dim} | {'shared' if shared else 'own copy'} | {block_n} | {warps} | "
                  f"{stages} | {splits} | {us:.1f} | {logical / us / 1e3:.0f} | {distinct / us / 1e3:.0f} |",
                  flush=True)
    print("\nbest per layout:")
    for key in sorted({(r["heads"], r["shared_prompt"]) for r in rows}):
        best = min((r for r in rows if (r["heads"], r["shared_prompt"]) == key), key=lambda r: r["us"])
        print(f"  heads {key[0]}, {'shared' if key[1] else 'own copy'} prompt pages: {best['us']:.1f} us "
              f"(block {best['block_n']}, warps {best['warps']}, stages {best['stages']}, splits {best['splits']})")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
