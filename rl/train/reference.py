"""The reference model of the KL term (algo.kl_coef > 0): frozen, sharded like the policy, parked in host memory.

It is the initial policy unless `model.ref_path` names another folder, built by the same
FSDP2 path as the policy (so at the first update the policy-vs-reference KL is exactly 0),
and never receives gradients. It comes onto the device only for the one forward pass per
rollout that gives the reference logprobs of every sample of this rank, and goes back to
pinned host memory before the engine wakes. Nothing is built when kl_coef = 0. With LoRA
(and no `model.ref_path`) nothing is built either: the initial policy is the frozen base the
policy holds, and `BaseOfPolicy` runs the policy with its adapters switched off.
"""

from __future__ import annotations

import dataclasses

import torch

from rl.config import ModelConfig
from rl.train.lora import adapters_off
from rl.train.policy import HostOffloader, build_policy
from rl.train.step import MicroBatch, logprob_rows


class Reference:
    def __init__(self, model: ModelConfig, mesh, device: torch.device, seed: int, max_context_len: int):
        cfg = dataclasses.replace(model, path=model.ref_path or model.path, gradient_checkpointing=False)
        self.model = build_policy(cfg, mesh, device, seed, max_context_len)
        self.model.requires_grad_(False)
        self.model.eval()
        self.device = device
        self.parking = HostOffloader(self.model)
        self.parking.offload()

    def logprobs(self, micro_batches: list[MicroBatch], temperature: float, replay: bool = False
                 ) -> list[torch.Tensor]:
        """Each micro-batch's (B, T-1) logprobs under the reference (`replay`: a MoE's recorded routing, see
        logprob_rows); every rank calls it with as many micro-batches."""
        self.parking.onload(self.device)
        try:
            return logprob_rows(self.model, micro_batches, temperature, replay)
        finally:
            self.parking.offload()


class BaseOfPolicy:
    """The reference of a LoRA policy: the policy's own frozen base, its adapters switched off for the pass."""

    def __init__(self, policy: torch.nn.Module):
        self.model = policy

    def logprobs(self, micro_batches: list[MicroBatch], temperature: float, replay: bool = False
                 ) -> list[torch.Tensor]:
        """Each micro-batch's (B, T-1) logprobs under the base; every rank calls it with as many micro-batches."""
        with adapters_off(self.model):
            return logprob_rows(self.model, micro_batches, temperature, replay)
