"""How long a rollout of multi-turn episodes waits on its environments after the engine's turn, on this machine's
CPU: a tiny random model on the native engine, 64 episodes of up to 3 turns (up to 192 model tokens), and an
environment whose every step sleeps STEP_S (0.05) seconds in one of the reward workers.

    python benchmarks/env_overlap.py [--workers 8] [--rollouts 5]

Prints the medians (after the first rollout, which also starts the workers) of the rollout's seconds and of
`perf/env_s`, the wait after the engine's turn that generation did not hide: an episode's step starts as soon as
the engine has its turn (rl/rollout/episodes.py), so only the steps of the turns that finish last are waited for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEP_S = 0.05


def make_env(prompt, label, columns):
    return Sleepy()


class Sleepy:
    """Two steps, each sleeping STEP_S (a sandboxed program's start and run), then the end."""

    def __init__(self):
        self.steps = 0

    def step(self, text, tokens):
        self.steps += 1
        time.sleep(STEP_S)
        return " and", self.steps >= 2, 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=5)
    args = parser.parse_args()
    import torch

    from rl.config import EnvConfig, RewardConfig, RolloutConfig
    from rl.data import Sample
    from rl.env.reward import RewardPool
    from rl.parallel import Dist
    from rl.rollout import SamplingParams
    from rl.rollout.collect import Collector
    from rl.rollout.native import NativeEngine
    from tests.test_engine import full_weights
    from tests.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model(seed=3, vocab_size=len(tokenizer)).eval()
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=64, page_size=16)
    engine.load_weights(full_weights(model))
    # This random model ends a turn at one of these ids, after ~50 tokens on average.
    params = SamplingParams(max_new_tokens=192, temperature=1.0, stop_token_ids=(188, 193, 246, 100, 101), seed=0)
    env = EnvConfig(fn="env_overlap:make_env", max_turns=3)
    one_rank = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    rows = []
    with RewardPool(RewardConfig(num_workers=args.workers), env.fn) as pool:
        collector = Collector(engine, pool, tokenizer, RolloutConfig(max_new_tokens=192, max_batch_size=64), one_rank,
                              env=env)
        for _ in range(args.rollouts):
            samples = [Sample(prompt="q", tokens=[40, 41, 42 + i // 8], raw_prompt="q", group_index=i // 8)
                       for i in range(64)]
            scored = collector.generate_and_score([samples[i : i + 8] for i in range(0, 64, 8)], params, 1, (0,), 60.0)
            rows.append((scored.stats.rollout_s, scored.stats.env_s))
    print(f"| step s | workers | rollout s | env_s (waited after the turn) |\n|---|---|---|---|\n"
          f"| {STEP_S:g} | {args.workers} | {statistics.median(r for r, _ in rows[1:]):.2f} | "
          f"{statistics.median(e for _, e in rows[1:]):.2f} |")


if __name__ == "__main__":
    main()
