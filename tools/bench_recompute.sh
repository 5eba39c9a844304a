#!/usr/bin/env bash
# Issue 22's recompute levers on ONE H100/H200, every contender in its own process (tools/bench_train.py), compiled
# blocks, optimizer step included. Parts, each one device command of at most ~9 minutes:
#   ceiling (~6 min): the 7B-width table (8 layers, 8 x 4096 tokens, 40 GiB cap; ~45 s a contender in
#       bench/results/keep_activations_llama7b_L8_b8_cap40.json): the on-device ceiling with every block recomputed
#       (2 x 4) and without recompute (1 x 8: one sequence's activations at a time, ~4.3 GiB beside 30 GB of model
#       states), layer-major with the root on the GPU keeping 24 and 28 of 32 (unit, sub-batch) pairs (a pair holds
#       1.07 GiB at 2 sequences) and 56 of 64 at 1 x 8.
#   liger (~3 min): the same table's best rows with Liger's RMSNorm, SwiGLU and RoPE (+3.8% on layer-major in
#       kernels_llama7b_L8_b8_cap40.json): the ceiling without recompute at 2 x 4 and 1 x 8, layer-major 1 x 8
#       keeping 56 of 64 pairs.
#   full (~7 min): full LLaMA-2-7B (32 layers), every model state on the host, activations on the GPU: the recorded
#       configuration (3 x 8 under a 40 GiB cap, 46.6% MFU in train_llama2_7b_full_1gpu_compiled.json), then 2 x 4
#       uncapped keeping as many of its 128 pairs as the card holds, K = (card GiB - 19) / 1.07 (8 sequences'
#       boundaries, ~8.3 GiB, plus ~5 GiB of buffers and ~6 GiB of margin), alone and with Liger's kernels; 2 x 4
#       keeping none (optional: what the batch change alone does).
#
#   usage: FSL_COMMIT=<commit> bash tools/bench_recompute.sh OUT_DIR [PART...]      (default: ceiling)
# Records: OUT_DIR/recompute_llama7b_L8_b8_cap40.json and OUT_DIR/recompute_llama2_7b_full_1gpu.json (their optional
# rows: ..._2x4.json and ..._keep0.json; tools/harness.py's header; rows written after every contender), logs
# OUT_DIR/<part>.log, wall times OUT_DIR/bench_recompute_times.txt.
# Carry .wheels (tools/device_wheels.sh liger-kernel torchao). An optional step is skipped when this call's elapsed
# time plus its estimate exceeds FSL_BENCH_BUDGET_S (default 570). FSL_BENCH_DRY_RUN=1 prints the commands instead.
set -uo pipefail
out=${1:?usage: FSL_COMMIT=<commit> bash tools/bench_recompute.sh OUT_DIR [ceiling] [liger] [full]}
shift
parts=" ${*:-ceiling} "
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export FSL_COMMIT=${FSL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=${FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB:-120}
budget=${FSL_BENCH_BUDGET_S:-570}
dry=${FSL_BENCH_DRY_RUN:-0}
echo "commit $FSL_COMMIT, parts:$parts" | tee -a "$out/bench_recompute_times.txt"

card_gib=80
[ "$dry" = 1 ] || {
python3 -c "import hydra, wandb" 2>/dev/null \
  || python3 -m pip install -q --no-index --find-links .wheels hydra-core wandb
python3 -c "import liger_kernel, torchao" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --find-links .wheels liger-kernel torchao || echo "liger-kernel/torchao not installed: their rows will say so"
python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
card_gib=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))")
ulimit -l unlimited 2>/dev/null || true
}
keep_full=$(( (card_gib - 19) * 100 / 107 ))
[ "$keep_full" -gt 128 ] && keep_full=128

run() {  # run PART STEP ESTIMATE_S REQUIRED(1|0) COMMAND...: an optional step is skipped when over the budget
  local key=$1 step=$2 estimate=$3 required=$4; shift 4
  [[ "$parts" == *" $key "* ]] || return 0
  if [ "$required" = 0 ] && [ $((SECONDS + estimate)) -gt "$budget" ]; then
    echo "$key/$step: skipped (${SECONDS} s elapsed + ~${estimate} s > ${budget} s budget)" \
      | tee -a "$out/bench_recompute_times.txt"
    return 0
  fi
  if [ "$dry" = 1 ]; then
    echo "$* --out-dir $out"
    return 0
  fi
  local start=$SECONDS
  "$@" --out-dir "$out" 2>&1 | tee -a "$out/$key.log" | grep -v '^{' | tail -12
  echo "$key/$step: $((SECONDS - start)) s (estimate ${estimate} s), ${SECONDS} s elapsed" \
    | tee -a "$out/bench_recompute_times.txt"
}

layers8=(--model llama2_7b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 --compile --steps 3 --warmup 1
         --timeout 150)
run ceiling table 330 1 python3 tools/bench_train.py "${layers8[@]}" --name recompute_llama7b_L8_b8_cap40 \
  --contender ondevice:2x4 --contender ondevice:1x8:recompute=off \
  --contender speedloader-overlap:2x4:root=device:keep=24 --contender speedloader-overlap:2x4:root=device:keep=28 \
  --contender speedloader-overlap:1x8:root=device:keep=56
run ceiling more 100 0 python3 tools/bench_train.py "${layers8[@]}" --name recompute_llama7b_L8_b8_cap40_2x4 \
  --contender ondevice:2x4:recompute=off

run liger table 160 0 python3 tools/bench_train.py "${layers8[@]}" --name recompute_liger_llama7b_L8_b8_cap40 \
  --contender ondevice:2x4:recompute=off:liger --contender ondevice:1x8:recompute=off:liger \
  --contender speedloader-overlap:1x8:root=device:keep=56:liger

full=(--model llama2_7b --layers 32 --seq-len 4096 --activation-store device --compile --steps 2 --warmup 1
      --timeout 240)
run full keep 330 1 python3 tools/bench_train.py "${full[@]}" --name recompute_llama2_7b_full_1gpu \
  --contender speedloader-overlap:3x8:cap=40 \
  --contender "speedloader-overlap:2x4:cap=none:keep=$keep_full" \
  --contender "speedloader-overlap:2x4:cap=none:keep=$keep_full:liger"
run full none 100 0 python3 tools/bench_train.py "${full[@]}" --name recompute_llama2_7b_full_1gpu_keep0 \
  --contender speedloader-overlap:2x4:cap=none
