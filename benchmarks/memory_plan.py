"""The start-up memory plan on paper: for one model folder (its config.json alone), each setup's largest phase per
rank against one device, with the fixes the start-up check would name, and no GPU needed.

    python benchmarks/memory_plan.py configs/models/qwen3-30b-a3b [--world-sizes 1 8] [--lora-ranks 0 64]
        [--device-gb 141] [--section.key=value ...]

The run is benchmarks/loop.sh's (32 prompts x 8 samples, prompts <= 512 tokens, responses <= 1024, micro-batches of
32768 tokens, the policy offloaded while the engine runs, the native engine); overrides after the options change it.
Each world size runs with and without expert parallelism over all its ranks (MoE models), each LoRA rank as given.
The plan is rl/run/memory.py's, the one a run prints before any weights load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.config import load_config  # noqa: E402
from rl.run.memory import GB, fixes, models_of, peaks, plan_memory, usable_bytes  # noqa: E402

LOOP = ["--rollout.rollout_batch_size=32", "--rollout.n_samples_per_prompt=8", "--data.max_prompt_len=512",
        "--rollout.max_new_tokens=1024", "--rollout.max_context_len=1600", "--train.micro_batch_tokens=32768",
        "--train.offload=true", "--model.random_init=true", "--model.compile=true"]


def setups(hf_config, world_sizes: list[int], lora_ranks: list[int]) -> list[tuple[int, int, int]]:
    """(world size, expert-parallel size, LoRA rank) of every setup to plan."""
    experts = getattr(hf_config, "num_experts", 0) or 0
    out = []
    for world in world_sizes:
        for ep in sorted({1, world} if experts and world > 1 and experts % world == 0 else {1}):
            out += [(world, ep, rank) for rank in lora_ranks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--device-gb", type=float, default=141.0, help="one device's memory (H200: 141)")
    args, overrides = parser.parse_known_args()
    hf_config = AutoConfig.from_pretrained(args.model)
    total = args.device_gb * GB
    usable = usable_bytes(total)
    print(f"{Path(args.model).name}: memory plan per rank on {args.device_gb:.0f} GB devices "
          f"({usable / GB:.1f} GB usable)\n")
    print("| ranks | expert parallel | LoRA rank | rollout GB | train GB | largest phase | verdict | to fit |")
    print("|---|---|---|---|---|---|---|---|")
    for world, ep, rank in setups(hf_config, args.world_sizes, args.lora_ranks):
        cfg = load_config(["--config", "configs/tiny.toml", f"--model.path={args.model}", *LOOP,
                           f"--lora.rank={rank}", f"--lora.alpha={2 * rank}", f"--train.expert_parallel={ep}",
                           *overrides], checked=False)
        models = models_of(cfg, hf_config)
        need = peaks(plan_memory(cfg, models, world, "cuda", total))
        phase, top = max(need.items(), key=lambda kv: kv[1])
        fits = top <= usable
        to_fit = "" if fits else "; ".join(fixes(cfg, lambda c, w: peaks(plan_memory(c, models, w, "cuda", total)),
                                                world, usable))
        print(f"| {world} | {ep} | {rank or '-'} | {need.get('rollout', 0) / GB:.1f} | {need.get('train', 0) / GB:.1f} "
              f"| {phase} {top / GB:.1f} | {'fits' if fits else f'over by {(top - usable) / GB:.1f} GB'} | {to_fit} |")


if __name__ == "__main__":
    main()
