"""One command per table, under the benchmarking protocol (docs/benchmarking.md): every contender at its best,
repeated, with its spread.

    python tools/bench_fair.py --list                                  # the tables and their contenders
    python tools/bench_fair.py TABLE --out-dir DIR [--part sweep|repeat|all] [--family F ...]
    python tools/bench_fair.py TABLE --out-dir DIR --dry-run           # the worker commands, nothing launched
    python tools/bench_fair.py TABLE --out-dir DIR --part repeat --points-from RECORD [--also SPEC] [--profile]
    python tools/bench_fair.py TABLE --out-dir DIR --budget-s 540      # a part per device command: run it again

A table fixes the work (model shape, depth, sequence length, effective batch, GPU-memory cap); each contender
family has its own knobs, swept under the same cap (:func:`train_ladders`, :func:`infer_ladders`):

  sweep    every knob setting of every family in one invocation. A family's settings form ladders: for each
           micro-batch n that divides the batch, tiers tried in order from the fastest-if-it-fits setting down
           (no recompute and units gathered once, then one of the two, then neither; layer-major: as many kept
           (unit, sub-batch) pairs as the cap's memory holds, then fewer); a ladder stops at the first tier with a
           point that fits. Every tried point, out-of-memory ones included, stays in the record. The sweep only
           ranks; --sweep-steps / --sweep-warmup (default: the repeat's) shorten its training points where a step
           takes many seconds (a batch of 128), each row saying its steps.
  repeat   each family's best sweep point (:func:`protocol.best_point`), in at least 3 invocations with the order
           of contenders alternated (:func:`protocol.run_order`); with DeepSpeed in the table (eager: its engine
           does not run our compiled blocks), layer-major's best eager point beside it (its ladders are swept
           with DeepSpeed's: family layer-major-eager). Without a sweep, only the
           settings named by --also (a setting known from elsewhere, e.g. the full model's kept pairs uncapped).
  all      sweep, then repeat.

Each part appends to one record, DIR/fair_<table>[_busyK][_copyM].json, written after every worker, so parts can
be separate device commands; a record is never extended on another GPU model (``--points-from`` lends its best
points to a record of the same table elsewhere; ``--also`` repeats another setting beside them). The record's ``summary`` holds, per family, the median and min-max over the repeat
invocations and ``ratios`` layer-major over every other family (median over median, ``overlap`` where the ranges
meet, ``binds`` where the peer's best micro-batch is smaller than the batch, ``target`` the issue's ratio for that case,
``bound`` what the ratio would be if layer-major's whole step took the fastest forward+backward any contender of the
table measured (usually the ceiling's): the most a schedule of the same kernels reaches, from measured rates; a
target above it is out of reach at that point). ``--family auto`` (any training table) adds the trainer with
``schedule=auto`` as a user runs it (tools/bench_auto.py: given the batch, the cap and the table's GPU-resident
modules, it chooses its schedule), one point, and ``ratios`` ``auto`` over each canonical peer. ``--host-busy K`` /
``--host-copy M``
run K busy-loop and M memory-copy processes beside every worker (tools/host_load.py): the busy-host curve.

Workers are tools/bench_train.py and tools/bench_infer.py (``--worker SPEC``), each in its own process with a fresh
CUDA context, ``--steps`` timed steps after ``--warmup`` (training; at least 5 after 2). Below the protocol's
minimums the command refuses unless ``--quick``, and its record says ``protocol: false``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
import harness  # noqa: E402
import protocol  # noqa: E402
from bench_train import WORKER_CPUS_ENV, contender_env  # noqa: E402
from host_load import HostLoad  # noqa: E402

REPO = harness.REPO
GIB = 2**30
LAYER_MAJOR = "layer-major"
EAGER = LAYER_MAJOR + "-eager"  # layer-major without torch.compile: the row beside DeepSpeed, whose engine runs eager
PEERS = ("fsdp2-offload", "deepspeed-offload")  # the canonical offloading peers the ratios are about
# Bytes of activations one sequence of one block keeps for its backward in bf16 with fused attention, per token and
# hidden unit (Korthikanti et al. 2022, 34 s h per layer without the s^2 term): the kept-pair estimate's basis.
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
GPU_MARGIN_GIB = 4.0  # the allocator's workspace, the compiled blocks' buffers, two gathered units in flight
KEEP_TIERS = 4  # layer-major: kept-pair counts tried per micro-batch, each an eighth of the pairs fewer
# A worker's step phases summarized per row: forward+backward, optimizer, the main thread's CPU time in forward+backward,
# the overlapped optimizer worker's busy time, the backward's waits for its gradient regions and the caching
# allocator's retries in the timed steps (bench_train's fields).
PHASES = ("fwd_bwd_s", "optimizer_s", "host_thread_cpu_s", "optimizer_busy_s", "grad_ring_wait_s",
          "alloc_retries_timed")


@dataclass(frozen=True)
class Table:
    """The work every row of a table does, and the contender families that do it."""

    name: str
    kind: str  # 'train' (tools/bench_train.py) or 'infer' (tools/bench_infer.py)
    model: str  # conf/model/<model>.yaml
    layers: Optional[int]  # the model's first blocks (None: all)
    seq_len: int  # training: tokens per sequence; generation: prompt length
    batch: int  # sequences per optimizer step, or prompts generated at once
    cap_gib: float  # every contender's GPU-memory cap (the ceiling's own: its states must fit, else uncapped)
    families: tuple[str, ...]
    headline: bool = False  # a README table: every row repeated; a map point repeats each family's best
    gen_len: int = 32
    compiled: bool = True  # training: every contender that can compiles its blocks (DeepSpeed runs eager)
    # The GPU-resident modules every offloading contender may keep (layer-major and FSDP2 offload alike): the
    # root (embeddings, final norm, LM head) and unit 1's states.
    allowances: str = ":root=device:dev=1"
    # Opt-in kernel levers (tools/bench_train.py's :liger, :fp8, :sdpa=B) given to every contender that takes them
    # (all but DeepSpeed): a table of levers compares like with like.
    levers: str = ""
    note: str = ""

    @property
    def figure(self) -> str:
        return "tokens_per_s" if self.kind == "train" else "generated_tokens_per_s"


TRAIN_FAMILIES = (LAYER_MAJOR, "fsdp2-offload", "deepspeed-offload", "ceiling")
# The trainer with schedule=auto as a user runs it (tools/bench_auto.py): given the batch, the cap and the table's
# GPU-resident modules, it chooses layer-major's plan or the canonical schedule. Any training table's, on request
# (--family auto): its tuning makes each worker a minute or more longer.
AUTO = "auto"


def _train(name: str, model: str, layers: Optional[int], seq_len: int, batch: int, cap: float, *,
           headline: bool = False, families: Sequence[str] = TRAIN_FAMILIES, **fields) -> Table:
    return Table(name, "train", model, layers, seq_len, batch, cap, tuple(families), headline=headline, **fields)


def _infer(name: str, model: str, families: Sequence[str], note: str) -> Table:
    return Table(name, "infer", model, None, 512, 0, 24, tuple(families), headline=True, note=note)


def _tables() -> dict[str, Table]:
    tables = [
        _train("train_7b_L8_b8_cap40", "llama2_7b", 8, 4096, 8, 40, headline=True,
               note="the README's 7B-width table: 8 x 4096 tokens under 40 GiB"),
        _train("train_7b_L8_b32_cap40", "llama2_7b", 8, 4096, 32, 40, headline=True,
               note="the same at 32 x 4096 tokens"),
    ]
    # The regime map: 7B width (8 layers) over the GPU-memory cap and the effective batch; 13B width with 32
    # sequences at 24 and 40 GiB; 16k-token sequences at batch 8.
    for cap in (24, 40, 80):
        for batch in (8, 32, 128):
            name = f"map_7b_L8_b{batch}_cap{cap}"
            if not any(t.name == name.replace("map_", "train_") for t in tables):
                tables.append(_train(name, "llama2_7b", 8, 4096, batch, cap))
    for cap in (24, 40):
        tables.append(_train(f"map_13b_L8_b32_cap{cap}", "llama2_13b", 8, 4096, 32, cap))
    tables.append(_train("map_7b_L8_s16k_b8_cap40", "llama2_7b", 8, 16384, 8, 40))
    # The families of today (the former tools/bench_moe.sh): a mixture of experts whose states exceed the cap (its
    # ceiling runs uncapped; units 1-2 on the GPU, as measured before) and Llama-3's wider vocabulary.
    tables.append(_train("train_qwen3moe_L4_b8_cap40", "qwen3_30b_a3b", 4, 4096, 8, 40, headline=True,
                         allowances=":root=device:dev=2", note="Qwen3-30B-A3B shape, 4 layers, 8 x 4096 tokens"))
    tables.append(_train("train_llama3_8b_L8_b8_cap40", "llama3_8b", 8, 4096, 8, 40, headline=True,
                         note="Llama-3-8B shape, 8 layers, 8 x 4096 tokens"))
    # The opt-in kernel levers (the former tools/bench_kernels.sh), every contender with the same ones.
    tables.append(_train("levers_7b_L8_b8_cap40", "llama2_7b", 8, 4096, 8, 40,
                         families=(LAYER_MAJOR, "fsdp2-offload", "ceiling"), levers=":liger:fp8",
                         note="Liger's kernels and torchao float8 linears in every contender"))
    # Full LLaMA-2-7B, every model state on the host (the former tools/bench_recompute.sh full): its ceiling holds
    # 108 GB of states, uncapped (fits an H200, not an H100: recorded out of memory there).
    tables.append(_train("full_llama2_7b_b8_cap40", "llama2_7b", None, 4096, 8, 40, headline=True,
                         note="full LLaMA-2-7B (32 layers), 8 x 4096 tokens under 40 GiB"))
    # A check of the code path on a CPU (tests/test_bench_fair.py): the tiny LLaMA, no figure means anything.
    tables.append(Table("cpu_check", "train", "llama_tiny", 2, 64, 2, 1000, (LAYER_MAJOR, "fsdp2-offload"),
                        compiled=False, note="the code path on a CPU (tests): no figure means anything"))
    # Generation under 24 GiB, prompt 512, generate 32 (the former tools/bench_quant.sh and bench_moe.sh parts).
    tables.append(_infer("infer_opt30b_24g", "opt_30b", ("speedloader-int4", "speedloader-bf16", "flexgen-c4",
                                                         "flexgen-fp16", "zero-inference-q4", "accelerate"),
                         "OPT-30B generation under 24 GiB"))
    tables.append(_infer("infer_llama2_70b_24g", "llama2_70b", ("speedloader-int4", "zero-inference-q4"),
                         "LLaMA-2-70B shape (more than the host in bf16): int4 weights streamed"))
    tables.append(_infer("infer_mixtral_24g", "mixtral_8x7b", ("speedloader-bf16", "zero-inference-bf16",
                                                               "accelerate"), "Mixtral-8x7B generation under 24 GiB"))
    return {t.name: t for t in tables}


TABLES = _tables()


# --- the sweep of each family's knobs ----------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the layer-major kept-pair estimate needs of the model (from ``harness.model_summary``)."""

    params: int
    root_params: int  # embeddings, final norm, LM head
    num_layers: int
    hidden: int

    @property
    def unit_params(self) -> int:
        return (self.params - self.root_params) // self.num_layers

    @classmethod
    def of(cls, table: Table) -> "Shape":
        cfg = harness.model_config(table.model, layers=table.layers, min_positions=table.seq_len)
        summary = harness.model_summary(cfg, table.seq_len)
        tied = getattr(cfg, "tie_word_embeddings", False)
        root = cfg.vocab_size * cfg.hidden_size * (1 if tied else 2) + cfg.hidden_size
        return cls(summary["params"], root, cfg.num_layers, cfg.hidden_size)


def kept_pairs(table: Table, shape: Shape, n: int) -> int:
    """Layer-major's first guess of ``keep_activations`` at micro-batch ``n``: the (unit, sub-batch) pairs whose
    activations the cap's memory holds after the allowances' fp32 states and AdamW moments (16 B a parameter: the
    root and the device units), two gathered bf16 units and a margin; at most every pair."""
    resident = 16 * (shape.root_params + device_units(table) * shape.unit_params) + 2 * 2 * shape.unit_params
    free = table.cap_gib * GIB - resident - GPU_MARGIN_GIB * GIB
    pair = n * table.seq_len * shape.hidden * ACTIVATION_BYTES_PER_TOKEN_HIDDEN
    pairs = shape.num_layers * (table.batch // n)
    return max(0, min(pairs, int(free // pair)))


def device_units(table: Table) -> int:
    """The units whose states the allowances keep on the GPU (``:dev=K``)."""
    return next((int(o[4:]) for o in table.allowances.split(":") if o.startswith("dev=")), 0)


def ceiling_fits(table: Table, shape: Shape) -> bool:
    """Whether the on-device ceiling's states (fp32 weights, gradients, AdamW moments: 16 B a parameter) and a
    margin fit the table's cap; otherwise the ceiling runs uncapped (and says so)."""
    return 16 * shape.params + GPU_MARGIN_GIB * GIB <= table.cap_gib * GIB


def train_ladders(table: Table, family: str, shape: Shape) -> list[list[list[str]]]:
    """The family's sweep as ladders (one per micro-batch n), each a list of tiers, each a list of bench_train
    contender specs. A ladder stops at the first tier where a point ran (the later tiers trade speed for memory at
    the same n), or at the tier after it where that point's allocator retried (:func:`retried`)."""
    if family == AUTO:  # one point: the tuner chooses the micro-batches
        return [[[f"{AUTO}:{table.batch}{table.allowances}{table.levers}"]]]
    ladders = []
    for n in protocol.divisors(table.batch):
        num = table.batch // n
        shape_spec = f"{n}x{num}"
        if family in (LAYER_MAJOR, EAGER):
            if num < 2:  # one sub-batch is the canonical schedule, not layer-major
                continue
            pairs = shape.num_layers * num
            first = kept_pairs(table, shape, n)
            step = max(1, pairs // 8)
            keeps = sorted({max(0, first - i * step) for i in range(KEEP_TIERS)}, reverse=True)
            # The trainer's default host step (optim.fp32_host_step=pool), named: bench_train's default is openmp.
            eager = ":eager" if family == EAGER else ""
            ladders.append([[f"speedloader-overlap:{shape_spec}{table.allowances}{table.levers}:adamw=pool:keep={k}"
                             f"{eager}"] for k in keeps])
        elif family == "fsdp2-offload":
            ladders.append(fsdp2_tiers(f"fsdp2-offload:{shape_spec}{table.allowances}{table.levers}", shape))
        elif family == "ceiling":
            cap = "" if ceiling_fits(table, shape) else ":cap=none"
            ladders.append(fsdp2_tiers(f"ondevice:{shape_spec}{table.levers}:sync=last{cap}", shape))
        elif family == "deepspeed-offload":
            ladders.append([[f"deepspeed-offload:{shape_spec}"]])
        else:
            raise ValueError(f"table {table.name}: unknown training family {family!r}")
    return ladders


def fsdp2_tiers(base: str, shape: Shape) -> list[list[str]]:
    """An FSDP2 family's tiers at one micro-batch, from the most memory to the least: nothing recomputed and every
    unit gathered once per step; then one block recomputed (the last: torchtitan's selective per-layer recompute at
    every L-th block) or the units resharded after forward; then every other block recomputed, or every block with
    the units gathered once; then every block recomputed and resharded (FSDP2's own default)."""
    layers = shape.num_layers
    one_block = [f"{base}:recompute=every{layers}:reshard=off"] if layers >= 2 else []
    every_other = [f"{base}:recompute=every2:reshard=off"] if layers > 2 else []  # with 2 layers: one_block
    return [[f"{base}:recompute=off:reshard=off"], one_block + [f"{base}:recompute=off"],
            every_other + [f"{base}:reshard=off"], [base]]


# Generation: each family's batches and policies (FlexGen's gpu_batch_size x num_gpu_batches, ours prompts x
# sub-batches), one tier each: no point is known to dominate another.
INFER_POINTS = {
    "infer_opt30b_24g": {
        "speedloader-int4": ["speedloader:48x4:device:w=int4:kvq=int8", "speedloader:56x8:device:w=int4:kvq=int8",
                             "speedloader:128x4:split=1:w=int4:kvq=int8"],
        "speedloader-bf16": ["speedloader:128x4:split=1:kvq=int8", "speedloader:104x8:split=2:cpu=6"],
        # FlexGen with its compression, attending on the GPU as its compressed settings do: its published OPT-30B
        # setting (the cache compressed, fp16 weights on the host; 64 x 8 there, where the host had 208 GB; here 64 x
        # 4 ran out of the host's 128 GiB, 64 x 3 fits), and with its weights compressed too, on the GPU (they fit
        # the cap at 4 bits) or on the host beside a larger batch
        "flexgen-c4": ["flexgen:32x8:c4:w=100:attn=gpu", "flexgen:32x12:c4:w=100:attn=gpu",
                       "flexgen:64x4:kc4:w=0:attn=gpu", "flexgen:64x6:c4:w=0:attn=gpu",
                       "flexgen:64x6:c4:w=100:attn=gpu", "flexgen:64x3:kc4:w=0:attn=gpu"],
        "flexgen-fp16": ["flexgen:32x2", "flexgen:48x3"],
        "zero-inference-q4": ["zero-inference:16:q4", "zero-inference:32:q4", "zero-inference:64:q4"],
        "accelerate": ["accelerate:16", "accelerate:32", "accelerate:64"],
    },
    "infer_llama2_70b_24g": {
        "speedloader-int4": ["speedloader:128x8:device:w=int4:kvq=int8", "speedloader:192x16:device:w=int4:kvq=int8"],
        "zero-inference-q4": ["zero-inference:32:q4", "zero-inference:64:q4", "zero-inference:96:q4"],
    },
    "infer_mixtral_24g": {
        "speedloader-bf16": ["speedloader:128x8", "speedloader:256x8", "speedloader:512x16"],
        "zero-inference-bf16": ["zero-inference:32:bf16", "zero-inference:64:bf16", "zero-inference:96:bf16"],
        "accelerate": ["accelerate:16", "accelerate:32", "accelerate:64"],
    },
}


def infer_ladders(table: Table, family: str) -> list[list[list[str]]]:
    points = INFER_POINTS.get(table.name, {})
    if family not in points:
        raise ValueError(f"table {table.name}: unknown generation family {family!r}")
    return [[[spec]] for spec in points[family]]


def family_of(spec: str) -> str:
    """The family a worker spec belongs to (the inverse of the ladders)."""
    name = spec.split(":")[0]
    if name.startswith("speedloader-overlap") or name == "speedloader-overlap":
        return EAGER if spec.endswith(":eager") else LAYER_MAJOR
    if name == "ondevice":
        return "ceiling"
    if name == "speedloader":
        return "speedloader-int4" if "w=int4" in spec else "speedloader-bf16"
    if name == "flexgen":  # with any of its compressions (weights and cache, or the cache only), or fp16
        return "flexgen-c4" if {"c4", "kc4"} & set(spec.split(":")[2:]) else "flexgen-fp16"
    if name == "zero-inference":
        return "zero-inference-q4" if ":q4" in spec else "zero-inference-bf16"
    return name


# --- running workers ----------------------------------------------------------------------------------


def worker_command(table: Table, spec: str, args: argparse.Namespace, sweep: bool = False) -> list[str]:
    """The worker's command line; a sweep point's training worker runs ``--sweep-steps`` after ``--sweep-warmup``."""
    if table.kind == "train":
        steps, warmup = sweep_steps(args) if sweep else (args.steps, args.warmup)
        layers = table.layers or harness.model_config(table.model).num_layers
        cmd = [sys.executable, str(REPO / "tools" / "bench_train.py"), "--worker", spec, "--model", table.model,
               "--layers", str(layers), "--seq-len", str(table.seq_len), "--max-gpu-memory-gib",
               f"{table.cap_gib:g}", "--steps", str(steps), "--warmup", str(warmup),
               "--device", args.device]
        return cmd + (["--compile"] if table.compiled else []) + (["--profile"] if args.profile else [])
    cmd = [sys.executable, str(REPO / "tools" / "bench_infer.py"), "--worker", spec, "--model", table.model,
           "--prompt-len", str(table.seq_len), "--gen-len", str(table.gen_len), "--gpu-memory-gib",
           f"{table.cap_gib:g}", "--device", args.device]
    return cmd + (["--layers", str(table.layers)] if table.layers else [])


@dataclass(frozen=True)
class Slot:
    """A share of the machine for one worker at a time (``--gpus N``): one GPU and a contiguous 1/N of the host's
    cores."""

    gpu: int
    cpus: tuple[int, ...]

    def env(self, env: dict) -> dict:
        """``env`` with the worker held to this slot: CUDA_VISIBLE_DEVICES, its cores (the worker takes them as its
        affinity before any library loads) and OpenMP's team sized to them."""
        return {**env, "CUDA_VISIBLE_DEVICES": str(self.gpu), WORKER_CPUS_ENV: ",".join(map(str, self.cpus)),
                "OMP_NUM_THREADS": str(len(self.cpus))}


def slots(n: int) -> list[Slot]:
    """``n`` slots: GPU i with the i-th contiguous part of this process's cores (the parts differ by at most one)."""
    cpus = sorted(os.sched_getaffinity(0))
    if n > len(cpus):
        raise ValueError(f"--gpus {n}: this machine has {len(cpus)} cores for the workers; use at most {len(cpus)}")
    size, extra = divmod(len(cpus), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [Slot(i, tuple(cpus[bounds[i]:bounds[i + 1]])) for i in range(n)]


def sweep_steps(args: argparse.Namespace) -> tuple[int, int]:
    """(timed, warm-up) steps of a sweep point: ``--sweep-steps`` / ``--sweep-warmup``, else the repeat's."""
    return (args.sweep_steps or args.steps, args.sweep_warmup or args.warmup)


# What a family's workers import beyond the project's own dependencies (FlexGen comes from its carried wheel).
FAMILY_NEEDS = {"deepspeed-offload": "deepspeed", "zero-inference-q4": "deepspeed", "zero-inference-bf16": "deepspeed",
                "accelerate": "accelerate"}


def check_installed(family: str) -> None:
    """SystemExit naming the package ``family``'s workers import where it is missing here: every worker of the family
    would fail after its start (half a minute of device time each), and the ladders would try one after another."""
    module = FAMILY_NEEDS.get(family)
    if module is not None and importlib.util.find_spec(module) is None:
        get = ("from the carried .whl as tools/bench_lib.sh's `bench_install deepspeed` does (deepspeed==0.19.8)"
               if module == "deepspeed" else f"pip install {module}")
        raise SystemExit(f"{family}: its workers import {module}, which is not installed in this environment; install "
                         f"it ({get}), or leave the family out (--family names the ones to run)")


def run_point(table: Table, spec: str, args: argparse.Namespace, slot: Optional[Slot] = None, sweep: bool = False,
              **fields) -> dict:
    """One worker in its own process (beside the host load, if any; held to ``slot`` if given): its record row. A
    sweep point's row says its timed and warm-up steps (they may be fewer than the repeat's)."""
    cmd = worker_command(table, spec, args, sweep)
    if sweep and table.kind == "train":
        steps, warmup = sweep_steps(args)
        fields = {**fields, "steps": steps, "warmup": warmup}
    if args.dry_run:
        print(" ".join(cmd), flush=True)
        return {"spec": spec, "family": family_of(spec), **fields, "status": "dry-run"}
    check_installed(family_of(spec))
    env = contender_env(spec)
    if slot is not None:
        env = slot.env(env)
        fields = {**fields, "gpu_slot": slot.gpu, "worker_cpus": len(slot.cpus)}
    with HostLoad(busy=args.host_busy, copy=args.host_copy) as load:
        outcome = harness.launch_worker(cmd, env, timeout=args.timeout)
    row = outcome.row(spec=spec, family=family_of(spec), **fields)
    if args.host_busy or args.host_copy:
        row["host_load"] = load.summary()
    shown = {k: row.get(k) for k in ("family", "spec", "status", table.figure, "peak_hbm_gib", "wall_s")}
    print(json.dumps(shown), flush=True)
    return row


# Families whose ladders repeat the same tiers at every micro-batch, memory growing with it: a tier out of memory at
# one n is out of memory at every larger n, so the next ladder starts at the first tier that fitted.
MONOTONE = ("fsdp2-offload", "ceiling", "deepspeed-offload")


class Budget:
    """``--budget-s``: this command's wall-clock allowance. A worker starts only where its expected wall time still
    fits (:func:`expected_wall_s`); the record keeps what finished, and the same command run again goes on from
    there (the sweep skips the points it has, the repeat runs the invocations still missing)."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds, self.began = seconds, time.monotonic()
        self.stopped_before: list[str] = []  # the first setting of each place that stopped (a family, the repeat)

    def allows(self, record: dict, specs: Sequence[str]) -> bool:
        if self.seconds is None:
            return True
        need = sum(expected_wall_s(record, spec) for spec in specs)
        if time.monotonic() - self.began + need <= self.seconds:
            return True
        self.stopped_before.append(specs[0])
        return False


DEFAULT_WALL_S = 90.0  # a worker's wall time before the record holds any: a compiled 8-layer point with its start


def record_rows(record: dict) -> list[dict]:
    """Every row of a record: the sweep's, then each repeat invocation's."""
    return [*record.get("sweep", []), *(r for inv in record.get("invocations", []) for r in inv["rows"])]


def expected_wall_s(record: dict, spec: str) -> float:
    """How long a worker of ``spec`` is expected to take: the longest run of that setting in the record, else of its
    family, else of any worker, else :data:`DEFAULT_WALL_S`; a tenth more, for the spread."""
    rows = record_rows(record)
    walls = {key: [r["wall_s"] for r in rows if r.get("wall_s") and match(r)] for key, match in
             (("spec", lambda r: r.get("spec") == spec), ("family", lambda r: r.get("family") == family_of(spec)),
              ("any", lambda r: True))}
    seen = walls["spec"] or walls["family"] or walls["any"]
    return 1.1 * (max(seen) if seen else DEFAULT_WALL_S)


def sweep(table: Table, families: Sequence[str], args: argparse.Namespace, record: dict, path: Path) -> None:
    """Every family's ladders. With ``--gpus N`` the families' sweeps run side by side, each on a free slot
    (:func:`slots`), a family's own points one after another as without it (its ladders' rules read its earlier
    points); the record is written after every point either way."""
    lock = threading.Lock()  # one family's rows at a time into the record, and one write of it
    if args.gpus <= 1 or len(families) <= 1 or args.dry_run:
        for family in families:
            sweep_family(table, family, args, record, path, lock)
        return
    free: queue.Queue = queue.Queue()
    for slot in slots(args.gpus):
        free.put(slot)
    stop = threading.Event()

    def on_a_slot(family: str) -> None:
        if stop.is_set():
            return
        slot = free.get()
        try:
            sweep_family(table, family, args, record, path, lock, slot, stop)
        finally:
            free.put(slot)

    with harness.sigterm_as_exit(), ThreadPoolExecutor(max_workers=args.gpus) as pool:
        futures = [pool.submit(on_a_slot, family) for family in families]
        try:
            for done in futures:
                done.result()  # a family's error (not a worker's: those are rows) stops the command
        except BaseException:  # that, Ctrl-C or a SIGTERM: no new point starts, the running ones stop
            stop.set()
            harness.stop_running()
            raise


def budget_of(args: argparse.Namespace) -> Budget:
    """The command's :class:`Budget` (none for a namespace built by hand)."""
    return getattr(args, "budget", None) or Budget(None)


def sweep_family(table: Table, family: str, args: argparse.Namespace, record: dict, path: Path,
                 lock: threading.Lock, slot: Optional[Slot] = None, stop: Optional[threading.Event] = None) -> None:
    shape = Shape.of(table) if table.kind == "train" else None
    ladders = train_ladders(table, family, shape) if table.kind == "train" else infer_ladders(table, family)
    start = 0  # MONOTONE: the first tier still worth trying
    for ladder_index, ladder in enumerate(ladders):
        fitted = None  # the first tier where a point ran
        reached = start  # the first tier not out of memory here (a timeout or failure says nothing about memory)
        for tier_index, tier in enumerate(ladder):
            if fitted is not None and tier_index > fitted + 1:
                break
            if tier_index < start:
                rows = [{"spec": spec, "family": family_of(spec), "ladder": ladder_index, "tier": tier_index,
                         "status": "skipped", "reason": "out of memory at a smaller micro-batch"}
                        for spec in tier]
            else:  # a point an earlier part of this record already ran is not run again
                with lock:
                    done = {r["spec"]: r for r in record["sweep"] if r["status"] in ("ok", "oom")}
                    to_run = [spec for spec in tier if spec not in done]
                    if to_run and not budget_of(args).allows(record, to_run):
                        return  # this family's sweep goes on in the next command
                on_slot = {"slot": slot} if slot is not None else {}
                rows = [done.get(spec) or run_point(table, spec, args, sweep=True, ladder=ladder_index, tier=tier_index,
                                                    **on_slot)
                        for spec in tier]
                if stop is not None and stop.is_set():  # the command was stopped: a stopped worker is no point
                    return
            with lock:
                record["sweep"] = [r for r in record["sweep"] if r["spec"] not in tier] + rows
                write(record, path, table, args)
            if tier_index == reached and all(r["status"] == "oom" for r in rows):
                reached += 1
            ran = [r for r in rows if r["status"] == "ok"]
            if ran and fitted is None:
                fitted = tier_index
                if not any(retried(r) for r in ran):
                    break
        if family in MONOTONE and table.kind == "train" and not args.dry_run:
            start = reached if fitted is None else fitted


def retried(row: dict) -> bool:
    """Whether the caching allocator retried in the point's timed steps: its reserved memory met the cap, and each
    retry freed the cache after synchronising the GPU (the launching thread blocked in an allocation). The next
    tier, with less memory, may then be faster, so the ladder tries it too."""
    return (row.get("alloc_retries_timed") or 0) > 0


def with_eager(table: Table, families: Sequence[str]) -> list[str]:
    """The families to sweep: with DeepSpeed among them (eager: its engine does not run our compiled blocks),
    layer-major's eager ladder too, so that the row beside DeepSpeed is eager at its own best setting (without
    compiled blocks the activations take more memory: the compiled best point's kept pairs may not fit)."""
    families = list(families)
    if table.kind == "train" and "deepspeed-offload" in families and EAGER not in families:
        families.append(EAGER)
    return families


def best_specs(record: dict, table: Table, families: Sequence[str]) -> dict[str, str]:
    """{family: its best sweep point's spec}; with DeepSpeed and layer-major among them, layer-major's best eager
    point too: from its own sweep (:func:`with_eager`), or, where a record has no eager sweep, the compiled best
    point run eager."""
    sweep_rows = record.get("sweep", [])
    best = {}
    for family in families:
        row = protocol.best_point([r for r in sweep_rows if r["family"] == family], key=table.figure)
        if row is not None:
            best[family] = row["spec"]
    if "deepspeed-offload" in best and LAYER_MAJOR in best and EAGER not in best:
        eager = [r for r in sweep_rows if r["family"] == EAGER and r["status"] in ("ok", "oom")]
        row = protocol.best_point(eager, key=table.figure)
        if row is not None:
            best[EAGER] = row["spec"]
        elif not eager:
            best[EAGER] = best[LAYER_MAJOR] + ":eager"
    return best


def same_table(recorded: dict, table: Table) -> bool:
    """Whether a record's table is ``table``: a field added to Table since the record was written counts as its
    default (the work it defines is unchanged)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Table) if f.default is not dataclasses.MISSING}
    return json.loads(json.dumps({**defaults, **recorded})) == json.loads(json.dumps(dataclasses.asdict(table)))


def peer_head(record: dict, families: Sequence[str] = PEERS) -> Optional[str]:
    """How a record's rows of ``families`` (the peers) that ran computed their loss: 'chunked' (layer-major's head:
    rows since e2a292b, whose ``head_loss_chunk_tokens`` is > 0), 'own' (the model's own loss, every logit of a
    micro-batch at once: rows without the field predate it, or ':loss=hf'), 'mixed'; None where no peer ran."""
    rows = record_rows(record)
    heads = {"chunked" if (r.get("head_loss_chunk_tokens") or 0) > 0 else "own"
             for r in rows if r.get("family") in families and r.get("status") == "ok"}
    return None if not heads else heads.pop() if len(heads) == 1 else "mixed"


def check_peers_chunked(record: dict, source: Path) -> None:
    """SystemExit where ``record``'s peers held every logit at once: rows run now (the peers chunk their head) would
    sit beside rows whose micro-batches that memory held smaller, and their best points would not be theirs now."""
    if peer_head(record, (*PEERS, "ceiling")) in ("own", "mixed"):
        raise SystemExit(f"{source}: its peers computed their loss from every logit of a micro-batch at once (before "
                         "e2a292b); the peers now chunk their head as layer-major does, so their rows do not mix: use "
                         "another --out-dir (a new record) and sweep again")


def take_points(record: dict, table: Table, families: Sequence[str], source: Path) -> None:
    """The sweep rows of ``families`` from another record of the same table (another GPU model, say), marked with
    where they came from: the repeat then runs their best points here without a sweep of its own."""
    other = json.loads(source.read_text())
    if not same_table(other["table"], table):
        raise SystemExit(f"{source} holds another definition of {table.name}: its points do not apply")
    # a family this record (or an earlier --points-from) already has points of keeps them: one sweep per family
    have = {r["family"] for r in record["sweep"]}
    taken = [{**r, "from_record": {"path": str(source), "device": other["device"], "commit": other["commit"]}}
             for r in other["sweep"] if r["family"] in families and r["family"] not in have]
    check_peers_chunked({"sweep": taken}, source)  # layer-major's points of an older record still apply
    record["sweep"].extend(taken)
    record.setdefault("points_from", []).append({"path": str(source), "device": other["device"]})


def repeat(table: Table, families: Sequence[str], args: argparse.Namespace, record: dict, path: Path) -> None:
    best = best_specs(record, table, families)
    if not best and not args.also:
        raise SystemExit(f"{table.name}: no sweep point ran in {path}; run --part sweep first, or name the settings "
                         "to repeat with --also")
    specs = list(best.values()) + [spec for spec in args.also if spec not in best.values()]
    # one worker at a time; under --gpus N each on the first slot, so it sees the share of the machine a sweep point
    # saw (a one-GPU machine's cores on a machine of N), not the whole host
    on_slot = {"slot": slots(args.gpus)[0]} if args.gpus > 1 else {}
    first = len(record["invocations"])
    count = args.invocations
    if getattr(args, "budget_s", None) is not None:  # then --invocations is the record's total of these settings
        count -= sum(1 for inv in record["invocations"] if set(specs) <= set(inv["order"]))
    for i in range(first, first + count):
        if not budget_of(args).allows(record, specs):
            return
        order = protocol.run_order(specs, i)
        rows = [run_point(table, spec, args, invocation=i, **on_slot) for spec in order]
        record["invocations"].append({"index": i, "order": order, "rows": rows, "boot_id": harness.boot_id()})
        write(record, path, table, args)


# --- the record ---------------------------------------------------------------------------------------


def peer_target(binds: bool, eighth_or_less: bool) -> float:
    """Issue 39's target for layer-major over a canonical peer: 2x where the peer's best micro-batch is an eighth of
    the batch or less, 1.3x where the cap binds it at all, else not slower (1x)."""
    return 2.0 if eighth_or_less else 1.3 if binds else 1.0


def peer_case(table: Table, sub_batch_size: int) -> dict:
    """Whether the cap binds a peer whose best micro-batch is ``sub_batch_size`` (smaller than the batch), whether
    that micro-batch is an eighth of the batch or less, and the issue's target for that case."""
    binds, eighth_or_less = sub_batch_size < table.batch, sub_batch_size * 8 <= table.batch
    return {"binds": binds, "eighth_or_less": eighth_or_less, "target": peer_target(binds, eighth_or_less)}


def sweep_pending(record: dict, table: Table) -> dict[str, list[str]]:
    """{family: the first point of each of its ladders (one micro-batch, or one generation point) of which the record
    holds no point yet}, for every family whose sweep has begun: a sweep part stopped by its time budget leaves
    them, and the family's best point may lie among them. A family not swept at all is not listed. A training
    ladder counts as swept where any point of the family ran at its micro-batch (a record from before a tier's
    spec changed keeps its points)."""
    def key(spec: str) -> tuple[str, str]:  # training: (family, "NxM"); generation: the point itself
        return (family_of(spec), spec.split(":")[1]) if table.kind == "train" else (family_of(spec), spec)

    have = {key(r["spec"]) for r in record.get("sweep", [])}
    swept = {family for family, _ in have}
    shape = Shape.of(table) if table.kind == "train" and swept & set(table.families) else None
    pending = {}
    # layer-major's eager ladder is swept beside DeepSpeed (with_eager) though no table names it
    for family in with_eager(table, table.families) if EAGER in swept else table.families:
        if family not in swept:
            continue
        ladders = train_ladders(table, family, shape) if table.kind == "train" else infer_ladders(table, family)
        left = [ladder[0][0] for ladder in ladders if key(ladder[0][0]) not in have]
        if left:
            pending[family] = left
    return pending


def fastest_fwd_bwd(families: dict) -> Optional[float]:
    """The bound's rate: the fastest forward+backward (tokens/s, median; optimizer set aside) any contender of the
    table measured. Usually the ceiling's (no recompute, nothing moved); but under a cap the ceiling's allocator may
    retry, and a peer holding fewer states on the GPU may then run the same kernels faster. None without the
    ceiling's: the others' alone (their recompute and transfers inside) bound nothing."""
    if not families.get("ceiling", {}).get("tokens_per_s_fwd_bwd_median"):
        return None
    return max(f["tokens_per_s_fwd_bwd_median"] for f in families.values() if f.get("tokens_per_s_fwd_bwd_median"))


def ratio_of(ours: dict, theirs: dict, figures: dict[str, dict[int, float]]) -> dict:
    """:func:`protocol.ratio` of two summary rows; where they did not run in the same invocations (a family repeated
    again by a later command), :func:`protocol.paired_ratio` of their figures (``figures``: {spec: {invocation:
    figure}} of the rows that ran): over the invocations both ran in, or flagged ``separate_invocations``."""
    if ours["invocations"] == theirs["invocations"]:
        return {**protocol.ratio(ours, theirs), "separate_invocations": False}
    r = protocol.paired_ratio(figures.get(ours["spec"], {}), figures.get(theirs["spec"], {}))
    if r["separate_invocations"] or r["invocations"] is None:
        del r["invocations"]  # named only where the ratio is taken over the shared ones
    return r


def summarize(record: dict, table: Table) -> dict:
    """Per family: the spread of its best point over the repeat invocations; ratios of layer-major (and of the
    int4 generation row) over every other family, median over median, with overlap and whether the cap binds
    (the peer's best micro-batch smaller than the batch)."""
    by_spec: dict[str, list] = {}
    ran_in: dict[str, list[int]] = {}  # the invocations each setting ran in
    figures: dict[str, dict[int, float]] = {}  # {spec: {invocation: figure}} of the rows that ran
    for inv in record["invocations"]:
        for row in inv["rows"]:
            by_spec.setdefault(row["spec"], []).append(row)
            ran_in.setdefault(row["spec"], []).append(inv["index"])
            if row.get("status") == "ok" and row.get(table.figure) is not None:
                figures.setdefault(row["spec"], {})[inv["index"]] = row[table.figure]
    best = best_specs(record, table, table.families)
    families = {}
    for spec, rows in by_spec.items():
        stats = protocol.summarize(rows, key=table.figure)
        ok = [r for r in rows if r.get("status") == "ok"]
        entry = {"spec": spec, **stats, "invocations": ran_in[spec]}
        if ok and table.kind == "train":
            entry.update(sub_batch_size=ok[0].get("sub_batch_size"), num_sub_batches=ok[0].get("num_sub_batches"),
                         mfu_median=protocol.spread(r["mfu"] for r in ok)["median"],
                         peak_hbm_gib_max=max(r.get("peak_hbm_gib", 0.0) for r in ok))
            for key in PHASES:  # where the step's time went (issue 40), medians over the invocations
                values = [r[key] for r in ok if r.get(key) is not None]
                if values:
                    entry[f"{key}_median"] = protocol.spread(values)["median"]
            rates = [r["tokens_per_s_fwd_bwd"] for r in ok if r.get("tokens_per_s_fwd_bwd")]
            if rates:
                entry["tokens_per_s_fwd_bwd_median"] = protocol.spread(rates)["median"]
        # a family's best point is the family's row; another setting of it (--also) is a row of its own
        family = family_of(spec)
        families[family if best.get(family, spec) == spec else spec] = entry
    ours_name = LAYER_MAJOR if table.kind == "train" else "speedloader-int4"
    ratios = {}
    ours = families.get(ours_name)
    fastest = fastest_fwd_bwd(families)
    if ours and ours["median"]:
        for name, theirs in families.items():
            if name == ours_name or not theirs["median"]:
                continue
            r = ratio_of(ours, theirs, figures)
            if table.kind == "train" and name in PEERS and theirs.get("sub_batch_size"):
                r.update(peer_case(table, theirs["sub_batch_size"]))
                if fastest:
                    r["bound"] = fastest / theirs["median"]
                    r["target_within_bound"] = r["bound"] >= r["target"]
            ratios[f"{ours_name}/{name}"] = r
        peers = [(families[p]["median"], p) for p in PEERS if families.get(p, {}).get("median")]
        if peers:
            ratios["best_peer"] = max(peers)[1]
    # schedule=auto (its own choice of schedule) over each canonical peer: what a user of the trainer gets there.
    auto = families.get(AUTO)
    for peer in PEERS if auto and auto["median"] else ():
        if families.get(peer, {}).get("median"):
            ratios[f"{AUTO}/{peer}"] = ratio_of(auto, families[peer], figures)
    # DeepSpeed runs eager: beside it, layer-major eager too (the like-for-like ratio; the compiled one above).
    eager, deepspeed = families.get(EAGER), families.get("deepspeed-offload")
    if eager and eager["median"] and deepspeed and deepspeed["median"]:
        ratios[f"{EAGER}/deepspeed-offload"] = ratio_of(eager, deepspeed, figures)
    starts = {inv.get("boot_id") or f"unknown {inv['index']}" for inv in record["invocations"]}
    missing = max(0, protocol.MIN_INVOCATIONS - len(record["invocations"])) if record.get("protocol", True) else 0
    # a peer swept but not repeated is no row above; its best sweep point says whether it may be the best peer
    unrepeated = {}
    for peer in PEERS if table.kind == "train" else ():
        row = protocol.best_point([r for r in record.get("sweep", []) if family_of(r["spec"]) == peer],
                                  key=table.figure)
        if row is not None and peer not in families:
            unrepeated[peer] = {"spec": row["spec"], table.figure: row[table.figure]}
    return {"families": families, "ratios": ratios, "machine_starts": len(starts), "invocations_missing": missing,
            "sweep_pending": sweep_pending(record, table), "peers_not_repeated": unrepeated}


def write(record: dict, path: Path, table: Table, args: argparse.Namespace) -> None:
    record["summary"] = summarize(record, table)
    if not args.dry_run:
        harness.write_record(path, record)


def markdown(record: dict, table: Table) -> str:
    lines = [f"{table.name} ({record['device']}, commit {record['commit'][:10]}): {table.note}", "",
             f"| family | best point | {table.figure} median | min-max | n | spread |", "|---|---|---|---|---|---|"]
    for family, s in record["summary"]["families"].items():
        if s["median"] is None:
            lines.append(f"| {family} | {s['spec']} | - | - | 0 | {s['not_ok']} |")
            continue
        lines.append(f"| {family} | {s['spec']} | {s['median']:,.1f} | {s['min']:,.1f}-{s['max']:,.1f} | {s['n']} "
                     f"| {s['spread']:.1%} |")
    for name, r in record["summary"]["ratios"].items():
        if isinstance(r, dict):
            lines.append(f"- {name}: **{r['ratio']:.2f}x**" + (" (ranges overlap: no measurable difference)"
                                                              if r["overlap"] else "")
                         + (f" (over the invocations both ran in: {', '.join(map(str, r['invocations']))})"
                            if r.get("invocations") else "")
                         + (" (rows of separate invocations: not a protocol ratio until they run together)"
                            if r.get("separate_invocations") else ""))
    missing = record["summary"]["invocations_missing"]
    lines.append(f"- {len(record['invocations'])} invocations on {record['summary']['machine_starts']} start(s) of the "
                 "machine" + (f"; {missing} more to come (a later --partial repeat, or the same --budget-s command)"
                                 if missing else ""))
    for peer, best in record["summary"].get("peers_not_repeated", {}).items():
        lines.append(f"- {peer}: swept, not repeated: its best point {best['spec']} ran at {best[table.figure]:,.1f}")
    for family, left in record["summary"].get("sweep_pending", {}).items():
        plural = "es" if len(left) > 1 else ""
        lines.append(f"- {family}'s sweep is partial: {len(left)} micro-batch{plural} not run yet "
                     f"({', '.join(left)}): run --part sweep again")
    lines.append("")
    lines.append(f"sweep: {sum(r['status'] == 'ok' for r in record['sweep'])} points ran, "
                 f"{sum(r['status'] == 'oom' for r in record['sweep'])} out of memory, "
                 f"{sum(r['status'] not in ('ok', 'oom') for r in record['sweep'])} other")
    return "\n".join(lines)


def record_path(table: Table, args: argparse.Namespace) -> Path:
    load = (f"_busy{args.host_busy}" if args.host_busy else "") + (f"_copy{args.host_copy}" if args.host_copy else "")
    return Path(args.out_dir, f"fair_{table.name}{load}.json")


# A sweep point only ranks a family's settings (the repeat measures the best one under the protocol): at large
# batches, where one step takes many seconds, fewer timed steps halve the sweep.
MIN_SWEEP_STEPS, MIN_SWEEP_WARMUP = 2, 1

COMMAND_KEYS = ("command", "commit", "device", "timestamp", "boot_id")  # each command that appended to a record


def load_record(table: Table, args: argparse.Namespace, path: Path) -> dict:
    header = harness.record_header("fair", __file__, device=harness.cpu_name() if args.device == "cpu" else None)
    if path.is_file():
        record = json.loads(path.read_text())
        if not same_table(record["table"], table):
            raise SystemExit(f"{path} holds another definition of {table.name}: move it away or use another --out-dir")
        if record["device"] != header["device"] and not args.dry_run:
            raise SystemExit(f"{path} was measured on {record['device']}, this machine is {header['device']}: the rows "
                             "of one table come from one GPU model (docs/benchmarking.md); use another --out-dir")
        check_peers_chunked(record, path)
        record["commands"].append({k: header[k] for k in COMMAND_KEYS})
        return record
    return {**header, "commands": [{k: header[k] for k in COMMAND_KEYS}],
            "table": dataclasses.asdict(table), "protocol": not args.quick,
            "rules": {"invocations": args.invocations, "steps": args.steps, "warmup": args.warmup},
            "host_load": {"busy": args.host_busy, "copy": args.host_copy}, "sweep": [], "invocations": []}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", help="a table name (--list shows them)")
    parser.add_argument("--list", action="store_true", help="the tables, their work and contender families")
    parser.add_argument("--part", choices=("sweep", "repeat", "all"), default="all")
    parser.add_argument("--family", action="append", default=[], help="only these families (repeatable)")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--invocations", type=int, default=protocol.MIN_INVOCATIONS)
    parser.add_argument("--steps", type=int, default=protocol.MIN_TIMED_STEPS)
    parser.add_argument("--warmup", type=int, default=protocol.MIN_WARMUP_STEPS)
    parser.add_argument("--sweep-steps", type=int, default=None,
                        help="training sweep points: this many timed steps (default --steps); the sweep chooses each "
                             "family's best point, the repeat measures it with --steps; at least %d" % MIN_SWEEP_STEPS)
    parser.add_argument("--sweep-warmup", type=int, default=None,
                        help="training sweep points: this many warm-up steps (default --warmup; at least %d: the "
                             "compile)" % MIN_SWEEP_WARMUP)
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="start no worker that would end after S seconds (by the record's wall times): a part of "
                             "a table per device command; run the same command again until it says the table is "
                             "complete. The repeat then counts --invocations as the total the record should hold")
    parser.add_argument("--quick", action="store_true", help="allow fewer than the protocol's minimums (marked)")
    parser.add_argument("--partial", action="store_true",
                        help="repeat: fewer invocations than the minimum now, a later command (another start of the "
                             "machine) adds the rest to the same record; its summary says how many are missing")
    parser.add_argument("--host-busy", type=int, default=0, help="busy-loop processes beside every worker")
    parser.add_argument("--host-copy", type=int, default=0, help="memory-copy processes beside every worker")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per worker")
    parser.add_argument("--gpus", type=int, default=1,
                        help="split the machine into this many slots (a GPU and an equal share of the host's "
                             "cores each): the sweep runs up to this many families' sweeps at once, one per slot; the "
                             "repeat runs one worker at a time on the first slot, the share a sweep point had")
    parser.add_argument("--also", action="append", default=[], metavar="SPEC",
                        help="repeat: another setting beside the best points (a lever's A/B), its own summary row")
    parser.add_argument("--points-from", action="append", default=[], metavar="RECORD",
                        help="take the sweep points from another record of this table (marked), instead of a sweep; "
                             "repeatable: a family's points come from the first record that has any")
    parser.add_argument("--profile", action="store_true",
                        help="training workers trace one extra step (stream busy time, launch gaps, copies)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a check of the code path (tests); no figure means anything")
    parser.add_argument("--dry-run", action="store_true", help="print the worker commands, launch nothing")
    args = parser.parse_args(argv)
    if args.list or not args.table:
        for t in TABLES.values():
            print(f"{t.name:28s} {t.kind:5s} {t.model} L{t.layers or 'all'} s{t.seq_len} batch {t.batch} "
                  f"cap {t.cap_gib:g} GiB {'headline' if t.headline else 'map'}: "
                  f"{', '.join(with_eager(t, t.families))}")
        return 0
    if args.table not in TABLES:
        parser.error(f"unknown table {args.table!r}; --list shows the {len(TABLES)} tables")
    table = TABLES[args.table]
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: use 1 or more")
    for flag, value, least in (("--sweep-steps", args.sweep_steps, MIN_SWEEP_STEPS),
                               ("--sweep-warmup", args.sweep_warmup, MIN_SWEEP_WARMUP)):
        if value is not None and value < least:
            parser.error(f"{flag} {value}: at least {least} (a sweep point still has to time a step after the "
                         "compiling one)")
    if args.gpus > 1 and (args.host_busy or args.host_copy):
        parser.error("--gpus runs workers side by side, which is its own host load: drop --host-busy/--host-copy, or "
                     "--gpus")
    if args.gpus > 1:
        try:
            slots(args.gpus)
        except ValueError as e:
            parser.error(str(e))
    if args.gpus > 1 and args.device == "cuda" and not args.dry_run:
        import torch  # only here: the parent launches workers and never touches the GPU otherwise

        if torch.cuda.device_count() < args.gpus:
            parser.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    families = args.family or list(table.families)
    known = with_eager(table, table.families) + ([AUTO] if table.kind == "train" else [])
    unknown = sorted(set(families) - set(known))
    if unknown:
        parser.error(f"table {table.name} has no families {unknown}; it has {', '.join(known)}")
    # As the trainer sets it; before the record is made, which says what every worker ran with.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    path = record_path(table, args)
    record = load_record(table, args, path)
    if args.partial and args.budget_s is not None:
        parser.error("--partial with --budget-s: drop --partial (under a budget --invocations is the record's total, "
                     "reached over as many commands as it takes)")
    if not args.quick:
        # A repeat may continue a record (another start of the GPU machine): its invocations count toward the minimum.
        done = len(record["invocations"]) if args.budget_s is None else 0  # with a budget: the total, not more
        if args.partial and args.part != "repeat":
            parser.error("--partial is for --part repeat (the sweep runs once)")
        try:
            protocol.check_protocol(invocations=protocol.MIN_INVOCATIONS if args.partial else
                                    args.invocations + (done if args.part == "repeat" else 0),
                                    steps=args.steps, warmup=args.warmup)
        except ValueError as e:
            parser.error(str(e))
    if args.quick:
        record["protocol"] = False
    args.budget = Budget(args.budget_s)
    for source in args.points_from:
        take_points(record, table, with_eager(table, families), Path(source))
    if args.part in ("sweep", "all"):
        sweep(table, with_eager(table, families), args, record, path)
    if args.part in ("repeat", "all") and not args.dry_run and not args.budget.stopped_before:
        repeat(table, families, args, record, path)
    write(record, path, table, args)
    if not args.dry_run:
        print(markdown(record, table))
    if args.budget.stopped_before:
        print(f"budget: {time.monotonic() - args.budget.began:.0f} of {args.budget_s:g} s used; not started: "
              f"{', '.join(args.budget.stopped_before)}; run the same command again to go on", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
