#!/usr/bin/env bash
# Time a launch to its first step at the Qwen3-1.7B shape on one GPU, the start-up cuts off and on (issue 55):
#   bash scripts/gpu/startup.sh OUT TOKENIZER [off|on|both|imports] [--cold SITE]
# TOKENIZER: a tokenizer folder with Qwen's vocabulary (stapo.quickstart.tiny.build_qwen_tokenizer). OUT gets a random
# model of the shape, the word task, and off/ and on/ with the train.log and phases.json of
# `python -m stapo.checks.startup run` (imports: OUT/imports.json, each process kind's imports cold and warm).
# "off" is STAPO_STARTUP_CUTS=none with verl's 8 TransferQueue units; "on" the defaults. --cold SITE removes the
# bytecode under SITE (where the packages are installed) and the checkout's before each launch, as after a fresh
# `pip install --no-compile`. A launch takes minutes: run the script detached (setsid ... &) and poll OUT.
set -euo pipefail
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -ge 2 ] || { usage >&2; exit 2; }
out=$(realpath -m "$1") tok=$(realpath -m "$2") modes=${3:-both} site=
if [ $# -ge 4 ]; then
  [ "$4" = --cold ] && [ $# -eq 5 ] && [ -d "$5" ] || { echo "error: $4 ${5:-}: give --cold SITE, a folder" >&2; exit 2; }
  site=$(realpath "$5")
fi
case $modes in both) modes="off on" ;; off | on | imports) ;; *) echo "error: $modes: off, on, both or imports" >&2; exit 2 ;; esac
[ -f "$tok/tokenizer_config.json" ] || { echo "error: $tok: no tokenizer_config.json; a tokenizer folder" >&2; exit 2; }
PY=${STAPO_PYTHON:-python3}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
[ -f "$out/model/config.json" ] || $PY -m stapo.checks.scale model --shape qwen3_1.7b --tokenizer "$tok" \
  --out "$out/model" --device cuda
[ -f "$out/word/train.parquet" ] || $PY -m stapo.quickstart.task word --out "$out/word" --train 512 --val 32
run=(data.train_files="$out/word/train.parquet" data.val_files="$out/word/validation.parquet"
  actor_rollout_ref.model.path="$out/model" trainer.n_gpus_per_node=1 data.train_batch_size=16
  actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=2048 trainer.total_training_steps=2
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable)
for mode in $modes; do
  if [ -n "$site" ]; then find "$site" stapo -name __pycache__ -type d -prune -exec rm -rf {} +; fi
  if [ "$mode" = imports ]; then
    $PY -m stapo.checks.startup imports --out "$out/imports.json"
    continue
  fi
  ray stop --force >/dev/null 2>&1 || true
  extra=() cuts=all
  if [ "$mode" = off ]; then cuts=none extra=(transfer_queue.backend.SimpleStorage.num_data_storage_units=8); fi
  STAPO_STARTUP_CUTS=$cuts TENSORBOARD_DIR="$out/$mode/tensorboard" $PY -m stapo.checks.startup run \
    --out "$out/$mode" --timeout 1500 -- bash scripts/train.sh stapo qwen3_1.7b "${run[@]}" \
    trainer.default_local_dir="$out/$mode/checkpoints" "${extra[@]}"
  ray stop --force >/dev/null 2>&1 || true
done
