"""The train phase alone: one optimizer step over a seed-sized batch, per model shape and option.

    python benchmarks/train.py [--models configs/models/qwen2.5-0.5b configs/models/qwen2.5-1.5b]
        [--variants "" "logprobs=chunked,mask=padding" "compile=off,mbt=16384" ...] [--repeats 2] [--profile]

256 samples (32 prompts x 8), prompts of 150-512 tokens, responses up to 1024 with the spread of an RL
batch (a third run to the limit, the rest spread below it), random weights, the trainer's own code path
(`build_schedule` + `train_on_rollout`, PPO with reused old logprobs as in the seed's default). Each variant
is a comma-separated list of option=value over these defaults (what benchmarks/loop.sh runs); without
--variants it runs the trainer as it was before these options, then the defaults:

    mbt=32768          train.micro_batch_tokens
    compile=on|off     model.compile (torch.compile of the decoder blocks, RoPE as rl/model/rope.py's op)
    checkpointing=off|on   model.gradient_checkpointing
    logprobs=fused|chunked the Triton log-prob kernels (CUDA) or the chunked torch path
    mask=none|causal|padding   `none`: the trainer's forward (no mask, the mask mapping prepared);
                       `causal`: no mask, the model builds its own (a host sync per forward);
                       `padding`: the padding mask, as the trainer ran before right-padded rows went without one
    cold=off|on        `on` empties torch's allocator cache before each step, as the RL loop's policy offload does
    width=64|1         what micro-batch widths are rounded up to on CUDA (`rl.train.step.width_multiple`)
    fresh=off|on       `on` draws new lengths for every step, as every rollout of the loop brings (new shapes:
                       cuDNN attention builds a graph for each one it has not seen)
    adamw=fused|foreach    torch's AdamW implementation (the trainer's is fused on CUDA)
    gathered=on|off    `on` keeps FSDP2's gathered bf16 parameters from the first micro-batch of an optimizer step
                       to its last (model.reshard_after_forward=false); `off` gathers them for every forward and
                       every backward
    packing=off|on     train.packing: samples back to back in one row per micro-batch, attention within each
    skip=off|on        `on` skips the samples of zero-advantage groups (`rl.train.step.skippable_samples`); with
                       --lengths, the histogram's zero_std_group_frac of the groups have zero advantage
    context=2048       rollout.max_context_len: padded rows' widest, and the bound on a document's length that
                       packed rows give the attention kernel (it sizes the kernel's grid)
    gqa=kernel|repeat  packed rows: grouped KV heads straight into the varlen kernel (`kernel`), or `repeat`ed to
                       the query's heads first and the queries copied to contiguous rows, as packed rows ran on
                       torch without `enable_gqa` before
    layout=views|select    packed rows: q, k and v handed to the varlen kernels as views (`views`,
                       `rl.train.packing.kernel_layout`), or through a select of the row (`t[0]`), as before: its
                       backward copies each gradient into new buffers in the compiled blocks
    reduce=once|each   one rank: an optimizer step's gradients reduced into FSDP2's shards once, after its last
                       micro-batch (`rl.train.step.reduce_once`), or after every micro-batch, as before
    lora=0|RANK        > 0: LoRA adapters of that rank (alpha 2 x rank) on the default target layers, the base
                       frozen (rl/train/lora.py); the MFU still counts the full model's FLOPs a token

--lengths FILE replays a real run's length distribution instead (benchmarks/lengths/*.json: prompt lengths per
group, response lengths per sample, the share of groups with zero reward variance, the batch's size):

    python benchmarks/train.py --lengths benchmarks/lengths/gsm8k-qwen2.5-0.5b-instruct.json \
        --variants fresh=on fresh=on,packing=on fresh=on,packing=on,skip=on --repeats 3

For each model x variant it prints the step time (median of --repeats after one warm-up step, and each one),
the graphs torch.compile compiled during those steps (recompiles: 0 once warm), tokens/s, MFU
(the model FLOPs of rl/model/flops.py over the device's dense bf16 peak), the forward-only time of the same
micro-batches, the peak memory and, with --profile, one step's wall time and largest device- and host-time
entries (`rl.train.measure.profiled`, what `log.profile_rollout` writes).
On a CPU (`--models tiny`) it runs a small model as a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import AlgoConfig, LoraConfig, ModelConfig, TrainConfig  # noqa: E402
from rl.data import Sample  # noqa: E402
from rl.model.flops import peak_bf16_flops, train_flops  # noqa: E402
from rl.model.rope import unfuse_rope  # noqa: E402
from rl.run.memory import choose_allocator  # noqa: E402
from rl.train import packing as packing_module  # noqa: E402
from rl.train import step as train_module  # noqa: E402
from rl.train.measure import graphs_compiled, profiled  # noqa: E402
from rl.train.packing import use_packed_attention  # noqa: E402
from rl.train.policy import build_optimizer, build_policy  # noqa: E402
from rl.train.step import build_schedule, skippable_samples, token_logprobs, train_on_rollout  # noqa: E402


def seed_batch(vocab: int, samples: int, max_response: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(samples // 8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(150, 512))]
        for k in range(8):
            n = max_response if rng.random() < 1 / 3 else rng.randint(max_response // 10, max_response - 1)
            s = Sample(prompt="", tokens=list(prompt), index=g * 8 + k, group_index=g)
            s.append_response_tokens([rng.randrange(3, vocab) for _ in range(n)], [-math.log(vocab)] * n)
            s.advantage = rng.choice([-1.0, 1.0]) * rng.random()
            out.append(s)
    return out


def replay_batch(lengths: dict, vocab: int, seed: int = 0) -> list[Sample]:
    """A batch drawn from a length histogram (benchmarks/lengths/*.json): one prompt length per group, one response
    length per sample, and zero_std_group_frac of the groups with every advantage 0 (rewards all equal)."""
    rng = random.Random(seed)

    def draw(hist: dict) -> int:
        i = rng.choices(range(len(hist["counts"])), weights=hist["counts"])[0]
        return rng.randint(hist["edges"][i] + 1, hist["edges"][i + 1])

    n, out = lengths["n_samples_per_prompt"], []
    for g in range(lengths["rollout_batch_size"]):
        prompt = [rng.randrange(3, vocab) for _ in range(draw(lengths["prompt_length"]))]
        flat = rng.random() < lengths["zero_std_group_frac"]
        for k in range(n):
            r = draw(lengths["response_length"])
            s = Sample(prompt="", tokens=list(prompt), index=g * n + k, group_index=g)
            s.append_response_tokens([rng.randrange(3, vocab) for _ in range(r)], [-math.log(vocab)] * r)
            s.advantage = 0.0 if flat else rng.choice([-1.0, 1.0]) * rng.random()
            out.append(s)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CAUSAL_FORWARD = train_module.causal_forward
VARLEN_CAUSAL = packing_module.varlen_causal
KERNEL_LAYOUT = packing_module.kernel_layout
REDUCE_ONCE = train_module.reduce_once


def varlen_causal_repeated(q, k, v, cu_seqlens, max_seqlen, scale):
    """Packed attention as it ran before grouped KV heads went to the kernel as they are (and as views)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return VARLEN_CAUSAL(q.contiguous(), k, v, cu_seqlens, max_seqlen, scale)


DEFAULTS = {"mbt": "32768", "compile": "on", "checkpointing": "off", "logprobs": "fused", "mask": "none",
            "cold": "off", "width": "64", "fresh": "off", "adamw": "fused",
            "gathered": "on", "packing": "off", "skip": "off", "context": "2048",
            "gqa": "kernel", "lora": "0", "layout": "views", "reduce": "once"}  # what benchmarks/loop.sh runs
# the trainer before these options
BEFORE = "mbt=16384,compile=off,logprobs=chunked,mask=padding,width=1,adamw=foreach,gathered=off,reduce=each"


def parse_variant(text: str) -> dict[str, str]:
    out = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS or not value:
            raise SystemExit(f"variant {text!r}: {item!r} is not option=value with an option of {list(DEFAULTS)}")
        out[key] = value
    return out


def variant_name(variant: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items() if v != DEFAULTS[k]) or "defaults"


def forward_with_padding_mask(model, input_ids):
    """The trainer's forward before right-padded rows ran without a mask (benchmark tokens are >= 3, padding 0)."""
    mask = (input_ids != 0).long()
    return model(input_ids=input_ids, attention_mask=mask, position_ids=torch.arange(input_ids.shape[1],
                 device=input_ids.device).expand_as(input_ids), use_cache=False)


def run(model_dir: str, variant: dict[str, str], args, d: parallel.Dist) -> dict:
    on = {k: v == "on" for k, v in variant.items()}
    train_module.FUSED_LOGPROBS = variant["logprobs"] == "fused"
    train_module.CUDA_WIDTH_MULTIPLE = int(variant["width"])
    if not on["compile"]:  # an earlier compiled variant swapped in the RoPE op for the process: HF's again
        unfuse_rope()
    packing_module.varlen_causal = {"kernel": VARLEN_CAUSAL, "repeat": varlen_causal_repeated}[variant["gqa"]]
    packing_module.kernel_layout = KERNEL_LAYOUT if variant["layout"] == "views" else lambda t: t[0].transpose(0, 1)
    torch._dynamo.reset()  # compiled blocks of an earlier variant called the other attention
    train_module.reduce_once = REDUCE_ONCE if variant["reduce"] == "once" else lambda model, dp_size: False
    train_module.causal_forward = {"none": CAUSAL_FORWARD, "padding": forward_with_padding_mask,
                                   "causal": lambda model, ids: model(input_ids=ids, use_cache=False)}[variant["mask"]]
    policy = build_policy(ModelConfig(path=model_dir, random_init=True, gradient_checkpointing=on["checkpointing"],
                                      compile=on["compile"], reshard_after_forward=not on["gathered"]),
                          d.mesh, d.device, seed=0, max_context_len=int(variant["context"]),
                          lora=LoraConfig(rank=int(variant["lora"]), alpha=2.0 * int(variant["lora"])))
    if on["packing"]:
        use_packed_attention(policy)
    samples_per_step = args.lengths["rollout_batch_size"] * args.lengths["n_samples_per_prompt"] if args.lengths \
        else args.samples
    train = TrainConfig(global_batch_size=samples_per_step, micro_batch_tokens=int(variant["mbt"]), lr=1e-6,
                        packing=on["packing"])
    algo = AlgoConfig(eps_clip_high=0.2)
    optimizer, scheduler = build_optimizer(policy, train, fused=variant["adamw"] == "fused" and d.device.type == "cuda")
    def draw(seed: int):
        batch = replay_batch(args.lengths, policy.config.vocab_size, seed) if args.lengths \
            else seed_batch(policy.config.vocab_size, args.samples, args.max_response, seed)
        skip = skippable_samples(batch, algo) if on["skip"] else frozenset()
        trained = [s for s in batch if s.index not in skip]
        return trained, build_schedule(batch, train, d.rank, d.world_size, d.device, int(variant["context"]), skip)

    samples, schedule = draw(0)
    options = dict(dp_size=d.world_size, train=train, algo=algo, temperature=1.0)
    times = []
    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    first_s, steps_graphs, steps_retries = 0.0, [], []
    for i in range(args.repeats + 1):  # the first step warms the allocator and kernels up (and compiles)
        if on["cold"] and d.device.type == "cuda":
            torch.cuda.empty_cache()
        if on["fresh"] and i:
            samples, schedule = draw(i)
        sync(d.device)
        compiled: dict[str, float] = {}
        retries = alloc_retries(d.device)
        t = time.perf_counter()
        with graphs_compiled(compiled, "graphs"):
            train_on_rollout(policy, optimizer, scheduler, schedule, **options)
        sync(d.device)
        elapsed = time.perf_counter() - t
        if i:
            times.append((elapsed, [len(s.tokens) for s in samples]))
            steps_graphs.append(int(compiled["graphs"]))  # which step compiled (a new shape), and
            steps_retries.append(alloc_retries(d.device) - retries)  # which one freed the cache to allocate
        else:
            first_s = elapsed
    forward_s = 0.0
    for _ in range(2):  # the second pass is timed: the first picks no-grad kernels and allocates
        sync(d.device)
        t = time.perf_counter()
        with torch.no_grad():
            for mb in schedule.micro_batches:
                token_logprobs(policy, mb, 1.0)
        sync(d.device)
        forward_s = time.perf_counter() - t
    profile = ""
    if args.profile:  # the trainer's own profiler (log.profile_rollout)
        path = Path(tempfile.mkdtemp()) / "profile.txt"
        with profiled(path):
            train_on_rollout(policy, optimizer, scheduler, schedule, **options)
        profile = path.read_text()
    peak = peak_bf16_flops(d.device)
    # per timed step (its own lengths with fresh=on), then the median of each
    row = {"model": Path(model_dir).name, "variant": variant_name(variant),
           "first_s": first_s,
           "tokens": int(statistics.median(sum(lengths) for _, lengths in times)),
           "micro_batches": len(schedule.steps[0]),
           "step_s": statistics.median(s for s, _ in times), "steps_s": [s for s, _ in times],
           "graphs": sum(steps_graphs), "steps_graphs": steps_graphs, "steps_alloc_retries": steps_retries,
           "tokens_per_s": statistics.median(sum(lengths) / s for s, lengths in times),
           "mfu": statistics.median(train_flops(policy.config, lengths) / (s * d.world_size * peak)
                                    for s, lengths in times) if peak else None,
           "forward_s": forward_s,
           "peak_gb": torch.cuda.max_memory_allocated(d.device) / 1e9 if d.device.type == "cuda" else None,
           "profile": profile}
    del policy, optimizer, scheduler, schedule
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def alloc_retries(device: torch.device) -> int:
    """How often the caching allocator has freed its cache and retried a cudaMalloc (each a device-wide sync)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["configs/models/qwen2.5-0.5b", "configs/models/qwen2.5-1.5b"])
    p.add_argument("--variants", nargs="+", default=[BEFORE, ""],
                   help="option=value,... over the defaults (see above); default: the trainer before its speed "
                        "options, and the defaults")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--lengths", help="a length histogram to replay (benchmarks/lengths/*.json)")
    p.add_argument("--json", type=Path, help="also append each row to this file, one JSON object a line")
    args = p.parse_args()
    args.lengths = json.loads(Path(args.lengths).read_text()) if args.lengths else None
    choose_allocator("native")  # the allocator a run with the native engine trains in
    d = parallel.init_distributed()
    models = list(args.models)
    if models == ["tiny"]:  # CPU smoke test
        from tests.tiny import save_tiny_model_dir
        models = [str(save_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny"))]
    variants = [parse_variant(v) for v in args.variants]
    if d.is_main:
        print(f"device: {torch.cuda.get_device_name(d.device) if d.device.type == 'cuda' else 'cpu'}, "
              f"{d.world_size} rank(s), peak {peak_bf16_flops(d.device) or 0:.3g} FLOP/s, torch {torch.__version__}; "
              f"defaults {','.join(f'{k}={v}' for k, v in DEFAULTS.items())}")
        print("| model | variant | tokens | micro-batches | first step s | step s | each step s | "
              "graphs compiled, each step | allocator retries, each step | tokens/s | MFU | forward-only s | peak GB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for m, v in itertools.product(models, variants):  # each row as it is measured: a later variant may not fit
        try:
            r = run(m, v, args, d)
        except torch.OutOfMemoryError as e:
            if d.world_size > 1:  # the other ranks wait in a collective: stop them all
                raise
            r = {"model": Path(m).name, "variant": variant_name(v), "oom": (str(e).split(". ")[1:] or [str(e)])[0]}
        if d.is_main and args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({k: x for k, x in r.items() if k != "profile"}) + "\n")
        if "oom" in r:  # one row that says so, and the next variant on a device the failed one let go of
            gc.collect()
            torch.cuda.empty_cache()
            if d.is_main:
                print(f"| {r['model']} | {r['variant']} | out of memory ({r['oom']}) |", flush=True)
            continue
        rows.append(r)
        if d.is_main:
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
            peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
            print(f"| {r['model']} | {r['variant']} | {r['tokens']:,} | {r['micro_batches']} | {r['first_s']:.2f} | "
                  f"{r['step_s']:.2f} | {' / '.join(f'{s:.2f}' for s in r['steps_s'])} | "
                  f"{' / '.join(map(str, r['steps_graphs']))} | {' / '.join(map(str, r['steps_alloc_retries']))} | "
                  f"{r['tokens_per_s']:,.0f} | {mfu} | {r['forward_s']:.2f} | {peak} |", flush=True)
    if d.is_main:
        for r in rows:
            if r["profile"]:
                print(f"\n{r['model']} {r['variant']}\n{r['profile']}")
    parallel.teardown()


if __name__ == "__main__":
    main()
