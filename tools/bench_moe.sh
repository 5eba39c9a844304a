#!/usr/bin/env bash
# Issue 19's benchmarks on ONE H200 (141 GB HBM, 128 GiB host), about 12 minutes of wall time in all:
#   moe_train (a, ~6 min): Qwen3-30B-A3B shape, 4 of its 48 layers (3.1B parameters, 0.85B active per token),
#      sequence 4096, 8 x 4096 tokens per step, optimizer step included, 40 GiB GPU cap, one bench_train
#      invocation: layer-major (compiled, root on the GPU) vs the on-device ceiling (uncapped: 16 B/param of model
#      states alone exceed 40 GiB at 4 layers) vs FSDP2 offload (compiled) vs DeepSpeed ZeRO-3 offload.
#   moe_infer (b, ~4 min): Mixtral-8x7B shape generation, 16 of its 32 layers (23.5B parameters, 47 GB in bf16:
#      twice the budget; the whole model, 93 GB, fits the host but these two contenders would take ~8 minutes
#      on it), 24 GiB budget, prompt 512, generate 32: layer-major vs accelerate offload.
#   llama3 (c, ~2 min): Llama-3-8B shape training, 8 layers, the LLaMA-2-7B table
#      (bench/results/house_root_on_device_llama7b_L8_b8_cap40.json): the on-device ceiling (uncapped: 2.8B
#      parameters x 16 B exceed 40 GiB) vs layer-major compiled with the root on the GPU, 8 x 4096 tokens, 40 GiB cap.
#   llama2 (c, ~1.5 min, optional): the LLaMA-2-7B pair again on the same machine (skipped when over the budget).
#
#   usage: FSL_COMMIT=<commit> bash tools/bench_moe.sh OUT_DIR [PART...]   (default: all four, in this order)
# One device command may run 600 s: run it as two, e.g.
#   bash tools/bench_moe.sh "$OUT" moe_train          and then
#   bash tools/bench_moe.sh "$OUT" moe_infer llama3 llama2
# Records: OUT_DIR/<name>.json (tools/harness.py's header, "commit" from $FSL_COMMIT: the GPU machine's copy of the
# tree has no .git; written after every contender), logs OUT_DIR/<part>.log, wall times OUT_DIR/bench_moe_times.txt.
# Carry .wheels (tools/device_wheels.sh: hydra, wandb, pydantic) and .whl (tools/build_deepspeed_wheels.sh:
# DeepSpeed 0.19.8, hjson); accelerate is in the GPU image. An optional part is skipped when this call's elapsed
# time plus its estimate exceeds FSL_BENCH_BUDGET_S (default 570: a 600 s command). FSL_MOE_INFER_LAYERS
# (default 16) sets moe_infer's depth. FSL_BENCH_DRY_RUN=1 prints the commands instead (no installs, no GPU).
set -uo pipefail
source "$(dirname "$0")/bench_lib.sh"
bench_start "bench_moe.sh OUT_DIR [moe_train] [moe_infer] [llama3] [llama2]" "moe_train moe_infer llama3 llama2" \
  bench_moe_times.txt "$@"
bench_install deepspeed
[ "$dry" = 1 ] || python3 -c "import deepspeed, accelerate; print('deepspeed', deepspeed.__version__, 'accelerate', \
  accelerate.__version__)"
infer_layers=${FSL_MOE_INFER_LAYERS:-16}

part() {  # part KEY NAME ESTIMATE_S REQUIRED(1|0) COMMAND...: bench_run with the record's --name
  local key=$1 name=$2 estimate=$3 required=$4
  shift 4
  bench_run "$key" "$name" "$estimate" "$required" "$@" --name "$name"
}

# a) MoE training. Micro-batch 2 is every contender's largest that fits: at 4 x 4096 tokens the fp32 logits, their
# log-softmax and gradient over the 151,936-token vocabulary alone take ~25 GB. DeepSpeed last (its CPU Adam is
# JIT-built first), so that a run cut short keeps the others (each contender's row is written when it ends).
part moe_train moe_qwen3_30b_a3b_L4_s4096_b8_cap40 360 1 \
  python3 tools/bench_train.py --model qwen3_30b_a3b --layers 4 --seq-len 4096 --max-gpu-memory-gib 40 --compile \
    --contender speedloader-overlap:2x4:root=device --contender ondevice:2x4:cap=none --contender fsdp2-offload:2x4 \
    --contender deepspeed-offload:2x4 --steps 3 --warmup 1 --timeout 240

# b) MoE generation.
part moe_infer "infer_mixtral_8x7b_L${infer_layers}_p512_g32_24g" 225 1 \
  python3 tools/bench_infer.py --model mixtral_8x7b --layers "$infer_layers" --gpu-memory-gib 24 --prompt-len 512 \
    --gen-len 32 --contender speedloader:128x8 --contender accelerate:16 --timeout 270

# c) Dense: Llama-3-8B against its ceiling, then (time permitting) LLaMA-2-7B's pair again on the same machine.
part llama3 llama3_8b_L8_s4096_b8_cap40 120 1 \
  python3 tools/bench_train.py --model llama3_8b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 --compile \
    --contender ondevice:2x4:cap=none --contender speedloader-overlap:2x4:root=device --steps 3 --warmup 1 --timeout 150
part llama2 llama2_7b_L8_s4096_b8_cap40 100 0 \
  python3 tools/bench_train.py --model llama2_7b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 --compile \
    --contender ondevice:2x4 --contender speedloader-overlap:2x4:root=device --steps 3 --warmup 1 --timeout 120

echo "total ${SECONDS} s" | tee -a "$times"
