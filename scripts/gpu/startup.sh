#!/usr/bin/env bash
# Time launches to their first step at the Qwen3-1.7B shape on one GPU, the start-up cuts off and on:
#   bash scripts/gpu/startup.sh OUT TOKENIZER [LAUNCHES|imports] [--cold SITE | --compiled SITE]
# TOKENIZER: a tokenizer folder with Qwen's vocabulary (stapo.quickstart.tiny.build_qwen_tokenizer). OUT gets a random
# model of the shape, the word task, and a folder per launch, KIND-N for the N-th launch of its kind, with the
# train.log and phases.json of `python -m stapo.checks.startup run` (imports: OUT/imports.json instead).
# LAUNCHES: a comma list run in order, default warm,warm-off,off,on,on,off: "off" is STAPO_STARTUP_CUTS=none with
# verl's 8 TransferQueue units, "on" the defaults; "warm" and "warm-off" are launches like on and off, kept apart from
# the compared ones, that pay what a first launch pays (vLLM's compile cache, the page cache; a first off launch after
# on ones paid 12.5 s more once: docs/evidence/startup.md). N continues after OUT's existing KIND-N folders.
# --cold SITE removes the bytecode under SITE (where the packages are installed) and the checkout's before each
# launch, as after `pip install --no-compile`; --compiled SITE compiles it once first (and the run's packages'
# elsewhere), as pip's default install does.
# A launch takes minutes: run the script detached (setsid ... &) and poll OUT.
set -euo pipefail
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -ge 2 ] || { usage >&2; exit 2; }
out=$(realpath -m "$1") tok=$(realpath -m "$2") launches=warm,warm-off,off,on,on,off bytecode= site=
shift 2
case "${1:-}" in "" | --*) ;; *) launches=$1; shift ;; esac
if [ $# -gt 0 ]; then
  case "$1" in --cold | --compiled) ;; *) bytecode=bad ;; esac
  [ -z "$bytecode" ] && [ $# -eq 2 ] && [ -d "$2" ] || { echo "error: $1 ${2:-}: give --cold SITE or --compiled SITE, a folder" >&2; exit 2; }
  bytecode=$1 site=$(realpath "$2")
fi
IFS=, read -ra kinds <<< "$launches"
for kind in "${kinds[@]}"; do
  case $kind in warm | warm-off | off | on) ;; imports) [ "$launches" = imports ] || kind=bad ;; *) kind=bad ;; esac
  [ "$kind" != bad ] || { echo "error: $launches: a comma list of warm, warm-off, off and on, or imports alone" >&2; exit 2; }
done
PY=${STAPO_PYTHON:-python3}
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
qwen_shape "$out" "$tok"
if [ "$bytecode" = --compiled ]; then
  found=$($PY -c 'from stapo.train.startup_cuts import package_folders; print(*package_folders(), sep="\n")')
  folders=()
  [ -z "$found" ] || mapfile -t folders <<< "$found"
  $PY -m compileall -q -j 0 "$site" stapo "${folders[@]}" ||
    echo "warning: compileall left the files above without bytecode; their first imports compile them" >&2
fi
run+=(data.train_batch_size=16 actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=2048
  trainer.total_training_steps=2)
for kind in "${kinds[@]}"; do
  if [ "$bytecode" = --cold ]; then find "$site" stapo -name __pycache__ -type d -prune -exec rm -rf {} +; fi
  if [ "$kind" = imports ]; then
    $PY -m stapo.checks.startup imports --out "$out/imports.json"
    continue
  fi
  next_run "$out" "$kind"
  ray stop --force >/dev/null 2>&1 || true
  extra=() cuts=all
  case $kind in *off) cuts=none extra=(transfer_queue.backend.SimpleStorage.num_data_storage_units=8) ;; esac
  STAPO_STARTUP_CUTS=$cuts TENSORBOARD_DIR="$dir/tensorboard" $PY -m stapo.checks.startup run \
    --out "$dir" --timeout 1500 -- bash scripts/train.sh stapo qwen3_1.7b "${run[@]}" \
    trainer.default_local_dir="$dir/checkpoints" "${extra[@]}"
  ray stop --force >/dev/null 2>&1 || true
done
