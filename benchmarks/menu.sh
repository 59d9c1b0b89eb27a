#!/usr/bin/env bash
# The algorithm menu on the quickstart: every advantage estimator and policy loss for a few rollouts from the
# same pretrained SmolLM2-135M-Instruct, then one table of the reward over the first and last five rollouts.
#   bash benchmarks/menu.sh [ROLLOUTS=10] [OUT=runs/menu]
# Needs the quickstart's model (bash launch.sh --install configs/quickstart.toml prepares it). Runs one after
# the other on this machine's devices (2 CPU ranks without a GPU); the held-out eval is off to save time.
set -euo pipefail
cd "$(dirname "$0")/.."
rollouts=${1:-10}
out=${2:-runs/menu}
declare -A runs=(
  [grpo]=""
  [dr_grpo]="--algo.advantage_estimator=dr_grpo --algo.loss_agg=seq_mean_token_sum_norm"
  [rloo]="--algo.advantage_estimator=rloo"
  [reinforce_plus_plus]="--algo.advantage_estimator=reinforce_plus_plus"
  [reinforce_plus_plus_baseline]="--algo.advantage_estimator=reinforce_plus_plus_baseline"
  [gae]="--algo.advantage_estimator=gae --critic.lr=5e-5"
  [gspo]="--algo.policy_loss=gspo --algo.eps_clip=3e-4 --algo.eps_clip_high=4e-4 --algo.loss_agg=seq_mean_token_mean"
  [cispo]="--algo.policy_loss=cispo --algo.eps_clip=1.0 --algo.eps_clip_high=0.28"
  [grpo_kl]="--algo.kl_coef=0.05 --algo.kl_estimator=low_var_kl"
)
order=(grpo dr_grpo rloo reinforce_plus_plus reinforce_plus_plus_baseline gae gspo cispo grpo_kl)
for name in "${order[@]}"; do
  [[ -f "$out/$name/final/config.json" ]] && continue  # finished earlier: a rerun only prints the table
  start=$(date +%s)
  # shellcheck disable=SC2086
  bash launch.sh configs/quickstart.toml --train.num_rollout="$rollouts" --eval.source= --log.progress=false \
    --log.output_dir="$out/$name" --checkpoint.resume=never ${runs[$name]} > "$out.$name.log" 2>&1 \
    || { echo "$name failed: see $out.$name.log" >&2; exit 1; }
  echo "$name: $(( $(date +%s) - start )) s" >&2
done
python - "$out" "${order[@]}" <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
print("| run | keys | reward first 5 | reward last 5 | last train/kl_ref | last step s |")
print("|---|---|---|---|---|---|")
for name in names:
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows]
    cfg = json.loads((out / name / "config.json").read_text())["algo"]
    keys = f"{cfg['advantage_estimator']} / {cfg['policy_loss']} / {cfg['loss_agg']}"
    kl = rows[-1].get("train/kl_ref")
    print(f"| {name} | {keys} | {sum(rewards[:5]) / 5:.3f} | {sum(rewards[-5:]) / 5:.3f} | "
          f"{'' if kl is None else f'{kl:.2e}'} | {rows[-1]['perf/step_s']:.1f} |")
PY
