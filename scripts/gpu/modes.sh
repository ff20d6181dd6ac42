#!/usr/bin/env bash
# The trainer modes' speed side by side at the Qwen3-1.7B shape on one GPU (docs/trainer-modes.md):
#   bash scripts/gpu/modes.sh OUT TOKENIZER [ORDER]
# TOKENIZER: a tokenizer folder with Qwen's vocabulary (stapo.quickstart.tiny.build_qwen_tokenizer). OUT gets a random
# model of the shape, the word task and a folder per run, MODE-N for the N-th run of MODE, with its train.log,
# metrics.jsonl and exit_code. ORDER: a comma list of sync and colocate, default sync,colocate,colocate,sync (each mode
# twice, alternated). Each run: STAPO, 8 prompts x 8 responses of up to 2,048 tokens (a random model writes to the
# limit), two PPO mini-batches, 5 steps; on one GPU, vLLM and the actor share it in both modes (colocate_async overlaps
# them in time only). Then the per-step summary of every run (python -m stapo.checks.scale summary).
# Runs take minutes each: run the script detached (setsid ... &) and poll OUT. It stops every Ray cluster on the
# machine before each run (`ray stop --force`): run it alone, as a speed measurement must be anyway.
set -euo pipefail
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -eq 2 ] || [ $# -eq 3 ] || { usage >&2; exit 2; }
out=$(realpath -m "$1") tok=$(realpath -m "$2") order=${3:-sync,colocate,colocate,sync}
IFS=, read -ra modes <<< "$order"
for mode in "${modes[@]}"; do
  case $mode in sync | colocate) ;; *) echo "error: ORDER=$order: a comma list of sync and colocate" >&2; exit 2 ;; esac
done
[ -f "$tok/tokenizer_config.json" ] || { echo "error: $tok: no tokenizer_config.json; a tokenizer folder" >&2; exit 2; }
PY=${STAPO_PYTHON:-python3}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
[ -f "$out/model/config.json" ] || $PY -m stapo.checks.scale model --shape qwen3_1.7b --tokenizer "$tok" \
  --out "$out/model" --device cuda
[ -f "$out/word/train.parquet" ] || $PY -m stapo.quickstart.task word --out "$out/word" --train 512 --val 32
run=(data.train_files="$out/word/train.parquet" data.val_files="$out/word/validation.parquet"
  actor_rollout_ref.model.path="$out/model" trainer.n_gpus_per_node=1 data.train_batch_size=8
  actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_response_length=2048 trainer.total_training_steps=5
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable
  'trainer.logger=["console","file"]')
runs=()
for mode in "${modes[@]}"; do
  n=1
  while [ -e "$out/$mode-$n" ]; do n=$((n + 1)); done
  dir="$out/$mode-$n"
  mkdir -p "$dir"
  runs+=("$dir/metrics.jsonl")
  ray stop --force > /dev/null 2>&1 || true  # a run that failed may leave its cluster, which the next would refuse
  code=0
  VERL_FILE_LOGGER_PATH="$dir/metrics.jsonl" PYTHON=$PY timeout 1500 bash scripts/train.sh stapo qwen3_1.7b "${run[@]}" \
    trainer.v1.trainer_mode="stapo_${mode/colocate/colocate_async}" trainer.default_local_dir="$dir/checkpoints" \
    > "$dir/train.log" 2>&1 || code=$?
  echo "$code" > "$dir/exit_code"
  echo "$mode-$n: exit $code"
done
$PY -m stapo.checks.scale summary "${runs[@]}"
