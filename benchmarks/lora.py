"""Full-parameter training against LoRA on the same loop, one table: build time, rollout and train tokens/s,
train MFU, weight push time, step time, peak device and host memory.

    python benchmarks/lora.py MODEL_DIR [--tokenizer DIR] [--rank 64] [--gpus 1] [--rollouts 4]
                              [--engines native vllm] [--variants full full-host-adamw lora] [--random-init]
                              [--out runs/lora] [-- --section.key=value ...]
    python benchmarks/lora.py MODEL_DIR --smoke        # CPU: the tiny test batch on one gloo rank, 2 rollouts

On GPUs each variant runs the seed's scenario of `benchmarks/loop.sh` (32 prompts x 8 samples, prompts <= 512
tokens, responses <= 1024, micro-batches of 32768 tokens, compiled blocks, gradient checkpointing, the training
state offloaded while the engine runs) on `--gpus` ranks: full-parameter, full-parameter with AdamW's moments in
host memory (`train.optimizer_offload`), then LoRA of `--rank` on the attention and MLP projections, each with every
engine of `--engines`. A variant whose memory plan does not fit is not run: its row shows the plan's one line (7B
full-parameter on one H200 is refused that way, and runs with the moments in host memory). `--random-init` takes a
config-only folder (configs/models/...) with random weights; without `--tokenizer` a word-level one is written
for the prompts. Medians are over every rollout but the first (compiles, captures graphs, pins host memory). "rollout peak
GB" is torch's allocator: it holds all of vLLM, but not the native engine's own pools (its weights and KV cache). The
MFU counts the full model's FLOPs per token (6N) in both columns: LoRA skips the base's weight gradients, so its
MFU is of the same model work, not of the arithmetic done. Runs land in OUT/<row> (`--out`, default runs/lora), each
row's medians in OUT/<row>.json: a row found there is kept, so the same command run again (with the same `--out`)
runs only the rows still missing, then prints the whole table; big models' rows can then span several sittings.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from loop_breakdown import write_data, write_tokenizer  # noqa: E402

SEED_SCENARIO = ["--data.max_prompt_len=512", "--rollout.max_context_len=1600", "--rollout.max_new_tokens=1024",
                 "--rollout.rollout_batch_size=32", "--rollout.n_samples_per_prompt=8", "--reward.num_workers=4",
                 "--train.micro_batch_tokens=32768", "--model.compile=true", "--model.gradient_checkpointing=true",
                 "--train.offload=true", "--train.lr=1e-6"]
SMOKE = ["--data.max_prompt_len=64", "--rollout.max_context_len=128", "--rollout.max_new_tokens=8",
         "--rollout.rollout_batch_size=8", "--rollout.n_samples_per_prompt=4", "--reward.num_workers=1",
         "--train.lr=1e-4"]
ROWS = [("policy build s", "build_s"), ("rollout tok/s", "perf/rollout_tokens_per_s"),
        ("train tok/s", "perf/train_tokens_per_s"), ("train MFU", "perf/train_mfu"), ("train s", "perf/train_s"),
        ("weight push s", "perf/weight_sync_s"), ("weight push GB/s", "perf/weight_sync_gbps"),
        ("step s", "perf/step_s"), ("rollout peak GB", "memory/rollout_peak_gb"),
        ("train peak GB", "memory/train_peak_gb"), ("host peak GB (largest rank)", "host_peak_gb"),
        ("checkpoint MB", "checkpoint_mb")]


# Runs the command and prints the largest resident set of its process tree (each rank waits for what it
# starts): this process's own children would carry the peak of an earlier variant.
HOST_PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
             "print('host peak KiB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(code)")


def run_variant(name: str, model: str, tokenizer: str, data: Path, nproc: int, overrides: list[str],
                work: Path) -> dict:
    """One loop run; its medians, or {"refused": line} when it stopped with a one-line error."""
    out = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}",
           f"--model.tokenizer={tokenizer}", f"--data.source={data}",
           "--reward.user_fn=tests.reward_fns:digit_fraction",
           "--log.progress=false", "--checkpoint.resume=never", f"--log.output_dir={out}", *overrides]
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    print(f"lora benchmark: {name}: {' '.join(cmd[4:])}", flush=True)
    proc = subprocess.run([sys.executable, "-c", HOST_PEAK, *cmd], cwd=ROOT, env=_env(), capture_output=True,
                          text=True)
    log = proc.stdout + proc.stderr
    peak = re.search(r"host peak KiB (\d+)", log)
    host_peak = int(peak.group(1)) * 1024 / 1e9 if peak else float("nan")
    (work / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        lines = [line for line in log.splitlines() if line.startswith(("rl: error:", "rl: stopped:"))]
        return {"refused": lines[0] if lines else f"exit {proc.returncode}; see {work / name}.log"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    use = rows[1:] or rows
    medians = {key: statistics.median([r[key] for r in use if key in r] or [float("nan")]) for _, key in ROWS}
    built = re.search(r"policy: built, sharded and loaded in ([\d.]+) s", log)
    medians["build_s"] = float(built.group(1)) if built else float("nan")
    medians["host_peak_gb"] = host_peak
    saved = sorted((out / "checkpoints").glob("rollout_*"))
    medians["checkpoint_mb"] = sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file()) / 1e6 \
        if saved else float("nan")
    return medians


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def table(results: dict[str, dict]) -> str:
    lines = ["| median over rollouts 1.. | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for label, key in ROWS:
        cells = ["refused" if "refused" in r else f"{r.get(key, float('nan')):.4g}" for r in results.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    refusals = [f"{name}: {r['refused']}" for name, r in results.items() if "refused" in r]
    return "\n".join(lines + [""] + refusals)


def main(argv: list[str]) -> None:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python benchmarks/lora.py", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model folder (with --random-init: a config folder)")
    parser.add_argument("--tokenizer", default="", help="a tokenizer folder (default: the model's, else one written)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--engines", nargs="+", default=["native"], choices=["native", "vllm"])
    parser.add_argument("--variants", nargs="+", default=["full", "full-host-adamw", "lora"],
                        choices=["full", "full-host-adamw", "lora"])
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny test batch on one rank, 2 rollouts")
    parser.add_argument("--out", default=str(ROOT / "runs" / "lora"),
                        help="where runs and each row's medians go; rows already there are kept")
    args = parser.parse_args(argv)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    tokenizer = args.tokenizer or args.model
    if args.smoke:
        from tests.tiny import write_arithmetic_jsonl

        write_arithmetic_jsonl(data)
        scenario, nproc, rollouts = SMOKE, 1, 2
    else:
        write_data(str(data))
        scenario, nproc, rollouts = SEED_SCENARIO, args.gpus, args.rollouts
        if not (Path(tokenizer) / "tokenizer_config.json").is_file():
            tokenizer = str(work / "tokenizer")
            write_tokenizer(tokenizer)
    common = [*scenario, f"--train.num_rollout={rollouts}", "--checkpoint.interval=0", "--checkpoint.keep_last=1",
              *(["--model.random_init=true"] if args.random_init else []), *extra]
    results = {}
    for engine in args.engines:
        engine_keys = ["--rollout.engine=vllm", "--rollout.vllm.gpu_memory_utilization=0.3"] if engine == "vllm" else []
        if engine == "vllm" and args.smoke:
            engine_keys = ["--rollout.engine=vllm", "--rollout.vllm.kv_cache_memory_bytes=33554432"]
        for variant, keys in (("full", []), ("full-host-adamw", ["--train.optimizer_offload=true"]),
                              (f"lora{args.rank}", [f"--lora.rank={args.rank}", f"--lora.alpha={2 * args.rank}"])):
            if variant.rstrip("0123456789") not in args.variants:
                continue
            name = f"{Path(args.model).name}-{args.gpus if not args.smoke else 'cpu'}-{engine}-{variant}"
            done = work / f"{name}.json"
            if done.exists():
                print(f"lora benchmark: {name}: measured before, kept ({done})", flush=True)
            else:
                done.write_text(json.dumps(run_variant(name, args.model, tokenizer, data, nproc,
                                                       [*common, *engine_keys, *keys], work)))
            results[name] = json.loads(done.read_text())
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
