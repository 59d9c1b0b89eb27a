#!/usr/bin/env bash
# The seed's scenario on 1..N GPUs of one node: 32 prompts x 8 samples, prompts <= 512 tokens,
# responses <= 1024, global batch 256, one train step per rollout, micro-batches cut by tokens,
# policy offloaded while the engine runs. Random weights of a config folder; any tokenizer folder.
#
#   bash benchmarks/loop.sh configs/models/qwen2.5-1.5b TOKENIZER_DIR "1 2 4 8" [ROLLOUTS] [--section.key=value ...]
#   ENGINES="native vllm" bash benchmarks/loop.sh ...   # each GPU count with each engine, tabled side by side
#
# vLLM runs take rollout.vllm.gpu_memory_utilization=$VLLM_MEMORY (default 0.3; an override after ROLLOUTS wins) and
# rollout.vllm.kwargs=$VLLM_KWARGS (a TOML inline table, default {}).
# The trainer runs compiled decoder blocks over micro-batches of 32768 tokens (MICRO_BATCH_TOKENS, COMPILE=false
# to run eager). Runs land in runs/loop/<model>-<gpus> (native) or runs/loop/<model>-<gpus>-vllm; the step-time
# table is printed at the end (LOOP_OUT=DIR puts them under DIR instead of runs/loop).
set -euo pipefail
model=$1; tokenizer=$2; gpus=$3; rollouts=${4:-4}; shift $(( $# < 4 ? $# : 4 ))
engines=${ENGINES:-native}
data=runs/loop/prompts.jsonl
mkdir -p runs/loop
python benchmarks/loop_breakdown.py data $data
runs=()
for n in $gpus; do
  for engine in $engines; do
    out=${LOOP_OUT:-runs/loop}/$(basename $model)-$n
    extra=()
    if [ "$engine" = vllm ]; then
      out=$out-vllm
      extra=(--rollout.engine=vllm --rollout.vllm.gpu_memory_utilization=${VLLM_MEMORY:-0.3}
             "--rollout.vllm.kwargs=${VLLM_KWARGS:-{\}}")
    fi
    torchrun --standalone --nproc-per-node $n -m rl.main --config configs/tiny.toml \
      --model.path=$model --model.random_init=true --model.tokenizer=$tokenizer \
      --data.source=$data --data.max_prompt_len=512 --rollout.max_context_len=1600 --rollout.max_new_tokens=1024 \
      --rollout.rollout_batch_size=32 --rollout.n_samples_per_prompt=8 --reward.num_workers=4 \
      --reward.user_fn=tests.reward_fns:digit_fraction --log.progress=false --train.micro_batch_tokens=${MICRO_BATCH_TOKENS:-32768} \
      --model.compile=${COMPILE:-true} \
      --train.lr=1e-6 --train.offload=true --train.num_rollout=$rollouts --log.output_dir=$out "${extra[@]}" "$@"
    runs+=($out)
  done
done
python benchmarks/loop_breakdown.py table "${runs[@]}"
