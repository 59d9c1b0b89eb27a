"""Mixture-of-experts blocks for training: grouped expert matmuls, routing replay and the router's auxiliary loss.

`transformers` computes a sparse MoE block (`Qwen3MoeSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`) with a Python
loop over the experts that the batch hits: per expert a gather of its tokens, two matmuls and an `index_add_`
back, about ten small kernels for every expert the batch hits. `use_grouped_moe(model)` replaces each block's
forward (in place, before FSDP2 wraps the model, as rl/model/invariant.py patches its modules) with one that

- routes as the block does: softmax over the experts in float32, top-k, the top-k weights renormalised to sum
  to 1 where the config says `norm_topk_prob`; Qwen2-MoE's shared expert is added, scaled by its sigmoid gate;
- sorts the (token, slot) pairs by expert, so each expert's tokens are one contiguous segment, runs one grouped
  GEMM per projection (gate_up, then down) over the sorted rows, and puts every row back in its (token, slot)
  place before the k slots of a token are summed with their weights.

The grouped GEMM is `torch._grouped_mm` on CUDA in bf16 (compute capability 8.0 and up from torch 2.9, where
torch has the kernel for it; 9.x only before), one kernel per projection. Anywhere else (CPU, float32) it is
a loop over the experts' contiguous segments of the sorted rows (`split` then one `F.linear` each): still one
pass, no gather per expert, and its backward stacks the experts' weight gradients once (`unbind`).
The block's own parameters are used as they are (transformers 5 holds the experts fused, `experts.gate_up_proj`
(E, 2 * I, H) with the gate half first and `experts.down_proj` (E, H, I)), so FSDP2, LoRA targeting and
checkpoints see the same names. LoRA's per-expert adapters of those tensors (rl/train/lora.py puts them on the
experts) run in the same pass: each projection adds scale * (rows @ A[e].T) @ B[e].T over the same sorted rows,
two more grouped matmuls of the same segments (`ExpertLoRA`; torch's grouped GEMM wants rows of a multiple of 16
bytes, so in bf16 a rank that is not a multiple of 8 takes the loop over the segments instead). Tested on CPU
against transformers' loop over the experts (tests/test_lora_moe.py); the grouped GEMM with adapters has not run on
a GPU here. The router is called as its module (`block.gate`), so transformers' output
recorders (`output_router_logits`) still see its logits.

Routing replay: the rollout engine picks each token's experts in its own forward; the trainer's forward of the
same tokens can pick others (bf16 noise near a top-k boundary), and then its logprobs are those of another
network. `set_routing_replay(model, experts)` hands the blocks, per MoE layer and token, the top-k expert ids to
use; the weights of those experts still come from this forward's router softmax (gathered at the replayed ids,
renormalised as `norm_topk_prob` says), so the router keeps its gradient. `routing_mismatch(model)` is the
fraction of (layer, token) routings whose own top-k set differs from the replayed one. With `replace=False` the
blocks keep their own choice and only count that fraction against the record: what a run without replay measures.

The state lives in one `MoeRouting` per model (`moe_routing(model)`), shared by its blocks. Its settings stay
until they are set again, not for one call: activation checkpointing runs a block's forward again in the
backward, and the recomputation must route as the forward did. What the blocks record (router logits, the
experts they used, the mismatch counts) is kept per layer and overwritten, so a recomputation records nothing
twice.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from rl.parallel import to_device

MOE_BLOCKS = ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3NextSparseMoeBlock")


@dataclass
class MoeRouting:
    """What the patched MoE blocks of one model share.

    `replay`: (layers, tokens, k) expert ids the blocks use instead of their own top-k (None: their own); a
    negative id means no record, and that token takes its own choice whole (such tokens are not counted in the
    mismatch). `mask`: (tokens,) the tokens the mismatch counts (None: all). `replace`: False keeps each block's own
    choice and only counts the mismatch against `replay`. `record_logits`: keep each layer's
    router logits for `router_aux_loss` (on where the config sets `output_router_logits`). `record_experts`: keep
    the expert ids each layer used (`recorded_experts`: the layout `replay` takes)."""

    num_layers: int
    num_experts: int
    top_k: int
    replay: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    replace: bool = True
    record_logits: bool = False
    record_experts: bool = False
    router_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    mismatch: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def layer_replay(self, layer: int, tokens: int, device: torch.device) -> torch.Tensor | None:
        """The replayed ids of one layer, (tokens, k), or None without replay."""
        if self.replay is None:
            return None
        ids = self.replay[layer]
        if ids.shape[0] != tokens:
            raise ValueError(f"routing replay holds {ids.shape[0]} tokens per layer, the forward has {tokens}: "
                             f"set it for each micro-batch (set_routing_replay)")
        return ids.to(device, non_blocking=True)

    def note_mismatch(self, layer: int, own: torch.Tensor, replay: torch.Tensor) -> None:
        """Counts the tokens of one layer whose own top-k set is not the replayed one (two device scalars, no sync)."""
        with torch.no_grad():
            counted = (replay >= 0).all(-1)
            if self.mask is not None:
                counted &= self.mask.to(counted.device)
            differ = (own.sort(-1).values != replay.sort(-1).values).any(-1) & counted
            self.mismatch[layer] = differ.sum(), counted.sum()


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's sparse MoE blocks (Qwen2-MoE, Qwen3-MoE, Qwen3-Next), in layer order."""
    return [m for m in model.modules() if type(m).__name__ in MOE_BLOCKS]


def use_grouped_moe(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Patches every sparse MoE block of a `transformers` causal LM to `moe_forward` (grouped expert matmuls,
    routing replay; see the module docstring) and gives the model its `MoeRouting`; returns the blocks patched,
    none for a dense model (which is left as it is). Works on a meta model: only forwards and attributes change."""
    blocks = moe_blocks(model)
    if not blocks:
        return blocks
    for block in blocks:
        experts = block.experts
        layout = (getattr(experts, "has_gate", True), getattr(experts, "has_bias", False),
                  getattr(experts, "is_transposed", False), getattr(experts, "is_concatenated", True))
        if layout != (True, False, False, True):
            raise ValueError(f"{type(block).__name__}: experts with (gate, bias, transposed, concatenated) = {layout}, "
                             f"the grouped forward knows (True, False, False, True) only")
    state = MoeRouting(num_layers=len(blocks), num_experts=blocks[0].gate.num_experts, top_k=blocks[0].gate.top_k,
                       record_logits=bool(getattr(model.config, "output_router_logits", False)))
    for layer, block in enumerate(blocks):
        block.moe_routing, block.moe_layer = state, layer
        block.forward = types.MethodType(moe_forward, block)
    model.moe_routing = state
    return blocks


def moe_routing(model: torch.nn.Module) -> MoeRouting:
    """The routing state use_grouped_moe gave the model (its settings and what its blocks recorded)."""
    state = getattr(model, "moe_routing", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no grouped MoE blocks (use_grouped_moe)")
    return state


def set_routing_replay(model: torch.nn.Module, experts: torch.Tensor | None, mask: torch.Tensor | None = None,
                       replace: bool = True, device: torch.device | None = None) -> None:
    """Replays `experts`, (MoE layers, batch, seq, k) or (MoE layers, tokens, k) integer expert ids recorded by the
    rollout engine (negative: no record), in every forward from now on, until set again; None turns replay off.
    The tokens are the forward's batch flattened row by row. `mask` (batch, seq) or (tokens,): the tokens that
    `routing_mismatch` counts (the response tokens; None: all). `replace=False`: the blocks route by their own
    choice and only count how often it differs from `experts` (the mismatch of a run without replay). `device`:
    where the forward runs, when `experts` and `mask` are elsewhere (the host): they are checked where they are,
    with no device sync, and copied there once."""
    state = moe_routing(model)
    state.mismatch.clear()
    state.router_logits.clear()
    state.replace = replace
    if experts is None:
        state.replay = state.mask = None
        return
    if experts.dim() < 3 or experts.shape[0] != state.num_layers or experts.shape[-1] != state.top_k:
        raise ValueError(f"routing replay: expert ids of shape {list(experts.shape)}, the model wants "
                         f"({state.num_layers} MoE layers, ..., {state.top_k})")
    if experts.numel() and int(experts.max()) >= state.num_experts:
        raise ValueError(f"routing replay: expert id {int(experts.max())}, the model has {state.num_experts} experts")
    state.replay = to_device(experts.reshape(state.num_layers, -1, state.top_k), device).long()
    state.mask = None if mask is None else to_device(mask.reshape(-1), device).bool()


def routing_mismatch(model: torch.nn.Module) -> float:
    """The fraction of (MoE layer, token) routings of the last replayed forward whose own top-k set differs from
    the replayed one: how often the trainer would have picked other experts without replay (0.0 without replay)."""
    counts = mismatch_counts(model)
    if counts is None:
        return 0.0
    differ, total = (int(c) for c in counts)
    return differ / total if total else 0.0


def mismatch_counts(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(differing, counted) (MoE layer, token) routings of the last forward with a record, summed over the layers
    as two device scalars (no host sync); None for a dense model or a forward without a record."""
    state = getattr(model, "moe_routing", None)
    if state is None or not state.mismatch:
        return None
    differ, counted = zip(*state.mismatch.values())
    return torch.stack(differ).sum(), torch.stack(counted).sum()


def router_aux_coef(model: torch.nn.Module) -> float:
    """The weight of the router's load-balancing loss in the training loss, as transformers' MoE models add it: the
    config's `router_aux_loss_coef` where the config asks for it (`output_router_logits`), else 0 (and for a
    dense model)."""
    state = getattr(model, "moe_routing", None)
    if state is None or not state.record_logits:
        return 0.0
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


def no_router_outputs(model: torch.nn.Module) -> dict[str, bool]:
    """The forward's keyword that keeps a MoE model whose config sets `output_router_logits` from gathering its
    router logits and computing its own aux loss in every forward ({} for any other model): the grouped blocks record
    the logits themselves (`router_aux_loss`), and transformers' loss reads the attention mask as a tensor, which
    the trainer's prepared mask mappings are not."""
    config = getattr(model, "config", None)
    return {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}


def recorded_experts(model: torch.nn.Module) -> torch.Tensor:
    """The expert ids every MoE layer used in the last forward, (MoE layers, tokens, k): what `set_routing_replay`
    takes. Needs `moe_routing(model).record_experts = True` before that forward."""
    state = moe_routing(model)
    if len(state.experts) != state.num_layers:
        raise ValueError("no experts recorded: set moe_routing(model).record_experts = True before the forward")
    return torch.stack([state.experts[layer] for layer in range(state.num_layers)])


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's choice from its logits (tokens, E): (experts, weights, own) with experts and own (tokens, k)
    ids and weights (tokens, k) float32. Without replay the experts are the softmax's own top-k; with replay the
    replayed ids, weighted by this softmax at those ids, so the router gets a gradient; a token whose record has a
    negative id takes its own choice whole (mixing the two could pick one expert twice)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    own_weights, own = torch.topk(probs, top_k, dim=-1)
    if replay is None:
        experts, weights = own, own_weights
    else:
        experts = torch.where((replay >= 0).all(-1, keepdim=True), replay, own)
        weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights, own


def _grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel runs these operands: CUDA, bf16, and a GPU torch has the kernel for."""
    return x.dtype == weight.dtype and grouped_mm_runs(x.device, x.dtype)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped experts run as torch's grouped GEMM on this device and dtype (CUDA, bf16, a GPU torch has
    the kernel for): their segments then stay on the device, and a decode step over them is a CUDA graph's."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    # the compiled blocks call this: Dynamo folds get_device_properties to a constant; get_device_capability
    # and a TorchVersion built here are not on its list of foldable calls
    major = torch.cuda.get_device_properties(device).major
    return major >= 8 if GROUPED_MM_FROM_SM80 else major == 9


GROUPED_MM_FROM_SM80 = TorchVersion(torch.__version__) >= "2.9"  # torch's grouped GEMM: 8.x and up, before 9.x only


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | list[int]) -> torch.Tensor:
    """x (rows, in) sorted by expert times each expert's weight (E, out, in), transposed: (rows, out).
    `segments` is the int32 running end of each expert's rows for `torch._grouped_mm`, or their counts as a
    list for the loop over the segments."""
    if isinstance(segments, torch.Tensor):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=segments)
    return torch.cat([F.linear(part, w) for part, w in zip(x.split(segments), weight.unbind(0))])


EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # a grouped block's fused expert tensors, as `experts` names them


@dataclass
class ExpertLoRA:
    """Low-rank updates of the fused expert tensors, per expert W[e] + scale * B[e] @ A[e] (rl/train/lora.py puts
    them on the experts as `<tensor>_lora_A` (E, rank, in) and `<tensor>_lora_B` (E, out, rank)): `pairs` maps
    `EXPERT_TENSORS` names to their (A, B), absent where a tensor has none. `dropout` acts on the adapters' input."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    dropout: float = 0.0

    def grouped_mm_fits(self) -> bool:
        """torch's grouped GEMM wants each operand's rows 16-byte aligned: the rank-wide product too."""
        return all(a.shape[1] * a.element_size() % 16 == 0 for a, _ in self.pairs.values())


def expert_lora(experts: torch.nn.Module, dtype: torch.dtype | None = None) -> ExpertLoRA | None:
    """The experts' adapters (None without, or with them switched off: `lora_enabled`), cast to `dtype` if given."""
    if not getattr(experts, "lora_enabled", False):
        return None
    pairs = {}
    for name in EXPERT_TENSORS:
        a, b = getattr(experts, f"{name}_lora_A", None), getattr(experts, f"{name}_lora_B", None)
        if a is not None:
            pairs[name] = (a, b) if dtype is None else (a.to(dtype), b.to(dtype))
    dropout = experts.lora_dropout if experts.training and torch.is_grad_enabled() else 0.0
    return ExpertLoRA(pairs, experts.lora_scale, dropout)


def grouped_experts(experts: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for x (tokens, H) routed to ids (tokens, k) with weights (tokens, k) in x's dtype:
    sum over the k slots of weight * down(act(gate) * up)(x) of that slot's expert (LoRA's adapters included)."""
    return grouped_mlp(x, ids, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn, expert_lora(experts))


def grouped_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor], lora: ExpertLoRA | None = None) -> torch.Tensor:
    """`grouped_experts` over the fused expert tensors themselves, gate_up (E, 2 * I, H) with the gate half first
    and down (E, H, I): the trainer's blocks and the rollout engine's (rl/model/decoder.py) compute their experts
    here. `lora`: the adapters' update of each projection, through the same grouped matmuls over the same rows."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert; pair p is token p // k, slot p % k
    # Counted into a tensor of fixed size: bincount on CUDA reads the largest id on the host (no CUDA graph holds it).
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    if _grouped_mm_supported(x, down) and (lora is None or lora.grouped_mm_fits()):
        segments = torch.cumsum(counts, dim=0, dtype=torch.int32)
    else:
        segments = counts.tolist()
    rows = SlotRows.apply(x, order, k)
    gate, up = _expert_projection(rows, gate_up, segments, lora, "gate_up_proj").chunk(2, dim=-1)
    out = _expert_projection(act(gate) * up, down, segments, lora, "down_proj")
    return combine_slots(out, order, weights)


def pair_order(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert back in (token, slot) order: sorted row i to pair order[i]."""
    return rows.new_empty(rows.shape).index_copy(0, order, rows)


def combine_slots(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' rows (sorted by expert) back in (token, slot) order, each token's k slots summed with their
    weights (tokens, k): (tokens, H)."""
    tokens, k = weights.shape
    return (pair_order(rows, order).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


class SlotRows(torch.autograd.Function):
    """x (tokens, H) gathered to the sorted (token, slot) pairs: row i is x[order[i] // k]. Autograd's own
    backward of that gather is an accumulating index_put, which sorts the indices and ran as ~10% of a 2B MoE's
    train-step device time on an H100; here each token's gradient is its k rows' gradients, put back in (token,
    slot) order as the block's output is and summed over the slots (a copy and a reduction, deterministic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return pair_order(grad, order).view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None


def _expert_projection(rows: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | list[int],
                       lora: ExpertLoRA | None, name: str) -> torch.Tensor:
    """rows (sorted by expert) through each expert's weight (E, out, in), plus its adapter's
    scale * (rows @ A[e].T) @ B[e].T where `lora` has one for `name`: (rows, out)."""
    out = _grouped_linear(rows, weight, segments)
    if lora is None or name not in lora.pairs:
        return out
    a, b = lora.pairs[name]
    h = F.dropout(rows, lora.dropout) if lora.dropout else rows
    return out + lora.scale * _grouped_linear(_grouped_linear(h, a, segments), b, segments)


def moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The sparse MoE block's forward (bound to the block by use_grouped_moe): route, replay, grouped experts,
    and Qwen2-MoE's gated shared expert."""
    batch, seq, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    state, layer = self.moe_routing, self.moe_layer
    logits = self.gate(x)[0]  # the router's module call: transformers' recorders of router logits see it
    replay = state.layer_replay(layer, x.shape[0], x.device)
    experts, weights, own = route(logits, self.gate.top_k, self.gate.norm_topk_prob,
                                  replay if state.replace else None)
    if replay is not None:
        state.note_mismatch(layer, own, replay)
    if state.record_logits and torch.is_grad_enabled():  # the aux loss's: only a forward that trains reads them
        state.router_logits[layer] = logits
    if state.record_experts:
        state.experts[layer] = experts.detach()
    spread = getattr(self, "expert_parallel", None)  # experts over ranks (rl/model/expert_parallel.py)
    if spread is None:
        out = grouped_experts(self.experts, x, experts, weights.to(x.dtype))
    else:
        out = spread(self.experts, x, experts, weights.to(x.dtype))
    if hasattr(self, "shared_expert"):  # Qwen2-MoE: one dense expert every token takes, scaled by its gate
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out.view(batch, seq, hidden)


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary load-balancing loss over the layers' router logits (each (tokens, E)), as
    transformers' `load_balancing_loss_func` computes it: E * sum_e f_e * P_e, with f_e the top-k assignments to
    expert e per token and P_e its mean router probability, both over all layers' (unmasked) tokens. Unscaled:
    the caller multiplies by the config's `router_aux_loss_coef`. The top-k is the router's own (not a replay)."""
    if not router_logits:
        return torch.zeros(())
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(device).float(), dim=-1)
        keep = torch.ones(probs.shape[0], device=device) if attention_mask is None else \
            attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned.index_add(0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * keep.unsqueeze(-1)).sum(dim=0)
        rows = rows + keep.sum()
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


def router_aux_loss(model: torch.nn.Module, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`load_balancing_loss` over the router logits the model's MoE layers recorded in its last forward (on with
    the config's `output_router_logits`, or `moe_routing(model).record_logits = True`), unscaled."""
    state = moe_routing(model)
    if len(state.router_logits) != state.num_layers:
        raise ValueError("no router logits recorded: set moe_routing(model).record_logits = True before the forward")
    logits = [state.router_logits.pop(layer) for layer in range(state.num_layers)]  # read once, then let go
    gate = moe_blocks(model)[0].gate
    return load_balancing_loss(logits, gate.num_experts, gate.top_k, attention_mask)
