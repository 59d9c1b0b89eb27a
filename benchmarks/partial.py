"""Partial rollouts and the staleness bound against the synchronous loop, on a real instruct model whose
responses have a long tail: GSM-style word problems (reasoning-gym's gsm_symbolic), answers in \\boxed{},
up to 512 new tokens, configs/recipes/gsm8k_boxed.toml with a shorter run and a held-out eval every 5 rollouts.

    python benchmarks/partial.py write-data DIR [--bundles]  # needs reasoning-gym: DIR/train.jsonl, DIR/eval.jsonl
    python benchmarks/partial.py run MODEL_DIR DIR OUT [--modes sync partial1 partial2] [--rollouts 30]
                                 [--async-rollouts 45]
    python benchmarks/partial.py table OUT             # one table from the runs under OUT
    python benchmarks/partial.py tail OUT [--modes full sync partial1 partial2] [--rollouts 8] [--stop-ids 300]
                                 [--max-new-tokens 4096] [--prompts 64] [--model configs/models/qwen2.5-0.5b]

`write-data --bundles` makes the tail the real model's own: a training prompt bundles 1-12 problems (most one,
BUNDLE_SIZES) and asks for the sum of their answers, so a response's length follows its bundle (~260 tokens a
problem for Qwen2.5-Coder-0.5B-Instruct); run it with room for the long prompts and responses:
`run MODEL DIR OUT --rollout.max_new_tokens=4096 --rollout.max_context_len=5376 --data.max_prompt_len=1280
--rollout.max_batch_size=1024` (benchmarks/RESULTS.md, "A natural long tail on the real model").

`tail` is the speed half of the comparison on a much longer tail, with no model to download and nothing
learned: random weights of `--model`'s config (or a model folder's own weights) with `--stop-ids` token ids as
stop ids, so each sampled token ends its response with probability ~stop-ids / vocabulary (300 of Qwen2.5's
151,936: a geometric length, expected mean ~500, the longest of 512 samples expected near 3,000 of the 4,096
allowed), 64
prompts x 8 (`--prompts`: more samples a rollout give the steps the bound asks for more rows), every sequence in
flight given an engine row up to 1,024 (`rollout.max_batch_size`: its worst-case KV fills an H200), compiled blocks and
packed rows in the train phase, a digit reward. Its table is `table`'s, with no eval columns filled.

Modes: `sync` (the synchronous loop), `partial1` / `partial2` (rollout.partial_rollout with max_staleness 1 / 2 and
the default groups in flight, half the bound's room), `partial1_wide` / `partial2_wide` (the bound's whole room),
`ahead1` (max_staleness 1 without partial rollouts), `vllm` / `vllm_partial1` (the same through vLLM, at the default
train settings: the training state stays on the device), and for `tail` `full` (no stop ids: all 512 samples run
min(512, --max-new-tokens) tokens, the engine's full-batch rate on the same start); the asynchronous ones weigh
tokens by truncated importance weights (algo.tis_cap = 2). The table, over rollouts 1 on (rollout 0 holds CUDA-graph
captures): rollout tokens/s as the median of the rollouts and overall (their tokens over their generation seconds:
partial rollouts alternate between short and long, and a median weighs them alike) and that as a fraction of
`full`'s, median step seconds, mean and max staleness, the fraction of trained samples that crossed a weight push,
the median response tokens a rollout continued (their KV computed again under the new weights) and tokens the engine
prefilled (prompts, and continued samples past the prompt pages they share; 0 where not logged), held-out greedy
accuracy at the end and the last within as many minutes of steps as the synchronous run took, the minutes of steps
until the eval first reached the synchronous run's final accuracy, the train phase's peak device memory and the
seconds the engine's KV cache took to come back after it; the mean step with and without its eval, and the latter's
speed-up over `sync`; the decode steps a rollout ran and the rows a step ran on average (a tail drains the batch:
many steps over few rows), the tokens a generated token was sampled over, averaged over the generated tokens
(`rollout/context_mean`: what a decode step reads from the KV cache a row), and the mean and longest response. The
speed columns take rollouts 1 to the last every run has: `run --async-rollouts N` runs the asynchronous modes
longer than `--rollouts`, so that their accuracy curves span the synchronous run's minutes. Under the table, each
run's held-out accuracy at every eval with the minutes of steps before it. Curves: `python -m rl.plot OUT/sync
OUT/partial1 ... --x minutes`. A mode whose run under OUT finished is skipped: the same command
again goes on where the last one stopped.
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
MODES = {
    "sync": [],
    "partial1": ["--rollout.partial_rollout=true", "--rollout.max_staleness=1", "--algo.tis_cap=2.0"],
    "partial2": ["--rollout.partial_rollout=true", "--rollout.max_staleness=2", "--algo.tis_cap=2.0"],
    # The bound's whole room in flight, (max_staleness + 1) batches ({batch}: the groups a rollout trains): every
    # trained sample near the bound.
    "partial1_wide": ["--rollout.partial_rollout=true", "--rollout.max_staleness=1", "--algo.tis_cap=2.0",
                      "--rollout.over_sampling_batch_size={2 * batch}"],
    "partial2_wide": ["--rollout.partial_rollout=true", "--rollout.max_staleness=2", "--algo.tis_cap=2.0",
                      "--rollout.over_sampling_batch_size={3 * batch}"],
    "ahead1": ["--rollout.max_staleness=1", "--algo.tis_cap=2.0"],
    # `tail` only: no stop ids, every sample runs up to 512 tokens: the engine's full-batch rate on the same start.
    "full": [],
    "vllm": ["--rollout.engine=vllm"],
    "vllm_partial1": ["--rollout.engine=vllm", "--rollout.partial_rollout=true", "--rollout.max_staleness=1",
                      "--algo.tis_cap=2.0"],
}


def mode_args(mode: str, batch: int) -> list[str]:
    """The mode's overrides for a rollout of `batch` groups."""
    return [arg.replace("{2 * batch}", str(2 * batch)).replace("{3 * batch}", str(3 * batch)) for arg in MODES[mode]]


# `write-data --bundles`: how many problems a training prompt bundles, and how often. A response works through
# each problem in turn (~260 tokens a problem for Qwen2.5-Coder-0.5B-Instruct), so the count sets its length: most
# prompts are one problem, and a 64-prompt rollout holds ~3 of 8 or 12 (a response of ~2,000-3,500 tokens).
BUNDLE_SIZES = {1: 0.70, 2: 0.10, 3: 0.06, 4: 0.05, 6: 0.04, 8: 0.03, 12: 0.02}
GSM_ASK = " Give the result as your final answer. Do not include units."


def write_data(out: Path, columns: dict | None = None, bundles: bool = False, eval_rows: int = 128) -> None:
    """gsm_symbolic rows as `prompt` and `answer`, with `columns` added to every row: 4000 for training and
    `eval_rows` held out. With `bundles`, a training prompt holds BUNDLE_SIZES problems and asks for the sum of their
    answers: a real task whose response lengths have a long tail by the prompt (held-out rows stay single problems)."""
    import random

    import reasoning_gym

    out.mkdir(parents=True, exist_ok=True)
    # The recipe's seeds: training items from 1234 on, eval items from 1000000 on (no overlap).
    for name, size, seed in (("train", 4000, 1234), ("eval", eval_rows, 1000000)):
        items = list(reasoning_gym.create_dataset("gsm_symbolic", size=size * (3 if bundles else 1), seed=seed))
        if bundles and name == "train":
            items = bundle(items, size, random.Random(seed))
        with (out / f"{name}.jsonl").open("w") as f:
            for row in items[:size]:
                f.write(json.dumps({"prompt": row["question"], "answer": row["answer"], **(columns or {})}) + "\n")
    print(f"wrote {out}/train.jsonl (4000) and {out}/eval.jsonl ({eval_rows})")


def bundle(items: list[dict], size: int, rng) -> list[dict]:
    """`size` prompts of BUNDLE_SIZES problems each, drawn in order from `items`: the question names each problem and
    asks for the sum of their answers."""
    prompts, taken = [], 0
    for k in rng.choices(list(BUNDLE_SIZES), weights=list(BUNDLE_SIZES.values()), k=size):
        group, taken = items[taken:taken + k], taken + k
        if len(group) < k:
            raise ValueError(f"bundle: {len(items)} problems are too few for {size} prompts")
        if k == 1:
            prompts.append(group[0])
            continue
        body = "\n\n".join(f"Problem {i + 1}: {g['question'].replace(GSM_ASK, '')}" for i, g in enumerate(group))
        total = sum(float(g["answer"]) for g in group)
        prompts.append({"question": f"Solve each of the following {k} problems, then add up their {k} answers and give "
                                    f"that sum as your final answer. Do not include units.\n\n{body}",
                        "answer": f"{total:.6f}".rstrip("0").rstrip(".")})
    return prompts


def done(run_dir: Path, rollouts: int) -> bool:
    """Whether the run under `run_dir` logged its last rollout: the same command again skips it, so a comparison
    longer than one sitting goes on where it stopped (an unfinished run's folder stops it: rl.main never writes over
    a run)."""
    finished = (run_dir / "metrics.jsonl").is_file() and any(r.get("rollout_id") == rollouts - 1 for r in rows(run_dir))
    if finished:
        print(f"== {run_dir.name}: finished before, skipped", flush=True)
    return finished


def asynchronous(mode: str) -> bool:
    return any("max_staleness" in arg for arg in MODES[mode])


def run(model: Path, data: Path, out: Path, modes: list[str], rollouts: int, extra: list[str],
        async_rollouts: int | None = None) -> None:
    """Each mode's run under OUT/<mode>: `rollouts` rollouts, `async_rollouts` for the asynchronous modes (more, for
    their curves to run as many minutes as the synchronous one's)."""
    count = {m: async_rollouts if async_rollouts and asynchronous(m) else rollouts for m in modes}
    for mode in [m for m in modes if not done(out / m, count[m])]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "rl.main",
               "--config", str(ROOT / "configs/recipes/gsm8k_boxed.toml"), f"--model.path={model}",
               f"--data.source={data / 'train.jsonl'}", f"--eval.source={data / 'eval.jsonl'}",
               "--eval.interval=5", f"--train.num_rollout={count[mode]}", "--train.lr=3e-6",
               "--train.lr_warmup_steps=2",
               "--checkpoint.interval=0", "--log.progress=false", f"--log.output_dir={out / mode}",
               *mode_args(mode, 64), *extra]
        print(f"== {mode}: {' '.join(cmd[5:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    table(out)


def tail(out: Path, model: str, modes: list[str], rollouts: int, stop_ids: int, max_new_tokens: int, prompts: int,
         extra: list[str]) -> None:
    """The `tail` runs: random weights with `stop_ids` stop ids (module docstring), each mode under OUT/<mode>."""
    from transformers import AutoConfig

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from loop_breakdown import write_tokenizer

    from tests.tiny import write_arithmetic_jsonl

    out.mkdir(parents=True, exist_ok=True)
    data = write_arithmetic_jsonl(out / "prompts.jsonl", rows=max(512, 4 * prompts))
    weights = any(Path(model).glob("*.safetensors"))
    tokenizer = model
    if not (Path(model) / "tokenizer_config.json").is_file():
        tokenizer = str(out / "tokenizer")
        write_tokenizer(tokenizer)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    if not 0 < stop_ids < vocab // 2:
        raise SystemExit(f"--stop-ids must be in 1..{vocab // 2 - 1} for a vocabulary of {vocab}, got {stop_ids}")
    stops = list(range(vocab // 2, vocab // 2 + stop_ids))  # ids no tokenizer here gives a prompt
    for mode in [m for m in modes if not done(out / m, rollouts)]:
        new_tokens = min(max_new_tokens, 512) if mode == "full" else max_new_tokens
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "rl.main",
               "--config", str(ROOT / "configs/tiny.toml"), f"--model.path={model}", f"--model.tokenizer={tokenizer}",
               *([] if weights else ["--model.random_init=true"]), f"--data.source={data}",
               "--reward.user_fn=tests.reward_fns:digit_fraction", "--reward.num_workers=4",
               f"--rollout.rollout_batch_size={prompts}", "--rollout.n_samples_per_prompt=8",
               "--rollout.max_batch_size=1024",
               f"--rollout.max_new_tokens={new_tokens}", f"--rollout.max_context_len={new_tokens + 64}",
               f"--rollout.stop_token_ids={json.dumps([] if mode == 'full' else stops)}",
               "--train.micro_batch_tokens=32768",
               "--train.packing=true", "--model.compile=true", "--train.lr=1e-6", f"--train.num_rollout={rollouts}",
               "--checkpoint.interval=-1", "--log.progress=false", f"--log.output_dir={out / mode}",
               *mode_args(mode, prompts),
               *extra]
        print(f"== {mode}: {' '.join(cmd[5:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    table(out)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def eval_points(run: list[dict]) -> list[tuple[int, float, float]]:
    """Each eval as (rollout id; minutes of steps before it, evals included, as `rl.plot --x minutes` places it;
    accuracy)."""
    evals, seconds = [], 0.0
    for r in run:
        if r.get("eval/accuracy") is not None:
            evals.append((r["rollout_id"], seconds / 60, r["eval/accuracy"]))
        seconds += r.get("perf/step_s", 0.0)
    return evals


def eval_minutes(run: list[dict]) -> list[tuple[float, float]]:
    return [(minutes, accuracy) for _, minutes, accuracy in eval_points(run)]


def curves(runs: dict[str, list[dict]]) -> None:
    """Held-out accuracy at each eval's rollout, the minutes of steps before it in brackets (runs with no eval, such
    as `full`, left out)."""
    points = {name: {rollout: (m, a) for rollout, m, a in eval_points(run)} for name, run in runs.items()}
    points = {name: by_rollout for name, by_rollout in points.items() if by_rollout}
    columns = sorted({rollout for by_rollout in points.values() for rollout in by_rollout})
    if not columns:
        return
    print("\n| run | " + " | ".join(map(str, columns)) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, by_rollout in points.items():
        cells = [(f"{by_rollout[c][1]:.3f}" + (f" ({by_rollout[c][0]:.2f})" if by_rollout[c][0] else ""))
                 if c in by_rollout else "" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


def minutes_to(run: list[dict], accuracy: float) -> float | None:
    """Minutes of steps before the eval first reached `accuracy`."""
    return next((minutes for minutes, reached in eval_minutes(run) if reached >= accuracy), None)


def accuracy_within(run: list[dict], minutes: float) -> float | None:
    """The last held-out accuracy the run logged within `minutes` of steps."""
    return next((a for m, a in reversed(eval_minutes(run)) if m <= minutes + 1e-8), None)


def generated(step: dict) -> float:
    """The tokens the step's rollout generated."""
    return step.get("perf/rollout_tokens_per_s", 0.0) * step.get("perf/rollout_s", 0.0)


def overall_rate(steps: list[dict]) -> float:
    """Tokens over generation seconds, over the rollouts that generated."""
    generating = [r for r in steps if r.get("perf/rollout_tokens_per_s")]
    return sum(map(generated, generating)) / max(sum(r["perf/rollout_s"] for r in generating), 1e-9)


def table(out: Path) -> None:
    runs = {d.name: rows(d) for d in sorted(out.iterdir()) if (d / "metrics.jsonl").is_file()}
    target = next((r["eval/accuracy"] for r in reversed(runs.get("sync", [])) if "eval/accuracy" in r), None)
    full = overall_rate(after_first(runs["full"])) if "full" in runs else None
    # The speed columns compare the rollouts every run has (`full`, the reference rate, whatever its count); the
    # eval columns take each run whole.
    # (A run's last row can be its final eval alone, with no step: its rollout id is one past the last step's.)
    last = min((max(r["rollout_id"] for r in run if "perf/step_s" in r) for name, run in runs.items()
                if name != "full"), default=None)
    sync = training_step_s(after_first(runs["sync"], last)) if "sync" in runs else None
    sync_minutes = sum(r.get("perf/step_s", 0.0) for r in runs["sync"]) / 60 if "sync" in runs else None
    print(f"| mode | rollout tokens/s | overall | of full | step s | mean step s | without evals | x sync | rollout s "
          f"| train s | response mean / max | decode steps | rows a step | context a token | staleness mean / max "
          f"| partial frac | resumed tokens | prefill tokens "
          f"| final eval acc | eval acc in sync's minutes "
          f"| minutes to sync's final ({'-' if target is None else f'{target:.3f}'}) | total minutes "
          f"| train peak GB | KV wake-up s |")
    print("|---" * 24 + "|")
    for name, run in runs.items():
        steps = after_first(run, last)

        def median(key: str) -> float:
            return statistics.median(r.get(key, 0.0) for r in steps)

        evals = [r["eval/accuracy"] for r in run if "eval/accuracy" in r]
        lag = [r.get("rollout/staleness_mean", 0.0) for r in steps]
        to_target = minutes_to(run, target) if target is not None else None
        in_sync_minutes = accuracy_within(run, sync_minutes) if sync_minutes is not None else None
        overall = overall_rate(steps)
        without_evals = training_step_s(steps)
        decode = sum(r.get("rollout/decode_steps", 0.0) for r in steps)
        longest = max(r.get("rollout/response_length_max", 0.0) for r in steps)
        row_steps = sum(r.get("rollout/decode_steps", 0.0) * r.get("rollout/decode_rows_mean", 0.0) for r in steps)
        print(f"| {name} | {median('perf/rollout_tokens_per_s'):,.0f} | {overall:,.0f} "
              f"| {'-' if not full else f'{overall / full:.0%}'} | {median('perf/step_s'):.2f} "
              f"| {statistics.mean(r['perf/step_s'] for r in steps):.2f} | {without_evals:.2f} "
              f"| {'-' if not sync else f'{sync / without_evals:.2f}x'} "
              f"| {median('perf/rollout_s'):.2f} | {median('perf/train_s'):.2f} "
              f"| {median('rollout/response_length_mean'):,.0f} / {longest:,.0f} "
              f"| {decode / len(steps):,.0f} | {row_steps / max(decode, 1):,.0f} | {mean_context(steps):,.0f} "
              f"| {statistics.mean(lag):.2f} / {max(r.get('rollout/staleness_max', 0.0) for r in steps):.0f} "
              f"| {statistics.mean(r.get('rollout/partial_frac', 0.0) for r in steps):.2f} "
              f"| {median('rollout/resumed_tokens'):,.0f} | {median('rollout/prefill_tokens'):,.0f} "
              f"| {evals[-1] if evals else float('nan'):.3f} "
              f"| {'-' if in_sync_minutes is None else f'{in_sync_minutes:.3f}'} "
              f"| {'-' if to_target is None else f'{to_target:.2f}'} "
              f"| {sum(r.get('perf/step_s', 0.0) for r in run) / 60:.2f} "
              f"| {max(r.get('memory/train_peak_gb', 0.0) for r in steps):.1f} | {median('perf/onload_kv_s'):.2f} |")
    curves(runs)


def mean_context(steps: list[dict]) -> float:
    """The tokens a generated token was sampled over, averaged over the rollouts' generated tokens (0: not logged)."""
    logged = [r for r in steps if "rollout/context_mean" in r]
    return sum(generated(r) * r["rollout/context_mean"] for r in logged) / max(sum(map(generated, logged)), 1e-9)


def after_first(run: list[dict], last: int | None = None) -> list[dict]:
    """The steps of rollouts 1 to `last` (rollout 0 holds CUDA-graph captures and compiles)."""
    return [r for r in run if "perf/step_s" in r and r["rollout_id"] > 0 and (last is None or r["rollout_id"] <= last)]


def training_step_s(steps: list[dict]) -> float:
    """The mean step without its held-out eval: evals are the same work in every mode, and their greedy loops to
    the cap (in some evals, not others) are noise on a comparison of the rollout modes."""
    return statistics.mean(r["perf/step_s"] - (r.get("perf/eval_s") or 0.0) for r in steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-data")
    w.add_argument("dir", type=Path)
    w.add_argument("--bundles", action="store_true", help="training prompts of 1-12 problems, their answers summed")
    w.add_argument("--eval-rows", type=int, default=128, help="held-out problems")
    r = sub.add_parser("run")
    r.add_argument("model", type=Path)
    r.add_argument("data", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--modes", nargs="+", default=["sync", "partial1", "partial2"],
                   choices=sorted(set(MODES) - {"full"}))
    r.add_argument("--rollouts", type=int, default=30)
    r.add_argument("--async-rollouts", type=int, help="rollouts of the asynchronous modes (default: --rollouts)")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    tl = sub.add_parser("tail")
    tl.add_argument("out", type=Path)
    tl.add_argument("--model", default=str(ROOT / "configs/models/qwen2.5-0.5b"),
                    help="a config folder (random weights) or a model folder")
    tl.add_argument("--modes", nargs="+", default=["full", "sync", "partial1", "partial2"], choices=sorted(MODES))
    tl.add_argument("--rollouts", type=int, default=8)
    tl.add_argument("--stop-ids", type=int, default=300)
    tl.add_argument("--max-new-tokens", type=int, default=4096)
    tl.add_argument("--prompts", type=int, default=64, help="prompts a rollout trains (x 8 samples)")
    args, extra = p.parse_known_args()
    if args.command == "write-data":
        write_data(args.dir, bundles=args.bundles, eval_rows=args.eval_rows)
    elif args.command == "run":
        run(args.model, args.data, args.out, args.modes, args.rollouts, extra, args.async_rollouts)
    elif args.command == "tail":
        tail(args.out, args.model, args.modes, args.rollouts, args.stop_ids, args.max_new_tokens, args.prompts, extra)
    else:
        table(args.out)


if __name__ == "__main__":
    main()
