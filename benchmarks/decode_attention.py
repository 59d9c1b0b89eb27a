"""Paged decode attention (rl/model/kernels/attention_triton.py) on the seed's batch layout, over kernel settings.

    python benchmarks/decode_attention.py [--out FILE.json]

One layer's decode attention for 256 sequences (32 prompts x 8 samples, prompts of 256-512
tokens, 512 tokens generated so far), for the Qwen2.5-0.5B and 1.5B head layouts, in two cache
layouts: the engine's, where a group's samples share their prompt's pages, and one where every
sample has its own copy (same bytes per sequence, 8x the distinct prompt bytes). The gap between
the two is what the shared prompt pages already save through L2.

Prints microseconds per call and bandwidth two ways: counting every sequence's context (what the
kernel logically reads) and counting distinct cache pages once (the bytes that must come from HBM
at best). Calls are timed inside a CUDA graph of 24 (one decode step's layers), as the engine
replays them; launching each call from Python would time the launches.

    python benchmarks/decode_attention.py --splits-by-rows    # best split count per bucket and context
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.model.kernels.attention import paged_attention_reference  # noqa: E402
from rl.model.kernels.attention_triton import decode_attention  # noqa: E402
from rl.rollout.native import decode_splits  # noqa: E402


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


PAGE = 64  # the engine's page size
SETTINGS = list(itertools.product((32, 64), (4, 8), (2, 3), (1, 2, 4)))  # block_n, warps, stages, splits
HEADS = [(14, 2, 64), (12, 2, 128)]  # Qwen2.5-0.5B and 1.5B: heads, kv heads, head dim


def graph_us(fn, calls: int = 24) -> float:
    """Microseconds per call of `fn`, replayed as a CUDA graph of `calls` back-to-back calls (best of 5)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def cache(heads: int, kv_heads: int, dim: int, rows: int, generated: int, shared: bool, dev: torch.device):
    """(q, k_cache, v_cache, block tables, lengths, distinct pages) for `rows` sequences of the seed's layout."""
    tables, lengths, pages = layout(max(1, rows // 8), min(8, rows), PAGE, generated, shared,
                                    torch.Generator().manual_seed(0))
    k_cache = torch.randn(pages * PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : heads * dim].view(-1, heads, dim)  # strided over rows like the engine's fused projection
    return q, k_cache, torch.randn_like(k_cache), tables.to(dev), lengths.to(dev), pages


def splits_by_rows(dev: torch.device, rows_list: list[int], generated_list: list[int], counts: list[int]) -> None:
    """us per call for each split count over decode buckets and contexts, with the count the engine picks."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("| heads x dim | rows | generated | " + " | ".join(f"{n} splits us" for n in counts) + " | best | engine |")
    print("|---" * (len(counts) + 5) + "|")
    for (heads, kv_heads, dim), rows, generated in itertools.product(HEADS, rows_list, generated_list):
        q, k_cache, v_cache, tables, lengths, _ = cache(heads, kv_heads, dim, rows, generated, True, dev)
        us = {n: graph_us(lambda: decode_attention(q, k_cache, v_cache, tables, lengths, PAGE, dim ** -0.5, n))
              for n in counts}
        print(f"| {heads}x{dim} | {rows} | {generated} | " + " | ".join(f"{us[n]:.1f}" for n in counts) +
              f" | {min(us, key=us.get)} | {decode_splits(rows, kv_heads, dim, sms)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    parser.add_argument("--splits-by-rows", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 128, 256], help="with --splits-by-rows")
    parser.add_argument("--generated", type=int, nargs="+", default=[128, 512, 896], help="with --splits-by-rows")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="with --splits-by-rows")
    args = parser.parse_args()
    dev = torch.device(args.device)
    if args.splits_by_rows:
        splits_by_rows(dev, args.rows, args.generated, args.splits)
        return
    generated = 512
    rows = []
    print("| heads/kv x dim | prompt pages | block_n | warps | stages | splits | us | GB/s all contexts "
          "| GB/s distinct pages |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (heads, kv_heads, dim), shared in itertools.product(HEADS, (True, False)):
        q, k_cache, v_cache, tables, lengths, pages = cache(heads, kv_heads, dim, 256, generated, shared, dev)
        want = paged_attention_reference(q, k_cache, v_cache, tables, lengths, PAGE)
        per_token = 2 * kv_heads * dim * 2
        logical, distinct = int(lengths.sum()) * per_token, pages * PAGE * per_token
        for block_n, warps, stages, splits in SETTINGS:
            def run():
                return decode_attention(q, k_cache, v_cache, tables, lengths, PAGE, dim ** -0.5, splits,
                                        block_n=block_n, num_warps=warps, num_stages=stages)
            err = ((run().float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, (block_n, warps, stages, splits, err)
            us = graph_us(run)
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
