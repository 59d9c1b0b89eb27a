"""How far bf16 rounding alone moves a model's logprobs: the floor under any engine-vs-trainer logprob difference.

    python benchmarks/bf16_floor.py configs/models/qwen3-1.7b [...] [--tokens 256] [--device cpu]

For each config folder, random weights (seed 0) score random token ids in float32 and in bf16 with two attention
kernels (SDPA and eager); the table gives the mean |logprob difference| of bf16 SDPA against bf16 eager (two
kernel orders, both bf16: what an engine and a trainer that share no kernels differ by at best) and against float32.
An engine whose difference from the trainer (benchmarks/families.py, benchmarks/rollout.py) sits at the first
column is at that floor; going below it takes the same kernels on both sides (model.batch_invariant).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def token_logprobs(model, ids: torch.Tensor, attention: str) -> torch.Tensor:
    """Each next token's logprob under `model` with its attention kernel set to `attention`."""
    for module in model.modules():
        if getattr(module, "config", None) is not None and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = attention
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def floor(model_dir: Path, tokens: int, device: str) -> dict[str, float]:
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (2, tokens), device=device)
    model_state = model.state_dict()
    full = token_logprobs(model, ids, "sdpa")
    # the same weights in bf16, built as a bf16 model so that its buffers (RoPE's inverse frequencies) stay float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    model.load_state_dict(model_state)
    sdpa, eager = token_logprobs(model, ids, "sdpa"), token_logprobs(model, ids, "eager")
    return {"sdpa vs eager": (sdpa - eager).abs().mean().item(), "vs float32": (sdpa - full).abs().mean().item(),
            "mean logprob": full.mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=256, help="tokens in each of the two sequences")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print("| model | bf16 SDPA vs bf16 eager, mean abs | bf16 SDPA vs float32, mean abs | mean logprob | s |")
    print("|---|---|---|---|---|")
    for model_dir in args.models:
        start = time.perf_counter()
        r = floor(model_dir, args.tokens, args.device)
        print(f"| {model_dir.name} | {r['sdpa vs eager']:.2e} | {r['vs float32']:.2e} | {r['mean logprob']:.2f} "
              f"| {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
