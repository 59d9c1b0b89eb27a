"""Model families side by side in one table: rollout tokens/s of the native engine against in-process vLLM, each
engine's logprobs against the trainer's, the cache one sequence holds, the train phase's MFU on real lengths and the
RL step's time; for a mixture of experts, the routing mismatch with replay off and on.

    python benchmarks/families.py OUT [--models DIR ...] [--precisions bf16 fp8 ...] [--parts PART ...]
    python benchmarks/families.py table OUT

Weights are random (any config folder; by default Qwen3 0.6B/1.7B/4B and a Gemma 3 1B shape from configs/models,
which also holds `qwen3-moe-2b` and `qwen3.5-1.5b`), so both engines do the same work. The parts, each run over every
model before the next part starts and skipped once OUT holds it (a repeated command finishes only what is missing,
then prints the table; one model's failure leaves the others to run):

    native   benchmarks/rollout.py: the seed batch (32 prompts x 8, prompts of 256-512 tokens, 1024 new tokens, EOS
    vllm     ignored) on each engine, and its logprobs against the trainer's bf16 forward of the same tokens;
             `--num-prompts 8 --max-new-tokens 8192` for a long-response batch
    train    benchmarks/train.py on benchmarks/lengths' real-run histogram: packed 32768-token rows, compiled blocks,
             every sample trained; the MFU counts the matmuls one token computes (a MoE's chosen experts only)
    step     benchmarks/loop.sh's batch with the native engine: 4 rollouts, the training state on the device,
             packed rows, every group with reward variance (tests.reward_fns:spread); medians over rollouts 1..
             Both take micro-batches of 32768 tokens, or the largest the start-up memory plan fits on this GPU
             (its own column): Qwen3-1.7B plans 115.7 GB at 32768 tokens, more than an 80 GB card holds.
    replay   a mixture of experts only: the step again with train.routing_replay on. Its columns give, off -> on, the
             fraction of trained tokens whose experts the trainer picked differently from the engine
             (train/routing_mismatch; 0 with replay) and the engine-vs-trainer KL (rollout/logprob_k3_kl)

`--precisions bf16 fp8 fp8-kv` adds a row per model for FP8 rollouts (weights, then weights and KV cache) in both
engines and the step; the train columns are the BF16 trainer's either way. vLLM's columns stay empty where it is not
installed. The goals in the table's header: native at least 2x vLLM, a logprob mean abs difference of at most 0.01,
train MFU of at least 40% from 1.7B up.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["configs/models/qwen3-0.6b", "configs/models/qwen3-1.7b", "configs/models/qwen3-4b",
          "configs/models/gemma3-1b"]
LENGTHS = "benchmarks/lengths/gsm8k-qwen2.5-0.5b-instruct.json"
MICRO_BATCH_TOKENS = 32768
STEP = ["--train.offload=false", "--train.packing=true", "--reward.user_fn=tests.reward_fns:spread"]
PARTS = ("native", "vllm", "train", "step", "replay")
# --precisions: the rollout keys of each, set alike in both engines and the RL step (the train phase is bf16 always)
PRECISIONS = {"bf16": {}, "fp8": {"precision": "fp8"}, "fp8-kv": {"precision": "fp8", "kv_precision": "fp8"},
              "kv-fp8": {"kv_precision": "fp8"}}


def batch(a: argparse.Namespace) -> list[str]:
    return [f"--rollout.rollout_batch_size={a.num_prompts}", f"--rollout.max_new_tokens={a.max_new_tokens}",
            f"--rollout.max_context_len={512 + a.max_new_tokens}"]


def device_memory() -> float | None:
    """GPU 0's memory in bytes as the run's start-up check reads it (torch's total, some 470 MiB under nvidia-smi's
    on an H100), asked in a child process so that this one starts no CUDA context; None without a GPU."""
    ask = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else '')"
    try:
        out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=120, check=True)
        return float(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def micro_batch_tokens(model: Path, a: argparse.Namespace, device_total: float | None) -> int:
    """The train part's and the step's micro-batch: 32768 tokens, or where the start-up memory plan of the step's
    run (the training state on the device) does not fit `device_total` at that, the largest multiple of 64 that
    does. 32768 without a GPU, or where nothing fits (the run then says so itself)."""
    if device_total is None:
        return MICRO_BATCH_TOKENS
    sys.path.insert(0, str(ROOT))
    from transformers import AutoConfig

    from rl.config import load_config
    from rl.run.memory import largest_size, models_of, peaks, plan_memory, usable_bytes

    cfg = load_config(["--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}",
                       "--model.random_init=true", "--model.compile=true", "--data.max_prompt_len=512",
                       f"--train.micro_batch_tokens={MICRO_BATCH_TOKENS}", *STEP, *batch(a)], checked=False)
    models = models_of(cfg, AutoConfig.from_pretrained(model))
    fits = lambda c: max(peaks(plan_memory(c, models, 1, "cuda", device_total)).values()) \
        <= usable_bytes(device_total)  # noqa: E731
    if fits(cfg):
        return MICRO_BATCH_TOKENS
    _, changed = largest_size(cfg, ("train", "micro_batch_tokens", 1, MICRO_BATCH_TOKENS // 64 - 1, 64), fits)
    return changed.train.micro_batch_tokens if changed else MICRO_BATCH_TOKENS


def command(part: str, model: Path, precision: str, a: argparse.Namespace, tokenizer: Path,
            out: Path, mbt: int) -> tuple[list[str], dict]:
    """One part's command line for one model at one rollout precision, and the environment variables it adds."""
    keys = PRECISIONS[precision]
    if part in ("native", "vllm"):  # each engine on its own: one that fails leaves the other's row
        return ([sys.executable, "benchmarks/rollout.py", "--models", str(model), "--engines", part,
                 f"--{part}-variants", json.dumps(keys), "--num-prompts", str(a.num_prompts),
                 "--max-new-tokens", str(a.max_new_tokens), "--hf-steps", "-1", "--no-vllm-calls",
                 "--out", str(out / f"{part}.json")], {})
    if part == "train":
        return ([sys.executable, "benchmarks/train.py", "--models", str(model), "--lengths", LENGTHS,
                 "--variants", f"fresh=on,packing=on,mbt={mbt}", "--repeats", "3", "--json",
                 str(out / "train.jsonl")], {})
    replay = ["--train.routing_replay=true"] if part == "replay" else []
    rollout = [f"--rollout.{k}={v}" for k, v in keys.items()]
    return (["bash", "benchmarks/loop.sh", str(model), str(tokenizer), "1", "4", *STEP, *batch(a), *rollout, *replay,
             f"--train.micro_batch_tokens={mbt}"],
            {"LOOP_OUT": str(out / part)})


def run(a: argparse.Namespace) -> None:
    models, tokenizer, out = [m.resolve() for m in a.models], a.tokenizer and a.tokenizer.resolve(), a.out.resolve()
    if tokenizer is None:  # any tokenizer serves random weights: the word-level one of benchmarks/loop_breakdown.py
        tokenizer = out / "tokenizer"
        if not (tokenizer / "tokenizer.json").exists():
            subprocess.run([sys.executable, "benchmarks/loop_breakdown.py", "tokenizer", str(tokenizer)], cwd=ROOT,
                           check=True)
    device_total, sizes = device_memory(), {}
    # each part over every model and precision first: the most columns filled within a time limit
    for part, model, precision in itertools.product(a.parts, models, a.precisions):
        if (part == "replay" and not shape(model).num_experts) or (part == "vllm" and part not in a.engines):
            continue
        name = model.name + ("" if precision == "bf16" else f" {precision}")
        dest = out / name.replace(" ", "-")
        if (dest / f"{part}.done").exists():
            print(f"== {name} {part}: done before, kept", flush=True)
            continue
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "model").write_text(str(model))
        (dest / "precision").write_text(precision)
        if model not in sizes:
            sizes[model] = micro_batch_tokens(model, a, device_total)
        (dest / "micro_batch_tokens").write_text(str(sizes[model]))
        cmd, env = command(part, model, precision, a, tokenizer, dest, sizes[model])
        print(f"== {name} {part}: {' '.join(cmd)}", flush=True)
        failed = subprocess.run(cmd, cwd=ROOT, env=os.environ | env).returncode
        if failed:  # one model's failure (out of memory, an unsupported family) leaves the others to run
            print(f"== {name} {part}: exit {failed}", flush=True)
            continue
        (dest / f"{part}.done").touch()
    print(table(out))


def shape(model_dir: Path):
    sys.path.insert(0, str(ROOT))
    from transformers import AutoConfig

    from rl.model.shape import ModelShape

    return ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))


def params(model_dir: Path) -> str:
    """Total parameters, and the active ones where they differ (a mixture of experts)."""
    s = shape(model_dir)
    total = f"{s.num_params / 1e9:.2f}B"
    active = s.num_params - s.decoder_matmul_params + s.active_matmul_params
    return total if active == s.num_params else f"{total} ({active / 1e9:.2f}B active)"


def sequence_bytes(s, context: int, kv_itemsize: int) -> int:
    """One sequence's cache at `context` tokens: K and V of each attention layer (a sliding-window layer's window at
    most) and each linear-attention layer's state (its convolution inputs in bf16)."""
    tokens = sum(min(s.window(i) or context, context) for i in range(s.num_layers) if not s.is_linear(i))
    return tokens * 2 * s.kv_size * kv_itemsize + (s.linear_state_bytes(2) if s.linear_layers else 0)


def row(dest: Path, model_dir: Path) -> str:
    """One model's row: what each of its finished parts measured, '-' for the rest."""
    engines = {e: json.loads((dest / f"{e}.json").read_text())["rows"][0] for e in ("native", "vllm")
               if (dest / f"{e}.json").exists()}
    cells = {"params": params(model_dir), "per sequence": "-"}
    if engines:  # at the batch's mean context: what the engine holds for one sequence
        r = next(iter(engines.values()))
        context = round(statistics.mean(r["prompt_lens"]) + r["new_tokens"])
        fp8 = (dest / "precision").exists() and "kv_precision" in PRECISIONS[(dest / "precision").read_text()]
        size = sequence_bytes(shape(model_dir), context, 1 if fp8 else 2)
        cells["per sequence"] = f"{size / 2**20:.1f} MiB at {context} tokens"
    for name in ("native", "vllm"):
        r = engines.get(name)
        cells[f"{name} tok/s"] = f"{r['engine_tok_s']:,.0f}" if r else "-"
        cells[f"{name} logprob"] = f"{r['logprob_parity']['mean_abs']:.2e}" if r else "-"
    both = "native" in engines and "vllm" in engines
    cells["ratio"] = f"{engines['native']['engine_tok_s'] / engines['vllm']['engine_tok_s']:.2f}x" if both else "-"
    train = dest / "train.jsonl"
    trains = [json.loads(line) for line in train.read_text().splitlines()] if train.exists() else []
    fit = [t for t in trains if "oom" not in t]
    cells["mfu"] = (f"{fit[-1]['mfu']:.1%}" if fit[-1]["mfu"] else "-") if fit else \
        ("out of memory" if trains else "-")
    cells["train s"] = f"{fit[-1]['step_s']:.2f}" if fit else "-"
    mbt = dest / "micro_batch_tokens"
    cells["micro-batch"] = f"{int(mbt.read_text()):,}" if mbt.exists() else "-"
    steps = {part: loop_steps(dest / part) for part in ("step", "replay")}
    for key, label in (("perf/step_s", "step s"), ("perf/rollout_s", "rollout s"), ("perf/train_s", "step train s")):
        cells[label] = f"{median(steps['step'], key):.2f}" if steps["step"] else "-"
    for key, label, form in (("train/routing_mismatch", "mismatch", ".1%"), ("rollout/logprob_k3_kl", "k3", ".2e")):
        cells[label] = " -> ".join(format(median(steps[p], key), form) if steps[p] else "-" for p in steps) \
            if steps["replay"] else "-"
    return " | ".join(cells.values())


def loop_steps(run: Path) -> list[dict]:
    """The logged steps of the loop run under `run` but the first (which compiles and captures graphs)."""
    for metrics in run.glob("*/metrics.jsonl"):
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "perf/step_s" in r][1:]
    return []


def median(steps: list[dict], key: str) -> float:
    return statistics.median([r[key] for r in steps if key in r] or [float("nan")])


def table(out: Path) -> str:
    device = "-"
    lines = []
    for dest in sorted(p for p in out.iterdir() if (p / "model").is_file()):
        model_dir = Path((dest / "model").read_text())
        if (dest / "native.json").exists():
            device = json.loads((dest / "native.json").read_text())["device"]
        lines.append(f"| {dest.name} | {row(dest, model_dir)} |")
    vllm = "" if importlib.util.find_spec("vllm") else " (vLLM is not installed here: its columns stay empty)"
    return "\n".join([
        f"device: {device}{vllm}; goals: native / vLLM >= 2x, logprob mean abs <= 0.01, train MFU >= 40% from 1.7B",
        "| model | params | cache per sequence | native tok/s | native logprob mean abs | vLLM tok/s "
        "| vLLM logprob mean abs | native / vLLM | train MFU (real lengths) | train s (real lengths) "
        "| micro-batch tokens | step s | rollout s | train s "
        "| routing mismatch, replay off -> on | engine-vs-trainer k3 KL, replay off -> on |",
        "|---" * 16 + "|", *lines])


def main() -> None:
    if sys.argv[1:2] == ["table"]:
        return print(table(Path(sys.argv[2])))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--models", nargs="+", type=Path, default=[ROOT / m for m in MODELS])
    p.add_argument("--engines", nargs="+", choices=["native", "vllm"],
                   default=["native", "vllm"] if importlib.util.find_spec("vllm") else ["native"])
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder (default: a word-level one written under OUT)")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts of the batch, 8 samples each")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="tokens each sample generates")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="the parts to run (default: all)")
    p.add_argument("--precisions", nargs="+", default=["bf16"], choices=list(PRECISIONS),
                   help="rollout precisions, a row each: fp8 weights (rollout.precision), and with an FP8 KV cache "
                        "(rollout.kv_precision) too or alone")
    run(p.parse_args())


if __name__ == "__main__":
    main()
