"""Triton kernels of the trainer's token log-probs: log p(target), the entropy and their gradient, read
straight from the lm_head's bfloat16 logits.

The torch path of `rl.train.step.TokenLogprobs` (which defines the semantics and runs on the CPU) converts
each chunk of logits to float32 and runs a chain of ops over the vocabulary: divide by the temperature,
logsumexp, gather, softmax, product, sum, and in backward exp, subtract, multiply, scatter. At 16k
tokens x a 152k vocabulary every op is a pass over ~10 GB of float32. Here one program per row reads
its bfloat16 logits once in forward, keeping a running max and, per lane, sums of exponentials and of
exponential x logit (an online softmax), and once more in backward, where it writes the gradient in
the logits' dtype: log p_y = u_y - lse(u) and H = lse(u) - E_p[u] with u = z / T, and
dL/dz_i = g_lp (1[i = y] - p_i) / T - g_H p_i (u_i - E_p[u]) / T.

`rl.train.step.TokenLogprobs` calls `forward` and `backward` on CUDA (imported on first use there);
tests/test_logprob_kernels.py runs them on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # vocabulary lanes per loop step: 75 steps over a 152k vocabulary
NUM_WARPS = 8
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _forward_kernel(logits_ptr, target_ptr, logprob_ptr, entropy_ptr, lse_ptr, vocab, row_stride, inv_t,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)  # running max of u over the blocks read so far; per lane:
    s = tl.zeros([BLOCK], tl.float32)  # sum of exp(u - m)
    t = tl.zeros([BLOCK], tl.float32)  # and sum of exp(u - m) * u
    for v0 in range(0, vocab, BLOCK):
        valid = v0 + lanes < vocab
        u = tl.load(base + v0 + lanes, mask=valid, other=0.0).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(tl.where(valid, u, float("-inf")), axis=0))
        scale = tl.exp2((m - m_new) * LOG2E)  # one exponential per block for the rescale, one per logit below
        e = tl.where(valid, tl.exp2((u - m_new) * LOG2E), 0.0)
        s = s * scale + e
        t = t * scale + e * tl.where(valid, u, 0.0)
        m = m_new
    total = tl.sum(s, axis=0)
    lse = m + tl.log(total)
    mean_u = tl.sum(t, axis=0) / total
    y = tl.load(target_ptr + row)
    u_y = tl.load(base + y).to(tl.float32) * inv_t
    tl.store(logprob_ptr + row, u_y - lse)
    tl.store(entropy_ptr + row, lse - mean_u)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(logits_ptr, target_ptr, lse_ptr, entropy_ptr, grad_lp_ptr, grad_h_ptr, grad_ptr, vocab,
                     row_stride, grad_row_stride, inv_t, HAS_LP: tl.constexpr, HAS_H: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * grad_row_stride
    lanes = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    y = tl.load(target_ptr + row)
    g = tl.load(grad_lp_ptr + row) * inv_t if HAS_LP else 0.0
    if HAS_H:
        gh = tl.load(grad_h_ptr + row) * inv_t
        mean_u = lse - tl.load(entropy_ptr + row)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + lanes
        valid = idx < vocab
        u = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32) * inv_t
        p = tl.exp2((u - lse) * LOG2E)
        d = tl.where(idx == y, g, 0.0) - p * g
        if HAS_H:
            d -= gh * p * (u - mean_u)
        tl.store(out + idx, d.to(grad_ptr.dtype.element_ty), mask=valid)


def forward(logits: torch.Tensor, target: torch.Tensor, temperature: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), entropy, log-normaliser) per row of `logits` (rows, vocab) under softmax(logits / T),
    in float32."""
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
    if rows:
        _forward_kernel[(rows,)](logits, target.contiguous(), logprobs, entropy, lse, vocab, logits.stride(0),
                                 1.0 / temperature, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return logprobs, entropy, lse


def backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
             grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """d(loss)/d(logits) in the logits' dtype, from the gradients of `forward`'s log-probs and entropy (None:
    that output went unused)."""
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    grad = torch.empty_like(logits)
    rows, vocab = logits.shape
    if rows:
        _backward_kernel[(rows,)](
            logits, target.contiguous(), lse, entropy,
            grad_logprobs.contiguous() if grad_logprobs is not None else lse,
            grad_entropy.contiguous() if grad_entropy is not None else lse,
            grad, vocab, logits.stride(0), grad.stride(0), 1.0 / temperature,
            HAS_LP=grad_logprobs is not None, HAS_H=grad_entropy is not None, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return grad
