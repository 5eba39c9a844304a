#!/usr/bin/env bash
# Issue 21's generation benchmarks on ONE H200 (128 GiB host), 24 GiB GPU budget for every contender, prompt 512,
# generate 32, dummy weights, every contender in its own process (tools/bench_infer.py). Parts, each one device
# command of at most ~9 minutes (estimates from bench/results/infer_opt30b_24g*.json: a bf16 OPT-30B speedloader
# contender took 227 s end to end, 46 s of it generating; FlexGen 189 s; accelerate 358 s):
#
#   core (~5 min, the default):
#     llama70b  LLaMA-2-70B shape, int4 weights (g64, 38.5 GB packed: the bf16 model, 138 GB, exceeds the host),
#               the whole KV cache on the GPU in int8: speedloader 192 x 16 (103 s end to end on one H100, 9fa67a3:
#               bench/results/infer_llama2_70b_int4_device_kv8_p512_g32_24g.json)
#   opt30b (~9 min): OPT-30B, ONE invocation: speedloader int4 weights + int8 KV, 128 x 4 (~90 s), FlexGen
#               0.1.8 with its OPT-30B policy (~190 s), DeepSpeed ZeRO-Inference 4-bit (fp16, group 64) at 16
#               sequences (~220 s?, a guess). Its own device command.
#   zero (~3 min): ZeRO-Inference 4-bit on the LLaMA-2-70B shape at 64 sequences appended to its record (123 s
#               on one H100; its largest batch under 24 GiB)
#   more (~9 min): OPT-30B speedloader bf16 weights (over 270 s on one H200: cut there before printing, d4a8997),
#               then int8 weights if the budget allows, in the int4 row's shape, appended to the OPT-30B record
#   ratio (~5 min): int4 vs bf16 weights on OPT-30B in ONE invocation: bf16 in its shape above (133 s on one H200,
#               62.5 tokens/s, c748422), then int4 weights with the whole int8 cache on the GPU at 56 sequences in 8
#               sub-batches and 48 in 4 (19.5 and 16.7 GiB of cache; no cache crosses the link, only the 16.6 GB of
#               packed weights a step), and 56 x 8 again with the prefill dequantizing per linear
#               (weight_dequantize='linear': what 'auto' picks when a whole unit would not fit). A decoding step with
#               the whole cache on the GPU runs the batch as one group, each linear dequantized when it runs (one
#               fused kernel each since session 21), so the sub-batches only split the prefill's activations. 60 x 10
#               ran out of memory in a decoding step's attention (e051158: one layer's int8 keys and values widened
#               to bf16 for 60 sequences, 842 MiB, beside 20.9 GiB of cache).
#   accelerate (~6 min, optional): OPT-30B accelerate:16 appended (its last row: 2.5 tokens/s, 358 s)
#
#   usage: FSL_COMMIT=<commit> bash tools/bench_quant.sh OUT_DIR [PART...]       (default: core)
#   e.g. four device commands:  bash tools/bench_quant.sh "$OUT" core ; ... opt30b ; ... zero ; ... more
# Records: OUT_DIR/infer_llama2_70b_int4_device_kv8_p512_g32_24g.json and OUT_DIR/infer_opt30b_quant_p512_g32_24g.json
# (tools/harness.py's header; a part appends its rows with --append), logs OUT_DIR/<part>.log, wall times
# OUT_DIR/bench_quant_times.txt. Carry .wheels (tools/device_wheels.sh) and .whl (FlexGen's wheel, `pip download
# flexgen==0.1.8 --no-deps -d .whl`; DeepSpeed 0.19.8 and hjson: tools/build_deepspeed_wheels.sh). The quantized
# path itself needs no wheel: its formats and kernels are PyTorch's (docs/generation.md). A part's second step is
# skipped when this call's elapsed time plus its estimate exceeds FSL_BENCH_BUDGET_S (default 570); rows are
# written after every contender, so a command cut short keeps what finished. FSL_BENCH_DRY_RUN=1 prints the
# commands instead.
set -uo pipefail
# The budget of the 72.4 tokens/s run (infer_opt30b_24g_same_run.json); the machine's MemTotal starts small.
export FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB=${FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB:-125}
source "$(dirname "$0")/bench_lib.sh"
bench_start "bench_quant.sh OUT_DIR [core] [opt30b] [zero] [more] [ratio] [accelerate]" "core" bench_quant_times.txt "$@"
if [[ "$parts" == *" zero "* || "$parts" == *" opt30b "* ]]; then
  bench_install deepspeed
else
  bench_install
fi
opt=infer_opt30b_quant_p512_g32_24g
llama=infer_llama2_70b_int4_device_kv8_p512_g32_24g
common=(--gpu-memory-gib 24 --prompt-len 512 --gen-len 32)

# core: LLaMA-2-70B int4 (the row that could not run before); opt30b: OPT-30B int4, FlexGen and ZeRO-Inference.
# 192 x 16: the whole cache (17.3 GB in int8) on the GPU, so a decoding step runs the batch as one group per layer;
# per decoding step the link carries 38.5 GB of packed weights. (256 x 16 with a split cache, f922d2f: 36.5 tokens/s.)
bench_run core core/llama70b 150 1 python3 tools/bench_infer.py --model llama2_70b \
  "${common[@]}" --name "$llama" --timeout 300 \
  --contender speedloader:192x16:device:w=int4:kvq=int8
# 128 x 4: n = 32, 1 sub-batch's cache (32 sequences, 12 GB in int8) on the GPU, 3 copied from the host in int8 each
# step (36.5 GB, with 16.6 GB of packed weights: ~1.05 s at the link's rate), no CPU attention (int8 codes attended on
# the host ran at ~5 GB/s): 99.2 tokens/s, 90 s end to end on one H100 (00e0eb7). The earlier 208 x 16 with 9
# sub-batches attended on the CPU gave no output within 270 s.
bench_run opt30b opt30b/opt30b 300 1 python3 tools/bench_infer.py --model opt_30b \
  "${common[@]}" --name "$opt" --timeout 270 \
  --contender speedloader:128x4:split=1:w=int4:kvq=int8 --contender flexgen:32x2
# ZeRO-Inference's 4-bit weights (its KV offload needs a patched transformers: not carried) in the same record: the
# opt30b part's second step, so the three contenders share one invocation (~90 + 190 + 220 s).
bench_run opt30b opt30b/zero 220 0 python3 tools/bench_infer.py --model opt_30b "${common[@]}" --name "$opt" --append \
  --timeout 300 --contender zero-inference:16:q4

# zero: ZeRO-Inference on the LLaMA-2-70B shape (its largest batch under 24 GiB; 123 s on one H100).
bench_run zero zero/llama70b 320 1 python3 tools/bench_infer.py --model llama2_70b \
  "${common[@]}" --name "$llama" --append \
  --timeout 330 --contender zero-inference:64:q4

# more: OPT-30B in bf16 (59 GB of weights a step) and int8 weights (31 GB) in the int4 row's shape, 128 x 4 with one
# sub-batch's int8 cache on the GPU and three copied (36.5 GB a step): the int4 / bf16 ratio on one machine. (The
# earlier 208 x 16 with 9 sub-batches attended on the CPU over int8 codes gave no output within 270 s.)
bench_run more more/opt30b_bf16 400 1 python3 tools/bench_infer.py --model opt_30b \
  "${common[@]}" --name "$opt" --append \
  --timeout 420 --contender speedloader:128x4:split=1:kvq=int8
bench_run more more/opt30b_int8 170 0 python3 tools/bench_infer.py --model opt_30b \
  "${common[@]}" --name "$opt" --append \
  --timeout 270 --contender speedloader:128x4:split=1:w=int8:kvq=int8

# ratio: int4 / bf16 at each one's best shape, one invocation. bf16 at 128 x 4 streams 59.2 GB of weights and 35.4 GB
# of int8 cache a decoding step (1.88 s); int4 with the cache on the GPU streams 16.6 GB (0.36 s), so fewer sequences
# (what fits 24 GiB beside the cache) decode faster than 128 whose cache crosses the link.
bench_run ratio ratio/opt30b 450 1 python3 tools/bench_infer.py --model opt_30b \
  "${common[@]}" --name infer_opt30b_int4_vs_bf16_p512_g32_24g \
  --timeout 300 --contender speedloader:128x4:split=1:kvq=int8 --contender speedloader:56x8:device:w=int4:kvq=int8 \
  --contender speedloader:48x4:device:w=int4:kvq=int8 --contender speedloader:56x8:device:w=int4:kvq=int8:deq=linear

bench_run accelerate accelerate/opt30b 380 1 python3 tools/bench_infer.py --model opt_30b \
  "${common[@]}" --name "$opt" --append \
  --timeout 420 --contender accelerate:16
