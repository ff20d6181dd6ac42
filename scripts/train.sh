#!/usr/bin/env bash
# Train one method at one model size on this node (Ray starts locally), or on the Ray cluster in RAY_ADDRESS.
#   bash scripts/train.sh METHOD SIZE [HYDRA_OVERRIDE ...]
#   METHOD: stapo | justrl | grpo | entropy20        SIZE: qwen3_1.7b | qwen3_8b | qwen3_14b
# Example: bash scripts/train.sh stapo qwen3_8b trainer.nnodes=1 stapo.tau_p=0.001
set -euo pipefail
usage="usage: bash scripts/train.sh {stapo|justrl|grpo|entropy20} {qwen3_1.7b|qwen3_8b|qwen3_14b} [override ...]"
method=${1:?$usage}
size=${2:?$usage}
shift 2
case "$method" in stapo|justrl|grpo|entropy20) ;; *) echo "unknown method '$method'; $usage" >&2; exit 2 ;; esac
case "$size" in qwen3_1.7b|qwen3_8b|qwen3_14b) ;; *) echo "unknown size '$size'; $usage" >&2; exit 2 ;; esac
exec python3 -m stapo.train --config-name="$method" size="$size" "$@"
