#!/usr/bin/env bash
# Launch an rl run on one node, or on several under SLURM.
#
#   bash launch.sh [--install] [--nproc N] CONFIG [--section.key=value ...]
#   sbatch --nodes 2 --gpus-per-node 8 launch.sh CONFIG [...]      # SLURM, one torchrun per node
#
# SIGTERM or SIGUSR1 to this script reaches every rank as SIGUSR1: the run checkpoints at the end of
# its step and exits 0. Under SLURM the job asks for SIGUSR1 two minutes before its time limit and,
# once the ranks have stopped that way, requeues itself; the requeued job resumes from the checkpoint.
#
# --install  installs rl (and a CPU torch where no GPU and no torch is present) and prepares the
#            config's model if it is one of the offline models rl.prepare knows.
# --nproc N  ranks per node (default: the GPU count, or 2 on a CPU-only machine).
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"

install=0
nproc=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --install) install=1; shift ;;
    --nproc) nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "usage: bash launch.sh [--install] [--nproc N] CONFIG [--section.key=value ...]" >&2; exit 2; }
config="$1"; shift
[[ -f "$config" ]] || { echo "launch.sh: config file not found: $config" >&2; exit 2; }

if [[ $install == 1 ]]; then
  if ! python -c "import torch" 2>/dev/null; then
    # Without a GPU take the CPU build; a plain `pip install torch` would fetch several GB of CUDA.
    if command -v nvidia-smi >/dev/null 2>&1; then pip install torch; else pip install torch==2.13.0; fi
  fi
  pip install -e ".[quickstart]"
  python -m rl.prepare --config "$config" "$@"
fi

if [[ -z "$nproc" ]]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())")
  if [[ "$gpus" -gt 0 ]]; then nproc=$gpus; else nproc=2; fi
fi

# Runs a command in the background, turns SIGTERM/SIGUSR1 into SIGUSR1 for `children` of it (the
# ranks under torchrun, which itself would die of SIGUSR1) or for `itself` (srun, which forwards
# it to every task), then waits for it; `stopped` records that a signal came.
stopped=0
run_forwarding_stop() {
  local target=$1; shift
  "$@" &
  local pid=$!
  if [[ $target == children ]]; then
    trap 'stopped=1; pkill -USR1 -P "$pid" 2>/dev/null || true' TERM USR1
  else
    trap 'stopped=1; kill -USR1 "$pid" 2>/dev/null || true' TERM USR1
  fi
  local rc=0
  while true; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break  # wait returned for a trapped signal: the job still runs
  done
  trap - TERM USR1
  return "$rc"
}

if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" ]]; then
  # The batch script itself: start one task per node, each running this script again.
  rc=0
  run_forwarding_stop itself srun --ntasks-per-node=1 bash "$0" --nproc "$nproc" "$config" "$@" || rc=$?
  if [[ $stopped == 1 && $rc == 0 ]]; then
    echo "launch.sh: stopped at a checkpoint ahead of the time limit; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit "$rc"
fi

if [[ -n "${SLURM_STEP_ID:-}" ]]; then
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  run_forwarding_stop children torchrun --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$head:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" \
    -m rl.main --config "$config" "$@"
  exit $?
fi

run_forwarding_stop children torchrun --standalone --nproc-per-node "$nproc" -m rl.main --config "$config" "$@"
