"""The policy under FSDP2 and one rollout's worth of optimizer steps.

The model is a plain `transformers` causal LM loaded in fp32 on every rank, then
`fully_shard` is applied per decoder block and at the root (torchtitan's recipe):
on GPU with bf16 compute and fp32 master weights and gradient reduction, on CPU in
fp32. The loss is a token mean over the whole global batch of a step (every rank
divides by the same global token count), so results do not depend on how samples
were split into micro-batches or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from rl.algo import approx_kl_k3, can_reuse_old_logprobs, masked_sum, ppo_clip_loss
from rl.config import AlgoConfig, ModelConfig, TrainConfig
from rl.data import Sample


def load_hf_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    """fp32 model on the CPU: pretrained weights, or random ones (identical on every rank) from the config."""
    if cfg.random_init:
        hf_config = AutoConfig.from_pretrained(cfg.path)
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                attn_implementation=cfg.attn_implementation)
    return AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32,
                                                attn_implementation=cfg.attn_implementation)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ValueError(f"cannot find decoder blocks of {type(model).__name__} to shard")
    return blocks


def shard_policy(model: torch.nn.Module, mesh, device: torch.device, gradient_checkpointing: bool) -> torch.nn.Module:
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, scheduler


# ---------------------------------------------------------------------------- batches and logprobs


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T-1), 1 where target t+1 is a trained response token
    advantages: torch.Tensor  # (B, T-1)
    rollout_logprobs: torch.Tensor  # (B, T-1)
    indices: list[int]  # Sample.index of each row


def collate(samples: list[Sample], device: torch.device, pad_token_id: int = 0) -> MicroBatch:
    """Right-padded micro-batch; targets are shifted by one so row t predicts token t+1."""
    width = max(len(s.tokens) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    advantages = torch.zeros((b, width - 1))
    rollout_logprobs = torch.zeros((b, width - 1))
    for i, s in enumerate(samples):
        n, start = len(s.tokens), s.prompt_length - 1
        input_ids[i, :n] = torch.tensor(s.tokens)
        attention_mask[i, :n] = 1
        loss_mask[i, start : start + s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float)
        advantages[i, start : start + s.response_length] = s.advantage
        rollout_logprobs[i, start : start + s.response_length] = torch.tensor(s.rollout_log_probs)
    position_ids = torch.arange(width).expand(b, width).contiguous()
    return MicroBatch(input_ids.to(device), attention_mask.to(device), position_ids.to(device),
                      loss_mask.to(device), advantages.to(device), rollout_logprobs.to(device),
                      [s.index for s in samples])


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), both (B, T-1): log p(token t+1 | <= t) under logits / temperature."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                   use_cache=False).logits
    b, t, vocab = logits.shape
    # Every position gets a target (the last one a dummy) so the logits stay one contiguous (B*T, V) view.
    target = torch.cat([mb.input_ids[:, 1:], mb.input_ids.new_zeros(b, 1)], dim=1).reshape(-1)
    logprobs, entropy = ChunkedLogprobs.apply(logits.reshape(-1, vocab), target, temperature,
                                              max(1, LOGPROB_CHUNK_BYTES // (4 * vocab)))
    return logprobs.view(b, t)[:, :-1], entropy.view(b, t)[:, :-1]


LOGPROB_CHUNK_BYTES = 1 << 29  # float32 logits materialised at once: ~880 rows of a 152k vocabulary


class ChunkedLogprobs(torch.autograd.Function):
    """log p(target) and the entropy of softmax(logits / T), computed over row chunks in float32.

    Only one chunk of float32 logits exists at a time: forward keeps the per-row log-normaliser, and
    backward rebuilds each chunk's softmax from it (d log p_y / d z_i = (1[i = y] - p_i) / T) instead
    of autograd holding (rows, vocab) float32 activations, which at 16k tokens and a 152k vocabulary
    are ~10 GB each. Entropy is a metric: no gradient flows through it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk: int):
        rows = logits.shape[0]
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for s in range(0, rows, chunk):
            z = logits[s : s + chunk].float() / temperature
            lse[s : s + chunk] = norm = torch.logsumexp(z, dim=-1)
            logprobs[s : s + chunk] = z.gather(-1, target[s : s + chunk, None]).squeeze(-1) - norm
            entropy[s : s + chunk] = norm - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, target, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            g = grad_logprobs[s : s + ctx.chunk, None] / ctx.temperature
            d = torch.exp(logits[s : s + ctx.chunk].float() / ctx.temperature - lse[s : s + ctx.chunk, None]).mul_(-g)
            grad[s : s + ctx.chunk] = d.scatter_add_(1, target[s : s + ctx.chunk, None], g)
        return grad, None, None, None


class PolicyOffloader:
    """Moves the policy's FSDP2 shards and optimizer state between the GPU and host memory around rollout.

    Host copies live in pinned buffers allocated on the first offload and reused after, so both
    directions run at copy-engine speed (pageable `model.to("cpu")` moved 1.5B's 18 GB of training
    state at ~4 GB/s) and no host allocation happens per step. The buffers are cut from large pinned
    arenas: torch's pinned allocator rounds every request up to a power of two, up to 2x the host
    memory if each tensor asked for its own. Parameters move through `Module._apply`, so FSDP2
    re-links its sharded storage exactly as it does for `model.to`. On a CPU run nothing moves.
    """

    ARENA_BYTES = 1 << 30

    def __init__(self, model: torch.nn.Module, optimizer):
        self.model, self.optimizer = model, optimizer
        self.host: dict[tuple, torch.Tensor] = {}
        self.arena, self.arena_used = torch.empty(0, dtype=torch.uint8), 0

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def onload(self, device: torch.device) -> None:
        self._move(device)

    def _move(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            return  # CPU training: the state already lives in host memory
        self.optimizer.zero_grad(set_to_none=True)  # gradients are dead after the step: never copied
        order = iter(range(1 << 62))
        self.model._apply(lambda t: self._moved(("module", next(order)), t, device))
        for i, state in enumerate(self.optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # Adam's 0-dim `step` stays on the host
                    state[key] = self._moved(("optim", i, key), value, device)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _moved(self, key: tuple, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.device == device:
            return t
        if device.type != "cpu":
            moved = local.to(device, non_blocking=True)
        elif local.untyped_storage().nbytes() > local.numel() * local.element_size():
            # An unevenly sharded FSDP2 parameter: a view of its padded shard. FSDP2 re-pads the new
            # local tensor into fresh host memory inside `_apply`, reading it at once, so this copy
            # must have landed before returning (and a pinned buffer would go unused).
            moved = local.cpu()
        else:
            buf = self.host.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = self.host[key] = self._pinned(local.shape, local.dtype)
            moved = buf.copy_(local, non_blocking=True)
        if isinstance(t, DTensor):  # same spec, new local tensor (from_local would move it to the mesh's device)
            return DTensor(moved, t._spec, requires_grad=t.requires_grad)
        return moved

    def _pinned(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if self.arena_used + nbytes > self.arena.numel():
            size = max(self.ARENA_BYTES, 1 << max(nbytes - 1, 1).bit_length())  # what the allocator grants
            self.arena, self.arena_used = self._new_arena(size), 0
        view = self.arena[self.arena_used : self.arena_used + nbytes].view(dtype).view(shape)
        self.arena_used += -(-nbytes // 512) * 512  # keep every buffer aligned
        return view

    @staticmethod
    def _new_arena(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)


# ---------------------------------------------------------------------------- the train step


def add_mismatch(sums: dict[str, torch.Tensor], train_lp: torch.Tensor, rollout_lp: torch.Tensor,
                 mask: torch.Tensor) -> None:
    """Rollout-vs-trainer log-prob mismatch on the same tokens, before any update (what TIS relies on)."""
    diff = (train_lp.detach() - rollout_lp).abs() * mask
    sums["mismatch_abs_sum"] += diff.sum()
    sums["mismatch_abs_max"] = torch.maximum(sums["mismatch_abs_max"], diff.max() if diff.numel() else diff.sum())
    # Tokens were drawn from the rollout policy, so k3 estimates KL(rollout || trainer).
    sums["mismatch_k3_sum"] += masked_sum(approx_kl_k3(rollout_lp, train_lp.detach()), mask)
    sums["mismatch_tokens"] += mask.sum()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return float(total)


@torch.no_grad()
def compute_old_logprobs(model, micro_batches: list[MicroBatch], temperature: float) -> dict[int, torch.Tensor]:
    return {i: row for mb in micro_batches
            for i, row in zip(mb.indices, token_logprobs(model, mb, temperature)[0])}


def train_on_rollout(model, optimizer, scheduler, steps: list[list[MicroBatch]], step_tokens: list[int],
                     dp_size: int, train: TrainConfig, algo: AlgoConfig, temperature: float) -> dict[str, float]:
    """Runs one optimizer step per entry of `steps` (this rank's micro-batches of each global batch).

    `step_tokens[k]` is the number of loss tokens of global batch k summed over all ranks.
    Returns this rank's sums (loss, clipped tokens, entropy, rollout/trainer mismatch) and the
    grad norms, for the caller to reduce across ranks.
    """
    model.train()
    reuse = can_reuse_old_logprobs(train, algo)
    old: dict[int, torch.Tensor] = {}
    # Sums stay on the device until the end: a host sync per micro-batch would stall FSDP's prefetches.
    device = next(model.parameters()).device
    sums = {key: torch.zeros((), device=device) for key in ("loss_sum", "clipped_tokens", "entropy_sum", "tokens",
                                                             "mismatch_abs_sum", "mismatch_abs_max",
                                                             "mismatch_k3_sum", "mismatch_tokens")}
    all_micro_batches = [mb for step in steps for mb in step]
    if not reuse and not algo.use_rollout_logprobs:  # seed step 38: policy moves between steps
        old = compute_old_logprobs(model, all_micro_batches, temperature)
        for mb in all_micro_batches:
            add_mismatch(sums, torch.stack([old[i] for i in mb.indices]), mb.rollout_logprobs, mb.loss_mask)
    grad_norms = []
    for step_index, (micro_batches, global_tokens) in enumerate(zip(steps, step_tokens, strict=True)):
        denom = max(global_tokens, 1)
        for mb in micro_batches:
            logprobs, entropy = token_logprobs(model, mb, temperature)
            if not old and step_index == 0:  # the policy has not moved yet: these are the old logprobs
                add_mismatch(sums, logprobs, mb.rollout_logprobs, mb.loss_mask)
            if reuse:
                old_lp = logprobs.detach()
            elif algo.use_rollout_logprobs:
                old_lp = mb.rollout_logprobs
            else:
                old_lp = torch.stack([old[i] for i in mb.indices])
            token_loss, clipped = ppo_clip_loss(logprobs, old_lp, mb.advantages, algo.eps_clip, algo.eps_clip_high)
            loss = masked_sum(token_loss, mb.loss_mask) / denom
            # FSDP averages gradients over ranks; scale so the result is the global token mean.
            (loss * dp_size).backward()
            sums["loss_sum"] += loss.detach()
            sums["clipped_tokens"] += masked_sum(clipped, mb.loss_mask)
            sums["entropy_sum"] += masked_sum(entropy, mb.loss_mask)
            sums["tokens"] += mb.loss_mask.sum()
        grad_norms.append(clip_grad_norm(model, train.clip_grad))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if isinstance(model, FSDPModule):
        model.reshard()
    out = dict(zip(sums, torch.stack(list(sums.values())).tolist()))  # one host sync for all the sums
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["lr"] = scheduler.get_last_lr()[0]
    return out
