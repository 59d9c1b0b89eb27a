"""Paged decode attention (rl/rollout/kernels.py) on the seed's batch layout, over kernel settings,
against a candidate kernel.

    python benchmarks/decode_attention.py [--out FILE.json]

One layer's decode attention for 256 sequences (32 prompts x 8 samples, prompts of 256-512
tokens, 512 tokens generated so far), for the Qwen2.5-0.5B and 1.5B head layouts, in two cache
layouts: the engine's, where a group's samples share their prompt's pages, and one where every
sample has its own copy (same bytes per sequence, 8x the distinct prompt bytes). If the two take
the same time, the shared prompt pages are not saving HBM reads, and a kernel that reads each
prompt page once per group cannot win through bandwidth.

The candidate ("packed") runs one program per (sequence, split) for every KV head at once: it
loads each token's keys and values for all KV heads as one contiguous row and multiplies with a
block-diagonal query tile (each query head's row is zero outside its own KV head's columns), so
the two dots do the GQA routing and the block table is read once per key block for all heads.
It writes the same split partials as the engine's kernel and reuses its merge.

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
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.rollout.kernels import (_attend_block, _decode_merge_kernel, _dot_precision,  # noqa: E402
                                _split_range, _split_result, decode_attention)
from rl.rollout.model import paged_attention_reference  # noqa: E402


@triton.jit
def _packed_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr,
                         part_lse_ptr, scale_log2, q_row_stride, bt_row_stride, num_splits,
                         NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         KV_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start, end = _split_range(context_lens_ptr, seq, split, num_splits, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, KV_DIM)  # every KV head's dims side by side, as a cache row stores them
    own = (h[:, None] // GROUP) == (c // HEAD_DIM)[None, :]
    hmask = h < NUM_HEADS
    q = tl.load(q_ptr + seq * q_row_stride + h[:, None] * HEAD_DIM + (c % HEAD_DIM)[None, :],
                mask=hmask[:, None] & own, other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, KV_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        n = tl.arange(0, BLOCK_N)
        tmask = t0 + n < end
        page = tl.load(block_tables_ptr + seq * bt_row_stride + t0 // PAGE).to(tl.int64)
        offs = (page * PAGE + t0 % PAGE + n)[:, None] * KV_DIM + c[None, :]
        m, l, acc = _attend_block(q, k_cache_ptr, v_cache_ptr, offs, tmask, m, l, acc, scale_log2, DOT_PRECISION)
    out, lse = _split_result(m, l, acc)
    part = (seq * NUM_HEADS + h) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + (c % HEAD_DIM)[None, :], out, mask=hmask[:, None] & own)
    tl.store(part_lse_ptr + part, lse, mask=hmask)


def packed_decode_attention(q, k_cache, v_cache, block_tables, context_lens, page_size: int, scale: float,
                            num_splits: int, block_n: int = 64, num_warps: int = 4, num_stages: int = 2):
    """Same contract as rl.rollout.kernels.decode_attention; needs page_size % block_n == 0."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert page_size % block_n == 0
    part_out = q.new_empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(batch, num_heads, num_splits, dtype=torch.float32)
    _packed_split_kernel[(batch, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale * 1.4426950408889634,
        q.stride(0), block_tables.stride(0), num_splits, NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, KV_DIM=num_kv_heads * head_dim, PAGE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages)
    out = q.new_empty(batch, num_heads * head_dim)
    _decode_merge_kernel[(batch,)](part_out, part_lse, out, num_splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                                   BLOCK_HEADS=triton.next_power_of_2(num_heads), num_warps=4)
    return out


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


KERNELS = {
    "engine": (decode_attention, itertools.product((64,), (4, 8), (2, 3), (1, 2, 4))),
    "packed": (packed_decode_attention, itertools.product((32, 64), (4, 8), (2, 3), (1, 2, 4, 8))),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dev = torch.device(args.device)
    page, groups, n, generated = 64, 32, 8, 512
    settings = {name: list(grid) for name, (_, grid) in KERNELS.items()}
    rows = []
    print("| heads/kv x dim | prompt pages | kernel | block_n | warps | stages | splits | us | GB/s all contexts "
          "| GB/s distinct pages |")
    print("|---|---|---|---|---|---|---|---|---|---|")
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
        for name, (fn, _) in KERNELS.items():
            for block_n, warps, stages, splits in settings[name]:
                def run():
                    return fn(q, k_cache, v_cache, tables, lengths, page, dim ** -0.5, splits,
                              block_n=block_n, num_warps=warps, num_stages=stages)
                err = ((run().float() - want.float()).norm() / want.float().norm()).item()
                assert err < 1e-2, (name, block_n, warps, stages, splits, err)
                us = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
                row = {"heads": heads, "kv_heads": kv_heads, "dim": dim, "shared_prompt": shared, "kernel": name,
                       "block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "us": us}
                rows.append(row)
                print(f"| {heads}/{kv_heads} x {dim} | {'shared' if shared else 'own copy'} | {name} | {block_n} | "
                      f"{warps} | {stages} | {splits} | {us:.1f} | {logical / us / 1e3:.0f} | "
                      f"{distinct / us / 1e3:.0f} |", flush=True)
    print("\nbest per layout and kernel:")
    for key in sorted({(r["heads"], r["shared_prompt"], r["kernel"]) for r in rows}):
        best = min((r for r in rows if (r["heads"], r["shared_prompt"], r["kernel"]) == key), key=lambda r: r["us"])
        print(f"  heads {key[0]}, {'shared' if key[1] else 'own copy'} prompt pages, {key[2]}: {best['us']:.1f} us "
              f"(block {best['block_n']}, warps {best['warps']}, stages {best['stages']}, splits {best['splits']})")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
