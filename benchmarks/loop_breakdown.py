"""Step-time breakdown of RL loop runs, and the prompt file they train on.

    python benchmarks/loop_breakdown.py data /tmp/long.jsonl      # 2048 prompts of ~150-500 tokens
    python benchmarks/loop_breakdown.py tokenizer /tmp/tok        # a word-level tokenizer for them
    python benchmarks/loop_breakdown.py table RUN_DIR [RUN_DIR ...]
    python benchmarks/loop_breakdown.py engines ROLLOUT_JSON NATIVE_RUN_DIR VLLM_RUN_DIR   # benchmarks/engines.sh
    python benchmarks/loop_breakdown.py best-vllm ROLLOUT_JSON MODEL   # its fastest vLLM variant, as TOML

`tokenizer` writes a tokenizer folder for machines that have none: one token per word, digit
run and punctuation mark of those prompts (as many tokens per prompt as Qwen2.5's tokenizer gives,
within a few percent), a ChatML template, ids far below any model's vocabulary. `table` reads each run's metrics.jsonl and prints, per run, the median over every rollout but the
first (which compiles kernels, captures graphs and pins host memory) of the seed's phases: rollout,
engine sleep, policy onload, train, weight sync, policy offload and KV wake-up, with weight-sync
GB/s and memory per phase. `benchmarks/loop.sh` runs the loop on 1..N GPUs and calls both.
`best-vllm` prints the `vllm.LLM` arguments of the fastest vLLM variant that `benchmarks/rollout.py` measured
for MODEL as a TOML inline table, the value of `--rollout.vllm.kwargs`.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

ROWS = [("step s", "perf/step_s"), ("rollout s", "perf/rollout_s"), ("engine sleep s", "perf/offload_s"),
        ("policy onload s", "perf/onload_train_s"), ("train s", "perf/train_s"),
        ("engine wake (weights) s", "perf/onload_weights_s"), ("weight sync s", "perf/weight_sync_s"),
        ("weight sync GB/s", "perf/weight_sync_gbps"), ("policy offload s", "perf/offload_train_s"),
        ("engine wake (KV) s", "perf/onload_kv_s"), ("rollout tok/s", "perf/rollout_tokens_per_s"),
        ("response length", "rollout/response_length_mean"), ("padding micro-batches", "train/padding_micro_batches"),
        ("rollout peak GB", "memory/rollout_peak_gb"), ("device used after rollout GB", "memory/rollout_device_used_gb"),
        ("reserved asleep GB", "memory/asleep_reserved_gb"), ("device used asleep GB", "memory/asleep_device_used_gb"),
        ("train peak GB", "memory/train_peak_gb"),
        ("engine vs trainer logprob diff, mean", "rollout/logprob_abs_diff_mean"),
        ("engine vs trainer logprob diff, max", "rollout/logprob_abs_diff_max")]


def write_data(path: str, rows: int = 2048) -> None:
    """Arithmetic questions behind a filler context of 120-380 words, so prompts fill most of 512 tokens."""
    rng = random.Random(0)
    words = "alpha beta gamma delta seven nine eleven plus minus times sum value number carry digit".split()
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            context = " ".join(rng.choice(words) for _ in range(rng.randint(120, 380)))
            f.write(json.dumps({"question": f"{context}\nWhat is {a} + {b}?", "answer": str(a + b)}) + "\n")


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = "alpha beta gamma delta seven nine eleven plus minus times sum value number carry digit What is".split()
    words += ["system", "user", "assistant", "?", "+", "=", "."] + [str(d) for d in range(10)]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", additional_special_tokens=specials[:3])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(path)


def run_medians(run: str) -> dict[str, float]:
    """Each ROWS metric of a run's metrics.jsonl, median over every rollout but the first."""
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    use = rows[1:] or rows
    return {key: statistics.median([r[key] for r in use if key in r] or [float("nan")]) for _, key in ROWS}


def table(run_dirs: list[str]) -> str:
    medians = {Path(run).name: run_medians(run) for run in run_dirs}
    lines = ["| median over rollouts 1.. | " + " | ".join(medians) + " |", "|---|" + "---|" * len(medians)]
    lines += [f"| {label} | " + " | ".join(f"{m[key]:.4g}" for m in medians.values()) + " |" for label, key in ROWS]
    return "\n".join(lines)


def engines(rollout_json: str, native_run: str, vllm_run: str) -> str:
    """One table of both engines: `benchmarks/rollout.py --engines native vllm --out` rows per model (the
    fastest vLLM variant) and the loop's medians of a native and a vLLM run, with the acceptance bounds
    for vLLM on one GPU: sleep(2) frees >= 90% of its memory, a weight sync <= 0.05 s, and a train peak
    within 10% of the native engine's."""
    rows = json.loads(Path(rollout_json).read_text())["rows"]
    lines = ["| | native | vLLM | bound for vLLM | met |", "|---|---|---|---|---|"]

    def line(label, native, vllm, bound="", met=None):
        lines.append(f"| {label} | {native} | {vllm} | {bound} | {'' if met is None else 'yes' if met else 'NO'} |")

    for model in dict.fromkeys(r["model"] for r in rows):
        native = next(r for r in rows if r["model"] == model and r["engine"] == "native")
        vllm = fastest_vllm(rows, model, rollout_json)
        line(f"{model}: rollout tok/s (vLLM: {vllm['engine']})", f"{native['engine_tok_s']:,.0f}",
             f"{vllm['engine_tok_s']:,.0f}")
        line(f"{model}: of the decode roofline", f"{native['roofline_frac']:.0%}", f"{vllm['roofline_frac']:.0%}")
        freed = vllm["sleep"]["freed_frac"]
        line(f"{model}: sleep(2) frees", f"{native['sleep']['freed_frac']:.1%}", f"{freed:.1%}", ">= 90%",
             freed >= 0.9)
    loop = {"native": run_medians(native_run), "vllm": run_medians(vllm_run)}
    for label, key in ROWS[:5]:
        line(f"loop: {label}", f"{loop['native'][key]:.4g}", f"{loop['vllm'][key]:.4g}")
    sync = loop["vllm"]["perf/weight_sync_s"]
    line("loop: weight sync s", f"{loop['native']['perf/weight_sync_s']:.4g}", f"{sync:.4g}", "<= 0.05", sync <= 0.05)
    peaks = [loop[e]["memory/train_peak_gb"] for e in ("native", "vllm")]
    line("loop: train peak GB", f"{peaks[0]:.4g}", f"{peaks[1]:.4g}", "native + 10%", peaks[1] <= 1.1 * peaks[0])
    return "\n".join(lines)


def toml_value(value) -> str:
    """A JSON value as TOML (inline tables for objects)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(v)}" for key, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # true/false, numbers and basic strings are spelled alike


def fastest_vllm(rows: list[dict], model: str, rollout_json: str) -> dict:
    """The vLLM variant of `model` with the most tokens/s among `benchmarks/rollout.py`'s rows."""
    vllm = [r for r in rows if r["model"] == model and r["engine"].startswith("vllm")]
    if not vllm:
        sys.exit(f"{rollout_json} has no vLLM row for model {model!r}")
    return max(vllm, key=lambda r: r["engine_tok_s"])


def best_vllm(rollout_json: str, model: str) -> str:
    rows = json.loads(Path(rollout_json).read_text())["rows"]
    return toml_value(fastest_vllm(rows, model, rollout_json)["vllm_kwargs"])


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("data", "tokenizer", "table", "engines", "best-vllm") or \
            (sys.argv[1] == "engines" and len(sys.argv) != 5) or (sys.argv[1] == "best-vllm" and len(sys.argv) != 4):
        sys.exit(__doc__)
    if sys.argv[1] == "data":
        write_data(sys.argv[2])
    elif sys.argv[1] == "tokenizer":
        write_tokenizer(sys.argv[2])
    elif sys.argv[1] == "engines":
        print(engines(*sys.argv[2:]))
    elif sys.argv[1] == "best-vllm":
        print(best_vllm(*sys.argv[2:]))
    else:
        print(table(sys.argv[2:]))
