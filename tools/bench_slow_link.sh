#!/usr/bin/env bash
# Issue 43, item 1: two nodes over a slow link, on ONE machine with 2 GPUs (2 emulated nodes x 1 GPU). Each node's
# torchrun agent runs in its own network namespace; the two are joined by a veth pair shaped with tc to G Gbit/s
# each way (tools/slow_link.py), so every byte between the nodes crosses a link of known rate. Parts:
#   bw (~2.5 min): the link measured: NCCL all-reduce bus bandwidth, 1-256 MiB (tools/allreduce_bw.py), at 10 and
#       25 Gbit/s with NCCL's socket defaults, at 25 with 4 threads x 4 sockets per connection (what NCCL advises
#       for fast Ethernet), and at 1000 Gbit/s (the tbf far above what veth and NCCL's sockets carry: the path's
#       own ceiling on this machine). The link bytes each node sent are in every row: the traffic did cross it.
#   hsdp (~9 min): training at 10 Gbit/s, HSDP (dp_replicate=2: one replica per node; only gradients cross the
#       link), LLaMA-2-7B width, 4 layers, sequence 4096, 64 sequences per GPU per step (tools/bench_scale.py,
#       --ethernet 2x1): layer-major vs FSDP2 CPU offload vs DeepSpeed ZeRO-3 offload (DeepSpeed has no HSDP
#       with offloaded parameters: its ZeRO-3 shards over both nodes), each at several micro-batches of the same
#       effective batch, most important first (a run that no longer fits the budget is recorded as skipped).
#   fsdp (~9 min, not in the default): the same at 10 Gbit/s with the 1-D FSDP mesh (dp_replicate=1): the
#       parameters sharded over both nodes, every all-gather and reduce-scatter crossing the link (the paper's
#       setting: 3P per step for layer-major, 3NP for canonical accumulation over N micro-batches).
#   hsdp25 (~9 min, not in the default): hsdp at 25 Gbit/s.
#
#   usage: FSL_COMMIT=<commit> bash tools/bench_slow_link.sh OUT_DIR [PART...]    (default: bw hsdp)
# One device command may run 600 s: run the parts as separate commands, e.g.
#   bash tools/bench_slow_link.sh "$OUT" bw     then     bash tools/bench_slow_link.sh "$OUT" hsdp     (then fsdp)
# Records: OUT_DIR/slow_link_allreduce_<rate>.json,
#   OUT_DIR/slow_link_<mesh>_<rate>_<model>_L<layers>_s4096_<shape>[_cap<G>].json
# (+ .png), logs OUT_DIR/<part>.log, wall times OUT_DIR/bench_slow_link_times.txt.
# Needs root with CAP_NET_ADMIN, iproute2 (ip, tc), veth and sch_tbf; the first thing printed is which link the
# machine allows. FSL_LINK_MODES (default netns,lo,sockets) lists slow_link's modes to try, in order: lo (tc on
# loopback: the rate shared by both directions) and sockets (no tc: NCCL narrowed to one socket, rate measured
# only) are the fallbacks, each record's "link" says which one ran; FSL_LINK_MODES=netns refuses them.
# FSL_SLOW_LINK_SHAPE (default 2x32) and FSL_SLOW_LINK_CONTENDERS (comma-separated, tools/bench_scale.py's
# syntax) change the training parts' batch and contenders; FSL_SLOW_LINK_CAP_GIB caps every rank's GPU memory alike
# (bench_scale --max-gpu-memory-gib: the regime where the peers' best micro-batch is a small part of the batch;
# the record's name gets _capG); FSL_SLOW_LINK_STEPS / _WARMUP (default 5 / 2) the timed
# and warm-up steps; FSL_SLOW_LINK_INVOCATIONS (default 1) the invocations per command; FSL_SLOW_LINK_LAYERS (default
# 4) the model's layers (the record's name says L<layers>); FSL_SLOW_LINK_MODEL (default llama2_7b; any of
# tools/bench_scale.py's --model, e.g. llama2_13b: wider blocks, so the peers fit fewer sequences per micro-batch
# under a cap) its shapes (the record's name says which); FSL_SLOW_LINK_TIMEOUT (default 240 s) each contender's
# limit: under the cap a peer's step over 10 Gbit/s takes about 29 s at 4 layers (DeepSpeed 4 x 16 did not finish its
# 7 steps in 240 s at d239093), so a capped run with DeepSpeed wants 2 layers or a longer limit. A part run again with the
# same settings appends its invocations to the same record (the protocol's 3 over several device commands); its
# FSL_SLOW_LINK_CONTENDERS may name some of the record's contenders only (a slow peer in a command of its own).
# FSL_SLOW_LINK_GPUS_PER_NODE (default 1) gives each emulated node that many GPUs (a 4-GPU machine: 2 nodes x 2 GPUs,
# NVLink within a node, both GPUs of a node sharing its link; HSDP then shards over a node's GPUs and replicates
# across the link); the record's name gets _nodes2xG.
# NCCL_* variables set by the caller reach every run.
# Carry .wheels (tools/device_wheels.sh: hydra, wandb) and .whl (tools/build_deepspeed_wheels.sh: DeepSpeed), and
# .iproute2 (tools/fetch_iproute2.sh) for a machine without `ip`/`tc`: the lent 2-GPU H100 machine had neither on
# 2026-11-27, so every part fell back to the unshaped socket path (the records' "link" says so).
# FSL_BENCH_DRY_RUN=1 prints the commands instead (no installs, no GPU, no link).
set -uo pipefail
source "$(dirname "$0")/bench_lib.sh"
bench_start "bench_slow_link.sh OUT_DIR [bw] [hsdp] [fsdp] [hsdp25]" "bw hsdp" bench_slow_link_times.txt "$@"
bench_install deepspeed
modes=${FSL_LINK_MODES:-netns,lo,sockets}
shape=${FSL_SLOW_LINK_SHAPE:-2x32}
steps=${FSL_SLOW_LINK_STEPS:-5}; warmup=${FSL_SLOW_LINK_WARMUP:-2}  # the protocol's minimums (docs/benchmarking.md)
layers=${FSL_SLOW_LINK_LAYERS:-4}; limit=${FSL_SLOW_LINK_TIMEOUT:-240}
model=${FSL_SLOW_LINK_MODEL:-llama2_7b}
per_node=${FSL_SLOW_LINK_GPUS_PER_NODE:-1}
gpu_ids=$(seq -s, 0 $((2 * per_node - 1)))
nodes_tag=$([ "$per_node" = 1 ] || echo "_nodes2x$per_node")
# Layer-major at its best (compiled, root on the GPU); the peers at their largest micro-batch first: over a slow link
# each micro-batch gathers every layer again, so the fewest micro-batches that fit win (DeepSpeed 32 x 2 beat 16 x 4
# over emulated Ethernet on 4 GPUs, bench/results/scale_llama2_7b_L4_s4096_64seq_micro_batches_eager.json), then
# smaller ones (under a cap, only those fit).
# Under FSL_SLOW_LINK_CAP_GIB=24 the largest micro-batch that fits depends on the layers: at 4 layers the peers' 32 x 2,
# 16 x 4 and FSDP2's 8 x 8 ran out of GPU memory (e98ed7a, 2 x H200; FSDP2's best was 4 x 16, d239093); at 2 layers
# FSDP2's 8 x 8 (16.6 GiB) and DeepSpeed's 8 x 8 (14.1 GiB) fit and DeepSpeed's 16 x 4 did not (8531464,
# bench/results/slow_link_fsdp_10g_llama2_7b_L2_s4096_2x32_cap24_points_*_h200x2_8531464.json). So a capped run tries
# each peer's 8 x 8 first (an out-of-memory point costs a start: DeepSpeed's 16 x 4, 76 s) and 4 x 16 after it; a
# 4 x 16 that its 8 x 8 beat is only a longer run, so drop it with FSL_SLOW_LINK_CONTENDERS once the 8 x 8 is known to
# fit. FSDP2 offload keeps its root on the GPU as layer-major does (`:root=device`, the protocol's same allowance;
# the 8531464 records ran it without). Those records' peers held every logit of a micro-batch at once; with
# layer-major's chunked head (the peers' default since e2a292b) both fit 16 x 4 at 2 layers (16.0 and 16.5 GiB) and
# neither 32 x 2, so the capped list starts at 16 x 4 and steps down to 8 x 8.
f=fsdp2-offload
# DeepSpeed runs eager (its engine does not take our compiled blocks), so the protocol wants layer-major eager beside
# it (`speedloader:root=device`); it comes right after the peers' first points.
uncapped=speedloader:compile:root=device,deepspeed-offload:32x2,$f:32x2:compile:root=device,speedloader:root=device,$f:16x4:compile:root=device,deepspeed-offload:16x4,$f:8x8:compile:root=device
capped=speedloader:compile:root=device,$f:16x4:compile:root=device,deepspeed-offload:16x4,speedloader:root=device,$f:8x8:compile:root=device,deepspeed-offload:8x8
contenders=${FSL_SLOW_LINK_CONTENDERS:-$([ -n "${FSL_SLOW_LINK_CAP_GIB:-}" ] && echo "$capped" || echo "$uncapped")}
if [ "$dry" != 1 ]; then
  python3 tools/slow_link.py cleanup  # what a command killed on this machine before may have left
  trap 'python3 tools/slow_link.py cleanup' EXIT
  python3 tools/slow_link.py probe --gbit 10 --modes "$modes" | tee -a "$times" \
    || { echo "no link can be made on this machine (above: why)" | tee -a "$times"; exit 2; }
fi

bw() {  # bw RATE NAME [VAR=VALUE...]: one bandwidth test
  local rate=$1 name=$2
  shift 2
  bench_run bw "$name" 45 0 env "$@" python3 tools/allreduce_bw.py --device cuda --nproc-per-node 1 \
    --link-gbit "$rate" --link-modes "$modes" --sizes-mb 1,4,16,64,256 --min-time-s 1 --timeout 150 --name "$name"
}
bw 10 slow_link_allreduce_10g
bw 25 slow_link_allreduce_25g
bw 25 slow_link_allreduce_25g_4x4 NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4
bw 1000 slow_link_allreduce_ceiling

train() {  # train PART RATE DP_REPLICATE NAME: one bench_scale invocation in what is left of the budget
  local key=$1 rate=$2 replicate=$3 name=$4${FSL_SLOW_LINK_CAP_GIB:+_cap$FSL_SLOW_LINK_CAP_GIB}$nodes_tag
  local left=$((budget - SECONDS - 20))
  bench_run "$key" "$name" 60 0 python3 tools/bench_scale.py --model "$model" --layers "$layers" --seq-len 4096 \
    --shape "$shape" --gpus '' --ethernet "2x$per_node" --gpu-ids "$gpu_ids" --dp-replicate "$replicate" --link-gbit "$rate" \
    --link-modes "$modes" --contenders "$contenders" --steps "$steps" --warmup "$warmup" \
    --invocations "${FSL_SLOW_LINK_INVOCATIONS:-1}" --timeout "$limit" --budget-s "$left" \
    ${FSL_SLOW_LINK_CAP_GIB:+--max-gpu-memory-gib "$FSL_SLOW_LINK_CAP_GIB"} \
    --name "$name"
}
train hsdp 10 2 "slow_link_hsdp_10g_${model}_L${layers}_s4096_$shape"
train fsdp 10 1 "slow_link_fsdp_10g_${model}_L${layers}_s4096_$shape"
train hsdp25 25 2 "slow_link_hsdp_25g_${model}_L${layers}_s4096_$shape"
[ "$dry" = 1 ] || python3 tools/slow_link.py cleanup | tee -a "$times"  # nothing left behind (the EXIT trap too)
