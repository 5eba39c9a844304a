#!/usr/bin/env bash
# Issue 22's recompute levers on ONE H100/H200, every contender in its own process (tools/bench_train.py), compiled
# blocks, optimizer step included. Parts, each one device command of at most ~9 minutes:
#   ceiling (~6 min): the 7B-width table (8 layers, 8 x 4096 tokens, 40 GiB cap; ~45 s a contender in
#       bench/results/keep_activations_llama7b_L8_b8_cap40.json): the on-device ceiling with every block recomputed
#       (2 x 4) and without recompute (1 x 8: one sequence's activations at a time, ~4.3 GiB beside 30 GB of model
#       states), layer-major with the root on the GPU keeping 24 and 28 of 32 (unit, sub-batch) pairs (a pair holds
#       1.07 GiB at 2 sequences) and 56 of 64 at 1 x 8.
#   cudnn (~3.5 min): cuDNN's attention (sdpa=cudnn) on the table's fastest rows, beside the ceiling without recompute
#       at 2 x 4 again (48.9% MFU in recompute_llama7b_L8_b8_cap40_2x4.json), all three in one invocation: the ceiling
#       without recompute with cuDNN, and layer-major 1 x 8 keeping 56 of 64 pairs with cuDNN.
#   gathered (~5 min, traced): the ceiling without recompute with its FSDP2 units gathered once per step
#       (schedule.reshard_after_forward=false) and one reduce-scatter per step (gradient_sync=last), at 1 x 8 and
#       2 x 4 (2 x 4 without them peaks at 39.8 of 40 GiB: the 3.2 GB of gathered bf16 weights may not fit), beside
#       both without them and layer-major 1 x 8 keeping 56 of 64 pairs; every row with one traced step (--profile).
#   tail (~4 min): layer-major 1 x 8's optimizer tail (61 ms a step in recompute_gathered_llama7b_L8_b8_cap40.json: the
#       last unit's CPU AdamW step, 58 ms, runs after the backward) moved to the GPU by keeping unit 1's states there
#       (offload.device_units=1, ~3 GiB), paid for with 6 or 8 fewer kept pairs (0.53 GiB each), beside keeping 56
#       with every unit offloaded and the gathered ceiling at 1 x 8, all in one invocation.
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
# Records: OUT_DIR/recompute_llama7b_L8_b8_cap40.json, OUT_DIR/recompute_cudnn_llama7b_L8_b8_cap40.json,
# OUT_DIR/recompute_gathered_llama7b_L8_b8_cap40.json, OUT_DIR/recompute_tail_llama7b_L8_b8_cap40.json and OUT_DIR/recompute_llama2_7b_full_1gpu.json (their optional
# rows: ..._2x4.json and ..._keep0.json; tools/harness.py's header; rows written after every contender), logs
# OUT_DIR/<part>.log, wall times OUT_DIR/bench_recompute_times.txt.
# Carry .wheels (tools/device_wheels.sh liger-kernel torchao). An optional step is skipped when this call's elapsed
# time plus its estimate exceeds FSL_BENCH_BUDGET_S (default 570). FSL_BENCH_DRY_RUN=1 prints the commands instead.
set -uo pipefail
source "$(dirname "$0")/bench_lib.sh"
bench_start "bench_recompute.sh OUT_DIR [ceiling] [cudnn] [gathered] [tail] [liger] [full]" "ceiling" bench_recompute_times.txt "$@"
bench_install kernels
card_gib=80  # a dry run's card
[ "$dry" = 1 ] \
  || card_gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
keep_full=$(( (card_gib - 19) * 100 / 107 ))
[ "$keep_full" -gt 128 ] && keep_full=128

layers8=(--model llama2_7b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 --compile --steps 3 --warmup 1
         --timeout 150)
bench_run ceiling ceiling/table 330 1 python3 tools/bench_train.py "${layers8[@]}" \
  --name recompute_llama7b_L8_b8_cap40 --contender ondevice:2x4 --contender ondevice:1x8:recompute=off \
  --contender speedloader-overlap:2x4:root=device:keep=24 --contender speedloader-overlap:2x4:root=device:keep=28 \
  --contender speedloader-overlap:1x8:root=device:keep=56
bench_run ceiling ceiling/more 100 0 python3 tools/bench_train.py "${layers8[@]}" \
  --name recompute_llama7b_L8_b8_cap40_2x4 --contender ondevice:2x4:recompute=off

bench_run cudnn cudnn/table 220 1 python3 tools/bench_train.py "${layers8[@]}" \
  --name recompute_cudnn_llama7b_L8_b8_cap40 --contender ondevice:2x4:recompute=off \
  --contender ondevice:2x4:recompute=off:sdpa=cudnn --contender speedloader-overlap:1x8:root=device:keep=56:sdpa=cudnn

bench_run gathered gathered/table 330 1 python3 tools/bench_train.py "${layers8[@]}" --profile \
  --name recompute_gathered_llama7b_L8_b8_cap40 --contender ondevice:1x8:recompute=off \
  --contender ondevice:1x8:recompute=off:sync=last:reshard=off --contender ondevice:2x4:recompute=off \
  --contender ondevice:2x4:recompute=off:sync=last:reshard=off --contender speedloader-overlap:1x8:root=device:keep=56

bench_run tail tail/table 240 1 python3 tools/bench_train.py "${layers8[@]}" \
  --name recompute_tail_llama7b_L8_b8_cap40 --contender ondevice:1x8:recompute=off:sync=last:reshard=off \
  --contender speedloader-overlap:1x8:root=device:keep=56 --contender speedloader-overlap:1x8:root=device:dev=1:keep=50 \
  --contender speedloader-overlap:1x8:root=device:dev=1:keep=48

bench_run liger liger/table 160 0 python3 tools/bench_train.py "${layers8[@]}" \
  --name recompute_liger_llama7b_L8_b8_cap40 --contender ondevice:2x4:recompute=off:liger \
  --contender ondevice:1x8:recompute=off:liger --contender speedloader-overlap:1x8:root=device:keep=56:liger

full=(--model llama2_7b --layers 32 --seq-len 4096 --activation-store device --compile --steps 2 --warmup 1
      --timeout 240)
bench_run full full/keep 330 1 python3 tools/bench_train.py "${full[@]}" --name recompute_llama2_7b_full_1gpu \
  --contender speedloader-overlap:3x8:cap=40 \
  --contender "speedloader-overlap:2x4:cap=none:keep=$keep_full" \
  --contender "speedloader-overlap:2x4:cap=none:keep=$keep_full:liger"
bench_run full full/none 100 0 python3 tools/bench_train.py "${full[@]}" --name recompute_llama2_7b_full_1gpu_keep0 \
  --contender speedloader-overlap:2x4:cap=none
