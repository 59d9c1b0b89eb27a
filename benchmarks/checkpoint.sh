#!/usr/bin/env bash
# Checkpoint costs on this machine for a model shape: start-up (meta-device build, each rank loading its
# shard of a safetensors folder), save, resume and final-export times, checkpoint size, host memory.
#
#   bash benchmarks/checkpoint.sh configs/models/qwen2.5-1.5b [NPROC] [--section.key=value ...]
#
# Writes a random-weight bf16 copy of the shape (with the small test tokenizer, which makes the prompts
# long: up to 1300 tokens are kept) to runs/ckpt/model, runs 2
# rollouts saving after each, then resumes for a third, and prints what the runs logged.
set -euo pipefail
shape=$1; nproc=${2:-1}; shift $(( $# < 2 ? $# : 2 ))
root=runs/ckpt; model=$root/model; out=$root/run
rm -rf "$out"; mkdir -p "$root"
python - "$shape" "$model" <<'PY'
import sys, time, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
sys.path.insert(0, ".")
from tests.tiny import tiny_tokenizer
shape, model = sys.argv[1], Path(sys.argv[2])
if not (model / "config.json").is_file():
    t = time.perf_counter()
    config = AutoConfig.from_pretrained(shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    m.save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    print(f"wrote {model} in {time.perf_counter() - t:.1f} s")
PY
python benchmarks/loop_breakdown.py data $root/prompts.jsonl
run() {
  local log=$root/last.log rc=0
  torchrun --standalone --nproc-per-node "$nproc" -m rl.main --config configs/tiny.toml --model.path=$model \
    --data.source=$root/prompts.jsonl --data.max_prompt_len=1300 --rollout.max_context_len=1600 \
    --rollout.max_new_tokens=256 --rollout.rollout_batch_size=32 --rollout.n_samples_per_prompt=8 \
    --reward.num_workers=4 --reward.user_fn=tests.reward_fns:digit_fraction --log.progress=false \
    --train.micro_batch_tokens=16384 --train.offload=true --checkpoint.interval=1 --log.output_dir=$out "$@" \
    > $log 2>&1 || rc=$?
  grep -E "^(policy|checkpoint|rl: |rollout [0-9])" $log | cut -c1-220 || true
  if [[ $rc != 0 ]]; then tail -40 $log; exit $rc; fi
}
start=$SECONDS; run --train.num_rollout=2 "$@"; echo "start to end: $((SECONDS - start)) s"
du -sh "$out"/checkpoints/* "$out"/final
start=$SECONDS; run --train.num_rollout=3 "$@"; echo "start to end: $((SECONDS - start)) s"
