#!/usr/bin/env bash
# Issue 22's kernel levers on ONE H100/H200 (one device command, ~8 minutes): the 7B-width table of
# bench/results/keep_activations_llama7b_L8_b8_cap40.json (LLaMA-2-7B shape, 8 layers, 8 x 4096 tokens per step as
# 2 x 4, compiled blocks, 40 GiB GPU cap, optimizer step included; there each contender took ~45 s end to end),
# every contender in its own process (tools/bench_train.py):
#   levers (required, ~6 min): the on-device ceiling; layer-major, root on the GPU, keep_activations=24 (the best
#       layer-major row of that record: every pair kept, no recompute); the same with :sdpa=cudnn, :liger, :fp8.
#   best (optional, ~2.5 min): the levers that beat that baseline in `levers` (by tokens/s, read from its record),
#       all together, layer-major and on-device (the ceiling with the same kernels).
#   liger_ab (~4 min, not in the default): the baseline and :liger with the installed Liger (0.8.5 in .wheels),
#       then :liger with Liger 0.8.1, reinstalled from .wheels for that one invocation: Liger's RMSNorm kernels
#       from 0.8.2 on call .to() on `offset`, which torch.compile passes as a Python float, and Inductor's
#       analysis of the Triton kernel fails ("assuming every input is mutated"; the error text of
#       recompute_liger_llama7b_L8_b8_cap40.json), once the suspected cause of Liger's rows being slower there.
#       Measured (1ce4881, kernels_liger_ab_*.json): 0.8.5 +4.6% on this row, 0.8.1 +3.3% (over the first
#       invocation's baseline): not the cause.
#
#   usage: FSL_COMMIT=<commit> bash tools/bench_kernels.sh OUT_DIR [PART...]      (default: levers best)
# Records: OUT_DIR/kernels_llama7b_L8_b8_cap40.json and OUT_DIR/kernels_best_llama7b_L8_b8_cap40.json
# (tools/harness.py's header; rows written after every contender), logs OUT_DIR/<part>.log, wall times
# OUT_DIR/bench_kernels_times.txt.
# Carry .wheels (tools/device_wheels.sh liger-kernel torchao: hydra, wandb, and the two kernel wheels; triton is in
# the GPU image's torch). An optional part is skipped when this call's elapsed time plus its estimate exceeds
# FSL_BENCH_BUDGET_S (default 570: a 600 s command). FSL_BENCH_DRY_RUN=1 prints the commands instead.
set -uo pipefail
source "$(dirname "$0")/bench_lib.sh"
bench_start "bench_kernels.sh OUT_DIR [levers] [best] [liger_ab]" "levers best" bench_kernels_times.txt "$@"
bench_install kernels
levers=kernels_llama7b_L8_b8_cap40
best=kernels_best_llama7b_L8_b8_cap40
common=(--model llama2_7b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 --compile --steps 3 --warmup 1
        --timeout 150)
base=speedloader-overlap:2x4:root=device:keep=24

bench_run levers levers 360 1 python3 tools/bench_train.py "${common[@]}" --name "$levers" --contender ondevice:2x4 \
  --contender "$base" --contender "$base:sdpa=cudnn" --contender "$base:liger" --contender "$base:fp8"

# The levers whose row beat the baseline's tokens/s (all three in a dry run: no record to read).
if [[ "$parts" != *" best "* ]]; then
  winners=""
elif [ "$dry" = 1 ]; then
  winners=":sdpa=cudnn:liger:fp8"
else
  winners=$(python3 - "$out/$levers.json" "$base" <<'PY'
import json, sys
rows = {r["contender_spec"]: r for r in json.load(open(sys.argv[1]))["results"] if r.get("status") == "ok"}
base = rows.get(sys.argv[2])
if base:
    print("".join(s for s in (":sdpa=cudnn", ":liger", ":fp8")
                  if sys.argv[2] + s in rows and rows[sys.argv[2] + s]["tokens_per_s"] > base["tokens_per_s"]))
PY
  )
fi
if [[ "$parts" != *" best "* ]]; then
  :
elif [ -n "$winners" ]; then
  bench_run best best 150 0 python3 tools/bench_train.py "${common[@]}" --name "$best" --contender "$base$winners" \
    --contender "ondevice:2x4$winners"
else
  echo "best: no lever beat the baseline (or no levers record)" | tee -a "$times"
fi

# liger_ab: one record per Liger version (each record's "packages" names it).
bench_run liger_ab liger_ab/installed 150 1 python3 tools/bench_train.py "${common[@]}" \
  --name kernels_liger_ab_installed --contender "$base" --contender "$base:liger"
if [[ "$parts" == *" liger_ab "* && "$dry" != 1 ]]; then
  python3 -m pip install -q --no-index --no-deps --force-reinstall --find-links .wheels liger-kernel==0.8.1
fi
bench_run liger_ab liger_ab/0.8.1 100 1 python3 tools/bench_train.py "${common[@]}" --name kernels_liger_ab_0_8_1 \
  --contender "$base:liger"
if [[ "$parts" == *" liger_ab "* && "$dry" != 1 ]]; then  # back to the newest in .wheels
  python3 -m pip install -q --no-index --no-deps --force-reinstall --find-links .wheels "liger-kernel>=0.8,<0.9"
fi
