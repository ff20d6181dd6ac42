#!/usr/bin/env bash
# Train one method at one model size on this node (Ray starts locally), or on the Ray cluster in RAY_ADDRESS.
#   bash scripts/train.sh METHOD SIZE [HYDRA_OVERRIDE ...]
# METHOD is a file of configs/ (stapo, justrl, grpo, entropy20), SIZE one of configs/size/ (qwen3_1.7b, ...);
# `bash scripts/train.sh --help` lists them and the stapo.* keys.
# Example: bash scripts/train.sh stapo qwen3_8b trainer.nnodes=1 stapo.tau_p=0.001
set -euo pipefail
python=${PYTHON:-python3}
if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  "$python" -m stapo.train --help
  [ $# -ge 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; } && exit 0
  exit 2
fi
method=$1 size=$2
shift 2
exec "$python" -m stapo.train --config-name="$method" size="$size" "$@"
