#!/usr/bin/env bash
# Launch an rl run on one node, or on several under SLURM.
#
#   bash launch.sh [--install] [--nproc N] [--max-restarts N] CONFIG [--section.key=value ...]
#   rl [--nproc N] ... CONFIG [...]                                  # the same, installed by setup.py
#   sbatch --nodes 2 --gpus-per-node 8 launch.sh CONFIG [...]      # SLURM, one torchrun per node
#
# It runs in the folder it was called from (under SLURM, the one the job was submitted from): paths in the
# config and on the command line are the caller's, and so are the modules a reward function names. The
# ranks run in the caller's Python: $PYTHON where set (`rl` sets it to its own), else the first `python` on
# PATH, as `$PYTHON -m torch.distributed.run` (torchrun). The config is checked before torchrun starts
# (`python -m rl.launch`): a bad key or value, a missing model folder, or a split the ranks cannot make
# ends in one line; an input error a rank meets later is handed back (RL_ERROR_FILE) and never restarted.
#
# SIGTERM, SIGUSR1 or a first Ctrl-C, to this script or to its whole process group (a terminal's Ctrl-C,
# `kill -TERM -PGID`), at any moment, is a stop request: the ranks checkpoint at the end of their step
# and exit 0 (before the first step there is nothing to save, and the run ends at once). A second Ctrl-C
# kills the run. torchrun and the ranks ignore these signals themselves (the ranks run in sessions of
# their own); this script hands the request on as a file the ranks read (RL_STOP_FILE) and a SIGUSR1.
# Under SLURM the job asks for SIGUSR1 ten minutes before its time limit (time to finish a step and
# save) and, once the ranks have stopped that way, requeues itself; the requeued job resumes from the
# checkpoint.
#
# --install         installs rl (and a CPU torch where no GPU and no torch is present) and prepares the
#                   config's model if it is one of the offline models rl.prepare knows.
# --nproc N         ranks per node (default: the GPU count, or 2 on a CPU-only machine).
# --max-restarts N  how often torchrun starts the ranks again after one dies (default 3); each restart
#                   resumes from the newest complete checkpoint. 0: a dead rank ends the run.
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
[[ -z "${SLURM_SUBMIT_DIR:-}" ]] || cd "$SLURM_SUBMIT_DIR"
python=${PYTHON:-$(command -v python || command -v python3 || echo python)}

# A stop request before the ranks exist is remembered and honoured before they are started.
stopped=0
trap 'stopped=1' TERM USR1 INT

install=0
nproc=""
max_restarts=3
while [[ $# -gt 0 ]]; do
  case "$1" in
    --install) install=1; shift ;;
    --nproc) nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --max-restarts=*) max_restarts="${1#*=}"; shift ;;
    *) break ;;
  esac
done

# Under sbatch $0 is Slurm's private copy of this script, which the other nodes lack: the batch script
# starts the one that was submitted, and takes its checkout (below) from there.
script=$(readlink -f "${BASH_SOURCE[0]}")
if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" ]]; then
  submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
  [[ -f "$submitted" ]] || submitted="$SLURM_SUBMIT_DIR/launch.sh"
  [[ -f "$submitted" ]] || { echo "launch.sh: cannot find launch.sh to start on each node (looked at $submitted)" >&2
                             exit 2; }
  script=$(readlink -f "$submitted")
fi
# In a checkout (not an installed package), its rl is the one to run, whatever folder this runs in.
checkout=$(dirname "$script")
[[ ! -f "$checkout/rl/__init__.py" ]] || export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"

for arg in "$@"; do  # --help (--help=SECTION): the keys, from the launcher; no config needed
  case "$arg" in --help|--help=*|-h) exec "$python" -m rl.launch "$@" ;; esac
done
[[ $# -ge 1 ]] || { echo "usage: bash launch.sh [--install] [--nproc N] [--max-restarts N] CONFIG" \
                         "[--section.key=value ...]" >&2; exit 2; }
config="$1"; shift
[[ -f "$config" ]] || { echo "launch.sh: config file not found: $config (paths are relative to $PWD)" >&2; exit 2; }
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "launch.sh: --max-restarts must be a whole number, got '$max_restarts'" >&2
                                       exit 2; }

if [[ $install == 1 ]]; then
  [[ -f "$checkout/setup.py" ]] || { echo "launch.sh: --install installs the checkout that holds launch.sh;" \
                                          "$checkout has no setup.py" >&2; exit 2; }
  if ! "$python" -c "import torch" 2>/dev/null; then
    # Without a GPU take the CPU build; a plain `pip install torch` would fetch several GB of CUDA.
    if command -v nvidia-smi >/dev/null 2>&1; then "$python" -m pip install torch
    else "$python" -m pip install torch==2.13.0; fi
  fi
  "$python" -m pip install -e "$checkout[quickstart]"
  "$python" -m rl.prepare --config "$config" "$@"
fi

if [[ -z "$nproc" ]]; then
  # (a stop request that interrupts this leaves no count: the run is not started then anyway)
  gpus=$("$python" -c "import torch; print(torch.cuda.device_count())") || gpus=0
  if [[ "$gpus" -gt 0 ]]; then nproc=$gpus; else nproc=2; fi
fi
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || { echo "launch.sh: --nproc must be a positive whole number, got '$nproc'" >&2
                                     exit 2; }
# The config's own errors, before any rank exists (one line, exit 2). A stop request meanwhile is this
# script's (the check ignores it, as torchrun does): the run is then not started.
(trap '' TERM USR1 INT; exec "$python" -m rl.launch --world-size $((nproc * ${SLURM_NNODES:-1})) "$config" "$@") \
  || exit $?

# Runs a command in the background and waits for it, turning SIGTERM/SIGUSR1/SIGINT into a stop request
# for `children` of it (the ranks under torchrun: the file RL_STOP_FILE, which they read at the end of
# each step and at start-up, and a SIGUSR1) or for `itself` (srun, which forwards SIGUSR1 to every
# task); `stopped` records that a request came. torchrun runs with SIGTERM, SIGINT and SIGUSR1 ignored
# and told not to handle them (torchrun --signals-to-handle, as PET_SIGNALS_TO_HANDLE; torch >= 2.9): it would otherwise stop
# its ranks at once on a signal sent to the whole process group or SLURM task (the ranks install
# handlers of their own). A request that came before the command started is handed on at once. A rank
# that ends on an input error leaves its exit code and line in RL_ERROR_FILE and exits 0, so that
# torchrun does not restart it: that code is the command's.
interrupts=0
run_forwarding_stop() {
  local target=$1; shift
  local forward stop_file="" error_file="" rc=0
  if [[ $stopped == 1 ]]; then
    echo "launch.sh: stop requested before the run started; nothing to save" >&2
    return 0
  fi
  if [[ $target == children ]]; then
    stop_file=$(mktemp -u "${TMPDIR:-/tmp}/rl-stop.XXXXXXXX")
    error_file=$(mktemp "${TMPDIR:-/tmp}/rl-error.XXXXXXXX")
    (trap '' USR1 TERM INT
     export RL_STOP_FILE="$stop_file" RL_ERROR_FILE="$error_file" PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT
     exec "$@") &
    forward='touch "$stop_file"; pkill -USR1 -P "$pid"'
  else
    "$@" &
    forward='kill -USR1 "$pid"'
  fi
  local pid=$!
  trap "stopped=1; $forward 2>/dev/null || true" TERM USR1
  trap "interrupts=\$((interrupts + 1)); stopped=1
        if [[ \$interrupts == 1 ]]; then
          echo 'launch.sh: stopping at the end of this step with a checkpoint; Ctrl-C again to kill the run now' >&2
          $forward 2>/dev/null || true
        else pkill -KILL -P \"\$pid\" 2>/dev/null; kill -KILL \"\$pid\" 2>/dev/null || true; fi" INT
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid" || true  # returns early for a trapped signal while the job still runs
  done
  trap 'stopped=1' TERM USR1 INT
  wait "$pid" || rc=$?  # the job's own exit status (bash keeps it)
  if [[ -s "$error_file" ]]; then rc=$(head -n 1 "$error_file"); fi
  rm -f "$stop_file" "$error_file"
  return "$rc"
}

if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" ]]; then
  # The batch script itself: start one task per node, each running this script again.
  rc=0
  run_forwarding_stop itself srun --ntasks-per-node=1 bash "$script" --nproc "$nproc" --max-restarts "$max_restarts" \
    "$config" "$@" || rc=$?
  if [[ $stopped == 1 && $rc == 0 ]]; then
    echo "launch.sh: stopped at a checkpoint ahead of the time limit; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit "$rc"
fi

if [[ -n "${SLURM_STEP_ID:-}" ]]; then
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  run_forwarding_stop children "$python" -m torch.distributed.run --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
    --nproc-per-node "$nproc" --max-restarts "$max_restarts" --rdzv-backend c10d \
    --rdzv-endpoint "$head:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" -m rl.main --config "$config" "$@"
  exit $?
fi

run_forwarding_stop children "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  --max-restarts "$max_restarts" -m rl.main --config "$config" "$@"
