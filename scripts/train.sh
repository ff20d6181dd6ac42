#!/usr/bin/env bash
# Train one method at one model size on this node (Ray starts locally), or on the Ray cluster in RAY_ADDRESS.
#   bash scripts/train.sh METHOD SIZE [HYDRA_OVERRIDE ...]
# METHOD is a file of configs/ (stapo, justrl, grpo, entropy20; stapo_random, stapo_high_entropy), SIZE one of
# configs/size/ (qwen3_1.7b, ...);
# `bash scripts/train.sh --help` lists them and the stapo.* keys.
# Example: bash scripts/train.sh stapo qwen3_8b trainer.nnodes=1 stapo.tau_p=0.001
set -euo pipefail
python=${PYTHON:-python3}
recipe='import importlib.util as u, sys; sys.exit(any(not u.find_spec(m) for m in ("stapo", "verl", "torch")))'
"$python" -c "$recipe" 2> /dev/null || { echo "error: PYTHON=$python: no Python with the recipe (stapo, verl, torch);" \
  "activate the environment of pip install -e . or set PYTHON to its python" >&2; exit 2; }
if [ $# -ge 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then
  exec "$python" -m stapo.train --help
fi
if [ $# -eq 1 ]; then
  sizes=$(cd "$(dirname "$0")/../configs/size" 2>/dev/null && ls *.yaml | sed 's/\.yaml$//' | paste -sd' ')
  echo "error: SIZE is missing: bash scripts/train.sh $1 SIZE [KEY=VALUE ...], SIZE one of: ${sizes:-see --help}" >&2
  exit 2
fi
if [ $# -lt 2 ]; then
  "$python" -m stapo.train --help
  exit 2
fi
method=$1 size=$2
shift 2
exec "$python" -m stapo.train --config-name="$method" size="$size" "$@"
