#!/usr/bin/env bash
# Both engines on one GPU in one run, and one table of them: rollout throughput of the seed's batch at
# 0.5B and 1.5B (benchmarks/rollout.py; vLLM as configured by default and with prefix caching off, the
# faster of them tabled), then the RL loop at 0.5B with each engine (benchmarks/loop.sh; vLLM with the settings of
# its faster variant at 0.5B), then
# `benchmarks/loop_breakdown.py engines`: tok/s, share of the decode roofline, sleep(2), the loop's phases,
# weight sync and train peak, with the bounds vLLM must meet.
#
#   bash benchmarks/engines.sh TOKENIZER_DIR [ROLLOUTS] [--section.key=value ...]   # overrides go to the loop
#
# Earlier loop runs of the same names are moved aside (runs/loop/<name>.<time>), so both loops start fresh.
set -euo pipefail
tokenizer=$1; rollouts=${2:-4}; shift $(( $# < 2 ? $# : 2 ))
out=runs/engines
mkdir -p $out
python benchmarks/rollout.py --engines native vllm --hf-steps -1 --parity-sequences 8 \
  --vllm-variants '{}' '{"enable_prefix_caching": false}' --out $out/rollout.json
for run in runs/loop/qwen2.5-0.5b-1 runs/loop/qwen2.5-0.5b-1-vllm; do
  if [ -e $run ]; then mv $run $run.$(date +%s); fi
done
kwargs=$(python benchmarks/loop_breakdown.py best-vllm $out/rollout.json qwen2.5-0.5b)  # on its own: set -e sees it fail
VLLM_KWARGS=$kwargs ENGINES="native vllm" bash benchmarks/loop.sh configs/models/qwen2.5-0.5b $tokenizer "1" $rollouts "$@"
python benchmarks/loop_breakdown.py engines $out/rollout.json runs/loop/qwen2.5-0.5b-1 runs/loop/qwen2.5-0.5b-1-vllm
