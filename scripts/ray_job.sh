#!/usr/bin/env bash
# Submit a training run to a running Ray cluster, from any machine that reaches its dashboard (port 8265).
#   RAY_ADDRESS=http://HEAD_IP:8265 bash scripts/ray_job.sh METHOD SIZE [HYDRA_OVERRIDE ...]
# The job runs `python3 -m stapo.train` on the head, so every node needs this package installed (pip install -e .,
# or the docker/Dockerfile image), not this checkout; relative paths in overrides resolve on the head.
# With the image (docs/container.md): start Ray on each node inside it (`ray start` as the image's command, with the
# host's network, or scripts/slurm.sbatch with STAPO_CONTAINER), and jobs run in it. This script runs from a checkout
# with `ray` installed, or from the image itself (its WORKDIR is the checkout):
#   docker run --rm --network host -e RAY_ADDRESS stapo-verl bash scripts/ray_job.sh METHOD SIZE
# Auth: a head started with RAY_AUTH_MODE=disabled needs nothing here; one that uses Ray's token auth needs
# RAY_AUTH_MODE=token here too, with the same token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN).
# A run longer than its job (docs/scale.md): SIGUSR1 or SIGTERM to this script stops the job with `ray job stop`,
# which sends the training SIGTERM: it saves at the end of its step and exits. This script then exits with status 3,
# as the training does after a save before its deadline ("saved, run me again"). STAPO_STOP_WAIT_S=3600: how long Ray
# lets the stopped job save before it kills it (the job's RAY_JOB_STOP_WAIT_TIME_S; Ray's default is 3 s).
set -euo pipefail
configs=$(dirname "$0")/../configs
names() { ls "$1" | sed -n 's/\.yaml$//p' | grep -vx base | paste -sd'|'; }  # config files -> a|b|c
usage="usage: RAY_ADDRESS=http://HEAD_IP:8265 bash scripts/ray_job.sh METHOD SIZE [override ...]  \
(METHOD: $(names "$configs"); SIZE: $(names "$configs/size"); see python3 -m stapo.train --help)"
case ${1-} in -h|--help) echo "$usage"; exit 0 ;; esac
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
if [ "$1" = base ] || [ ! -f "$configs/$1.yaml" ]; then
  echo "error: unknown method '$1'; choose one of: $(names "$configs" | sed 's/|/, /g')" >&2; exit 2
fi
[ -f "$configs/size/$2.yaml" ] \
  || { echo "error: unknown size '$2'; choose one of: $(names "$configs/size" | sed 's/|/, /g')" >&2; exit 2; }
method=$1 size=$2
shift 2
if [ -z "${RAY_ADDRESS-}" ]; then
  echo "error: RAY_ADDRESS is not set: set RAY_ADDRESS=http://HEAD:8265, the dashboard address of the Ray cluster" >&2
  exit 2
fi
# Check the dashboard first: `ray job submit` answers a wrong or dead address with a long urllib3 traceback.
python3 - "$RAY_ADDRESS" <<'EOF' || exit 2
import os, sys, urllib.error, urllib.request
address = sys.argv[1]
hint = "RAY_ADDRESS must be the dashboard address of a running Ray cluster, http://HEAD:8265"
if not address.startswith(("http://", "https://")):
    sys.exit(f"error: RAY_ADDRESS={address}: {hint}")
try:
    urllib.request.urlopen(address.rstrip("/") + "/api/version", timeout=10)
except urllib.error.HTTPError as error:
    if error.code in (401, 403) and os.environ.get("RAY_AUTH_MODE") != "token":
        sys.exit(f"error: the Ray cluster at {address} uses token auth: export RAY_AUTH_MODE=token and its token "
                 "(~/.ray/auth_token or RAY_AUTH_TOKEN)")
    if error.code not in (401, 403):
        sys.exit(f"error: RAY_ADDRESS={address} answered HTTP {error.code}, not a Ray dashboard: {hint}")
except Exception as error:
    sys.exit(f"error: no Ray dashboard answers at RAY_ADDRESS={address} ({getattr(error, 'reason', error)}): {hint}")
EOF
# The job's runtime env sets only RAY_JOB_STOP_WAIT_TIME_S: the recipe's configs give ray.init a runtime env
# (VERL_USE_EXTERNAL_MODULES, the audit and logger paths), and Ray 2.60 refuses a driver's runtime env that repeats an
# env var or another key of the job's ("Failed to merge the Job's runtime env"), which stopped every job this script
# submitted when both named the same variables (found by gpu_smoke --nodes 2, 2026-11-27).
id=stapo-$(date +%Y%m%d-%H%M%S)-$$
wait_s=${STAPO_STOP_WAIT_S:-3600}
[[ $wait_s =~ ^[0-9]+$ ]] || { echo "error: STAPO_STOP_WAIT_S=$wait_s: give whole seconds" >&2; exit 2; }
ray job submit --address="$RAY_ADDRESS" --submission-id="$id" \
  --runtime-env-json="{\"env_vars\": {\"RAY_JOB_STOP_WAIT_TIME_S\": \"$wait_s\"}}" -- \
  python3 -m stapo.train --config-name="$method" size="$size" "$@" &
client=$!
stop() {  # SIGNAL: ask the job to save and stop; bash runs a trap between commands, hence the background client
  echo "stapo: $1 received; stopping job $id: the training saves at the end of its step"
  ray job stop --address="$RAY_ADDRESS" --no-wait "$id" >/dev/null || echo "stapo: ray job stop $id failed" >&2
}
trap 'stop USR1' USR1
trap 'stop TERM' TERM
while kill -0 "$client" 2>/dev/null; do wait "$client" || true; done  # a trapped signal ends a wait early
wait "$client" && rc=0 || rc=$?
# Ray reports a job stopped on request as STOPPED and one that exited non-zero as FAILED, not its exit status: the
# training's own line tells a save before the deadline or on a signal
if ray job logs --address="$RAY_ADDRESS" "$id" 2>/dev/null | grep '^STAPO: saved step ' >/dev/null; then  # all of it
  exit 3
fi
exit "$rc"
