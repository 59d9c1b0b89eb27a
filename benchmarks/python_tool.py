"""A real instruct model learning to use the sandboxed Python tool on GSM-style word problems
(configs/python_tool.toml): the rows, a CPU smoke run, and the table of a run.

    python benchmarks/python_tool.py write-data DIR    # needs reasoning-gym: DIR/train.jsonl (4000), DIR/eval.jsonl (128)
    python benchmarks/python_tool.py smoke DATA OUT     # CPU, 2 gloo ranks, a tiny random model: the loop runs
    python benchmarks/python_tool.py table RUN          # evals (accuracy with tools, tool-call rate) and step times

The run itself: `torchrun --nproc-per-node 1 -m rl.main --config configs/python_tool.toml` (one GPU), after
`python -m rl.prepare --model qwen2.5-coder-0.5b --out models/qwen2.5-coder-0.5b`. Each row carries the tool's
system prompt (rl/env/python_tool.py's SYSTEM_PROMPT), so the model reads the tool described as Qwen2.5's chat
template describes tools.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rl.env.python_tool import SYSTEM_PROMPT  # noqa: E402

# Step phases as metrics.jsonl names them; env_s is the part of rollout_s spent waiting on the tool.
PHASES = ["perf/rollout_s", "perf/env_s", "perf/reward_s", "perf/train_s", "perf/weight_sync_s", "perf/step_s"]


def write_data(out: Path) -> None:
    """benchmarks/partial.py's gsm_symbolic rows (the same seeds), each with the tool's system prompt."""
    from partial import write_data as write_gsm_rows

    write_gsm_rows(out, {"system": SYSTEM_PROMPT})


def smoke(data: Path, out: Path, model: Path | None) -> None:
    """Two rollouts and three evals on 2 CPU ranks. A tiny random model has 512 positions and a byte-level
    vocabulary: its rows go without the system prompt, and its turns end at a few arbitrary ids, as the tests'
    do, since it knows no </tool_call>."""
    overrides = []
    if model is None:
        from tests.tiny import save_tiny_model_dir

        model = save_tiny_model_dir(out / "model")
        overrides = ["--data.system_prompt_key=", "--data.max_prompt_len=400", "--rollout.max_context_len=512",
                     "--env.stop=[]", f"--rollout.stop_token_ids={json.dumps(list(range(100, 115)))}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "rl.main",
           "--config", str(ROOT / "configs/python_tool.toml"), f"--model.path={model}",
           f"--data.source={data / 'train.jsonl'}", f"--eval.source={data / 'eval.jsonl'}", "--eval.num_examples=4",
           "--eval.interval=1", "--train.num_rollout=2", "--rollout.rollout_batch_size=4",
           "--rollout.n_samples_per_prompt=2", "--rollout.max_new_tokens=48", "--rollout.max_batch_size=64",
           "--env.max_tokens=128", "--reward.num_workers=2", f"--log.output_dir={out / 'run'}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True)
    table(out / "run")


def table(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    print("| rollout | eval accuracy (with tools) | eval tool-call rate | eval calls per episode | eval turns |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r.get("eval/accuracy") is not None:
            print(f"| {r['rollout_id']} | {r['eval/accuracy']:.3f} | {r.get('eval/tool_call_frac', 0):.3f} | "
                  f"{r.get('eval/tool_calls_mean', 0):.2f} | {r.get('eval/turns_mean', 0):.2f} |")
    steps = [r for r in rows if "perf/step_s" in r]
    train = [r for r in steps if "rollout/tool_calls_mean" in r]
    if train:
        first, last = train[: max(len(train) // 10, 1)], train[-max(len(train) // 10, 1):]
        for key in ("rollout/reward_mean", "rollout/tool_calls_mean", "rollout/turns_mean", "rollout/tool_errors",
                    "rollout/prefill_tokens_reused_frac"):  # the last with the native engine only
            if all(key in r for r in train):
                print(f"{key}: {statistics.mean(r[key] for r in first):.3f} (first steps) -> "
                      f"{statistics.mean(r[key] for r in last):.3f} (last)")
    print("median seconds per step: " + ", ".join(f"{k.removeprefix('perf/')} {statistics.median(r[k] for r in steps):.2f}"
                                                  for k in PHASES if steps and all(k in r for r in steps)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write-data").add_argument("out", type=Path)
    s = sub.add_parser("smoke")
    s.add_argument("data", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--model", type=Path, default=None, help="a HF folder (default: a tiny random model)")
    sub.add_parser("table").add_argument("run", type=Path)
    args = parser.parse_args()
    if args.command == "write-data":
        write_data(args.out)
    elif args.command == "smoke":
        smoke(args.data, args.out, args.model)
    else:
        table(args.run)


if __name__ == "__main__":
    main()
