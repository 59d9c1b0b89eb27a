"""The native engine's prefill of a partial rollout's continued samples, by attention kernel, on CUDA.

    python benchmarks/prefill.py [--model configs/models/qwen2.5-0.5b] [--sets 3]

A partial rollout resumes each unfinished sample by prefilling its prompt and the response so far under the new
weights: ~200 samples of 300 to 4,000 tokens, in padded chunks whose shapes differ from one rollout to the next.
Each set here is such a rollout's worth (48 prompts x 5 samples, responses of 300 tokens plus a geometric tail of
mean 500, up to 4,000), new lengths every set, so every set brings new shapes. Per attention kernel the table gives
the first prefill of each new set (what a rollout pays) and a second of the same set (shapes seen before): `cudnn`
is torch's default choice on Hopper, `engine` the engine's own choice (rl/model/decoder.py PREFILL_ATTENTION).
The samples of a prompt share its full pages, prefilled once (rl/rollout/scheduler.py `share_bases`); `engine, own
copies` prefills every sample's prompt for itself, as the engine did before. `--prompt-tokens LOW HIGH`: the prompts'
lengths (40-90 by default; a bundle of several problems runs to ~1,300). Random weights of the config: the work is
the same.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rl.model.decoder as model_module  # noqa: E402
from rl.rollout import scheduler  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402
from rl.rollout.scheduler import PagePool, Scheduler  # noqa: E402

KERNELS = {"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH],
           "engine": model_module.PREFILL_ATTENTION}


def continued_set(rng: random.Random, vocab: int, prompt_tokens: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    """A rollout's continued samples: (prompt + response so far, response length) each."""
    prompts = [[rng.randrange(100, vocab // 2) for _ in range(rng.randrange(*prompt_tokens))] for _ in range(48)]
    tokens, prior = [], []
    for prompt in prompts:
        for _ in range(5):
            n = 300
            while rng.random() > 1 / 500 and n < 4000:
                n += 1
            tokens.append(prompt + [rng.randrange(100, vocab // 2) for _ in range(n)])
            prior.append(n)
    return tokens, prior


def prefill_s(engine: NativeEngine, tokens: list[list[int]], prior: list[int]) -> tuple[float, int]:
    """Seconds to prefill the set, and the tokens prefilled (the engine's own count)."""
    sched = Scheduler(tokens, 4000, engine.page_size, PagePool(engine.num_pages), engine.max_batch_size, prior)
    to_prefill, _ = sched.admit()
    before = engine.stats.prefill_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine._prefill(to_prefill)
    torch.cuda.synchronize()
    return time.perf_counter() - start, engine.stats.prefill_tokens - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "configs/models/qwen2.5-0.5b"))
    p.add_argument("--sets", type=int, default=3, help="new sets per kernel")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[40, 90], metavar=("LOW", "HIGH"))
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/prefill.py measures CUDA kernels: no CUDA device here")
    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    engine = NativeEngine(config, torch.device("cuda"), torch.bfloat16, max_batch_size=1024,
                          max_context_len=4000 + args.prompt_tokens[1] + 64)
    engine.load_weights(hf.state_dict().items())
    del hf
    rng = random.Random(0)
    sample = functools.partial(continued_set, rng, config.vocab_size, tuple(args.prompt_tokens))
    prefill_s(engine, *sample())  # the first call of the process: lazy set-ups
    print("| attention | tokens a set | tokens prefilled | first prefill of a new set, s | tokens/s "
          "| again, same shapes, s | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    share = scheduler.share_bases
    for name, kernels, shared in [("cudnn", KERNELS["cudnn"], True), ("engine", KERNELS["engine"], True),
                                  ("engine, own copies", KERNELS["engine"], False)]:
        model_module.PREFILL_ATTENTION = kernels
        scheduler.share_bases = share if shared else lambda prompts, page_size: None
        first, again, tokens, prefilled = [], [], [], []
        for _ in range(args.sets):
            batch = sample()
            tokens.append(sum(map(len, batch[0])))
            seconds, new = prefill_s(engine, *batch)
            first.append(seconds)
            again.append(prefill_s(engine, *batch)[0])
            prefilled.append(new)
        n = statistics.mean(tokens)
        a, b = statistics.mean(first), statistics.mean(again)
        seconds = " ".join(f"{t:.2f}" for t in first)
        print(f"| {name} | {n:,.0f} | {statistics.mean(prefilled):,.0f} | {a:.3f} ({seconds}) | {n / a:,.0f} "
              f"| {b:.3f} | {n / b:,.0f} |")
    scheduler.share_bases = share


if __name__ == "__main__":
    main()
