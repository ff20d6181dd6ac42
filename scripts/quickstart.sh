#!/usr/bin/env bash
# First run of the recipe, no downloads: a tiny Qwen3 trained from scratch on the package's synthetic math task.
#   bash scripts/quickstart.sh [OUT] [OPTION ...]      (OPTIONs: python -m stapo.quickstart --help)
# With a GPU: warm-up, then JustRL and STAPO through verl (vLLM + FSDP), evaluation, S2T statistics and plots.
# Without one: warm-up on the CPU and the S2T mask on the warmed-up model's own rollouts (no RL training).
# PYTHON selects the interpreter (default: python3). docs/quickstart.md describes the outputs.
set -euo pipefail
python=${PYTHON:-python3}
recipe='import importlib.util as u, sys; sys.exit(any(not u.find_spec(m) for m in ("stapo", "verl", "torch")))'
"$python" -c "$recipe" 2> /dev/null || { echo "error: PYTHON=$python: no Python with the recipe (stapo, verl, torch);" \
  "activate the environment of pip install -e . or set PYTHON to its python" >&2; exit 2; }
case "${1-}" in
  -h | --help)
    sed -n '2,6s/^# \{0,1\}//p' "$0"
    echo
    exec "$python" -m stapo.quickstart --help ;;
  -*) echo "error: the first argument is the output folder (default outputs/quickstart), not $1; options follow it:" \
        "bash scripts/quickstart.sh OUT $*" >&2
      exit 2 ;;
esac
out=${1:-outputs/quickstart}
shift $(($# > 0 ? 1 : 0))
if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    nvidia-smi -L 2>/dev/null | head -n 1 || true
    exec "$python" -m stapo.quickstart gpu --out "$out" "$@"
fi
exec "$python" -m stapo.quickstart cpu --out "$out" "$@"  # it says why it runs without a GPU, after checking the options
