#!/usr/bin/env bash
# The GPU checks, as run on the GPU machine: every `gpu`-marked test, then (optionally) a benchmark.
#   usage: bash tools/gpu_suite.sh OUT_DIR [pytest args...]
# Installs the carried wheels (.wheels/, from tools/device_wheels.sh): hydra and wandb when hydra is missing, and the
# kernels extra.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [pytest args]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FSL_RECORD_DIR="$out"
source "$(dirname "$0")/bench_lib.sh" && bench_bytecode_cache  # each test process imports torch
# The GPU machine's MemTotal starts small and grows with use: give the arena the real budget.
export FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=${FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB:-120}
python3 -c "import hydra" 2>/dev/null || python3 -m pip install -q --no-index --find-links .wheels hydra-core wandb
# The kernels extra (Liger, torchao), without dependencies (theirs are the image's torch and triton), so that the
# kernel tests run instead of skipping; where .wheels lacks them, they skip and say so.
python3 -m pip install -q --no-index --no-deps --find-links .wheels "liger-kernel>=0.8,<0.9" "torchao>=0.18,<0.19" \
  2>/dev/null || echo "gpu_suite: liger-kernel/torchao not in .wheels (tools/device_wheels.sh): the kernel tests skip"
python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
ulimit -l unlimited 2>/dev/null || true
python3 -m pytest -q -m gpu -p no:cacheprovider -rfs "$@" 2>&1 | tee "$out/pytest_gpu.log" | tail -30
