#!/usr/bin/env bash
# The trainer modes' speed side by side at the Qwen3-1.7B shape on one GPU (docs/trainer-modes.md):
#   bash scripts/gpu/modes.sh OUT TOKENIZER [ORDER]
# TOKENIZER: a tokenizer folder with Qwen's vocabulary (stapo.quickstart.tiny.build_qwen_tokenizer). OUT gets a random
# model of the shape, the word task and a folder per run, MODE-N for the N-th run of MODE, with its args.txt (the
# arguments of scripts/train.sh, one a line), train.log, metrics.jsonl and exit_code. ORDER: a comma list of sync and
# colocate, default sync,colocate,colocate,sync (each mode twice, alternated). Each run: STAPO, 8 prompts x 8
# responses of up to 2,048 tokens (a random model writes to the limit), two PPO mini-batches, 5 steps; on one GPU,
# vLLM and the actor share it in both modes (colocate_async overlaps them in time only). Then the per-step summary of
# every run (python -m stapo.checks.scale summary).
# Runs take minutes each: run the script detached (setsid ... &) and poll OUT. It stops every Ray cluster on the
# machine before each run (`ray stop --force`): run it alone, as a speed measurement must be anyway.
set -euo pipefail
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -eq 2 ] || [ $# -eq 3 ] || { usage >&2; exit 2; }
out=$(realpath -m "$1") tok=$(realpath -m "$2") order=${3:-sync,colocate,colocate,sync}
IFS=, read -ra modes <<< "$order"
for mode in "${modes[@]}"; do
  case $mode in sync | colocate) ;; *) echo "error: ORDER=$order: a comma list of sync and colocate" >&2; exit 2 ;; esac
done
PY=${STAPO_PYTHON:-python3}
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
qwen_shape "$out" "$tok"
run+=(data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_response_length=2048
  trainer.total_training_steps=5)
runs=()
for mode in "${modes[@]}"; do
  next_run "$out" "$mode"
  runs+=("$dir/metrics.jsonl")
  train_run "$dir" stapo qwen3_1.7b "${run[@]}" trainer.v1.trainer_mode="stapo_${mode/colocate/colocate_async}"
done
$PY -m stapo.checks.scale summary "${runs[@]}"
