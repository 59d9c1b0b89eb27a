"""Policy loading on several ranks, started by tests/test_policy_load.py as
`torchrun --nproc-per-node 2 tests/policy_load_checks.py DIR`.

DIR holds model folders (plain, tied, sharded, broken); each rank writes DIR/results<rank>.json:
per folder, whether the gathered weights equal the files', how far the logits are from a plain
`from_pretrained` model's (0 on the CPU; a GPU computes in bf16), and the error a broken folder raised.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from rl import parallel  # noqa: E402
from rl.config import ConfigError, ModelConfig  # noqa: E402
from rl.model.invariant import make_batch_invariant  # noqa: E402
from rl.train.policy import (build_policy, init_non_persistent_buffers, init_random_weights,  # noqa: E402
                             shard_policy, weight_files)
from rl.train.weights import iter_full_weights  # noqa: E402

TOKENS = torch.tensor([[1, 5, 9, 13, 20, 40, 7, 2, 250, 258], [3, 3, 100, 101, 102, 17, 9, 1, 0, 4]])


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in weight_files(str(path)):
        out.update(load_file(file))
    return out


def logits(model, device, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens.to(device)).logits.cpu()


def check_folder(path: Path, d: parallel.Dist) -> dict:
    policy = build_policy(ModelConfig(path=str(path)), d.mesh, d.device, seed=0, max_context_len=64)
    gathered = {n: t.clone() for n, t in iter_full_weights(policy, torch.float32, 1 << 30)}
    stored = file_tensors(path)
    if policy.config.tie_word_embeddings:
        stored.setdefault("lm_head.weight", stored["model.embed_tokens.weight"])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    buffers = dict(reference.named_buffers())
    own_buffers = dict(policy.named_buffers())  # the computed ones too, which the weight stream leaves out
    return {
        "weights_differ": sorted(n for n in stored if not torch.equal(gathered[n].cpu(), stored[n].float())),
        "params_not_in_files": sorted(n for n, _ in policy.named_parameters(remove_duplicate=False)
                                      if n not in stored),
        "buffers_differ": sorted(n for n in buffers if not torch.equal(own_buffers[n].cpu(), buffers[n])),
        "logits_max_diff": float((logits(policy, d.device) - logits(reference, "cpu")).abs().max()),
        "tied": policy.lm_head.weight is policy.model.embed_tokens.weight,
    }


def check_random_init(path: Path, d: parallel.Dist) -> dict:
    """The sharded random weights against the same draws on one unsharded CPU model: the same on every rank and
    for any number of ranks, with Hugging Face's scales."""
    policy = build_policy(ModelConfig(path=str(path), random_init=True), d.mesh, d.device, seed=5, max_context_len=64)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.to_empty(device="cpu")
    init_non_persistent_buffers(reference)
    init_random_weights(reference, 5, config.initializer_range)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    gathered = dict(iter_full_weights(policy, torch.float32, 1 << 30))
    other_seed = build_policy(ModelConfig(path=str(path), random_init=True), d.mesh, d.device, seed=6,
                              max_context_len=64)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    return {"weights_differ": sorted(n for n in expected if not torch.equal(gathered[n].cpu(), expected[n])),
            "q_proj_std": float(gathered[q_proj].std()), "initializer_range": config.initializer_range,
            "norms_one": bool((gathered["model.norm.weight"] == 1).all()),
            "biases_zero": all(bool((t == 0).all()) for n, t in gathered.items() if n.endswith("bias")),
            "other_seed_differs": not torch.equal(dict(iter_full_weights(other_seed, torch.float32, 1 << 30))[q_proj],
                                                  gathered[q_proj]),
            "logits_finite": bool(torch.isfinite(logits(policy, d.device)).all())}


def check_batch_invariant(path: Path, d: parallel.Dist) -> dict:
    """The meta-device build patched for batch invariance computes what the old in-memory path computed."""
    cfg = ModelConfig(path=str(path), batch_invariant=True)
    new = build_policy(cfg, d.mesh, d.device, seed=0, max_context_len=64)
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=cfg.attn_implementation)
    old = shard_policy(make_batch_invariant(whole, 64), d.mesh, d.device, False)
    tokens = TOKENS[:1, :4]  # Triton's interpreter is slow: one short row
    return {"logits_max_diff": float((logits(new, d.device, tokens) - logits(old, d.device, tokens)).abs().max())}


def main(out_dir: str) -> None:
    d = parallel.init_distributed()
    out = Path(out_dir)
    results = {name: check_folder(out / name, d) for name in ("plain", "tied", "sharded")}
    try:
        build_policy(ModelConfig(path=str(out / "broken")), d.mesh, d.device, seed=0, max_context_len=64)
        results["broken"] = "loaded"
    except ConfigError as e:
        results["broken"] = str(e)
    results["random_init"] = check_random_init(out / "plain", d)
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        results["batch_invariant"] = check_batch_invariant(out / "plain", d)
    (out / f"results{d.rank}.json").write_text(json.dumps(results, indent=1))
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
