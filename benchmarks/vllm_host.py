"""Where a vLLM engine's step goes on the host: one engine as the trainer runs it, one timed call, then the same
call with the main thread's Python stack sampled every millisecond.

    python benchmarks/vllm_host.py MODEL_DIR [--sequences 512] [--new-tokens 256] [--vllm-kwargs '{}'] [--calls 1]
                                   [--no-sample]

MODEL_DIR may be a config folder (configs/models/...): vLLM builds random weights (the trainer's
`load_format="dummy"`). The prompts are `--sequences / 8` random ones of 100-150 tokens, 8 samples each (a GSM
rollout's shape), EOS ignored, so every sequence decodes `--new-tokens`. It prints the timed call's tokens/s
and time per engine step, then the sampled call's share of samples per function, inclusive and self. The
sampler takes the interpreter lock every millisecond, so the sampled call runs slower than the timed one; when
it does, the host is what bounds the step. `--vllm-kwargs` goes to `vllm.LLM` as `rollout.vllm.kwargs` does;
`--calls` times that many calls, `--no-sample` leaves out the sampled one (to compare settings, one engine each).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from rollout import random_prompts  # noqa: E402

from rl import parallel  # noqa: E402
from rl.config import RolloutConfig, VllmEngineConfig  # noqa: E402
from rl.rollout import SamplingParams  # noqa: E402


class StackSampler:
    """Counts, every `interval` seconds, the functions on one thread's Python stack (inclusive, once per sample)
    and the function at its top (self)."""

    def __init__(self, thread_id: int, interval: float = 0.001):
        self.thread_id, self.interval = thread_id, interval
        self.inclusive, self.self_ = collections.Counter(), collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self.samples += 1
                self.self_[_name(frame)] += 1
                seen = set()
                while frame is not None:
                    seen.add(_name(frame))
                    frame = frame.f_back
                self.inclusive.update(seen)
            time.sleep(self.interval)

    def report(self, inclusive_rows: int = 45, self_rows: int = 25) -> str:
        n = max(self.samples, 1)
        lines = ["inclusive (share of samples):"]
        lines += [f"  {100 * c / n:5.1f}%  {k}" for k, c in self.inclusive.most_common(inclusive_rows)]
        lines += ["self:"] + [f"  {100 * c / n:5.1f}%  {k}" for k, c in self.self_.most_common(self_rows)]
        return "\n".join(lines)


def _name(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model folder or a config folder (random weights)")
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vllm-kwargs", default="{}", help="a JSON object of extra vllm.LLM arguments")
    parser.add_argument("--calls", type=int, default=1, help="timed calls, each printed")
    parser.add_argument("--no-sample", action="store_true", help="no call with the Python stack sampled")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_PORT", "29641")  # init_distributed sets the rest of a group of one
    device = parallel.init_distributed().device
    from transformers import AutoConfig

    from rl.rollout.vllm import VllmEngine

    kwargs = json.loads(args.vllm_kwargs)
    cfg = RolloutConfig(engine="vllm", max_context_len=160 + args.new_tokens, max_batch_size=max(256, args.sequences),
                        vllm=VllmEngineConfig(gpu_memory_utilization=0.3, kwargs=kwargs))
    engine = VllmEngine(args.model, cfg, device, torch.bfloat16, seed=0)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = [p for p in random_prompts(vocab, args.sequences // 8, 100, 150) for _ in range(8)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    engine.generate(prompts, SamplingParams(max_new_tokens=16))  # warm-up
    steps = [0]
    step = engine.llm.llm_engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.llm.llm_engine.step = counted_step

    def call() -> tuple[float, int]:
        steps[0] = 0
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, sum(len(o.token_ids) for o in out)

    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default")
    for _ in range(args.calls):
        wall, tokens = call()
        print(f"vllm_kwargs {kwargs}, VLLM_USE_V2_MODEL_RUNNER={runner}: {len(prompts)} sequences x "
              f"{args.new_tokens}: {wall:.2f} s, {tokens / wall:,.0f} tokens/s, {steps[0]} engine steps, "
              f"{1e3 * wall / steps[0]:.2f} ms a step")
    if not args.no_sample:
        with StackSampler(threading.get_ident()) as sampler:
            wall, _ = call()
        print(f"sampled call: {wall:.2f} s ({steps[0]} steps), {sampler.samples} samples")
        print(sampler.report())
    engine.close()
    parallel.teardown()


if __name__ == "__main__":
    main()
