"""LoRA: low-rank adapters trained on the policy's linear layers, the base weights frozen.

Each targeted `nn.Linear` (matched by the last part of its module path, `lora.target_modules`) becomes a
`LoRALinear` that holds the very same `weight` and `bias` under the same names, so the model folder's
safetensors load into it as they are and FSDP2 shards it like any other layer, plus two trainable matrices:

    y = x @ W.T + b + scale * (dropout(x) @ A.T) @ B.T      A: (rank, in), B: (out, rank), scale = alpha / rank

A starts as `nn.Linear`'s own init (Kaiming uniform), B at zero, so training starts from the base model. Every
base parameter has requires_grad False: autograd builds no gradient for it, FSDP2 reduce-scatters none, and
the optimizer is built over the adapters alone (`trainable`), so the base has no AdamW moments either. The
base exists once, in the policy; nothing copies it.

The engines never see A and B: `merged_weights` turns the stream of gathered tensors into the base's names,
W + scale * B @ A for each adapted layer (computed in fp32, cast once). The base never changes, so after the
first push only the adapted layers need to go (`changed_names`), while the engine keeps its weights.
With a KL term and no `model.ref_path` the reference is this same base, the policy run under `adapters_off`,
so the base is not built a second time for it.

Departures from PEFT: dropout acts only in passes that build a graph (the no-grad logprob passes are the
deterministic model the engine samples from), and the parameter names are `<layer>.lora_A` / `<layer>.lora_B`
(PEFT's `<layer>.lora_A.weight`, which `peft_name` writes in an adapter export).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from rl.config import LORA_TARGETS, ConfigError, LoraConfig
from rl.model.moe import moe_blocks
from rl.parallel import copy_own_rows, print0

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a dense MLP's; a MoE block's experts fuse them


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update; `weight`/`bias` are the replaced layer's own."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.scale, self.dropout = rank, alpha / rank, dropout
        self.enabled = True  # False: the base layer alone (`adapters_off`)
        # The adapters are registered first, so a bucketed push meets them before the weight they merge into.
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = torch.nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, training=self.training and torch.is_grad_enabled()) if self.dropout else x
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(h, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """Freezes every parameter of `model` and puts adapters on the linear layers named in cfg.target_modules;
    returns their module paths. Call it before `fully_shard` (FSDP2 records which parameters train) and on a
    meta or CPU model alike; `init_adapters` fills A and B once the model is materialised and sharded."""
    for param in model.parameters():
        param.requires_grad_(False)
    names_of = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    tied = {i for i, n in names_of.items() if n > 1}
    targets = set(cfg.target_modules)
    adapted, found = [], set()
    for path, module in list(model.named_modules()):
        name = path.rpartition(".")[2]
        if name not in targets:
            continue
        found.add(name)
        if not isinstance(module, torch.nn.Linear):
            raise ConfigError(f"lora.target_modules: {path} is a {type(module).__name__}, not a linear layer")
        if id(module.weight) in tied:
            raise ConfigError(f"lora.target_modules: {path}.weight is tied to another tensor (the embedding); "
                              f"an adapter merged into it would change both")
        parent = model.get_submodule(path.rpartition(".")[0])
        setattr(parent, name, LoRALinear(module, cfg.rank, cfg.alpha, cfg.dropout))
        adapted.append(path)
    missing = sorted(targets - found)
    experts_only = moe_blocks(model) and set(missing) <= set(EXPERT_PROJECTIONS)
    if experts_only and list(cfg.target_modules) == list(LORA_TARGETS):  # the default: the experts are left out
        print0(f"lora: {type(model).__name__}'s experts hold their projections as fused tensors, which take no "
               f"adapters: the adapters go on {sorted(found)} only")
    elif missing:
        why = (" (a MoE model's experts are fused tensors, not linear layers: they take no adapters)"
               if experts_only else "")
        raise ConfigError(f"lora.target_modules: no layer of {type(model).__name__} is named {missing}{why} "
                          f"(its linear layers: {sorted(linear_names(model))})")
    if hasattr(model, "get_input_embeddings"):
        model.get_input_embeddings().register_forward_hook(_embeddings_ask_for_grad)
    return adapted


def _embeddings_ask_for_grad(module, inputs, output: torch.Tensor) -> torch.Tensor:
    """In a pass that builds a graph, the frozen embeddings' output asks for a gradient, as every later decoder
    block's input does (through the adapters before it): the compiled blocks then meet one kind of input and
    compile one graph for the train pass, not a second for the first block (at 0.5B on an H200 the first LoRA
    step took 45 s against 12 s for full-parameter training). It costs the first block's input gradient."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def linear_names(model: torch.nn.Module) -> set[str]:
    return {path.rpartition(".")[2] for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def adapted_layers(model: torch.nn.Module) -> dict[str, LoRALinear]:
    """Module path -> LoRALinear, in the model's order (empty for a full-parameter model)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """A as `nn.Linear` initialises a weight (Kaiming uniform, bound 1/sqrt(in)), B zero: the same values on
    every rank (one generator, layers in order), each rank writing only its FSDP2 shard's rows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            a = torch.empty(layer.rank, layer.in_features)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            copy_own_rows(layer.lora_A, a)
            copy_own_rows(layer.lora_B, torch.zeros(layer.out_features, layer.rank))


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapted layer computes x @ W.T + b alone (the KL reference)."""
    layers = adapted_layers(model).values()
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or the adapters alone with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_names(model: torch.nn.Module) -> set[str]:
    """The adapters' parameter names (not in the model folder's files: they start from `init_adapters`)."""
    return {f"{path}.{leaf}" for path in adapted_layers(model) for leaf in ("lora_A", "lora_B")}


def changed_names(model: torch.nn.Module) -> set[str]:
    """The tensors of `model` that training changes, by name: every adapted layer's weight and its A and B
    (what a push must send once the engine holds the base)."""
    return {f"{path}.{leaf}" for path in adapted_layers(model) for leaf in ("weight", "lora_A", "lora_B")}


def merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32, returned in W's dtype. weight: (out, in), lora_A: (rank, in), lora_B: (out, rank)."""
    return (weight.float() + scale * (lora_B.float() @ lora_A.float())).to(weight.dtype)


def merged_weights(weights: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs with every adapted layer's A and B folded into its weight: what an engine or a
    Hugging Face folder holds. `scales`: module path -> alpha / rank of each adapted layer; other names pass
    through. An adapter that arrives before its weight is held (cloned: it is a view of a gathered bucket)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        path, _, leaf = name.rpartition(".")
        if path not in scales or leaf not in ("weight", "lora_A", "lora_B"):
            yield name, tensor
            continue
        parts = held.setdefault(path, {})
        parts[leaf] = tensor if leaf == "weight" else tensor.clone()
        if len(parts) == 3:
            del held[path]
            yield f"{path}.weight", merge(parts["weight"], parts["lora_A"], parts["lora_B"], scales[path])
    if held:
        raise ValueError(f"adapted layers without their weight or adapters in the stream: {sorted(held)[:3]}")


def scales_of(model: torch.nn.Module) -> dict[str, float]:
    return {path: layer.scale for path, layer in adapted_layers(model).items()}


# ---------------------------------------------------------------------------- the PEFT layout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"base_model.model.{name}.weight"


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM (the keys it needs to load the adapter)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": sorted(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}
