"""LoRA: low-rank adapters trained on the policy's linear layers and MoE experts, the base weights frozen.

Each targeted `nn.Linear` (matched by the last part of its module path, `lora.target_modules`) becomes a
`LoRALinear` that holds the very same `weight` and `bias` under the same names, so the model folder's
safetensors load into it as they are and FSDP2 shards it like any other layer, plus two trainable matrices:

    y = x @ W.T + b + scale * (dropout(x) @ A.T) @ B.T      A: (rank, in), B: (out, rank), scale = alpha / rank

A MoE block's experts hold their projections fused, `gate_up_proj` (E, 2 * I, H) and `down_proj` (E, H, I)
(rl/model/moe.py). The targets select them by a dense MLP's names, as PEFT's select every expert's linear layers
(`expert_targets`), and each gets per-expert adapters beside it on the experts module (`add_expert_adapters`):
`<tensor>_lora_A` (E, rank, in) and `<tensor>_lora_B` (E, out, rank), expert e's update scale * B[e] @ A[e]. The
grouped forward computes them over the same rows sorted by expert, with the same grouped matmuls as the fused
tensor (rl/model/moe.py's `ExpertLoRA`); gate_up's one adapter spans both halves (A shared by gate and up). Expert
parallelism splits them with their experts (rl/model/expert_parallel.py), each rank holding its experts' adapters.

A starts as `nn.Linear`'s own init (Kaiming uniform), B at zero, so training starts from the base model. Every
base parameter has requires_grad False: autograd builds no gradient for it, FSDP2 reduce-scatters none, and
the optimizer is built over the adapters alone (`trainable`), so the base has no AdamW moments either. The
base exists once, in the policy; nothing copies it.

The engines never see A and B: `merged_weights` turns the stream of gathered tensors into the base's names,
W + scale * B @ A for each adapted weight (per expert for a fused one; computed in fp32, cast once). The base
never changes, so after the first push only the adapted weights need to go (`changed_names`), while the engine
keeps its weights. With a KL term and no `model.ref_path` the reference is this same base, the policy run under
`adapters_off`, so the base is not built a second time for it.

Departures from PEFT: dropout acts only in passes that build a graph (the no-grad logprob passes are the
deterministic model the engine samples from), and the parameter names are `<layer>.lora_A` / `<layer>.lora_B`
(PEFT's `<layer>.lora_A.weight`, which `peft_tensors` writes in an adapter export, the experts' as the hub's one
adapter per expert and projection, which PEFT loads into transformers 5's fused experts).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from rl.config import ConfigError, LoraConfig
from rl.model.moe import EXPERT_TENSORS, moe_blocks
from rl.parallel import copy_own_rows, full_shape

# The target names that select a MoE block's fused expert tensors (`expert_targets`): a dense MLP's and the tensors'.
EXPERT_SELECTORS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


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
    """Freezes every parameter of `model` and puts adapters on the linear layers named in cfg.target_modules and on
    the fused expert tensors of its MoE blocks that they name (`expert_targets`); returns the adapted paths (a
    layer's module path, an expert tensor's parameter name). Call it before `fully_shard` (FSDP2 records which
    parameters train) and after `use_grouped_moe`, on a meta or CPU model alike; `init_adapters` fills A and B once
    the model is materialised and sharded."""
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
    adapted += _adapt_experts(model, cfg, found)
    missing = sorted(targets - found)
    if missing:
        raise ConfigError(f"lora.target_modules: no layer of {type(model).__name__} is named {missing} "
                          f"(its linear layers: {sorted(linear_names(model))}"
                          f"{', its experts: ' + str(sorted(EXPERT_SELECTORS)) if moe_blocks(model) else ''})")
    if cfg.export_adapter and hasattr(model, "config"):  # refused before the run, not at its end
        check_peft_experts(model.config.to_dict(), adapter_names(model))
    if hasattr(model, "get_input_embeddings"):
        model.get_input_embeddings().register_forward_hook(_embeddings_ask_for_grad)
    return adapted


def expert_targets(targets: Iterable[str]) -> list[str]:
    """The fused expert tensors (`EXPERT_TENSORS`) that lora.target_modules selects: `down_proj` by its name, and
    `gate_up_proj` by its own or by both halves it fuses (`gate_proj` and `up_proj`, a dense MLP's names, so the
    default targets adapt every MLP, routed experts included, as PEFT's do on per-expert linear layers). One half
    alone is refused: the fused tensor takes one adapter, A shared by its gate and up rows."""
    targets = set(targets)
    halves = targets & {"gate_proj", "up_proj"}
    fused = "gate_up_proj" in targets or len(halves) == 2
    if halves and not fused:
        raise ConfigError(f"lora.target_modules names {sorted(halves)} alone: a MoE block's experts fuse gate_proj "
                          f"and up_proj in one tensor (gate_up_proj) that takes one adapter; name both, or neither")
    return [name for name in EXPERT_TENSORS if name in targets or (name == "gate_up_proj" and fused)]


def _adapt_experts(model: torch.nn.Module, cfg: LoraConfig, found: set[str]) -> list[str]:
    """Adapters on the fused expert tensors of every grouped MoE block that cfg.target_modules selects (adding the
    target names that selected them to `found`); returns the tensors' parameter names."""
    blocks = moe_blocks(model)
    tensors = expert_targets(cfg.target_modules) if blocks else []
    if not tensors:
        return []
    paths = {id(m): p for p, m in model.named_modules()}
    adapted = []
    for block in blocks:
        if not hasattr(block, "moe_routing"):
            raise ValueError(f"{type(block).__name__}: patch it with use_grouped_moe before apply_lora (the grouped "
                             f"forward computes the experts' adapters)")
        add_expert_adapters(block.experts, tensors, cfg.rank, cfg.alpha, cfg.dropout)
        adapted += [f"{paths[id(block.experts)]}.{name}" for name in tensors]
    found |= {t for t in cfg.target_modules if t in EXPERT_SELECTORS}
    return adapted


def add_expert_adapters(experts: torch.nn.Module, tensors: list[str], rank: int, alpha: float, dropout: float) -> None:
    """Per-expert adapters on the experts' fused tensors `tensors`: `<tensor>_lora_A` (E, rank, in) and
    `<tensor>_lora_B` (E, out, rank) beside each (E, out, in) tensor, whose update
    scale * B[e] @ A[e] the grouped forward adds for expert e (rl/model/moe.py's `ExpertLoRA`). Registered before
    the fused tensors (taken out and put back after them), so a bucketed push meets them before the tensor they merge
    into, as LoRALinear's."""
    base = {name: param for name, param in experts.named_parameters(recurse=False)}
    for name in base:
        delattr(experts, name)
    for name in tensors:
        weight = base[name]
        num, out_features, in_features = weight.shape
        experts.register_parameter(f"{name}_lora_A", torch.nn.Parameter(
            torch.empty(num, rank, in_features, device=weight.device)))
        experts.register_parameter(f"{name}_lora_B", torch.nn.Parameter(
            torch.empty(num, out_features, rank, device=weight.device)))
    for name, param in base.items():
        experts.register_parameter(name, param)
    experts.lora_rank, experts.lora_scale, experts.lora_dropout = rank, alpha / rank, dropout
    experts.lora_tensors = tuple(tensors)
    experts.lora_enabled = True  # False: the base experts alone (`adapters_off`)


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


def adapted_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path -> the experts of a MoE block whose fused tensors have adapters (`add_expert_adapters`)."""
    return {path: m for path, m in model.named_modules() if getattr(m, "lora_tensors", None)}


def lora_rank(model: torch.nn.Module) -> int:
    """The adapters' rank (0 for a full-parameter model)."""
    for layer in list(adapted_layers(model).values()) + list(adapted_experts(model).values()):
        return layer.rank if isinstance(layer, LoRALinear) else layer.lora_rank
    return 0


def adapted_names(model: torch.nn.Module) -> list[str]:
    """The adapted layers' names (the last part of their module path) and the adapted fused expert tensors'."""
    names = {path.rpartition(".")[2] for path in adapted_layers(model)}
    return sorted(names | {name for experts in adapted_experts(model).values() for name in experts.lora_tensors})


def selected_names(model: torch.nn.Module, targets: Iterable[str]) -> list[str]:
    """What lora.target_modules `targets` adapts in `model`, named as `adapted_names` names it."""
    present = {path.rpartition(".")[2] for path, _ in model.named_modules()}
    names = set(targets) & present
    return sorted(names | set(expert_targets(targets) if moe_blocks(model) else []))


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """A as `nn.Linear` initialises a weight (Kaiming uniform, bound 1/sqrt(in); each expert's A alike), B zero: the
    same values on every rank (one generator, layers in order, then the experts'), each rank writing only the rows
    it holds (its FSDP2 shard, or its experts under expert parallelism)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            a = torch.empty(layer.rank, layer.in_features)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            copy_own_rows(layer.lora_A, a)
            copy_own_rows(layer.lora_B, torch.zeros(layer.out_features, layer.rank))
        for experts in adapted_experts(model).values():
            for name in experts.lora_tensors:
                lora_A, lora_B = getattr(experts, f"{name}_lora_A"), getattr(experts, f"{name}_lora_B")
                shape_A, shape_B = full_shape(lora_A), full_shape(lora_B)
                bound = 1 / math.sqrt(shape_A[-1])  # kaiming_uniform_(a=sqrt(5))'s, fan_in = in per expert
                copy_own_rows(lora_A, torch.empty(shape_A).uniform_(-bound, bound, generator=generator))
                copy_own_rows(lora_B, torch.zeros(shape_B))


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapted layer computes x @ W.T + b alone and the experts their fused
    tensors alone (the KL reference)."""
    layers = list(adapted_layers(model).values()) + list(adapted_experts(model).values())
    for layer in layers:
        _switch(layer, False)
    try:
        yield
    finally:
        for layer in layers:
            _switch(layer, True)


def _switch(layer: torch.nn.Module, on: bool) -> None:
    if isinstance(layer, LoRALinear):
        layer.enabled = on
    else:
        layer.lora_enabled = on


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or the adapters alone with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_names(model: torch.nn.Module) -> set[str]:
    """The adapters' parameter names (not in the model folder's files: they start from `init_adapters`)."""
    return {f"{weight.removesuffix('.weight')}{sep}{leaf}"
            for weight, sep in _adapted_weights(model).items() for leaf in ("lora_A", "lora_B")}


def changed_names(model: torch.nn.Module) -> set[str]:
    """The tensors of `model` that training changes, by name: every adapted weight (a layer's, an expert tensor)
    and its A and B (what a push must send once the engine holds the base)."""
    return set(_adapted_weights(model)) | adapter_names(model)


def _adapted_weights(model: torch.nn.Module) -> dict[str, str]:
    """Adapted weight name -> the separator of its adapters' names: `<layer>.weight` has `<layer>.lora_A`, an expert
    tensor `<experts>.gate_up_proj` has `<experts>.gate_up_proj_lora_A`."""
    out = {f"{path}.weight": "." for path in adapted_layers(model)}
    out |= {f"{path}.{name}": "_" for path, experts in adapted_experts(model).items() for name in experts.lora_tensors}
    return out


def adapter_of(name: str) -> tuple[str, str] | None:
    """An adapter's parameter name -> (the weight it merges into, "lora_A" or "lora_B"); None for other names."""
    for leaf in ("lora_A", "lora_B"):
        if name.endswith(f".{leaf}"):
            return f"{name.removesuffix(f'.{leaf}')}.weight", leaf
        if name.endswith(f"_{leaf}"):
            return name.removesuffix(f"_{leaf}"), leaf
    return None


def merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32, returned in W's dtype. weight: (out, in), lora_A: (rank, in), lora_B: (out, rank);
    or a fused expert tensor, each expert's alike: (E, out, in), (E, rank, in), (E, out, rank)."""
    return (weight.float() + scale * (lora_B.float() @ lora_A.float())).to(weight.dtype)


def merged_weights(weights: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs with every adapted weight's A and B folded into it: what an engine or a Hugging
    Face folder holds. `scales`: adapted weight name -> alpha / rank (`scales_of`); other names pass through. An
    adapter that arrives before its weight is held (cloned: it is a view of a gathered bucket)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        weight, leaf = (name, "weight") if name in scales else adapter_of(name) or (name, "")
        if weight not in scales:
            yield name, tensor
            continue
        parts = held.setdefault(weight, {})
        parts[leaf] = tensor if leaf == "weight" else tensor.clone()
        if len(parts) == 3:
            del held[weight]
            yield weight, merge(parts["weight"], parts["lora_A"], parts["lora_B"], scales[weight])
    if held:
        raise ValueError(f"adapted weights without their adapters or their weight in the stream: {sorted(held)[:3]}")


def scales_of(model: torch.nn.Module) -> dict[str, float]:
    """Adapted weight name -> its adapters' scale, alpha / rank."""
    scales = {f"{path}.weight": layer.scale for path, layer in adapted_layers(model).items()}
    return scales | {f"{path}.{name}": experts.lora_scale for path, experts in adapted_experts(model).items()
                     for name in experts.lora_tensors}


# ---------------------------------------------------------------------------- the PEFT layout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"base_model.model.{name}.weight"


def peft_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One adapter under PEFT's names: a linear layer's as it is (`peft_name`); a fused expert tensor's per expert,
    as PEFT holds the adapters of a model with one linear layer per expert (`<experts>.N.gate_proj`, `up_proj`,
    `down_proj`, the hub's layout), which PEFT loads into transformers 5's fused experts. The gate_up adapter is two
    adapters with the same A: gate's B is its first half of rows, up's the second (W + s * B @ A row by row)."""
    weight, leaf = adapter_of(name) or ("", "")
    experts, _, fused = weight.rpartition(".")
    if fused not in EXPERT_TENSORS:
        yield peft_name(name), tensor
        return
    for e, part in enumerate(tensor):
        if fused == "down_proj":
            yield peft_name(f"{experts}.{e}.down_proj.{leaf}"), part.clone()
            continue
        halves = (part, part) if leaf == "lora_A" else part.chunk(2, dim=0)
        for proj, half in zip(("gate_proj", "up_proj"), halves):
            yield peft_name(f"{experts}.{e}.{proj}.{leaf}"), half.clone()  # clones: safetensors stores no shared views


SHARED_EXPERT_MODELS = ("qwen2_moe", "qwen3_next")  # MoE families whose blocks add a shared expert (linear layers)


def check_peft_experts(config: dict, names: Iterable[str]) -> None:
    """Refuses a PEFT export of expert adapters for a model whose MoE blocks have a shared expert (`config`: its
    config.json): PEFT (0.21) loads the hub layout's per-expert adapters into transformers 5's fused experts by
    their names, which such a model's shared expert shares, and the adapter it loads is not the trained one."""
    model_type = config.get("text_config", config).get("model_type")
    if model_type in SHARED_EXPERT_MODELS and any(
            (adapter_of(n) or ("", ""))[0].rpartition(".")[2] in EXPERT_TENSORS for n in names):
        raise ConfigError(f"lora.export_adapter: PEFT does not load adapters on the fused experts of a model with a "
                          f"shared expert ({model_type}) as trained; export the merged model (final/, python -m "
                          f"rl.export without --adapter), or leave the experts out of lora.target_modules")


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM (the keys it needs to load the adapter); the fused
    `gate_up_proj` is named by the per-expert layers its adapters are written as (`peft_tensors`)."""
    targets = set(cfg.target_modules)
    if "gate_up_proj" in targets:
        targets = targets - {"gate_up_proj"} | {"gate_proj", "up_proj"}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}
