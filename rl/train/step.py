"""One rollout's worth of optimizer steps on the FSDP2 policy, and how a rollout is cut into them.

`build_schedule` splits the rollout into global batches, one per optimizer step, each
into length-balanced DP shares and micro-batches. The loss is
aggregated over the whole global batch of a step (every rank divides by the same global
token or sequence count, `rl.train.algo.aggregate`), so results do not depend on how samples
were split into micro-batches or ranks. `optimizer_steps` runs those steps for any loss:
the policy's here, the critic's value loss in rl/train/critic.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rl import parallel
from rl.config import AlgoConfig, RunStopped, TrainConfig
from rl.data import Sample, Status
from rl.model.expert_parallel import expert_grad_square_norm, reduce_expert_grads
from rl.model.moe import mismatch_counts, no_router_outputs, router_aux_coef, router_aux_loss, set_routing_replay
from rl.train.algo import (
    aggregate,
    approx_kl_k3,
    can_reuse_old_logprobs,
    kl_penalty,
    masked_sum,
    needs_old_logprobs,
    policy_loss,
    tis_weights,
)
from rl.train.packing import Documents, cut_packed, documents, packed_forward, packed_width, unpack

# ---------------------------------------------------------------------------- batches and logprobs


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, T), right-padded
    loss_mask: torch.Tensor  # (B, T-1), 1 where target t+1 is a trained response token
    advantages: torch.Tensor  # (B, T-1)
    rollout_logprobs: torch.Tensor  # (B, T-1)
    indices: list[int]  # Sample.index of each row
    # train.packing: input_ids is one packed row (1, W) instead, and the forward's per-token outputs are read
    # back into the (B, T-1) rows of the samples; every other tensor keeps one row per sample
    documents: Documents | None = None
    # (B, T-1) rows of the passes before the update (`Learner.fill_micro_batches`), None where none ran: the
    # policy's old logprobs (`needs_old_logprobs`, algo.kl_in_reward), the reference's (algo.kl_coef > 0), and
    # the critic's values and the returns it trains towards (GAE)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # A mixture of experts' recorded routing (Sample.routed_experts) in the forward's token layout: (MoE layers,
    # input tokens flattened row by row, k) int16 on the host, at each input token the experts the engine fed that
    # token with (-1: none: padding, the last token, a sample without a record), and (input tokens,) bool, the
    # trained response tokens `train/routing_mismatch` counts; None without any record (a dense model, vLLM)
    routed_experts: torch.Tensor | None = None
    routing_mask: torch.Tensor | None = None
    lengths: list[int] | None = None  # each sample's tokens (the real tokens the router's aux loss averages over)
    # (differing, counted) routings of the old-logprob pass (`fill_old_logprobs`), for train/routing_mismatch
    routing_counts: tuple[torch.Tensor, torch.Tensor] | None = None


def routing_layout(samples: list[Sample], starts: list[int], total: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The samples' recorded routing laid out as a forward of `total` input tokens feeds them, sample k's token i
    at input position starts[k] + i (the forward there computes that token with those experts, and predicts token
    i + 1 from it), and the mask of their trained response tokens; (None, None) when no sample has a record."""
    first = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    if first is None:
        return None, None
    layers, k = first.shape[0], first.shape[-1]
    experts = torch.full((layers, total, k), -1, dtype=torch.int16)
    mask = torch.zeros(total, dtype=torch.bool)
    for s, start in zip(samples, starts, strict=True):
        record, n = s.routed_experts, len(s.tokens)
        if record is None:
            continue
        if tuple(record.shape) != (layers, n, k):
            raise ValueError(f"sample {s.index}: routed_experts of shape {list(record.shape)}, its {n} tokens want "
                             f"({layers}, {n}, {k})")
        experts[:, start : start + n] = record
        mask[start + s.prompt_length : start + n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return experts, mask


def collate(samples: list[Sample], device: torch.device, pad_token_id: int = 0, width: int = 0) -> MicroBatch:
    """Right-padded micro-batch (to `width`, or the longest row); targets are shifted by one so row t predicts
    token t+1. The rows are filled in numpy: torch.tensor converts a Python list ~7x slower, and a seed rollout's
    ~360k tokens took ~0.15 s of a train phase in which the device had nothing to do yet."""
    width = max(width, *(len(s.tokens) for s in samples))
    input_ids = np.full((len(samples), width), pad_token_id, dtype=np.int64)
    for i, s in enumerate(samples):
        input_ids[i, : len(s.tokens)] = s.tokens
    mb = _collate_targets(samples, device, torch.from_numpy(input_ids).to(device), width)
    mb.routed_experts, mb.routing_mask = routing_layout(samples, [i * width for i in range(len(samples))],
                                                        len(samples) * width)
    return mb


def _collate_targets(samples: list[Sample], device: torch.device, input_ids: torch.Tensor, width: int) -> MicroBatch:
    """A micro-batch of `input_ids` with the samples' loss mask, advantages and rollout logprobs as (rows, width - 1)
    target rows, each sample's at its response tokens' targets."""
    loss_mask, advantages, rollout_logprobs = (np.zeros((len(samples), width - 1), dtype=np.float32) for _ in range(3))
    for i, s in enumerate(samples):
        start, end = s.prompt_length - 1, s.prompt_length - 1 + s.response_length
        loss_mask[i, start:end] = s.loss_mask
        advantages[i, start:end] = s.advantage
        rollout_logprobs[i, start:end] = s.rollout_log_probs
    return MicroBatch(input_ids, *(torch.from_numpy(a).to(device) for a in (loss_mask, advantages, rollout_logprobs)),
                      [s.index for s in samples], lengths=[len(s.tokens) for s in samples])


def collate_packed(samples: list[Sample], device: torch.device, width: int, max_seqlen: int,
                   pad_token_id: int = 0) -> MicroBatch:
    """`collate`'s target rows, with the forward's input one packed row (train.packing): the samples back to back,
    then padding to `width`. The last token of a sample predicts the next sample's first, a target never read."""
    lengths = [len(s.tokens) for s in samples]
    total = sum(lengths)
    packed = np.full((1, width), pad_token_id, dtype=np.int64)
    packed[0, :total] = np.fromiter(itertools.chain.from_iterable(s.tokens for s in samples), np.int64, total)
    docs = documents(lengths, width, max_seqlen, max(lengths) - 1, device)
    experts, mask = routing_layout(samples, [0, *itertools.accumulate(lengths)][:-1], width)
    return dataclasses.replace(_collate_targets(samples, device, torch.from_numpy(packed).to(device), max(lengths)),
                               documents=docs, routed_experts=experts, routing_mask=mask)


def causal_forward(model: torch.nn.Module, input_ids: torch.Tensor):
    """The model's output over right-padded rows. No attention mask: under the causal mask a real token
    never sees the padding after it, and without a mask SDPA runs its flash kernels, where a padding mask
    sent it to a masked kernel. Positions are 0.. in every row, given per row: RoPE's cos and sin then come
    as (rows, length, head_dim), which a compiled block's RoPE kernel indexes by token (measured a little
    faster than the (1, length, head_dim) of the model's default positions).

    When the model names its layers' attention kinds (`config.layer_types`, as Qwen2 does) and all of them
    attend causally over the whole context, it gets its mask mapping prepared (no mask for any layer): left
    to build one, it reads a device flag back to look for packed sequences in the positions, a host sync in
    every forward."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    if set(getattr(getattr(model, "config", None), "layer_types", None) or ["other"]) == {"full_attention"}:
        return model(input_ids=input_ids, attention_mask={"full_attention": None}, position_ids=positions,
                     use_cache=False, **no_router_outputs(model))
    return model(input_ids=input_ids, position_ids=positions, use_cache=False, **no_router_outputs(model))


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), both (B, T-1): log p(token t+1 | <= t) under logits / temperature."""
    if mb.documents is None:
        logits = causal_forward(model, mb.input_ids).logits
    else:
        logits = packed_forward(model, mb.input_ids, mb.documents).logits
    b, t, vocab = logits.shape
    # Every position gets a target (the last one a dummy) so the logits stay one contiguous (B*T, V) view.
    target = torch.cat([mb.input_ids[:, 1:], mb.input_ids.new_zeros(b, 1)], dim=1).reshape(-1)
    kernels = None
    if FUSED_LOGPROBS and logits.is_cuda:
        import rl.model.kernels.logprobs_triton as kernels
    logprobs, entropy = TokenLogprobs.apply(logits.reshape(-1, vocab), target, temperature,
                                            max(1, LOGPROB_CHUNK_BYTES // (4 * vocab)), kernels)
    logprobs, entropy = logprobs.view(b, t)[:, :-1], entropy.view(b, t)[:, :-1]
    if mb.documents is not None:  # the packed row's targets back into the samples' rows
        return unpack(logprobs, mb.documents), unpack(entropy, mb.documents)
    return logprobs, entropy


FUSED_LOGPROBS = True  # on CUDA, rl/model/kernels/logprobs_triton.py: one read of the bf16 logits forward, one backward


LOGPROB_CHUNK_BYTES = 1 << 29  # float32 logits materialised at once: ~880 rows of a 152k vocabulary


class TokenLogprobs(torch.autograd.Function):
    """log p(target) and the entropy of softmax(logits / T), in float32.

    With `kernels` (rl/model/kernels/logprobs_triton.py, on CUDA) Triton kernels read the logits once each way. Without,
    torch ops run over row chunks in float32, and only one chunk of float32 logits exists at a time:
    forward keeps the per-row log-normaliser, and backward rebuilds each chunk's softmax from it
    (d log p_y / d z_i = (1[i = y] - p_i) / T) instead of autograd holding (rows, vocab) float32
    activations, which at 16k tokens and a 152k vocabulary are ~10 GB each. The entropy H gets a gradient
    only when a loss uses it (algo.entropy_coef): with u = z / T, dH / du_i = -p_i (u_i - E_p[u]) and
    E_p[u] = logsumexp(u) - H.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk: int, kernels=None):
        if kernels is not None:
            logprobs, entropy, lse = kernels.forward(logits, target, temperature)
        else:
            rows = logits.shape[0]
            logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
            entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
            for s in range(0, rows, chunk):
                z = logits[s : s + chunk].float() / temperature
                lse[s : s + chunk] = norm = torch.logsumexp(z, dim=-1)
                logprobs[s : s + chunk] = z.gather(-1, target[s : s + chunk, None]).squeeze(-1) - norm
                entropy[s : s + chunk] = norm - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, target, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.kernels = temperature, chunk, kernels
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, target, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        if ctx.kernels is not None:
            return ctx.kernels.backward(logits, target, lse, entropy, grad_logprobs, grad_entropy, t), *[None] * 4
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            u = logits[rows].float().div_(t)
            p = u.sub(lse[rows, None]).exp_()
            g = grad_logprobs[rows, None] / t if grad_logprobs is not None else p.new_zeros(p.shape[0], 1)
            if grad_entropy is not None:  # in u's memory: -p (u - E_p[u]) dH / T
                u.sub_((lse[rows] - entropy[rows])[:, None]).mul_(p).mul_(-grad_entropy[rows, None] / t)
            d = p.mul_(-g)
            if grad_entropy is not None:
                d.add_(u)
            grad[rows] = d.scatter_add_(1, target[rows, None], g)
        return grad, None, None, None, None


# ---------------------------------------------------------------------------- the schedule


CUDA_WIDTH_MULTIPLE = 64  # micro-batch widths on CUDA; see `width_multiple`


def width_multiple(device: torch.device) -> int:
    """What micro-batch widths are rounded up to. On CUDA, SDPA's cuDNN kernels build a graph for every new
    (rows, width) shape, 0.1-0.3 s each (forward and backward, measured on an H200), and every rollout brings
    new lengths; rounded widths make the shapes repeat, so after the first rollouts every shape is built.
    The cost is ~32 padded tokens a row. Elsewhere no rounding."""
    return CUDA_WIDTH_MULTIPLE if device.type == "cuda" else 1


@dataclass
class Schedule:
    """One rollout's optimizer steps as this rank runs them (`build_schedule`)."""

    steps: list[list[MicroBatch]]  # this rank's micro-batches of each global batch, one optimizer step each
    step_tokens: list[int]  # each global batch's loss tokens over all ranks: what a token mean divides by
    step_seqs: list[int]  # each global batch's sequences with a loss token over all ranks
    padding: int  # zero-loss micro-batches over all ranks, added so that every rank runs as many passes

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """Every micro-batch of this rank, step by step: what each pass before the update runs over."""
        return [mb for step in self.steps for mb in step]


def build_schedule(samples: list[Sample], train: TrainConfig, rank: int, world_size: int, device,
                   max_width: int = 0, skip: frozenset[int] = frozenset()) -> Schedule:
    """The rollout's global batches in order, each split across DP ranks by balanced length, then
    this rank's share cut into micro-batches, with each global batch's loss token and sequence counts over all
    ranks (the loss aggregation's denominators) and the padding micro-batches added. Widths are rounded up
    (`width_multiple`), never past `max_width` (the context the model was checked for) when it is given.
    With train.packing, each micro-batch is one packed row instead (rl/train/packing.py).

    Samples whose Sample.index is in `skip` (`skippable_samples`: they add nothing to the loss) run no pass
    (but for the few that even out the ranks' counts), and still count in the step's token and sequence
    totals: the loss divides by the same numbers as without the skip, so the gradient is the same.

    Every rank holds the whole rollout, so each one computes every rank's cut and pads its own list
    to the longest with zero-loss copies of a real micro-batch: FSDP's collectives need all ranks
    to run the same number of forward/backward passes.

    With train.routing_replay every sample must bring its recorded routing (`check_routing`)."""
    if train.routing_replay:
        check_routing(samples)
    steps, step_tokens, step_seqs, padding = [], [], [], 0
    for start in range(0, len(samples), train.global_batch_size):
        batch = samples[start : start + train.global_batch_size]
        trained = [s for s in batch if s.index not in skip]
        # The ranks take equal counts: a few skippable samples (the shortest) train after all, at zero advantage,
        # when the rest do not split evenly (a sample whose reward is its group's mean has advantage 0 too).
        skipped = sorted((s for s in batch if s.index in skip), key=lambda s: len(s.tokens))
        trained += skipped[: -len(trained) % world_size]
        parts = parallel.balanced_partition([float(len(s.tokens)) for s in trained], world_size)
        shares = [sorted((trained[i] for i in part), key=lambda s: len(s.tokens)) for part in parts]  # less padding
        cuts, mine = cut_share(shares, rank, train, torch.device(device), max_width,
                               min(batch, key=lambda s: len(s.tokens)))
        count = max(1, *map(len, cuts))
        mine += [zero_loss(mine[0]) for _ in range(count - len(mine))]
        padding += sum(count - len(c) for c in cuts)
        steps.append(mine)
        step_tokens.append(sum(sum(s.loss_mask) for s in batch))
        step_seqs.append(sum(any(s.loss_mask) for s in batch))
    return Schedule(steps, step_tokens, step_seqs, padding)


def check_routing(samples: list[Sample]) -> None:
    """train.routing_replay: every sample carries the routing it was generated with, or the step stops in one line
    (a sample without one would train on the trainer's own routing, silently unreplayed)."""
    missing = [s.index for s in samples if s.routed_experts is None]
    if missing:
        raise RunStopped(f"train.routing_replay: {len(missing)} of {len(samples)} samples carry no recorded routing "
                         f"(Sample.routed_experts of samples {missing[:5]}): the rollout engine recorded none, and "
                         f"they would train unreplayed")


def cut_share(shares: list[list[Sample]], rank: int, train: TrainConfig, device: torch.device, max_width: int,
              filler: Sample) -> tuple[list[list[Sample]], list[MicroBatch]]:
    """Every rank's cut of its share (shortest first) into micro-batches, and this rank's collated. A rank whose
    share is empty (every sample skipped) gets one zero-loss micro-batch, of padding or of `filler`."""
    multiple = width_multiple(device)
    if train.packing:
        budget = train.micro_batch_tokens
        longest_first = [share[::-1] for share in shares]
        cuts = [[[share[i] for i in row] for row in cut_packed([len(s.tokens) for s in share], budget)]
                for share in longest_first]
        mine = [collate_packed(mb, device, packed_width(sum(len(s.tokens) for s in mb), budget, multiple),
                               max_width or budget) for mb in cuts[rank]]
        return cuts, mine or [zero_loss(collate_packed([filler], device, packed_width(len(filler.tokens), budget,
                                                                                    multiple), max_width or budget))]

    def width(n: int) -> int:
        rounded = -(-n // multiple) * multiple
        return max(n, min(rounded, max_width)) if max_width else rounded

    cuts = [cut_micro_batches(share, train.micro_batch_size, train.micro_batch_tokens, width) if share else []
            for share in shares]
    mine = [collate(mb, device, width=width(max(len(s.tokens) for s in mb))) for mb in cuts[rank]]
    return cuts, mine or [zero_loss(collate([filler], device, width=width(len(filler.tokens))))]


def skippable_samples(samples: list[Sample], algo: AlgoConfig) -> frozenset[int]:
    """Sample.index of the samples that add nothing to the loss or its gradient: no trained token (a response
    masked by algo.mask_truncated), or a zero advantage on every trained token (a GRPO-family group whose rewards
    are all equal), which makes every policy loss, and the importance weights times it, exactly 0. Terms that do
    not go through the advantage keep the latter: the entropy bonus, the KL in the loss, and KL folded into the
    reward or GAE, whose advantages are only known in the train phase."""
    untrained = frozenset(s.index for s in samples if not any(s.loss_mask))
    if algo.entropy_coef > 0 or algo.kl_coef > 0 or algo.advantage_estimator == "gae":
        return untrained
    return untrained | frozenset(s.index for s in samples if s.advantage == 0.0)


def mask_truncated(samples: list[Sample]) -> int:
    """algo.mask_truncated: every response that hit its token limit (Status.TRUNCATED) gets an all-zero loss mask,
    so it adds no token, sequence or gradient to the loss (TRL's mask_truncated_completions); its reward has counted
    in its group's baseline already. Returns how many were masked."""
    hit = [s for s in samples if s.status == Status.TRUNCATED]
    for s in hit:
        s.loss_mask = [0] * len(s.loss_mask)
    return len(hit)


def cut_micro_batches(samples: list[Sample], size: int, token_budget: int, width=lambda n: n
                      ) -> list[list[Sample]]:
    """Consecutive runs of `samples` (shortest first): `size` rows each, or, with a token budget,
    as many rows as fit when every row is padded to `width(the run's longest)`."""
    if token_budget <= 0:
        return [samples[i : i + size] for i in range(0, len(samples), size)]
    out: list[list[Sample]] = [[]]
    for s in samples:
        if out[-1] and (len(out[-1]) + 1) * width(len(s.tokens)) > token_budget:
            out.append([])
        out[-1].append(s)
    return out


def zero_loss(mb):
    """A micro-batch that runs forward and backward but adds nothing to the loss or the metrics."""
    return dataclasses.replace(mb, loss_mask=torch.zeros_like(mb.loss_mask),
                               routing_mask=None if mb.routing_mask is None else torch.zeros_like(mb.routing_mask))


# ---------------------------------------------------------------------------- the train step


def add_mismatch(sums: dict[str, torch.Tensor], train_lp: torch.Tensor, rollout_lp: torch.Tensor,
                 mask: torch.Tensor, indices: list[int], per_sample: list) -> None:
    """Rollout-vs-trainer log-prob mismatch on the same tokens, before any update (what TIS relies on);
    each sample's mean |difference| goes to `per_sample` as (indices, sums, tokens), read once at the end."""
    diff = (train_lp.detach() - rollout_lp).abs() * mask
    per_sample.append((indices, diff.sum(-1), mask.sum(-1)))
    sums["mismatch_abs_sum"] += diff.sum()
    sums["mismatch_abs_max"] = torch.maximum(sums["mismatch_abs_max"], diff.max() if diff.numel() else diff.sum())
    # Tokens were drawn from the rollout policy, so k3 estimates KL(rollout || trainer).
    k3 = approx_kl_k3(rollout_lp, train_lp.detach()) * mask
    sums["mismatch_k3_sum"] += k3.sum()
    sums["mismatch_k3_max"] = torch.maximum(sums["mismatch_k3_max"], k3.max() if k3.numel() else k3.sum())
    sums["mismatch_tokens"] += mask.sum()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """The gradient's L2 norm over the whole model, and the clip to `max_norm` (0: none). Experts split by expert
    parallelism (plain tensors beside FSDP2's DTensors) add their squared norm, each slice counted once
    (`expert_grad_square_norm`); the two kinds are clipped apart, as torch's multi-tensor kernels refuse a mix."""
    sharded, experts = [], []
    for p in model.parameters():
        (experts if hasattr(p, "expert_group") else sharded).append(p)  # `split_experts`' test
    total = torch.nn.utils.get_total_norm([p.grad for p in sharded if p.grad is not None], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if experts:
        total = (total.float().square() + expert_grad_square_norm(experts).to(total.device)).sqrt()
    if max_norm > 0:
        for params in (sharded, experts):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 module of `model` back to its shards (`FSDPModule.reshard` frees only its own parameters):
    after the passes of an optimizer step, which keep them gathered with model.reshard_after_forward=false."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def optimizer_step(model, optimizer, scheduler, step_loss: torch.Tensor, max_norm: float) -> tuple[float, bool]:
    """Clips the gradients and steps, unless the step's loss or grad norm is not finite on any rank: then every
    rank skips it, so the weights keep their last finite values. Returns (grad norm, skipped)."""
    reshard(model)  # the shards hold the gradients, and the step's update is gathered afresh by the next pass
    if getattr(model, "expert_groups", None):  # experts split over ranks: averaged as FSDP2 averages the rest
        reduce_expert_grads(model, model.expert_groups[1])
    grad_norm = clip_grad_norm(model, max_norm)
    skipped = bool(parallel.all_reduce_max(float(not (torch.isfinite(step_loss) and math.isfinite(grad_norm)))))
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def reduce_once(model, dp_size: int) -> bool:
    """Whether an optimizer step's gradients are reduced once, after its last micro-batch, rather than after each.
    On one rank FSDP2's reduction only moves the gradients into their shards, yet it concatenates and copies
    every block's gradients each micro-batch: in a profiled step of a 2B MoE on one H100 (27 micro-batches of
    8192 tokens, a host-bound step) 0.19 s of the device's time and 0.65 s of the host's. Skipped, FSDP2 keeps
    them unsharded and float32 across the micro-batches, as large as the shards they replace on one rank. Over
    several ranks that would be the whole model's gradients on every rank, so there they are reduced each
    micro-batch (and the reduction overlaps the backward)."""
    return dp_size == 1 and hasattr(model, "set_requires_gradient_sync")


def optimizer_steps(model, optimizer, scheduler, steps: list[list[MicroBatch]], step_totals: list, dp_size: int,
                    max_norm: float, loss: Callable[[int, MicroBatch, Any], torch.Tensor]
                    ) -> tuple[list[float], list[bool]]:
    """One optimizer step per global batch: every micro-batch of this rank runs forward and backward, then
    `optimizer_step` clips and steps, or skips a non-finite step. `loss(k, mb, step_totals[k])` is micro-batch
    `mb`'s share of global batch k's loss; `step_totals[k]`: the global batch's counts over all ranks that the
    loss divides by. Returns the steps' grad norms and whether each was skipped."""
    device = next(model.parameters()).device
    grad_norms, skipped_flags = [], []
    once = reduce_once(model, dp_size)
    for k, (micro_batches, totals) in enumerate(zip(steps, step_totals, strict=True)):
        step_loss = torch.zeros((), device=device)
        for i, mb in enumerate(micro_batches):
            if once:  # the step's last backward reduces what the others accumulated
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            mb_loss = loss(k, mb, totals)
            # FSDP averages gradients over ranks; scale so the result is the global batch's loss.
            (mb_loss * dp_size).backward()
            step_loss += mb_loss.detach()
        # A skipped step keeps the engine's weights finite too; the caller counts the streak.
        grad_norm, skipped = optimizer_step(model, optimizer, scheduler, step_loss, max_norm)
        grad_norms.append(grad_norm)
        skipped_flags.append(skipped)
    return grad_norms, skipped_flags


@torch.no_grad()
def rows_of(model, micro_batches: list[MicroBatch], forward) -> list[torch.Tensor]:
    """`forward(model, micro_batch)` of each micro-batch, without gradients; the model is resharded after."""
    out = [forward(model, mb) for mb in micro_batches]
    reshard(model)
    return out


def logprob_rows(model, micro_batches: list[MicroBatch], temperature: float, replay: bool = False
                 ) -> list[torch.Tensor]:
    """Each micro-batch's (B, T-1) logprobs under `model` (the reference); with `replay` (train.routing_replay) a
    MoE model routes each token as recorded, as the policy's passes do, so the KL to it measures the weights'
    drift and not the routers' disagreement."""
    def forward(m, mb: MicroBatch) -> torch.Tensor:
        if replay:
            route_as_recorded(m, mb, True)
        return token_logprobs(m, mb, temperature)[0]

    try:
        return rows_of(model, micro_batches, forward)
    finally:
        if replay:
            own_routing(model)


def fill_old_logprobs(model, micro_batches: list[MicroBatch], temperature: float, replay: bool = False) -> None:
    """Each micro-batch's `old_logprobs`: the policy's before the update, in a pass of their own; a MoE policy's
    routed as recorded (`route_as_recorded`: replayed with `replay`, train.routing_replay), its mismatch kept in
    `routing_counts`."""
    def forward(m, mb: MicroBatch) -> torch.Tensor:
        route_as_recorded(m, mb, replay)
        rows = token_logprobs(m, mb, temperature)[0]
        mb.routing_counts = mismatch_counts(m)
        return rows

    try:
        for mb, rows in zip(micro_batches, rows_of(model, micro_batches, forward), strict=True):
            mb.old_logprobs = rows
    finally:
        own_routing(model)


def route_as_recorded(model, mb: MicroBatch, replay: bool) -> None:
    """Before a forward of `mb` through a MoE policy: its recorded routing replayed (`replay`: train.routing_replay)
    or only compared with the router's own choice (the mismatch a run without replay logs); a micro-batch without
    a record routes by the router's own choice. The setting holds until the next call, through the recomputation
    of activation checkpointing in the backward. Nothing for a dense model."""
    if getattr(model, "moe_routing", None) is None:
        return
    if mb.routed_experts is None:
        set_routing_replay(model, None)
        return
    set_routing_replay(model, mb.routed_experts, mb.routing_mask, replace=replay, device=mb.input_ids.device)


def own_routing(model) -> None:
    """A MoE policy back on its own routing, after the passes over a rollout's micro-batches."""
    if getattr(model, "moe_routing", None) is not None:
        set_routing_replay(model, None)


def add_routing_mismatch(sums: dict[str, torch.Tensor], counts: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """(differing, counted) routings of one forward (`mismatch_counts`) into the step's sums."""
    if counts is not None:
        sums["routing_differ"] += counts[0]
        sums["routing_counted"] += counts[1]


def real_tokens(mb: MicroBatch) -> torch.Tensor:
    """(rows, width) bool over the forward's input: the samples' tokens, not the padding (all of them for a
    micro-batch that does not say its samples' lengths)."""
    device, width = mb.input_ids.device, mb.input_ids.shape[1]
    if mb.lengths is None:
        return torch.ones_like(mb.input_ids, dtype=torch.bool)
    if mb.documents is None:
        return torch.arange(width, device=device)[None] < parallel.to_device(torch.tensor(mb.lengths), device)[:, None]
    return (torch.arange(width, device=device) < sum(mb.lengths))[None]


def micro_batch_aux_loss(sums: dict[str, torch.Tensor], model, mb: MicroBatch, global_tokens: float) -> torch.Tensor:
    """The router's load-balancing loss of this micro-batch's forward (rl/model/moe.py's `router_aux_loss`, unscaled,
    over the samples' tokens, prompt and response, as transformers' attention mask counts them), times the
    micro-batch's share of the global batch's trained tokens: a step's micro-batches over all ranks add up to the
    token-weighted mean of their aux losses (a zero-loss padding micro-batch adds nothing)."""
    aux = router_aux_loss(model, real_tokens(mb)) * (mb.loss_mask.sum() / max(global_tokens, 1))
    sums["router_aux_sum"] += aux.detach()
    return aux


def kl_rows(kind: str, mb: MicroBatch) -> torch.Tensor:
    """(B, T-1) per-token KL estimate of the policy before the update against the reference."""
    return kl_penalty(kind, mb.old_logprobs, mb.ref_logprobs)


def response_kl_sums(kl: list[torch.Tensor], micro_batches: list[MicroBatch]) -> dict[int, float]:
    """Sample.index -> its `kl_rows` (one tensor per micro-batch) summed over the response's trained tokens, for
    algo.kl_in_reward; each sample once (padding micro-batches repeat indices)."""
    out: dict[int, float] = {}
    for rows, mb in zip(kl, micro_batches, strict=True):
        if mb.loss_mask.any():
            out.update(zip(mb.indices, (rows * mb.loss_mask).sum(-1).tolist()))
    return out


SUM_KEYS = ("loss_sum", "clipped_tokens", "entropy_sum", "tokens", "mismatch_abs_sum", "mismatch_abs_max",
            "mismatch_k3_sum", "mismatch_k3_max", "mismatch_tokens", "kl_ref_sum", "tis_weight_sum",
            "tis_capped_tokens", "sequences", "routing_differ", "routing_counted", "router_aux_sum")


def train_on_rollout(model, optimizer, scheduler, schedule: Schedule, *, dp_size: int, train: TrainConfig,
                     algo: AlgoConfig, temperature: float) -> dict[str, float]:
    """Runs one optimizer step per global batch of `schedule`, the whole list train.num_iterations times.

    The micro-batches bring what the loss reads besides the rollout: `old_logprobs` where they needed a pass of
    their own (`needs_old_logprobs`: `fill_old_logprobs` before the first update), `ref_logprobs` for the KL
    (algo.kl_coef > 0). Returns this rank's sums (loss, clipped tokens, entropy, rollout/trainer mismatch, KL,
    importance weights) and the grad norms, for the caller to reduce across ranks.

    A MoE policy routes each micro-batch's forward as recorded (`route_as_recorded`: replayed with
    train.routing_replay, else only compared), counts its routing mismatch in the pass before the update (as the
    logprob mismatch), and adds the router's load-balancing loss where its config asks for it (`router_aux_coef`).
    """
    model.train()
    reuse = can_reuse_old_logprobs(train, algo)
    # Sums stay on the device until the end: a host sync per micro-batch would stall FSDP's prefetches.
    device = next(model.parameters()).device
    sums = {key: torch.zeros((), device=device) for key in SUM_KEYS}
    per_sample: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    micro_batches = schedule.micro_batches
    has_old = all(mb.old_logprobs is not None for mb in micro_batches)
    if needs_old_logprobs(train, algo) and not has_old:
        raise ValueError("train_on_rollout: several optimizer steps (or algo.kl_in_reward) train against the old "
                         "logprobs of a pass before the first update; fill_old_logprobs first")
    if has_old:
        for mb in micro_batches:
            add_mismatch(sums, mb.old_logprobs, mb.rollout_logprobs, mb.loss_mask, mb.indices, per_sample)
            add_routing_mismatch(sums, mb.routing_counts)
    aux_coef = router_aux_coef(model)

    def loss(step_index: int, mb: MicroBatch, totals: tuple[int, int]) -> torch.Tensor:
        measured = not has_old and step_index == 0  # the policy has not moved yet: these are the old logprobs
        if train.routing_replay or measured:  # without replay the routing is compared only where it is counted
            route_as_recorded(model, mb, train.routing_replay)
        else:
            own_routing(model)
        logprobs, entropy = token_logprobs(model, mb, temperature)
        if measured:
            add_mismatch(sums, logprobs, mb.rollout_logprobs, mb.loss_mask, mb.indices, per_sample)
            add_routing_mismatch(sums, mismatch_counts(model))
        old_lp = ratio_denominator(mb, logprobs, reuse, algo.use_rollout_logprobs)
        mb_loss = micro_batch_loss(sums, mb, logprobs, entropy, old_lp, mb.ref_logprobs, algo, *totals)
        if aux_coef > 0:
            mb_loss = mb_loss + aux_coef * micro_batch_aux_loss(sums, model, mb, totals[0])
        sums["loss_sum"] += mb_loss.detach()
        return mb_loss

    passes = train.num_iterations  # the same mini-batches again, in the same order (TRL's num_iterations)
    try:
        grad_norms, skipped_flags = optimizer_steps(
            model, optimizer, scheduler, schedule.steps * passes,
            list(zip(schedule.step_tokens, schedule.step_seqs, strict=True)) * passes, dp_size, train.clip_grad, loss)
    finally:
        own_routing(model)
    out = step_outputs(sums, per_sample, grad_norms, skipped_flags)
    out["router_aux_coef"] = aux_coef
    out["lr"] = scheduler.get_last_lr()[0]
    return out


def ratio_denominator(mb: MicroBatch, logprobs: torch.Tensor, reuse: bool, use_rollout: bool) -> torch.Tensor:
    """The old logprobs the policy ratio divides by: this forward's own, detached, where no update came before it
    (`reuse`, see can_reuse_old_logprobs), else the rollout engine's (algo.use_rollout_logprobs) or the pass
    before the first update's."""
    if reuse:
        return logprobs.detach()
    return mb.rollout_logprobs if use_rollout else mb.old_logprobs


def step_outputs(sums: dict[str, torch.Tensor], per_sample: list[tuple[list[int], torch.Tensor, torch.Tensor]],
                 grad_norms: list[float], skipped_flags: list[bool]) -> dict:
    """This rank's sums on the host (one sync for all of them), the mean grad norm, the runs of skipped steps, and
    `sample_mismatch`: Sample.index -> the mean |trainer - rollout logprob| over its response."""
    out = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out.update(skipped_runs(skipped_flags))
    out["sample_mismatch"] = {}
    if per_sample:
        indices = [i for ids, _, _ in per_sample for i in ids]
        diffs = torch.cat([d for _, d, _ in per_sample]).tolist()
        tokens = torch.cat([n for _, _, n in per_sample]).tolist()
        out["sample_mismatch"] = {i: d / n for i, d, n in zip(indices, diffs, tokens, strict=True) if n > 0}
    return out


def micro_batch_loss(sums: dict[str, torch.Tensor], mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor,
                     old_lp: torch.Tensor, ref_lp: torch.Tensor | None, algo: AlgoConfig, global_tokens: float,
                     global_seqs: float) -> torch.Tensor:
    """This micro-batch's share of the step's loss: the policy loss (times the truncated importance weights),
    minus the entropy bonus, plus the KL to the reference, each aggregated over the global batch."""
    mask = mb.loss_mask
    token_loss, clipped = policy_loss(algo.policy_loss, logprobs, old_lp, mb.advantages, mask, algo.eps_clip,
                                      algo.eps_clip_high, algo.eps_clip_c)
    if algo.tis_cap > 0:
        weights, capped = tis_weights(old_lp, mb.rollout_logprobs, mask, algo.tis_cap, algo.tis_level,
                                      algo.tis_mode, algo.tis_cap_low)
        token_loss = token_loss * weights
        sums["tis_weight_sum"] += masked_sum(weights, mask)
        sums["tis_capped_tokens"] += masked_sum(capped, mask)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate(values, mask, algo.loss_agg, global_tokens, global_seqs, algo.loss_agg_norm)

    loss = agg(token_loss)
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * agg(entropy)
    if ref_lp is not None:
        kl = kl_penalty(algo.kl_estimator, logprobs, ref_lp)
        sums["kl_ref_sum"] += masked_sum(kl.detach(), mask)
        if not algo.kl_in_reward:
            loss = loss + algo.kl_coef * agg(kl)
    sums["clipped_tokens"] += masked_sum(clipped, mask)
    sums["entropy_sum"] += masked_sum(entropy.detach(), mask)
    sums["tokens"] += mask.sum()
    sums["sequences"] += (mask.sum(-1) > 0).sum()
    return loss


def skipped_runs(flags: list[bool]) -> dict[str, int]:
    """How many optimizer steps were skipped: in all, at the start, at the end, and in the longest run."""
    longest = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        longest = max(longest, run)
    leading = next((i for i, f in enumerate(flags) if not f), len(flags))
    trailing = next((i for i, f in enumerate(reversed(flags)) if not f), len(flags))
    return {"skipped_steps": sum(flags), "leading_skipped_steps": leading, "trailing_skipped_steps": trailing,
            "longest_skipped_run": longest}


def train_metrics(per_rank: list[dict[str, float]], num_steps: int, algo: AlgoConfig | None = None
                  ) -> dict[str, float]:
    tokens = sum(m["tokens"] for m in per_rank)
    mismatch_tokens = sum(m["mismatch_tokens"] for m in per_rank)
    out = {
        "train/loss": sum(m["loss_sum"] for m in per_rank) / num_steps,
        "train/clip_frac": sum(m["clipped_tokens"] for m in per_rank) / max(tokens, 1),
        "train/entropy": sum(m["entropy_sum"] for m in per_rank) / max(tokens, 1),
        "train/grad_norm": per_rank[0]["grad_norm"],
        "train/skipped_steps": per_rank[0]["skipped_steps"],
        "train/leading_skipped_steps": per_rank[0]["leading_skipped_steps"],
        "train/trailing_skipped_steps": per_rank[0]["trailing_skipped_steps"],
        "train/longest_skipped_run": per_rank[0]["longest_skipped_run"],
        "train/lr": per_rank[0]["lr"],
        "train/tokens": tokens,
        "rollout/logprob_abs_diff_mean": sum(m["mismatch_abs_sum"] for m in per_rank) / max(mismatch_tokens, 1),
        "rollout/logprob_abs_diff_max": max(m["mismatch_abs_max"] for m in per_rank),
        "rollout/logprob_k3_kl": sum(m["mismatch_k3_sum"] for m in per_rank) / max(mismatch_tokens, 1),
        "rollout/logprob_k3_kl_max": max(m["mismatch_k3_max"] for m in per_rank),
    }
    if algo is not None and algo.kl_coef > 0:  # KL(policy || reference) per trained token, by algo.kl_estimator
        out["train/kl_ref"] = sum(m["kl_ref_sum"] for m in per_rank) / max(tokens, 1)
        # per response: what the health metric table watches (healthy 1-10, > 50 drifting too fast)
        out["train/kl_ref_seq"] = sum(m["kl_ref_sum"] for m in per_rank) / max(sum(m["sequences"] for m in per_rank), 1)
    routed = sum(m["routing_counted"] for m in per_rank)
    if routed:  # a MoE policy with recorded routing: how often its own router picks other experts than the engine
        out["train/routing_mismatch"] = sum(m["routing_differ"] for m in per_rank) / routed
    if per_rank[0]["router_aux_coef"] > 0:  # the router's load-balancing loss, unscaled (train/loss holds it scaled)
        out["train/router_aux_loss"] = sum(m["router_aux_sum"] for m in per_rank) / num_steps
    if algo is not None and algo.tis_cap > 0:
        out["train/tis_weight_mean"] = sum(m["tis_weight_sum"] for m in per_rank) / max(tokens, 1)
        out["train/tis_clip_frac"] = sum(m["tis_capped_tokens"] for m in per_rank) / max(tokens, 1)
    return out
