"""Triton kernels of the engine's sampler on CUDA: one token per row from the tempered softmax, and its logprob.

Sampling is exact inverse-CDF: every program takes a slice of the vocabulary and writes its max and
sum of exponentials (one exp2 per logit); a second kernel per row draws one uniform (Philox, keyed
by a seed held on the device and bumped after each use, so graph replays draw fresh numbers), finds
the slice the draw lands in from the slice masses, and walks that slice's prefix sums to the token.
Its logprob is under the full tempered softmax. The engine's torch sampler (`sample_tokens` in
rl/rollout/native.py) draws from the same distribution by Gumbel-max, with other noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SAMPLE_SPLITS = 16  # vocabulary slices per row: enough programs to fill the GPU at small batches


@triton.jit
def _sample_split_kernel(logits_ptr, inv_temp_ptr, part_ptr, vocab, row_stride, chunk,
                         SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of x = logits * inv_temp over one slice of one row, in log2 units."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    scale = tl.load(inv_temp_ptr) * 1.4426950408889634
    start = split * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row * row_stride
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(start, end, BLOCK):
        c = off + tl.arange(0, BLOCK)
        run_max = tl.maximum(run_max, tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale)
    m = tl.max(run_max, axis=0)
    safe = tl.where(m > float("-inf"), m, 0.0)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for off in range(start, end, BLOCK):  # the slice is in L2 now: the second read is cheap
        c = off + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale
        run_sum += tl.exp2(x - safe)
    out = part_ptr + (row * SPLITS + split) * 2
    tl.store(out, m)
    tl.store(out + 1, tl.sum(run_sum, axis=0))


@triton.jit
def _sample_pick_kernel(logits_ptr, inv_temp_ptr, seed_ptr, part_ptr, tokens_ptr, logprobs_ptr, vocab, row_stride,
                        chunk, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse-CDF draw: one uniform picks the slice by its mass, then the token inside that slice."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(inv_temp_ptr) * 1.4426950408889634
    s = tl.arange(0, SPLITS)
    m = tl.load(part_ptr + (row * SPLITS + s) * 2)
    gm = tl.max(m, axis=0)
    mass = tl.where(m > float("-inf"), tl.load(part_ptr + (row * SPLITS + s) * 2 + 1) * tl.exp2(m - gm), 0.0)
    total = tl.sum(mass, axis=0)
    u = tl.rand(tl.load(seed_ptr), row.to(tl.int32))
    target = (1.0 - u) * total  # in (0, total]: the crossing always lands on a token of nonzero mass
    below = tl.cumsum(mass, axis=0) < target
    pick = tl.minimum(tl.sum(below.to(tl.int32), axis=0), SPLITS - 1)
    # Rounding can carry the draw past the last slice with mass: step back to the nearest one.
    pick = tl.max(tl.where((mass > 0) & (s <= pick), s, 0), axis=0)
    remaining = target - tl.sum(tl.where(s < pick, mass, 0.0), axis=0)
    start = pick * chunk
    end = tl.minimum(start + chunk, vocab)
    base = logits_ptr + row * row_stride
    token = -1
    last = start
    off = start
    while (off < end) & (token < 0):
        c = off + tl.arange(0, BLOCK)
        x = tl.load(base + c, mask=c < end, other=float("-inf")).to(tl.float32) * scale
        p = tl.exp2(x - gm)
        hit = (tl.cumsum(p, axis=0) >= remaining) & (p > 0)
        first = tl.min(tl.where(hit, c, 2147483647), axis=0)
        token = tl.where(first < 2147483647, first, -1)
        last = tl.maximum(last, tl.max(tl.where(p > 0, c, -1), axis=0))
        remaining -= tl.sum(p, axis=0)
        off += BLOCK
    token = tl.where(token < 0, last, token)  # rounding left a sliver of mass unclaimed: last live token
    x = tl.load(base + token).to(tl.float32) * scale
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, (x - gm - tl.log2(total)) / 1.4426950408889634)


def sample(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V) from softmax(logits * inv_temperature), and its logprob.

    Exact inverse-CDF sampling in two launches: per (row, slice) the max and the sum of exponentials
    (one exp2 per logit), then per row one Philox uniform walks the slices' masses and the chosen
    slice's prefix sums. `inv_temperature` (1,) float32 and `seed` (1,) int64 live on the device;
    the seed is bumped in place so the next call (or graph replay) draws a fresh uniform.
    """
    rows, vocab = logits.shape
    block = 1024
    chunk = triton.cdiv(triton.cdiv(vocab, SAMPLE_SPLITS), block) * block
    parts = logits.new_empty(rows, SAMPLE_SPLITS, 2, dtype=torch.float32)
    _sample_split_kernel[(rows, SAMPLE_SPLITS)](logits, inv_temperature, parts, vocab, logits.stride(0), chunk,
                                                SPLITS=SAMPLE_SPLITS, BLOCK=block, num_warps=4)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_pick_kernel[(rows,)](logits, inv_temperature, seed, parts, tokens, logprobs, vocab, logits.stride(0),
                                 chunk, SPLITS=SAMPLE_SPLITS, BLOCK=block, num_warps=4)
    seed.add_(1)
    return tokens, logprobs

