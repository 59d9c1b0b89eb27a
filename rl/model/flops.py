"""Model FLOPs of training, for `perf/train_mfu`: what the model must compute, not what a kernel happens to do.

One training pass over a sequence is a forward and a backward, 3 forwards' worth of matmuls. Per
token, a forward multiplies every weight matrix it uses once (2 FLOPs per weight): the decoder's linear
layers (q, k, v, o and the gated MLP's three; in a mixture of experts the router, the top-k experts the token
is routed to and any shared expert, not every expert) and the lm_head (hidden x vocab, tied or not; the
embedding lookup is no matmul). Causal attention adds, per layer and sequence of length L, QK^T and
AV over the L (L + 1) / 2 visible pairs: 2 x 2 x heads x head_dim FLOPs per pair. Norms, activations,
RoPE and the softmax are left out (a few percent at these shapes), as in the usual MFU counts.
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
    pairs = sum(n * (n + 1) // 2 for n in seq_lens)
    attention = s.num_layers * 4 * s.q_size * pairs
    return 2.0 * weights * sum(seq_lens) + attention


def train_flops(config, seq_lens: list[int], passes: float = 1.0) -> float:
    """Forward + backward over the sequences `passes` times (3 forwards each)."""
    return 3.0 * passes * forward_flops(config, seq_lens)
