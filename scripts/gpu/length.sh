#!/usr/bin/env bash
# The Qwen3-1.7B shape at the paper's response length on one GPU, and vLLM alone on the same work (docs/scale.md):
#   bash scripts/gpu/length.sh OUT TOKENIZER [LENGTH [PROMPTS]]
# TOKENIZER: a tokenizer folder with Qwen's vocabulary (stapo.quickstart.tiny.build_qwen_tokenizer). OUT gets a random
# model of the shape, the word task and OUT/sync-N: one STAPO run in verl's synchronous trainer, PROMPTS prompts
# (default 2) x 8 responses of up to LENGTH tokens (default 15,360, the paper's limit; a random model writes to it),
# two PPO mini-batches, 3 steps, with its args.txt, train.log, metrics.jsonl and exit_code. Then OUT/vllm: standalone
# vLLM on as many prompts, samples and tokens at the run's memory share (python -m stapo.checks.benchmark vllm: a
# first call and two timed ones), and the run's per-step summary (phases, tokens/s, MFU, peak memory). The paper's
# 256 prompts a step do not fit one GPU. It stops every Ray cluster on the machine first: run it alone, detached.
set -euo pipefail
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h | --help) usage; exit 0 ;; esac
[ $# -ge 2 ] && [ $# -le 4 ] || { usage >&2; exit 2; }
out=$(realpath -m "$1") tok=$(realpath -m "$2") length=${3:-15360} prompts=${4:-2}
for value in "$length" "$prompts"; do
  [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "error: LENGTH and PROMPTS are positive whole numbers, not $value" >&2; exit 2; }
done
[ $((prompts % 2)) -eq 0 ] || { echo "error: PROMPTS=$prompts: an even number (two PPO mini-batches)" >&2; exit 2; }
PY=${STAPO_PYTHON:-python3}
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
qwen_shape "$out" "$tok"
next_run "$out" sync
train_run "$dir" stapo qwen3_1.7b "${run[@]}" data.train_batch_size="$prompts" \
  actor_rollout_ref.actor.ppo_mini_batch_size=$((prompts / 2)) data.max_response_length="$length" \
  trainer.total_training_steps=3
share=$($PY -c 'from stapo.checks.benchmark import rollout_config as r; print(r(["size=qwen3_1.7b"]).gpu_memory_utilization)')
$PY -m stapo.checks.benchmark vllm --model "$out/model" --data "$out/word/train.parquet" --prompts "$prompts" --n 8 \
  --response-length "$length" --repeats 2 --gpu-memory-utilization "$share" --out "$out/vllm"
$PY -m stapo.checks.scale summary "$dir/metrics.jsonl"
