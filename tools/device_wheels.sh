#!/usr/bin/env bash
# Builds a wheelhouse (.wheels/ at the project root) of the Python packages that the GPU
# machine lacks (hydra-core, omegaconf, antlr4 runtime, wandb and their dependencies; liger-kernel and torchao),
# for Python 3.12 on x86-64, so it can be carried to a machine with no network.
#   usage (from the project root):  bash tools/device_wheels.sh [extra packages...]
#   then carry [".wheels"] and, on the GPU machine, first run:
#   python3 -m pip install -q --no-index --find-links .wheels hydra-core wandb && python3 -m pip install -q --no-deps --no-build-isolation -e .
set -euo pipefail
out=${WHEELS_DIR:-.wheels}
mkdir -p "$out"
mkdir -p .git/info; grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
# antlr4-python3-runtime 4.9.x (needed by hydra-core 1.3) ships only as a source archive: build it here.
pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  --find-links "$out" -d "$out" "hydra-core==1.3.*" "omegaconf>=2.3" wandb "$@"
# The kernels extra (liger-kernel, torchao: bench_fair.py's levers table), without dependencies: theirs are torch and
# triton, which the GPU image has (downloading them would replace its CUDA build).
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any -d "$out" \
  "liger-kernel>=0.8,<0.9" "torchao>=0.18,<0.19"
# Liger 0.8.1 too: an A/B of releases under torch.compile (docs/results.md, kernel levers).
pip download -q --no-deps --only-binary=:all: --platform any -d "$out" "liger-kernel==0.8.1"
du -sh "$out"
