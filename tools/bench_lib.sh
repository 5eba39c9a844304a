# What the device benchmark scripts share (tools/bench_slow_link.sh; the tables of one GPU are tools/bench_fair.py's),
# sourced first thing (`source "$(dirname "$0")/bench_lib.sh"`):
#   bench_start USAGE DEFAULT_PARTS TIMES_FILE "$@"
#                                the script's arguments (OUT_DIR [PART...]: sets `out` and `parts`), the repository
#                                root as working directory, then bench_init
#   bench_init TIMES_FILE        the environment every run wants, the budget, the dry-run flag and the commit line
#   bench_bytecode_cache         Python's bytecode written under /tmp (the GPU machine's image writes none)
#   bench_install [deepspeed] [kernels]
#                                the carried wheels (.wheels: hydra, wandb, liger-kernel, torchao; .whl: DeepSpeed
#                                0.19.8 and hjson), the project itself, the machine's lines; nothing in a dry run
#   bench_run PART LABEL ESTIMATE_S REQUIRED(1|0) COMMAND...
#                                COMMAND --out-dir OUT_DIR if PART was asked for; an optional one (REQUIRED 0) is
#                                skipped when this call's elapsed time plus ESTIMATE_S exceeds FSL_BENCH_BUDGET_S
#                                (default 570: a 600 s device command); its output goes to OUT_DIR/PART.log, a
#                                line with its wall time to the times file; FSL_BENCH_DRY_RUN=1 prints it instead
# FSL_COMMIT names the commit in every record (the GPU machine's copy of the tree has no .git).

bench_start() {
  local usage=$1 default_parts=$2 times_file=$3
  shift 3
  out=${1:?usage: FSL_COMMIT=<commit> bash tools/$usage}
  shift
  parts=" ${*:-$default_parts} "
  out=$(mkdir -p "$out" && cd "$out" && pwd)  # absolute: the scripts run from the repository root
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  bench_init "$times_file"
}

bench_init() {
  times="$out/$1"
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  bench_bytecode_cache
  export FSL_COMMIT=${FSL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  # The GPU machine's MemTotal starts small and grows with use: give the arena the real budget.
  export FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=${FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB:-120}
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/fsl_torch_extensions}  # DeepSpeed's JIT ops, built once
  budget=${FSL_BENCH_BUDGET_S:-570}
  dry=${FSL_BENCH_DRY_RUN:-0}
  echo "commit $FSL_COMMIT, parts:$parts" | tee -a "$times"
}

# The GPU machine's image sets PYTHONDONTWRITEBYTECODE=1 and ships no bytecode, so every worker process compiled
# torch and transformers from source (docs/benchmarking.md): keep their bytecode under /tmp instead.
bench_bytecode_cache() {
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/fsl_pycache}
}

bench_install() {
  [ "$dry" = 1 ] && return 0
  python3 -c "import hydra, wandb" 2>/dev/null \
    || python3 -m pip install -q --no-index --find-links .wheels hydra-core wandb
  if [[ " $* " == *" deepspeed "* ]]; then
    python3 -c "import deepspeed" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --find-links .whl --find-links .wheels deepspeed==0.19.8 hjson pydantic pydantic-core annotated-types \
      typing-inspection typing-extensions || echo "deepspeed not installed: its rows will say so"
  fi
  if [[ " $* " == *" kernels "* ]]; then
    python3 -c "import liger_kernel, torchao" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
      --find-links .wheels liger-kernel torchao || echo "liger-kernel/torchao not installed: their rows will say so"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e .
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  ulimit -l unlimited 2>/dev/null || true
}

bench_run() {
  local key=$1 label=$2 estimate=$3 required=$4
  shift 4
  [[ "$parts" == *" $key "* ]] || return 0
  if [ "$required" = 0 ] && [ $((SECONDS + estimate)) -gt "$budget" ]; then
    echo "$label: skipped (${SECONDS} s elapsed + ~${estimate} s > ${budget} s budget)" | tee -a "$times"
    return 0
  fi
  if [ "$dry" = 1 ]; then
    echo "$* --out-dir $out"
    return 0
  fi
  local start=$SECONDS
  "$@" --out-dir "$out" 2>&1 | tee -a "$out/$key.log" | grep -v '^{' | tail -12
  echo "$label: $((SECONDS - start)) s (estimate ${estimate} s), ${SECONDS} s elapsed" | tee -a "$times"
}
