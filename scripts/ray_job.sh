#!/usr/bin/env bash
# Submit a training run to a running Ray cluster (every node must have this package installed, e.g. the
# docker/Dockerfile image). RAY_ADDRESS defaults to the local head's dashboard.
#   RAY_ADDRESS=http://HEAD_IP:8265 bash scripts/ray_job.sh METHOD SIZE [HYDRA_OVERRIDE ...]
set -euo pipefail
usage="usage: bash scripts/ray_job.sh METHOD SIZE [override ...]  (see scripts/train.sh)"
method=${1:?$usage}
size=${2:?$usage}
shift 2
exec ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" \
  --runtime-env-json='{"env_vars": {"VERL_USE_EXTERNAL_MODULES": "stapo.train.plugin"}}' \
  -- bash scripts/train.sh "$method" "$size" "$@"
