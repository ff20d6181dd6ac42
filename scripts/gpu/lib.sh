# Sourced by the GPU scripts of this folder: their one option, --src FILE, and SmolLM2-135M converted from it.
take_src() {  # [--src FILE]: sets src=(--src FILE), or src=() without it; anything else ends the script with status 2
  src=()
  [ $# -eq 0 ] && return 0
  [ "$1" = --src ] && [ $# -eq 2 ] || { echo "error: $1: unknown option; the one option is --src FILE" >&2; exit 2; }
  [ -f "$2" ] || { echo "error: --src $2: no such file" >&2; exit 2; }
  src=(--src "$2")
}
needs_gpu() {  # one line and status 2 where nvidia-smi lists no GPU: before any download, conversion or Ray cluster
  # (grep reads all of it: grep -q would stop at the first GPU, and nvidia-smi writing on would die of SIGPIPE)
  nvidia-smi -L 2> /dev/null | grep '^GPU' > /dev/null || {
    echo "error: ${0##*/} needs an NVIDIA GPU, and nvidia-smi -L lists none here: run it on a GPU node" >&2
    exit 2
  }
}
out_and_model() {  # "$@" of a script run as `SCRIPT OUT [--src FILE]`: --help (the script's usage), the argument
  # count, then out=OUT, PY, and SmolLM2-135M converted into model=OUT/smollm2/raw
  case "${1:-}" in -h | --help) usage; exit 0 ;; esac
  [ $# -eq 1 ] || [ $# -eq 3 ] || { usage >&2; exit 2; }
  out=$1
  take_src "${@:2}"
  needs_gpu
  PY=${STAPO_PYTHON:-python}
  model="$out/smollm2/raw"
  smollm2 "$model"
}
smollm2() {  # FOLDER: SmolLM2-135M-Instruct in FOLDER (python -m stapo.tools.pretrained, from ${src[@]}), once
  [ -f "$1/config.json" ] || $PY -m stapo.tools.pretrained --out "$1" "${src[@]}"
}
engine_job() {  # DIR NAME COMMAND SETTING [OPTION ...]: python -m stapo.checks.batch_invariance COMMAND on $model (from
  # out_and_model) in a process of its own, 15 minutes at most; its record DIR/NAME.json, its log DIR/NAME.log
  timeout 900 $PY -m stapo.checks.batch_invariance "$3" --model "$model" --setting "$4" "${@:5}" \
    --out "$1/$2.json" > "$1/$2.log" 2>&1 || echo "$2: exit $?" >&2
}
engine_records() {  # DIR NAME ...: a line for each NAME without its record DIR/NAME.json, and status 1 if any
  local name code=0
  for name in "${@:2}"; do
    [ -f "$1/$name.json" ] || { echo "error: no $name record; see $1/$name.log" >&2; code=1; }
  done
  return $code
}
ladder() {  # OUT: the ladder's model, task and warm-up (docs/history.md, section 10) under OUT, once; sets warm, task
  needs_gpu
  warm="$1/smollm2-warm/step-300" task="$1/tasks/mixed"
  [ -f "$warm/config.json" ] && return 0
  smollm2 "$1/smollm2/raw"
  $PY -m stapo.quickstart.task word --difficulty 2 3 4 --out "$task" --train 5000 --val 200
  $PY -m stapo.quickstart.warmup --model "$1/smollm2/raw" --out "$1/smollm2-warm" --steps 300 \
    --exclude "$task/train.parquet" "$task/validation.parquet"
}
qwen_shape() {  # OUT TOKENIZER: a random Qwen3-1.7B with TOKENIZER's vocabulary in OUT/model and the word task in
  # OUT/word, once; sets run=(...), the overrides of a short one-GPU run on them (no validation, checkpoint or resume)
  [ -f "$2/tokenizer_config.json" ] || { echo "error: $2: no tokenizer_config.json; a tokenizer folder" >&2; exit 2; }
  needs_gpu
  mkdir -p "$1"
  [ -f "$1/model/config.json" ] || $PY -m stapo.checks.scale model --shape qwen3_1.7b --tokenizer "$2" \
    --out "$1/model" --device cuda
  [ -f "$1/word/train.parquet" ] || $PY -m stapo.quickstart.task word --out "$1/word" --train 512 --val 32
  run=(data.train_files="$1/word/train.parquet" data.val_files="$1/word/validation.parquet"
    actor_rollout_ref.model.path="$1/model" trainer.n_gpus_per_node=1 trainer.val_before_train=False
    trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable)
}
next_run() {  # OUT KIND: sets dir=OUT/KIND-N, N one more than the last KIND-N folder there
  local n=1
  while [ -e "$1/$2-$n" ]; do n=$((n + 1)); done
  dir="$1/$2-$n"
}
train_run() {  # DIR METHOD SIZE [OVERRIDE ...]: scripts/train.sh into DIR (its arguments in args.txt, one a line, which
  # python -m stapo.tools.cost measure composes; train.log, metrics.jsonl, exit_code), 25 minutes at most, after
  # stopping every Ray cluster on the machine (a run that failed may leave its cluster, which the next would refuse)
  local dir=$1
  shift
  set -- "$@" trainer.default_local_dir="$dir/checkpoints" 'trainer.logger=["console","file"]'
  mkdir -p "$dir"
  printf '%s\n' "$@" > "$dir/args.txt"
  ray stop --force > /dev/null 2>&1 || true
  local code=0
  VERL_FILE_LOGGER_PATH="$dir/metrics.jsonl" PYTHON=$PY timeout 1500 bash scripts/train.sh "$@" > "$dir/train.log" 2>&1 \
    || code=$?
  echo "$code" > "$dir/exit_code"
  echo "${dir##*/}: exit $code"
}
