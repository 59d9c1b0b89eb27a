"""Packed micro-batches (train.packing): several samples back to back in one row, each attending only to itself.

A packed micro-batch is one row of up to `train.micro_batch_tokens` tokens holding whole samples, then padding.
Positions restart at 0 for every sample, and attention never crosses from one sample into another: on CUDA
through FlashAttention's variable-length kernel (`torch.nn.attention.varlen`, one causal attention per sample
over the row's offsets, no padding rows, no masked-out work); elsewhere through SDPA with a block-diagonal
causal mask (dense, for tests and CPU runs). Padding is in documents of its own (pieces of at most max_seqlen
tokens), so every query attends to at least itself and no kernel leaves an output unwritten.

Unlike padded rows, a packed row's width does not follow the samples' lengths: every packed micro-batch of a
run is one row between half a budget and a budget long (`packed_width`), so compiled decoder blocks meet one
shape family and do not recompile when a rollout brings new lengths.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rl.config import ConfigError
from rl.model.moe import no_router_outputs

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10: packed rows on CUDA are refused at start-up
    varlen_attn = None

ATTENTION = "rl_packed"  # the name under which transformers finds `packed_attention`
# torch spells causality and grouped KV heads differently across versions; read once, outside compiled code
VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()


@dataclass
class Documents:
    """Where each sample of a packed row sits (the row's padding is the last documents)."""
    position_ids: torch.Tensor  # (1, W): 0.. within each document
    document_ids: torch.Tensor  # (1, W): k on the k-th document's tokens
    cu_seqlens: torch.Tensor  # (documents + 1,) int32: each document's start, then W
    # a bound on the documents' lengths, the same for every row of a run (the model's context): an int that
    # changed from row to row would recompile the compiled blocks
    max_seqlen: int
    targets: torch.Tensor  # (samples, T-1) long: where sample k's target t sits among the row's W-1 targets


def packed_width(tokens: int, budget: int, multiple: int) -> int:
    """A packed row's width: `tokens` rounded up to `multiple`, and never under half the budget, so that the
    compiled blocks' code, which branches on the token count of a pass, sees every row on the same side of
    its thresholds (a row of under ~6k tokens compiled a second graph at 0.5B on an H200)."""
    return max(-(-tokens // multiple) * multiple, -(-(budget // 2) // multiple) * multiple, 1)


def cut_packed(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions of `lengths` (sorted longest first) cut into rows of at most `budget` tokens: next-fit in
    decreasing order, so every row but the last is nearly full. A sample longer than the budget rows alone."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if rows[-1] and used + n > budget:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return [r for r in rows if r]


def documents(lengths: list[int], width: int, max_seqlen: int, targets_per_sample: int,
              device: torch.device) -> Documents:
    """The layout of one row holding documents of `lengths` from its start, padded to `width`; positions of
    the padding are 0 (they index nothing real). Past a sample's end its `targets` point at whatever follows
    (the collated rows mask those out). The padding is cut into documents of at most `max_seqlen` tokens: as one
    document, a row's padding (up to half its budget) cost attention quadratic in its length, and raised the
    kernel's max_seqlen for that row alone."""
    pad = width - sum(lengths)
    sizes = lengths + [max_seqlen] * (pad // max_seqlen) + ([pad % max_seqlen] if pad % max_seqlen else [])
    document_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))
    starts = torch.tensor([0] + sizes, dtype=torch.long).cumsum(0)
    position_ids = torch.arange(width) - starts[document_ids]
    if pad > 0:
        position_ids[-pad:] = 0
    targets = (starts[: len(lengths), None] + torch.arange(targets_per_sample)).clamp(max=width - 2)
    return Documents(position_ids[None].to(device), document_ids[None].to(device),
                     starts.to(torch.int32).to(device), max(max_seqlen, *sizes), targets.to(device))


def unpack(values: torch.Tensor, docs: Documents) -> torch.Tensor:
    """(1, W-1) per-target values of a packed row -> (samples, T-1), one row per sample as `collate` lays them."""
    return values.reshape(-1)[docs.targets]


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, T) bool, True where query i may attend key j: the same document and j <= i."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & torch.ones_like(same[0], dtype=torch.bool).tril())[:, None]


def packed_forward(model: torch.nn.Module, input_ids: torch.Tensor, docs: Documents):
    """The model's output over one packed row. The varlen kernel on CUDA needs no mask; elsewhere SDPA gets
    the block-diagonal mask, handed to every layer as a prepared mask mapping (the model builds none)."""
    kinds = set(getattr(model.config, "layer_types", None) or [])
    if kinds - {"full_attention"} - packed_linear_kinds(model):
        raise ValueError(f"train.packing: layers of kinds {sorted(kinds)}; packed rows support full attention and "
                         f"Gated DeltaNet linear attention (rl/model/linear_attention.py) only")
    mask = None if input_ids.is_cuda else document_mask(docs.document_ids)
    # linear-attention layers take the sequences' bounds from cu_seq_lens_q, and no mask
    masks = {"full_attention": mask, "linear_attention": None}
    return model(input_ids=input_ids, attention_mask={kind: masks[kind] for kind in kinds} if kinds else mask,
                 position_ids=docs.position_ids, use_cache=False, cu_seq_lens_q=docs.cu_seqlens,
                 cu_seq_lens_k=docs.cu_seqlens, max_length_q=docs.max_seqlen, max_length_k=docs.max_seqlen,
                 **no_router_outputs(model))


def packed_linear_kinds(model: torch.nn.Module) -> set[str]:
    """{"linear_attention"} where the linear-attention modules of `model` run the packed-row forward
    (`use_packed_linear_attention`, which build_policy applies), else nothing."""
    return {"linear_attention"} if getattr(model, "packed_linear_attention", False) else set()


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention interface: (1, heads, T, head_dim) in, (1, T, heads, head_dim) out. A packed row
    on CUDA runs the varlen kernel; anything else (padded rows, the CPU's masked rows) runs transformers' SDPA."""
    if cu_seq_lens_q is None or not query.is_cuda:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return varlen_attention(query, key, value, cu_seq_lens_q, max_length_q, scaling), None


def varlen_attention(query, key, value, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None):
    """`packed_attention`'s varlen branch: (1, heads, T, head_dim) in, (1, T, heads, head_dim) out."""
    q, k, v = (kernel_layout(t) for t in (query, key, value))
    return varlen_causal(q, k, v, cu_seqlens, max_seqlen, scale)[None]


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """A packed row's (1, heads, T, head_dim) as the varlen kernels' (T, heads, head_dim), by views alone, so
    that the gradients come back by views too: the kernels read rows and heads at any stride (a copy to
    contiguous cost ~1% of a 0.5B step), and a select of the row (`t[0]`) made the compiled backward copy the
    q, k and v gradients into new buffers (`select_backward` and transposing clones: five kernels a layer, 4% of
    the device time of the 0.5B replay's step on an H200)."""
    return t.squeeze(0).transpose(0, 1)


def varlen_causal(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None) -> torch.Tensor:
    """Causal attention within each [cu_seqlens[i], cu_seqlens[i+1]) of (T, heads, head_dim) q, k, v.
    `max_seqlen` only sizes the kernel's grid: any bound on the documents' lengths is right. Grouped KV heads go
    to the kernel as they are (it reads each KV head for its group of query heads): through torch's `enable_gqa`
    where it has one, else through `causal_gqa` below, never repeated to the query's heads first."""
    extra = {"window_size": (-1, 0)} if "window_size" in VARLEN_PARAMS else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" not in VARLEN_PARAMS:
            return causal_gqa(q, k, v, cu_seqlens, max_seqlen, scale)[0]
        extra["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **extra)


# FlashAttention's varlen kernels take fewer KV heads than query heads (the backward sums each group's key and
# value gradients itself), but torch's `varlen_attn` before 2.13 refuses them. Repeating K and V to the query's
# heads (7x at Qwen2.5-0.5B) cost a copy of both per layer and pass, their gradients summed back, and 7x the
# saved K/V; these ops call the kernels directly, as custom ops so that compiled blocks trace through them.
@torch.library.custom_op("rl::causal_gqa", mutates_args=())
def causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of causal attention per document: q (T, heads, d), k and v (T, kv_heads, d)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                           0.0, True, False, scale=scale)
    return out, lse


@torch.library.custom_op("rl::causal_gqa_backward", mutates_args=())
def causal_gqa_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the kernel's RNG state, unread at p=0
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(grad.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens,
                                                    max_seqlen, max_seqlen, 0.0, True, no_dropout, unused,
                                                    scale=scale)


@causal_gqa.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@causal_gqa_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _causal_gqa_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _causal_gqa_grad(ctx, grad, _grad_lse):
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = causal_gqa_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


causal_gqa.register_autograd(_causal_gqa_grad, setup_context=_causal_gqa_setup)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Points `model`'s attention at `packed_attention` (SDPA for every pass without packed documents)."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        raise ConfigError(f"train.packing needs model.attn_implementation='sdpa', got "
                         f"{model.config._attn_implementation!r}")
    if next(model.parameters()).is_cuda and varlen_attn is None:
        raise ConfigError(f"train.packing on CUDA needs torch.nn.attention.varlen (torch >= 2.10), torch is "
                         f"{torch.__version__}")
    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # what a model that builds its own masks looks up
    model.config._attn_implementation = ATTENTION
