"""The step on the seed batch, the train phase on real lengths and a real run's compile stalls, in one table.

    python benchmarks/speed.py MODEL_DIR DATA_DIR TOKENIZER_DIR OUT [--parts PART ...]
    python benchmarks/speed.py table OUT

MODEL_DIR is a real instruct model (Qwen2.5-Coder-0.5B-Instruct, `python -m rl.prepare`), DATA_DIR holds
`benchmarks/partial.py write-data`'s gsm_symbolic rows, TOKENIZER_DIR any tokenizer for the random-weight parts
(`python benchmarks/loop_breakdown.py tokenizer DIR` writes one). The parts, each skipped once OUT holds it (a
repeated command finishes only what is missing, and prints the table):

    seed-0.5b       benchmarks/loop.sh's seed batch (32 prompts x 8, prompts up to 512 tokens, responses up to
    seed-1.5b       1024, random weights), 4 rollouts, the training state kept on the device, packed rows,
                    every sample trained (tests.reward_fns:spread gives every group reward variance)
    seed-0.5b-skip  the same with the benchmark's digit reward: the zero-advantage skip trains only the groups
                    with signal, as a real run does
    replay          benchmarks/train.py on benchmarks/lengths' real-run histogram, packed rows of 32768 and
                    65536 tokens, both models, every sample trained
    real            benchmarks/partial.py's real run (configs/recipes/gsm8k_boxed.toml, 40 rollouts, an eval
    real-compiled   every 5) eager over padded 16384-token micro-batches, and as the recipe stands: compiled
                    blocks over packed 32768-token rows

Step columns are medians over rollouts 1.. (rollout 0 compiles and captures graphs); "graphs after rollout 0"
sums perf/train_graphs_compiled over them (0: no train-phase recompile once the run is warm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from partial import rows as metrics  # noqa: E402

SEED = ["--train.offload=false", "--train.packing=true", "--reward.user_fn=tests.reward_fns:spread"]
EAGER = ["--model.compile=false", "--train.packing=false", "--train.micro_batch_tokens=16384"]  # the recipe before
LENGTHS = "benchmarks/lengths/gsm8k-qwen2.5-0.5b-instruct.json"
PARTS = ["seed-0.5b", "seed-0.5b-skip", "seed-1.5b", "replay", "real", "real-compiled"]


def command(part: str, model: Path, data: Path, tokenizer: Path, out: Path) -> tuple[list[str], dict]:
    """The command line of one part, and the environment variables it adds."""
    if part.startswith("seed"):
        size = part.split("-")[1]
        extra = SEED[:-1] if part.endswith("skip") else SEED
        return (["bash", "benchmarks/loop.sh", f"configs/models/qwen2.5-{size}", str(tokenizer), "1", "4", *extra],
                {"LOOP_OUT": str(out / part)})
    if part == "replay":
        return ([sys.executable, "benchmarks/train.py", "--models", "configs/models/qwen2.5-0.5b",
                 "configs/models/qwen2.5-1.5b", "--lengths", LENGTHS, "--variants", "fresh=on,packing=on",
                 "fresh=on,packing=on,mbt=65536", "--repeats", "3", "--json", str(out / part / "rows.jsonl")], {})
    mode = ["--modes", "sync"] + (EAGER if part == "real" else [])
    return ([sys.executable, "benchmarks/partial.py", "run", str(model), str(data), str(out / part), *mode,
             "--rollouts", "40"], {})


def run(parts: list[str], model: Path, data: Path, tokenizer: Path, out: Path) -> None:
    for part in parts:
        if (out / f"{part}.done").exists():
            print(f"== {part}: done before, kept", flush=True)
            continue
        (out / part).mkdir(parents=True, exist_ok=True)
        cmd, env = command(part, model, data, tokenizer, out)
        print(f"== {part}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, env=os.environ | env)
        (out / f"{part}.done").touch()
    table(out)


def loop_row(part: str, run_dir: Path) -> str:
    run = metrics(run_dir)
    steps = [r for r in run if "perf/step_s" in r and r["rollout_id"] > 0]

    def median(key: str, default: float = 0.0) -> float:
        return statistics.median(r.get(key, default) for r in steps)

    evals = [r["eval/accuracy"] for r in run if "eval/accuracy" in r]
    trained = [r["rollout/num_samples"] - r.get("train/skipped_zero_adv_samples", 0) for r in steps
               if "rollout/num_samples" in r]
    return (f"| {part} | {run_dir.name} | {median('perf/step_s'):.2f} | {median('perf/rollout_s'):.2f} "
            f"| {median('perf/rollout_tokens_per_s'):,.0f} | {median('perf/train_s'):.2f} "
            f"| {median('perf/train_mfu'):.1%} | {statistics.median(trained) if trained else '-'} "
            f"| {sum(r.get('perf/train_graphs_compiled', 0) for r in steps):.0f} | {len(steps) + 1} "
            f"| {' -> '.join(f'{a:.3f}' for a in evals) or '-'} |")


def table(out: Path) -> None:
    print("| part | run | step s | rollout s | rollout tok/s | train s | train MFU | samples trained | graphs after "
          "rollout 0 | rollouts | held-out accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for part in PARTS:
        if part == "replay":
            rows = out / part / "rows.jsonl"
            for r in (json.loads(line) for line in rows.read_text().splitlines()) if rows.exists() else []:
                if "oom" in r:
                    print(f"| replay | {r['model']} {r['variant']} | out of memory ({r['oom']}) |")
                    continue
                mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
                print(f"| replay | {r['model']} {r['variant']} | - | - | - | {r['step_s']:.2f} | {mfu} "
                      f"| {r['tokens']:,} tokens | {r['graphs']} | - | - |")
            continue
        for run_dir in sorted(p.parent for p in (out / part).glob("**/metrics.jsonl")):
            print(loop_row(part, run_dir))


def main() -> None:
    if sys.argv[1:2] == ["table"]:
        return table(Path(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("tokenizer", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    a = p.parse_args()
    run(a.parts, a.model.resolve(), a.data.resolve(), a.tokenizer.resolve(), a.out.resolve())


if __name__ == "__main__":
    main()
