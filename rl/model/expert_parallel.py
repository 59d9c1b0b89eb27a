"""Expert parallelism for the grouped MoE blocks (rl/model/moe.py): each rank of an expert-parallel (EP) group of N
ranks holds E / N of a block's experts, and the tokens travel to the experts instead of the experts to the tokens.

`shard_experts(block, group)` keeps only this rank's slice of the block's fused expert tensors: rank r of the group
holds experts [r * E / N, (r + 1) * E / N), `experts.gate_up_proj` (E / N, 2 * I, H) and `experts.down_proj`
(E / N, H, I), as plain local parameters under the same names. The block's forward (`moe_forward`) then routes as
before (the router and its weights are replicated and stay local; routing replay picks the experts before anything
moves) and hands the experts' part to `ExpertParallel`, which

1. sorts the (token, slot) pairs by expert id, so that the pairs for each owning rank, and within it each expert,
   are contiguous, and exchanges the per-expert pair counts with one all-to-all (the counts decide the splits);
2. sends each pair's hidden row to the rank that owns its expert (`all_to_all_single` with those splits);
3. runs the received rows through the local experts with the same grouped path as the single-rank block
   (`grouped_mlp`, each row one slot of weight 1);
4. sends the outputs back with the reverse all-to-all (send and receive splits swapped), puts them back in
   (token, slot) order and sums the k slots weighted by the router weights, which never left the rank: the
   router's gradient is the single-rank one.

The all-to-all is a small autograd function whose backward is the reverse all-to-all of the gradient. torch's
`torch.distributed._functional_collectives.all_to_all_single_autograd` computes the same (same values and
gradients on gloo ranks, torch 2.13), but it is a private module and returns an asynchronous tensor; the function
here is a few lines over the public `all_to_all_single` and stays eager. Each rank's
expert-weight gradient is then the sum over the tokens of every rank of the group that reached its experts: for a
loss that sums the ranks' losses, exactly the slice of the single-rank gradient.

Why plain local slices and not a DTensor Shard(0) on an EP sub-mesh: the forward needs the local slice itself (no
gather ever happens), and a DTensor would make FSDP2 and the optimizer see a second mesh dimension for a handful of
tensors. `train.expert_parallel` = N > 1 wires it into the trainer:

- rl/train/policy.py's `shard_policy(..., expert_parallel=N)` splits the experts over the "expert" groups of
  rl/parallel.py's `expert_parallel_mesh` (contiguous ranks; its "replica" groups hold the same slice) and has FSDP2
  ignore them (`ignored_params`; their mixed-precision cast is done here, in the forward); `mark_split_experts` marks
  them (`expert_group`, `global_experts`, `first_expert`), and `build_policy` loads each rank's experts from the
  safetensors, or draws them with `model.random_init`, as the same rows of the whole tensor;
- the train step (rl/train/step.py's `optimizer_step`) calls `reduce_expert_grads` after the last backward of each
  optimizer step: FSDP2 averages the other gradients over the world, while an expert's gradient already sums its
  EP group's tokens, so it is summed over its replicas and divided by the world size;
- the gradient-norm clip adds `expert_grad_square_norm`, each slice counted once (summed over one EP group, not over
  the replicas), to the DTensors' squared norm, and clips the two kinds apart;
- the optimizer puts the split experts in a param group of their own (torch's fused and multi-tensor AdamW refuse
  plain tensors beside DTensors); HostAdamW and the host offload take them as they are;
- checkpoints (rl/run/checkpoint.py) save each slice and its AdamW moments as a DTensor of the whole tensor on the
  (replica, expert) mesh, so DCP writes it at its global expert rows once and a resume reshards it to any EP size
  (1 included, where FSDP2 shards the experts), the param groups saved as one;
- the weight push (rl/train/weights.py) gathers a split tensor whole with `full_experts`;
- the memory plan (rl/run/memory.py) counts E / N experts per rank for parameters, gradients and AdamW state;
- LoRA's per-expert adapters of the fused tensors (rl/train/lora.py, on the experts module beside them) are split
  with their experts: each rank holds its experts' adapters, and everything above treats them as expert slices,
  while the frozen fused tensors get no gradient and no AdamW state.

Verified on CPU gloo ranks only (tests/test_expert_parallel.py, tests/expert_parallel_training.py): two and four
ranks, EP 2 against 1 to fp32 rounding (the train step, HostAdamW, the push, rl.main's loop with routing replay,
LoRA on the experts), checkpoint resumes at EP 2, 1 and 4 (LoRA's at 1). Not run on GPUs: NCCL, bf16 compute and train.offload's moves of the split
experts (rl/train/policy.py's HostOffloader, CUDA only) are untested, as is torch.compile of the blocks
(model.compile) with the all-to-all inside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl.model.moe import SlotRows, combine_slots, expert_lora, grouped_mlp


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of x's rows with the given splits; the backward sends the gradient back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """x's rows, split `send` (one count per rank of the group), to the ranks; returns the rows received, `recv`."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The differentiable all-to-all of x's rows (send: rows to each rank, recv: rows from each rank)."""
    return _AllToAll.apply(x, send, recv, group)


class ExpertParallel:
    """The experts' part of a block whose experts are spread over `group` (set by `shard_experts`): called by
    `moe_forward` as `ep(experts, x, ids, weights)` in place of `grouped_experts`, same arguments, same result."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group, self.num_experts, self.size = group, num_experts, dist.get_world_size(group)
        self.held = expert_slice(num_experts, group)  # this rank's global expert ids
        self.local, self.first = self.held.stop - self.held.start, self.held.start

    def __call__(self, experts: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank; pair p is token p // k
        counts = torch.bincount(flat, minlength=self.num_experts)  # pairs this rank sends to each expert
        # From each source rank, its pair counts for each of this rank's experts: (size, local).
        got = all_to_all(counts, [self.local] * self.size, [self.local] * self.size, self.group).view(self.size, -1)
        send = counts.view(self.size, self.local).sum(-1).tolist()
        recv = got.sum(-1).tolist()
        rows = exchange(SlotRows.apply(x, order, k), send, recv, self.group)
        # Received rows come by source rank, each source's by expert: their local expert ids.
        local_ids = torch.arange(self.local, device=x.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(got.reshape(-1).to(x.device))
        ones = torch.ones(local_ids.shape[0], 1, dtype=x.dtype, device=x.device)
        # FSDP2 leaves the split experts alone (ignored_params), so its mixed precision does not cast them: here.
        gate_up, down = experts.gate_up_proj.to(x.dtype), experts.down_proj.to(x.dtype)
        lora = expert_lora(experts, x.dtype)  # LoRA's adapters of the local experts, split with them
        out = grouped_mlp(rows, local_ids.unsqueeze(-1), ones, gate_up, down, experts.act_fn, lora)
        return combine_slots(exchange(out, recv, send, self.group), order, weights)


def expert_slice(num_experts: int, group: dist.ProcessGroup) -> slice:
    """The global expert ids this rank of `group` holds."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % size:
        raise ValueError(f"expert parallelism over {size} ranks: {num_experts} experts do not split evenly")
    local = num_experts // size
    return slice(rank * local, (rank + 1) * local)


def shard_experts(block: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Keeps this rank's slice of a grouped block's fused experts (see the module docstring) and makes its forward
    dispatch tokens over `group`. The block must already be patched (`use_grouped_moe`)."""
    if not hasattr(block, "moe_routing"):
        raise ValueError(f"{type(block).__name__}: patch it with use_grouped_moe before shard_experts")
    experts = block.experts
    block.expert_parallel = spread = ExpertParallel(group, experts.gate_up_proj.shape[0])
    for name, full in list(experts.named_parameters(recurse=False)):  # the fused tensors, and LoRA's adapters of them
        local = torch.nn.Parameter(full.detach()[spread.held].clone(), requires_grad=full.requires_grad)
        setattr(experts, name, local)
    mark_split_experts(block)


def mark_split_experts(model: torch.nn.Module) -> None:
    """Marks the split expert tensors of every block `shard_experts` split (again after `Module.to_empty`, which
    makes new parameters of a meta model's): `expert_group` (what `full_experts` gathers over, and how the train
    step, the optimizer and checkpoints tell them from FSDP2's DTensors), `global_experts` and `first_expert` (the
    slice's place in the whole tensor: the loader's rows, the checkpoint's offsets)."""
    for block in model.modules():
        spread = getattr(block, "expert_parallel", None)
        if isinstance(spread, ExpertParallel):
            for local in block.experts.parameters(recurse=False):
                local.expert_group, local.global_experts, local.first_expert = \
                    spread.group, spread.num_experts, spread.first


def split_experts(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's expert tensors split over ranks (`shard_experts`), none without expert parallelism."""
    return [p for p in model.parameters() if hasattr(p, "expert_group")]


def full_experts(local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full fused expert tensor (E, ...) in `dtype` from each rank's slice of a tensor `shard_experts` split: one
    all-gather over its group into one tensor (every rank of the group must call it): the whole tensor and this rank's
    slice are all it holds, as FSDP2's gather of a sharded tensor (rl/run/memory.py's `push_bytes`)."""
    group = local.expert_group
    local = local.detach().to(dtype).contiguous()
    full = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
    dist.all_gather_into_tensor(full, local, group=group)
    return full


def reduce_expert_grads(model: torch.nn.Module, replicas: dist.ProcessGroup) -> None:
    """Averages the split experts' gradients as FSDP2 averages the others' over all W ranks: each local expert's
    gradient already sums the tokens of its expert-parallel group, so it is summed over `replicas` (the ranks that
    hold the same experts: the "replica" dimension of rl/parallel.py's `expert_parallel_mesh`) and divided by W.
    Call once per optimizer step, after the last backward, before the gradient-norm clip."""
    world = dist.get_world_size()
    for param in split_experts(model):
        if not param.requires_grad:  # LoRA's frozen base
            continue
        if param.grad is None:  # every replica joins each reduction, with or without a gradient of its own
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=replicas)
        param.grad.div_(world)


def expert_grad_square_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The squared L2 norm of the split experts' gradients (`params`: this rank's slices, `split_experts`), each slice
    counted once: this rank's slices' summed over its expert-parallel group (its replicas hold the same gradients
    after `reduce_expert_grads`, and are not added). Every rank of the world calls it."""
    grads = [p.grad for p in params if p.grad is not None]
    square = sum((g.detach().float().square().sum() for g in grads), torch.zeros((), device=params[0].device))
    dist.all_reduce(square, group=params[0].expert_group)
    return square
