"""FP8 weights for the rollout engine (`rollout.precision = "fp8"`): the quantization maths, pure torch.

A weight (N, K) is held in FP8 e4m3 (`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, largest finite
value 448, no infinities) with float32 scales, one per output channel (N, 1) or one per BLOCK x BLOCK tile
(cdiv(N, BLOCK), cdiv(K, BLOCK)): each group's largest magnitude maps to 448, so w ~= fp8 * scale. A finer
group keeps an outlier from flattening its neighbours: a tile's scale follows its own largest value, a channel's
the largest of its whole row. Rounding to e4m3 moves a scaled value by at most half a step, 2^-4 of its magnitude
(2^-10 below e4m3's smallest normal, 2^-6), so |w - fp8 * scale| <= 2^-4 |w| + 2^-10 scale, element by element.

The product: on CUDA with compute capability >= 8.9, per-channel weights run through `torch._scaled_mm` with
per-token activation scales taken as the activations come (rowwise scaling, fp32 accumulation, bf16 out);
per-block weights, and every other device, dequantize the weight to the activation dtype and call F.linear, so
on the CPU the arithmetic is an ordinary matmul of the dequantized weight. `scaled_mm_reference` computes what
`torch._scaled_mm` computes, on any device, to check its quantization of the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(E4M3).max
BLOCK = 128  # rows and columns of a per-block scale's tile (DeepSeek-V3's, vLLM's fp8_per_block)
MIN_SCALE = 1e-12  # an all-zero group: a finite scale, zeros stay zeros
SCALED_MM_ALIGN = 16  # torch._scaled_mm wants both dimensions of the weight a multiple of this


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale (|x| <= 448 up to float32 rounding) -> e4m3, rounded to nearest.
    Clamped first: a value past 448 would become NaN (e4m3fn has no infinity to saturate to)."""
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (e4m3 (N, K), float32 scales (N, 1)): one scale per output channel (row)."""
    scale = (w.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_(min=MIN_SCALE)
    return to_e4m3(w.float() / scale), scale


def quantize_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (e4m3 (N, K), float32 scales (cdiv(N, block), cdiv(K, block))): one scale per block x block tile,
    the last row and column of tiles cut short where N or K is not a multiple of `block`."""
    n, k = w.shape
    rows, cols = cdiv(n, block), cdiv(k, block)
    tiles = w.float()
    if n % block or k % block:  # zero padding: it never raises a tile's largest magnitude
        tiles = F.pad(tiles, (0, cols * block - k, 0, rows * block - n))
    tiles = tiles.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_(min=MIN_SCALE)
    q = to_e4m3((tiles / scale[:, None, :, None]).view(rows * block, cols * block))  # not in place: w may be tiles
    return q[:n, :k].contiguous() if n % block or k % block else q, scale


def quantize(w: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block` with tiles of `block`, or `quantize_channel` for block 0."""
    return quantize_block(w, block) if block else quantize_channel(w)


def row_scales(scale: torch.Tensor, rows: int, block: int, row_block: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block scales (R, C) -> each row's scales (rows, C). `row_block[i]`: the scale row of weight row i, for a
    matrix fused from tensors quantized each on its own grid (a fused q/k/v); None: row i // block."""
    if row_block is not None:
        return scale[row_block]
    return scale.repeat_interleave(block, dim=0)[:rows]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 0, row_block: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale in `dtype`, (N, K). Every e4m3 value is exact in bf16 and float32; the product rounds once to
    `dtype` (float32: the scale's own 24 bits; bf16: the scale rounded to bf16 first, 2^-9 of it)."""
    w = q.to(dtype)
    if not block:
        return w.mul_(scale.to(dtype))
    n, k = w.shape
    rows = row_scales(scale, n, block, row_block).to(dtype)  # (N, cdiv(K, block))
    if k % block == 0:  # in place, tile column by tile column: no (N, K) scale tensor
        return w.view(n, k // block, block).mul_(rows[:, :, None]).view(n, k)
    return w.mul_(rows.repeat_interleave(block, dim=1)[:, :k])


@dataclass(frozen=True)
class Fp8Weight:
    """One linear layer's FP8 weight as the engine's forward passes it: (N, K) e4m3, its scales, the tile size
    (0: per channel) and, per block, each row's scale row."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: int = 0
    row_block: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block, self.row_block, dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (T, K) -> (e4m3 (T, K), float32 scales (T, 1)): one scale per token, from its own largest
    magnitude, as they come (dynamic)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp_(min=MIN_SCALE)
    return to_e4m3(x.float() / scale), scale


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs e4m3 on `device`: CUDA with compute capability 8.9 (Ada) or later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def uses_scaled_mm(x: torch.Tensor, w: Fp8Weight, scaled_mm: bool) -> bool:
    """Whether `linear` takes torch._scaled_mm for this product: a per-channel weight whose sides it accepts, and
    bf16 activations (its rowwise scaling writes bf16 alone)."""
    n, k = w.weight.shape
    return (scaled_mm and not w.block and x.dtype == torch.bfloat16 and x.dim() == 2
            and n % SCALED_MM_ALIGN == 0 and k % SCALED_MM_ALIGN == 0)


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, scaled_mm: bool = False
           ) -> torch.Tensor:
    """x (T, K) @ W^T (+ bias) in x's dtype. `scaled_mm` (see `scaled_mm_supported`): per-channel weights go
    through torch._scaled_mm with x quantized per token; otherwise W is dequantized to x's dtype for F.linear."""
    if uses_scaled_mm(x, w, scaled_mm):
        xq, x_scale = quantize_rows(x)
        out = torch._scaled_mm(xq, w.weight.t(), scale_a=x_scale, scale_b=w.scale.t(), out_dtype=x.dtype)
        return out if bias is None else out + bias
    return F.linear(x, w.dequantize(x.dtype), bias)


def scaled_mm_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What torch._scaled_mm computes for `linear`, in float32 on any device: x quantized per token, both sides
    dequantized, the product summed in float32."""
    xq, x_scale = quantize_rows(x)
    out = (xq.float() * x_scale) @ w.dequantize(torch.float32).t()
    return out if bias is None else out + bias.float()


# ---------------------------------------------------------------------------------------------- FP8 KV cache

# FP8 KV cache (`rollout.kv_precision = "fp8"`): keys and values stored in e4m3, x ~= fp8 * scale, with float32 scales
# one per (K or V, layer, KV head), set by the first write to the layer after the cache is laid out (`kv_scales`) and
# fixed from then on: the pages of a cache must all read with one scale, so a later, larger value is clamped to
# 448 * scale rather than the scale moved. KV_HEADROOM leaves that much room above the first write's largest value;
# e4m3's normal range spans 2^15, so the headroom costs precision only to values below ~2^-15 x 448 / 4 of the scale.
KV_HEADROOM = 4.0
KV_PER_HEAD = True  # one scale per KV head; False: one per layer (for K and for V), the largest over its heads


def kv_scales(x: torch.Tensor, per_head: bool | None = None) -> torch.Tensor:
    """The scales (KV heads,) float32 of keys or values x (tokens, KV heads, D) that a cache takes from its first
    write: each head's (or the layer's) largest magnitude times KV_HEADROOM maps to 448."""
    amax = x.detach().abs().amax(dim=(0, 2)).float()
    if not (KV_PER_HEAD if per_head is None else per_head):
        amax = amax.amax().expand_as(amax)
    return (amax * (KV_HEADROOM / E4M3_MAX)).clamp_min(MIN_SCALE)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values x (..., KV heads, D) -> e4m3 at the heads' scales (KV heads,): x / scale, clamped to +-448."""
    return to_e4m3(x.float() / scale[:, None])


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 keys or values (..., KV heads, D) at the heads' scales (KV heads,) -> `dtype`."""
    return (x.float() * scale[:, None]).to(dtype)
