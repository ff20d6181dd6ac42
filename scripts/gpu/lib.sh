# Sourced by the GPU scripts of this folder: their one option, --src FILE, and SmolLM2-135M converted from it.
take_src() {  # [--src FILE]: sets src=(--src FILE), or src=() without it; anything else ends the script with status 2
  src=()
  [ $# -eq 0 ] && return 0
  [ "$1" = --src ] && [ $# -eq 2 ] || { echo "error: $1: unknown option; the one option is --src FILE" >&2; exit 2; }
  [ -f "$2" ] || { echo "error: --src $2: no such file" >&2; exit 2; }
  src=(--src "$2")
}
smollm2() {  # FOLDER: SmolLM2-135M-Instruct in FOLDER (python -m stapo.tools.pretrained, from ${src[@]}), once
  [ -f "$1/config.json" ] || $PY -m stapo.tools.pretrained --out "$1" "${src[@]}"
}
