"""Model FLOPs of training, for `perf/train_mfu`: what the model must compute, not what a kernel happens to do.

One training pass over a sequence is a forward and a backward, 3 forwards' worth of matmuls. Per
token, a forward multiplies every weight matrix it uses once (2 FLOPs per weight): the decoder's linear
layers (q, k, v, o and the gated MLP's three; in a mixture of experts the router, the top-k experts the token
is routed to and any shared expert, not every expert) and the lm_head (hidden x vocab, tied or not; the
embedding lookup is no matmul). Causal attention adds, per layer and sequence of length L, QK^T and
AV over the L (L + 1) / 2 visible pairs (a sliding-window layer's: each token's last `window`): 2 x 2 x heads x
head_dim FLOPs per pair. A Gated DeltaNet layer (linear attention) has no pairs: per token and value head its
delta rule reads the state along k, writes it back and reads it along q, 3 x 2 x key_dim x value_dim FLOPs.
Norms, activations, RoPE, the short convolution and the softmax are left out (a few percent at these shapes), as
in the usual MFU counts.
"""

from __future__ import annotations

import re

import torch

from rl.model.shape import ModelShape

# Dense bf16 peak of one device from its datasheet (devices not listed get no MFU).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                   "B200": 2250e12}


def peak_bf16_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of a CUDA device of PEAK_BF16_FLOPS, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if re.search(rf"\b{key}\b", name)), None)


def decoder_matmul_params(config) -> int:
    """Weights of the decoder layers' matmuls (biases left out) one token computes with, of a Hugging Face config."""
    return ModelShape.from_hf(config).active_matmul_params


def forward_flops(config, seq_lens: list[int]) -> float:
    """Matmul FLOPs of one forward pass over sequences of these lengths."""
    s = ModelShape.from_hf(config)
    weights = s.active_matmul_params + s.hidden_size * s.vocab_size
    attention = sum(4 * s.q_size * visible_pairs(seq_lens, s.window(i))
                    for i in range(s.num_layers) if not s.is_linear(i))
    linear = len(s.linear_layers) * 6 * s.linear_value_heads * s.linear_key_dim * s.linear_value_dim * sum(seq_lens)
    return 2.0 * weights * sum(seq_lens) + attention + linear


def visible_pairs(seq_lens: list[int], window: int = 0) -> int:
    """(query, key) pairs causal attention computes over sequences of these lengths; with a sliding `window`,
    each token's last `window` (itself included)."""
    if not window:
        return sum(n * (n + 1) // 2 for n in seq_lens)
    return sum(min(n, window) * (min(n, window) + 1) // 2 + max(0, n - window) * window for n in seq_lens)


def train_flops(config, seq_lens: list[int], passes: float = 1.0) -> float:
    """Forward + backward over the sequences `passes` times (3 forwards each)."""
    return 3.0 * passes * forward_flops(config, seq_lens)
