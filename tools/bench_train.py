"""Training throughput, side by side on one GPU: speedloader vs FSDP2 offload vs on-device.

Each contender runs in its own process (fresh CUDA context and allocator, the same GPU-memory
cap), on the same model shape, sequence length and effective batch, with random tokens:

  speedloader     layer-major, parameters/gradients/optimizer state on the host (CPUOffloadPolicy)
  speedloader-overlap  the same, each unit's CPU optimizer step overlapped with the backward
  fsdp2-offload   FSDP2 + CPUOffloadPolicy, canonical gradient accumulation over micro-batches without
                  gradient sync (fp32 unsharded gradients accumulate on the GPU, one reduce-scatter)
  fsdp2-offload-rs  the same, reduce-scattering every micro-batch (gradients accumulate on the host)
  ondevice        FSDP2 with everything on the GPU, canonical accumulation, same recompute policy
                  (activation checkpointing of every block), the ceiling for the same blocks; with
                  ``:recompute=off`` none is recomputed (the ceiling where its activations fit)
  deepspeed-offload  DeepSpeed ZeRO-3, parameters and DeepSpeedCPUAdam on the host (tools/bench_deepspeed.py)
  auto            the trainer with schedule=auto as a user runs it, ``auto:B`` (B sequences; tools/bench_auto.py)

Usage (one GPU):
  python tools/bench_train.py --model llama2_7b --layers 8 --seq-len 4096 \
      --contender speedloader-overlap:1x8 --contender fsdp2-offload:1x8 --contender ondevice:1x8 \
      --max-gpu-memory-gib 40 --name llama7b_L8_b8
Each ``--contender NAME:nxN`` sets the sub-batch (micro-batch) size n and their number N.

``--model`` is any shape of ``conf/model/`` (llama2_7b, llama3_8b, qwen3_8b, mistral_7b, gemma3_12b,
mixtral_8x7b, qwen3_30b_a3b, ...; or the path of a YAML file of ModelConfig fields), loaded through
``ModelConfig`` with ``--layers`` blocks: the same layers, fewer of them. Every contender builds it from that
``ModelConfig`` (the Hugging Face class of its family); the FSDP2 contenders shard each block, a mixture of
experts' block with all its experts, as one unit. MFU counts the adapter's ``flops_per_token``: for a mixture
of experts only the routed experts' parameters (the record's ``model.mfu_basis`` says which). Every contender
of a mixture of experts runs the same Hugging Face experts kernel, ``--experts-implementation`` (default
grouped_mm, transformers 5's own; recorded per row). ``:cap=GiB`` or ``:cap=none`` gives one contender its
own GPU cap (the on-device ceiling of a model whose states exceed the others' cap):
  python tools/bench_train.py --model qwen3_30b_a3b --layers 4 --seq-len 4096 --max-gpu-memory-gib 40 --compile \
      --contender speedloader-overlap:2x4:root=device --contender fsdp2-offload:2x4 \
      --contender deepspeed-offload:2x4 --contender ondevice:2x4:cap=none --steps 3 --warmup 1
``--device cpu`` runs a worker on the CPU: a check of the code path (tests), no figure means anything.
A worker under torchrun (tools/bench_scale.py) shards over every rank; ``--dp-replicate R`` gives it an HSDP mesh
instead (R replicas, one per node; recorded as ``mesh``), except DeepSpeed's, which stays ZeRO-3 over all ranks.
``--param-transfer-dtype bf16`` makes the speedloader contenders transfer a bf16 copy of each offloaded
fp32 shard (half the host-to-device parameter bytes); a ``:transfer=bf16`` or ``:transfer=fp32``
suffix sets it per contender, so one invocation compares both (``--compile`` and ``:compile`` / ``:eager``
likewise run the blocks through one ``torch.compile``d forward; ``:root=device`` keeps the embeddings, final
norm and LM head of a speedloader contender on the GPU):
  python tools/bench_train.py --model llama2_7b --layers 8 --seq-len 4096 --max-gpu-memory-gib 40 \
      --contender speedloader-overlap:4x2 --contender speedloader-overlap:4x2:transfer=bf16 --steps 3 --warmup 1
Kernel levers (``fsdp_speedloader.kernels``, every contender but DeepSpeed, recorded per row): ``:sdpa=cudnn`` (or
flash, efficient, math) pins the blocks' attention backend, ``:liger`` binds Liger's RMSNorm, SwiGLU and RoPE,
``:fp8`` (or ``:fp8=rowwise``) makes the blocks' linears torchao float8 (MFU stays against the bf16 peak);
tools/bench_fair.py's levers table gives them to every contender.
The speedloader contenders are built from one ``SpeedLoaderOptions``; the FSDP2 contenders are the trainer's
canonical schedule (``fsdp_speedloader.app.canonical.apply_schedule``), and their step is the trainer's own
(``fsdp_speedloader.app.canonical.canonical_forward_backward``).

Writes bench/results/<name>.json (tools/harness.py's header: device, torch version, commit, command; then
config and every figure; a contender out of memory is recorded as ``status: oom``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

# bench_fair --gpus: this worker's share of the host's cores (comma-separated), taken before any library loads:
# OpenMP sizes its thread team from the affinity it finds then.
WORKER_CPUS_ENV = "FSL_WORKER_CPUS"
if os.environ.get(WORKER_CPUS_ENV):
    os.sched_setaffinity(0, {int(c) for c in os.environ[WORKER_CPUS_ENV].split(",")})

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: its modules import by name
from fsdp_speedloader import openmp_wait  # noqa: E402 (before torch, as in the trainer: openmp_wait.py)
import harness  # noqa: E402
import protocol  # noqa: E402

REPO = harness.REPO
# Shapes without a conf/model file: hidden, intermediate, heads, kv heads, vocab (depth is --layers). Every
# other --model is conf/model/<name>.yaml (llama2_7b and llama2_13b moved there: the same model, so their
# records stay comparable).
SHAPES = {
    "llama_1b": (2048, 5632, 16, 16, 32000),
}


def model_names() -> list[str]:
    """Every ``--model`` name: the shapes of conf/model/ and the few of ``SHAPES``."""
    return sorted(set(SHAPES) | set(harness.conf_model_names()))


def model_config(args: argparse.Namespace):
    """The ``--model`` shape with ``--layers`` blocks, positions for ``--seq-len`` (every contender's model)."""
    if args.model in SHAPES:
        from fsdp_speedloader.models.config import ModelConfig

        hidden, inter, heads, kv, vocab = SHAPES[args.model]
        return ModelConfig(name=args.model, hidden_size=hidden, intermediate_size=inter, num_layers=args.layers,
                           num_heads=heads, num_kv_heads=kv, vocab_size=vocab, max_position_embeddings=args.seq_len)
    return harness.model_config(args.model, layers=args.layers, min_positions=args.seq_len)


def _merged(intervals: list) -> list:
    """The union of (start_us, end_us) intervals as sorted, disjoint intervals."""
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _union_s(intervals: list) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals."""
    return sum(b - a for a, b in _merged(intervals)) / 1e6


def _overlap_s(first: list, second: list) -> float:
    """Seconds during which both unions of intervals are busy."""
    a, b = _merged(first), _merged(second)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e6


def timeline(step_s: float, compute: list, copies: list) -> dict:
    """Where the step's time went on the GPU: compute and copies together, compute alone, copies alone, and
    neither (the GPU waited for the host: Python, launches, synchronisations, the CPU optimizer). A step whose
    'neither' is large is bound by the host, whatever the link or the kernels would allow."""
    both = _overlap_s(compute, copies)
    compute_s, copies_s = _union_s(compute), _union_s(copies)
    idle = max(0.0, step_s - (compute_s + copies_s - both))
    return {"compute_and_copies_s": both, "compute_only_s": compute_s - both, "copies_only_s": copies_s - both,
            "gpu_idle_s": idle}


def launch_gaps(spans: list, *, long_us: float = 50.0) -> dict:
    """Idle gaps between consecutive kernels of one stream (µs spans): their count, total seconds, and those longer
    than ``long_us`` (the stream waited for the host to launch, or for a copy or event, not for a kernel's tail)."""
    merged = _merged(spans)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    long = [g for g in gaps if g > long_us]
    return {"count": len(gaps), "total_s": sum(gaps) / 1e6, "long_count": len(long), "long_total_s": sum(long) / 1e6,
            "long_us": long_us}


def attribute_gaps(compute: list, collectives: list, copies: list, *, long_us: float = 50.0,
                   slack_us: float = 30.0) -> dict:
    """What each long idle gap of the compute stream waited for: a gap that ends within ``slack_us`` of a collective
    kernel's end (on another stream) waited for that collective, else one that ends so after a copy waited for the
    copy, else the host (the next kernel was launched late: Python, synchronisations, the CPU optimizer). Seconds and
    counts per cause. A collective's kernel runs until its slowest rank joins, so time charged to collectives
    includes the other ranks' lateness."""
    out = {f"{cause}_{unit}": 0.0 if unit == "s" else 0 for cause in ("collective", "copy", "host")
           for unit in ("s", "count")}
    for gap_start, gap_end, cause in long_gaps(compute, collectives, copies, long_us=long_us, slack_us=slack_us):
        out[f"{cause}_s"] += (gap_end - gap_start) / 1e6
        out[f"{cause}_count"] += 1
    return {**out, "long_us": long_us, "slack_us": slack_us}


def long_gaps(compute: list, collectives: list, copies: list, *, long_us: float = 50.0,
              slack_us: float = 30.0) -> list:
    """The compute stream's gaps longer than ``long_us`` as (start_us, end_us, cause), cause as
    :func:`attribute_gaps` tells it."""
    merged = _merged(compute)
    ends = {"collective": sorted(b for _, b in collectives), "copy": sorted(b for _, b in copies)}
    out = []
    for (_, gap_start), (gap_end, _) in zip(merged, merged[1:]):
        if gap_end - gap_start <= long_us:
            continue
        cause = next((c for c in ("collective", "copy")
                      if any(gap_end - slack_us <= e <= gap_end and e >= gap_start for e in ends[c])), "host")
        out.append((gap_start, gap_end, cause))
    return out


def host_gaps_during(gaps: list, named: dict) -> dict:
    """Of the compute stream's gaps that waited for the host (``long_gaps``' cause 'host'), the seconds during which
    each named host wait was under way (``named``: name -> its (start_us, end_us) spans, on any thread:
    ``speedloader::grad_ring_wait``, the backward blocked on a gradient region; ``speedloader::optimizer_wait``, the
    forward blocked on a CPU step), and ``unnamed_s``, the rest: what launched the next kernel late was something
    else (Python, launches, the interpreter lock)."""
    host = [(a, b) for a, b, cause in gaps if cause == "host"]
    every = [span for spans in named.values() for span in spans]
    out = {name: _overlap_s(host, spans) for name, spans in sorted(named.items())}
    out["unnamed_s"] = _union_s(host) - _overlap_s(host, every)
    return out


def copy_gaps_by_copy(gaps: list, copies: dict, *, slack_us: float = 30.0) -> dict:
    """The seconds of the compute stream's copy gaps (``long_gaps``' cause 'copy') by the copy that ended just before
    each (within ``slack_us`` of its end; the latest such one): keyed 'DIRECTION SIZE MiB' (``copies``: direction ->
    [(start_us, end_us, bytes)]). Sizes tell a unit's parameters from a sub-batch's activations."""
    out: dict = {}
    for gap_start, gap_end, cause in gaps:
        if cause != "copy":
            continue
        ended = [(end, kind, size) for kind, spans in copies.items() for _, end, size in spans
                 if gap_end - slack_us <= end <= gap_end and end >= gap_start]
        if ended:
            _, kind, size = max(ended)
            key = f"{kind} {size / 2**20:.0f} MiB"
            out[key] = out.get(key, 0.0) + (gap_end - gap_start) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def late_launches(gaps: list, kernel_ids: dict, launches: dict, host_ops: dict, *, top: int = 12) -> dict:
    """For each gap the compute stream waited for the host (``long_gaps``' cause 'host'): was the kernel after it
    queued before the gap began (``queued_before_s``: it waited on the GPU for something the gap rule does not see,
    an event on another stream) or during it (``queued_late_s``), and, for late ones, what the queuing thread ran
    between the gap's start and the launch (``late_thread_ran_s``: operator and annotation names, seconds of overlap,
    nested ones counted each, the ``top`` longest). ``kernel_ids``: kernel start -> correlation id on the compute
    stream; ``launches``: correlation id -> (ts, thread); ``host_ops``: thread -> [(ts, end, name)]."""
    out = {"queued_before_s": 0.0, "queued_late_s": 0.0, "unmatched_s": 0.0}
    ran: dict = {}
    ordered = {tid: sorted(ops) for tid, ops in host_ops.items()}
    starts = {tid: [op[0] for op in ops] for tid, ops in ordered.items()}
    longest = {tid: max((b - a for a, b, _ in ops), default=0) for tid, ops in ordered.items()}
    for gap_start, gap_end, cause in gaps:
        if cause != "host":
            continue
        launch = launches.get(kernel_ids.get(gap_end))
        if launch is None:
            out["unmatched_s"] += (gap_end - gap_start) / 1e6
            continue
        launched, tid = launch
        if launched <= gap_start:
            out["queued_before_s"] += (gap_end - gap_start) / 1e6
            continue
        out["queued_late_s"] += (gap_end - gap_start) / 1e6
        window_end = min(launched, gap_end)
        ops, first = ordered.get(tid, []), starts.get(tid, [])
        i = bisect.bisect_left(first, window_end)  # ops starting before the window ends, back to the longest one
        while i > 0 and ops[i - 1][0] >= gap_start - longest[tid]:
            i -= 1
            a, b, name = ops[i]
            overlap = min(b, window_end) - max(a, gap_start)
            if overlap > 0:
                ran[name] = ran.get(name, 0.0) + overlap / 1e6
    out["late_thread_ran_s"] = dict(sorted(ran.items(), key=lambda kv: -kv[1])[:top])
    return out


# CUDA runtime calls that block the calling host thread until the GPU reaches a point.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def host_syncs(syncs: list, host_ops: dict, launcher, *, top: int = 8) -> dict:
    """The host's blocking CUDA calls (``syncs``: [(ts, end, call name, thread)]) split between the thread that
    queued the compute stream's kernels (``launcher``: while it blocks, nothing new reaches the GPU) and the others
    (the optimizer worker waiting for gradients: harmless), in seconds per call; and, for the launching thread, the
    innermost operator or annotation each sync ran inside (``launcher_inside``, the ``top`` longest; '(none)' outside
    any): which part of the step waited for the GPU."""
    out: dict = {"launcher": {}, "others": {}}
    inside: dict = {}
    ops = sorted(host_ops.get(launcher, []))
    for ts, end, name, tid in syncs:
        side = out["launcher" if tid == launcher else "others"]
        side[name] = side.get(name, 0.0) + (end - ts) / 1e6
        if tid == launcher:
            enclosing = [op for op in ops if op[0] <= ts and op[1] >= end]
            label = max(enclosing, key=lambda op: op[0])[2] if enclosing else "(none)"  # the innermost: latest start
            inside[label] = inside.get(label, 0.0) + (end - ts) / 1e6
    out["launcher_inside"] = dict(sorted(inside.items(), key=lambda kv: -kv[1])[:top])
    return out


def host_thread_usage() -> tuple[float, int]:
    """The calling thread's CPU seconds and involuntary context switches so far (Linux: RUSAGE_THREAD; elsewhere
    the process's): a step whose thread CPU time is near its wall time is bound by the host thread, and switches
    that grow under host load are the thread being preempted."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    usage = resource.getrusage(who)
    return time.thread_time(), usage.ru_nivcsw


def summarize_trace(path: str, step_s: float) -> dict:
    """One profiled step: busy time per CUDA stream, copies by direction, top kernels.

    The compute stream is the one with the most kernel time; its idle time within the step is an
    upper bound on the time compute waited (on copies, collectives or the CPU).
    """
    events = json.loads(Path(path).read_text())["traceEvents"]
    kernels: dict = {}
    collectives: list = []  # NCCL's kernels, whatever stream they run on
    copies: dict = {}  # direction -> [(start_us, end_us, bytes)]
    by_name: dict = {}
    host_calls: dict = {}  # CUDA runtime calls on the host (launches, synchronisations, event waits)
    named: dict = {}  # the package's host waits, named with record_function ("speedloader::..."): name -> spans
    launches: dict = {}  # correlation id -> (ts, host thread) of the CUDA call that queued the GPU work
    host_ops: dict = {}  # host thread -> [(ts, end, name)] of its operators and annotations
    syncs: list = []  # (ts, end, name, thread) of the host's blocking CUDA calls
    kernel_ids: dict = {}  # stream -> {kernel start: correlation id}
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") == "X" and cat in ("cuda_runtime", "cuda_driver"):
            launches[e.get("args", {}).get("correlation")] = (e["ts"], e.get("tid"))
        if e.get("ph") == "X" and cat == "cuda_runtime":
            host_calls[e["name"]] = host_calls.get(e["name"], 0.0) + e["dur"] / 1e6
            if e["name"] in BLOCKING_CALLS:
                syncs.append((e["ts"], e["ts"] + e["dur"], e["name"], e.get("tid")))
        if e.get("ph") == "X" and cat in ("cpu_op", "user_annotation"):
            host_ops.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        if e.get("ph") == "X" and cat == "user_annotation" and e["name"].startswith("speedloader::"):
            named.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (e["ts"], e["ts"] + e["dur"])
        if cat == "gpu_memcpy":
            kind = e["name"].split("(")[0].replace("Memcpy", "").strip()  # HtoD, DtoH, DtoD
            copies.setdefault(kind, []).append((*span, e.get("args", {}).get("bytes", 0)))
        elif cat == "kernel":
            stream = e.get("args", {}).get("stream", -1)
            kernels.setdefault(stream, []).append(span)
            kernel_ids.setdefault(stream, {})[e["ts"]] = e.get("args", {}).get("correlation")
            if e["name"].startswith("nccl"):
                collectives.append(span)
            by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"] / 1e6
    busy = {stream: _union_s(spans) for stream, spans in kernels.items()}
    stream = max(busy, key=busy.get) if busy else None  # the compute stream: the most kernel time
    compute = None if stream is None else str(stream)
    compute_spans, compute_ids = kernels.get(stream, []), kernel_ids.get(stream, {})
    all_copies = [(a, b) for spans in copies.values() for a, b, _ in spans]
    gaps = long_gaps(compute_spans, collectives, all_copies)
    queued_by: dict = {}  # thread -> compute-stream kernels it queued
    for correlation in compute_ids.values():
        if correlation in launches:
            queued_by[launches[correlation][1]] = queued_by.get(launches[correlation][1], 0) + 1
    launcher = max(queued_by, key=queued_by.get) if queued_by else None
    return {
        "step_s": step_s,
        "stream_busy_s": {str(k): v for k, v in busy.items()},
        "compute_stream": compute,
        "compute_idle_fraction": (1 - busy[stream] / step_s) if compute else None,
        "copies": {k: {"gib": sum(size for *_, size in v) / 2**30, "busy_s": _union_s([(a, b) for a, b, _ in v])}
                   for k, v in copies.items()},
        "top_kernels_s": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:15]),
        "timeline": timeline(step_s, compute_spans, all_copies),
        "compute_launch_gaps": launch_gaps(compute_spans),
        "compute_gaps_waited_for": attribute_gaps(compute_spans, collectives, all_copies),
        # which of the package's named host waits were under way while the compute stream waited for the host
        "host_gaps_during": host_gaps_during(gaps, named),
        # when the kernel after each such gap was queued, and what its thread ran meanwhile
        "host_gaps_launches": late_launches(gaps, compute_ids, launches, host_ops),
        # which copies the compute stream's copy gaps waited for, by direction and size
        "copy_gaps_by_copy": copy_gaps_by_copy(gaps, copies),
        "named_waits_s": {name: _union_s(spans) for name, spans in sorted(named.items())},
        "top_host_cuda_calls_s": dict(sorted(host_calls.items(), key=lambda kv: -kv[1])[:8]),
        # who blocked on the GPU: the launching thread (and inside which operator) or the others
        "host_syncs": host_syncs(syncs, host_ops, launcher),
    }


def time_steps(fwd_bwd: Callable, optimizer_step: Callable, args: argparse.Namespace, *, sync: Callable,
               reset_peak: Callable) -> tuple[list, list, list, Optional[dict], dict]:
    """Warm-up, then ``args.steps`` timed steps (fwd+bwd and optimizer timed apart, synchronised at
    the phase boundaries), then with ``args.profile`` one traced step summarized by ``summarize_trace``.

    Returns (fwd+bwd seconds, optimizer seconds, losses) of the timed steps, the profile summary, and the main
    thread's median CPU seconds and involuntary context switches per timed forward+backward, with the caching
    allocator's retries during the timed steps (``alloc_retries_timed``: each one freed the cache and synchronised),
    and the steps' wall seconds (``worker_phases_s``: the first step's, with compilation and first allocations, the
    other warm-up steps', the timed steps').
    """
    fb_times, opt_times, losses, host_cpu, switches = [], [], [], [], []
    retries_at_start = 0
    walls = []  # each step's wall seconds, warm-up included (the first compiles): where a worker's time goes
    for step in range(args.warmup + args.steps):
        sync()
        cpu0, sw0 = host_thread_usage()
        t0 = time.perf_counter()
        loss = fwd_bwd()
        sync()
        t1 = time.perf_counter()
        cpu1, sw1 = host_thread_usage()
        optimizer_step()
        sync()
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        if step == args.warmup - 1:
            reset_peak()
            retries_at_start = alloc_retries()
        if step >= args.warmup:
            fb_times.append(t1 - t0)
            opt_times.append(t2 - t1)
            losses.append(float(loss))
            host_cpu.append(cpu1 - cpu0)
            switches.append(sw1 - sw0)

    def traced_step() -> float:
        sync()
        t0 = time.perf_counter()
        fwd_bwd()
        optimizer_step()
        sync()
        return time.perf_counter() - t0

    profile = harness.profile_summary(traced_step, summarize_trace) if args.profile else None  # one more step
    host = {"host_thread_cpu_s": statistics.median(host_cpu) if host_cpu else None,
            "host_thread_involuntary_switches": statistics.median(switches) if switches else None,
            "alloc_retries_timed": alloc_retries() - retries_at_start,
            "worker_phases_s": {"first_step": walls[0] if walls else None,
                                "other_warmup_steps": sum(walls[1:args.warmup]), "timed_steps": sum(walls[args.warmup:])}}
    return fb_times, opt_times, losses, profile, host


def alloc_retries() -> int:
    """The caching allocator's cudaMalloc retries so far in this process (0 without CUDA)."""
    import torch

    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_initialized() else 0


class Contender(NamedTuple):
    name: str
    shape: str  # 'nxN'
    transfer: Optional[str]  # 'bf16' or None
    compiled: bool
    root_on_device: bool
    cap: Optional[str] = None  # its own GPU cap: GiB, or 'none' (uncapped); None: --max-gpu-memory-gib
    keep: int = 0  # speedloader: keep_activations, (unit, sub-batch) pairs that skip the recompute
    sdpa: str = "auto"  # the blocks' scaled_dot_product_attention backend (kernels.sdpa_backend)
    liger: bool = False  # Liger's RMSNorm, SwiGLU and RoPE (kernels.liger_kernels)
    fp8: Optional[str] = None  # a torchao float8 recipe for the blocks' linears (kernels.float8_training)
    states: str = "fp32"  # speedloader-overlap: AdamW's moments of host-resident parameters (optim.state_dtype)
    threads: int = 0  # speedloader-overlap: the optimizer worker's CPU threads (optim.worker_threads; 0: default)
    slots: int = 4  # speedloader-overlap: in-flight gradient regions (optim.grad_slots_in_flight; 0: one per param)
    adamw: str = "local"  # speedloader-overlap's fp32 AdamW: 'local' (LocalShardAdamW), 'pool' (its host pool) or 'torch'
    dev: int = 0  # offloading contenders: units 1 .. dev keep their states on the GPU (offload.device_units)
    recompute: bool = True  # FSDP2 contenders: every block recomputed in backward (schedule.activation_checkpointing)
    sync: Optional[str] = None  # FSDP2 contenders: schedule.gradient_sync ('every', 'last'); None: the contender's own
    reshard: bool = True  # FSDP2 contenders: schedule.reshard_after_forward (False: gathered once per step)
    nice: int = 0  # speedloader-overlap: the optimizer worker's niceness raised by this much (optim.worker_nice)
    affinity: bool = False  # speedloader-overlap: the worker on this rank's CPUs less one (optim.worker_affinity)
    env: tuple = ()  # every contender: (NAME, VALUE) its worker process starts with (contender_env)
    prefetch: Optional[int] = None  # every contender but DeepSpeed: units unsharded ahead in forward; None: --prefetch
    ascending: bool = False  # speedloader contenders: every loop over the sub-batches 0 .. N-1 (alternate_sub_batches off)
    recompute_every: int = 1  # FSDP2 contenders with recompute: only every k-th block (activation_checkpointing_every)
    loss: str = "chunked"  # FSDP2 and DeepSpeed contenders: the head's loss chunked as layer-major's, or 'hf' (all logits)


def contender_env(spec: str, base: Optional[dict] = None) -> dict:
    """The environment a contender's worker process starts with: ``base`` (default: this process's) plus the
    contender's ``:env=NAME=VALUE`` options. Set by the launcher, because what they set is read when a library loads
    (OpenMP reads ``OMP_WAIT_POLICY`` then), before the worker could set it itself."""
    env = dict(os.environ if base is None else base)
    for option in spec.split(":")[1:]:
        key, _, value = option.partition("=")
        if key == "env" and "=" in value:
            name, _, val = value.partition("=")
            env[name] = val
    return env


def parse_contender(spec: str, default_transfer: Optional[str], default_compile: bool = False) -> Contender:
    """'NAME:nxN[:transfer=bf16|fp32][:compile|:eager][:root=device][:cap=GiB|none][:keep=K][:sdpa=B][:liger]
    [:fp8[=RECIPE]][:states=fp32|bf16|int8][:threads=K][:slots=R][:adamw=local|pool|torch][:dev=K][:recompute=off]
    [:sync=every|last][:reshard=off][:nice=K][:affinity][:env=NAME=VALUE]'
    -> a ``Contender``.
    ``default_transfer`` / ``default_compile``: ``--param-transfer-dtype`` (speedloader contenders) and
    ``--compile`` (every contender but DeepSpeed) for a contender without the suffix. ``root=device``
    (speedloader and FSDP2-offload contenders): the embeddings, final norm and LM head keep their states on the
    GPU. ``cap`` (every contender): its own GPU-memory cap in GiB, or none, instead of ``--max-gpu-memory-gib``.
    ``keep`` (speedloader contenders): ``keep_activations``, pairs whose backward skips the recompute. The kernel levers
    (every contender but DeepSpeed; ``fsdp_speedloader.kernels``): ``sdpa`` the attention backend (auto, cudnn,
    flash, efficient, math), ``liger`` Liger's kernels, ``fp8`` torchao float8 linears (tensorwise unless a recipe
    is named). ``states`` and ``threads`` (speedloader-overlap): the host optimizer's moments (``optim.state_dtype``)
    and its worker's CPU threads (``optim.worker_threads``), ``nice`` that worker's niceness raised by K
    (``optim.worker_nice``), ``affinity`` that worker on this rank's CPUs less the launching thread's
    (``optim.worker_affinity``); ``env=NAME=VALUE`` (every contender, repeatable): its worker process starts with
    that environment variable (:func:`contender_env`; e.g. ``env=OMP_WAIT_POLICY=PASSIVE``); ``slots`` its in-flight host gradient slots
    (``optim.grad_slots_in_flight``, 0: one per parameter); ``adamw`` its fp32 AdamW, the trainer's
    ``LocalShardAdamW`` (default), the same with its host step in chunks on the host pool (``pool``:
    ``optim.fp32_host_step=pool``) or ``torch.optim.AdamW`` on the DTensors. Every other contender steps
    ``torch.optim.AdamW`` (fused). ``dev`` (speedloader and FSDP2-offload contenders): units 1 .. K keep their
    states on the GPU (``offload.device_units``). ``recompute=off`` (FSDP2 contenders): no block is recomputed in
    backward (``schedule.activation_checkpointing=false``): the ceiling where its activations fit. ``sync`` (FSDP2
    contenders): ``schedule.gradient_sync`` instead of the contender's own (``last`` for fsdp2-offload, else
    ``every``); ``reshard=off``: ``schedule.reshard_after_forward=false``, each unit gathered once per step.
    ``prefetch=K`` (every contender but DeepSpeed): ``schedule.forward_prefetch``, units unsharded ahead in forward,
    instead of ``--prefetch``. ``order=ascending`` (speedloader contenders): ``schedule.alternate_sub_batches=false``,
    every loop over the sub-batches 0 .. N-1 (the default alternates). ``loss`` (FSDP2 and DeepSpeed contenders): the
    head's logits for ``SpeedLoaderOptions.loss_chunk_tokens`` tokens at a time, as layer-major's
    (``chunked``, the default: ``models.chunked_loss``), or ``hf``: the model's own loss, every logit of a
    micro-batch at once (what these peers ran before that existed)."""
    from fsdp_speedloader.app.config import OptimConfig
    from fsdp_speedloader.kernels import FLOAT8_RECIPES, SDPA_BACKENDS

    name, shape, *options = spec.split(":")
    transfer = default_transfer if name.startswith("speedloader") else None
    compiled = default_compile and name != "deepspeed-offload"
    root_on_device = False
    cap = None
    keep = 0
    sdpa, liger, fp8 = "auto", False, None
    states, threads, slots, adamw, dev = "fp32", 0, OptimConfig().grad_slots_in_flight, "local", 0
    recompute, sync, reshard, nice, affinity, env, prefetch, ascending = True, None, True, 0, False, [], None, False
    recompute_every, loss = 1, "chunked"
    fsdp2 = name in ("ondevice", "fsdp2-offload", "fsdp2-offload-rs")
    auto = name == "auto"  # the trainer with schedule=auto: its batch is the shape (tools/bench_auto.py)
    if auto and not shape.isdigit():
        raise ValueError(f"contender {spec!r}: auto takes the batch alone, auto:B (the tuner plans n and N)")
    kernels_ok = name != "deepspeed-offload"
    for option in options:
        key, _, value = option.partition("=")
        if key in ("compile", "eager") and not value and name != "deepspeed-offload":
            compiled = key == "compile"
        elif key == "root" and value in ("device", "host") and (name.startswith("speedloader")
                                                                 or name.startswith("fsdp2-offload") or auto):
            root_on_device = value == "device"
        elif key == "transfer" and value in ("bf16", "fp32") and name.startswith("speedloader"):
            transfer = None if value == "fp32" else value
        elif key == "cap" and (value == "none" or _positive_float(value)):
            cap = value
        elif key == "keep" and value.isdigit() and name.startswith("speedloader"):
            keep = int(value)
        elif key == "sdpa" and value in SDPA_BACKENDS and kernels_ok:
            sdpa = value
        elif key == "liger" and not value and kernels_ok:
            liger = True
        elif key == "fp8" and (not value or value in FLOAT8_RECIPES) and kernels_ok:
            fp8 = value or "tensorwise"
        elif key == "states" and value in ("fp32", "bf16", "int8") and name == "speedloader-overlap":
            states = value
        elif key == "threads" and value.isdigit() and int(value) > 0 and name == "speedloader-overlap":
            threads = int(value)
        elif key == "nice" and value.isdigit() and 0 < int(value) <= 19 and name == "speedloader-overlap":
            nice = int(value)
        elif key == "env" and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[^:]*", value):
            env.append(tuple(value.split("=", 1)))
        elif key == "affinity" and not value and name == "speedloader-overlap":
            affinity = True
        elif key == "slots" and value.isdigit() and name == "speedloader-overlap":
            slots = int(value)
        elif key == "adamw" and value in ("local", "pool", "torch") and name == "speedloader-overlap":
            adamw = value
        elif key == "dev" and value.isdigit() and (name.startswith("speedloader") or name.startswith("fsdp2-offload")
                                                   or auto):
            dev = int(value)
        elif key == "recompute" and value in ("on", "off") and fsdp2:
            recompute = value == "on"
        elif key == "recompute" and value[:5] == "every" and value[5:].isdigit() and int(value[5:]) >= 2 and fsdp2:
            recompute_every = int(value[5:])
        elif key == "sync" and value in ("every", "last") and fsdp2:
            sync = value
        elif key == "reshard" and value in ("on", "off") and fsdp2:
            reshard = value == "on"
        elif key == "prefetch" and value.isdigit() and kernels_ok:
            prefetch = int(value)
        elif key == "order" and value in ("alternate", "ascending") and name.startswith("speedloader"):
            ascending = value == "ascending"
        elif key == "loss" and value in ("chunked", "hf") and (fsdp2 or name == "deepspeed-offload"):
            loss = value
        else:
            raise ValueError(f"contender {spec!r}: the suffixes are ':transfer=bf16|fp32' (speedloader "
                             "contenders), ':root=device|host' (speedloader, fsdp2-offload and auto contenders), "
                             "':compile' or ':eager' (every contender but "
                             "deepspeed-offload), ':cap=GiB|none' (every contender), ':keep=K' (speedloader "
                             f"contenders: keep_activations), ':sdpa={'|'.join(SDPA_BACKENDS)}', ':liger' and "
                             f"':fp8[={'|'.join(FLOAT8_RECIPES)}]' (every contender but deepspeed-offload), "
                             "':states=fp32|bf16|int8', ':threads=K', ':nice=K', ':affinity', ':slots=R' and "
                             "':adamw=local|pool|torch' "
                             "(speedloader-overlap), ':dev=K' (speedloader, fsdp2-offload and auto contenders), "
                             "':recompute=on|off|everyK' (K >= 2: every K-th block), ':sync=every|last' and "
                             "':reshard=on|off' (ondevice and "
                             "fsdp2-offload contenders), ':prefetch=K' (every contender but deepspeed-offload: "
                             "units unsharded ahead in forward), ':order=alternate|ascending' (speedloader "
                             "contenders: the sub-batch order of their loops), ':loss=chunked|hf' (FSDP2 and "
                             "DeepSpeed contenders: the head's loss), ':env=NAME=VALUE' (every contender)")
    return Contender(name, shape, transfer, compiled, root_on_device, cap, keep, sdpa, liger, fp8, states, threads,
                     slots, adamw, dev, recompute, sync, reshard, nice, affinity, tuple(env), prefetch, ascending,
                     recompute_every, loss)


def head_loss_chunk(contender: Contender) -> int:
    """Tokens per chunk of a canonical or DeepSpeed contender's head loss (0: the model's own, every logit at once)."""
    from fsdp_speedloader import SpeedLoaderOptions

    return SpeedLoaderOptions().loss_chunk_tokens if contender.loss == "chunked" else 0


def _positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def gpu_cap_gib(contender: Contender, default: Optional[float]) -> Optional[float]:
    """The contender's GPU cap in GiB (None: uncapped): its ``:cap=`` or ``--max-gpu-memory-gib``."""
    if contender.cap is None:
        return default
    return None if contender.cap == "none" else float(contender.cap)


def canonical_train_config(args: argparse.Namespace, name: str, sub_batch: int, num_sub: int, compiled: bool,
                           kernels=None, device_units: int = 0, recompute: bool = True, sync: Optional[str] = None,
                           reshard: bool = True, root_on_device: bool = False, recompute_every: int = 1):
    """An FSDP2 contender as the trainer's canonical schedule (``apply_schedule`` shards by it): gradient
    accumulation over ``num_sub`` micro-batches, every (``recompute_every``-th) block recomputed (none without
    ``recompute``), one FSDP unit per block;
    ``fsdp2-offload`` reduce-scatters after the last micro-batch only, ``fsdp2-offload-rs`` and ``ondevice``
    after every one (``sync``: this instead); ``reshard=False`` keeps each unit gathered from the step's first
    forward to its last backward; units 1 .. ``device_units`` of the offloading ones keep their states on the GPU,
    and with ``root_on_device`` the root's (embeddings, final norm, LM head): the allowances layer-major takes."""
    from fsdp_speedloader.app.config import DataConfig, KernelsConfig, OffloadConfig, ScheduleConfig, TrainConfig

    schedule = ScheduleConfig(name="canonical", sub_batch_size=sub_batch, num_sub_batches=num_sub,
                              activation_checkpointing=recompute, activation_checkpointing_every=recompute_every,
                              forward_prefetch=args.prefetch,
                              compile_blocks=compiled,
                              gradient_sync=sync or ("last" if name == "fsdp2-offload" else "every"),
                              reshard_after_forward=reshard)
    return TrainConfig(model=model_config(args), data=DataConfig(seq_len=args.seq_len), schedule=schedule,
                       offload=OffloadConfig(params=name != "ondevice", device_units=device_units,
                                             root=not root_on_device),
                       kernels=kernels or KernelsConfig(),
                       device=args.device, param_dtype="bfloat16")


def process_age_s() -> Optional[float]:
    """Seconds since this process started, the interpreter's start and imports included (Linux /proc; else None)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_worker(args: argparse.Namespace) -> dict:
    """One contender, one process: build, warm up, time ``--steps`` steps, return the figures."""
    before_worker_s, t_entry = process_age_s(), time.perf_counter()
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fsdp_speedloader import SpeedLoaderOptions, apply_speedloader, fsdp2, speedloader_engine
    from fsdp_speedloader.app.config import KernelsConfig
    from fsdp_speedloader.app.canonical import apply_schedule, canonical_forward_backward
    from fsdp_speedloader.app.trainer import num_label_tokens
    from fsdp_speedloader.models import build_model, get_adapter, materialize_model
    from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group

    contender = parse_contender(args.worker, args.param_transfer_dtype, args.compile)
    if contender.prefetch is not None:  # its own forward prefetch depth instead of --prefetch
        args = argparse.Namespace(**{**vars(args), "prefetch": contender.prefetch})
    missing = {k: v for k, v in contender.env if os.environ.get(k) != v}
    if missing:  # read when the libraries loaded, before this line: only the launcher can set them
        raise RuntimeError(f"contender {args.worker!r}: its worker started without {missing}; launch it with "
                           "bench_train.contender_env(spec)")
    name, shape, transfer, compiled, root_on_device = contender[:5]
    cap = gpu_cap_gib(contender, args.max_gpu_memory_gib)
    args = argparse.Namespace(**{**vars(args), "max_gpu_memory_gib": cap})  # DeepSpeed reads its cap there
    if name == "auto":  # the trainer itself, schedule=auto: it plans the micro-batches
        from bench_auto import run_auto

        return run_auto(args, contender, cap)
    sub_batch, num_sub = (int(v) for v in shape.split("x"))
    if name == "deepspeed-offload":  # a peer with its own engine and launcher environment
        from bench_deepspeed import run_deepspeed

        chunk = head_loss_chunk(contender)
        return {**run_deepspeed(args, sub_batch, num_sub, chunk), "contender_spec": args.worker,
                "max_gpu_memory_gib": cap, "head_loss_chunk_tokens": chunk}
    cuda = args.device == "cuda"
    maybe_init_process_group(args.device)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cap and cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total), device)
    cfg = model_config(args)
    model = build_model(cfg)  # meta: the family's own Hugging Face class, from the ModelConfig
    experts = harness.set_experts_implementation(model, args.experts_implementation)  # before any compile
    adapter = get_adapter(model)
    offload = name != "ondevice"
    layer_major = name.startswith("speedloader")
    mesh = build_mesh(args.device, args.dp_replicate)  # dp_replicate > 1: HSDP, one replica per node
    gradient_sync, reshard, scope = None, True, None
    if layer_major:
        options = SpeedLoaderOptions(
            num_sub_batches=num_sub, activation_store=args.activation_store, offload_params=True,
            param_dtype=torch.bfloat16, forward_prefetch=args.prefetch,
            param_transfer_dtype=torch.bfloat16 if transfer == "bf16" else None, compile_blocks=compiled,
            offload_root=not root_on_device, device_units=contender.dev, keep_activations=contender.keep,
            alternate_sub_batches=not contender.ascending,
            sdpa_backend=contender.sdpa,
            liger_kernels=contender.liger, float8_training=contender.fp8)
        apply_speedloader(model, options, mesh=mesh)
    else:
        kernels = KernelsConfig(sdpa_backend=contender.sdpa, liger_kernels=contender.liger,
                                float8_training=contender.fp8)
        train_cfg = canonical_train_config(args, name, sub_batch, num_sub, compiled, kernels, contender.dev,
                                           contender.recompute, contender.sync, contender.reshard, root_on_device,
                                           contender.recompute_every)
        scope = apply_schedule(model, train_cfg, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        gradient_sync, reshard = train_cfg.schedule.gradient_sync, train_cfg.schedule.reshard_after_forward
    # FSDP units besides the root: each holds whole blocks (a mixture of experts' block with all its experts).
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    blocks_per_fsdp_unit = sorted({sum(b in set(u.modules()) for b in adapter.blocks) for u in units})
    t_built = time.perf_counter()
    materialize_model(model, cfg, device=device, seed=0, param_device=torch.device("cpu") if offload else device)
    t_materialized = time.perf_counter()
    model.train()
    engine = speedloader_engine(model) if layer_major else None

    def build_adamw(params):
        if contender.states != "fp32" and all(p.device.type == "cpu" for p in params):
            from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW

            return CompressedAdamW(params, state_dtype=contender.states, lr=1e-5)
        if name == "speedloader-overlap" and contender.adamw in ("local", "pool"):
            from fsdp_speedloader.memory.compressed_adamw import CHUNK_PER_THREAD
            from fsdp_speedloader.memory.local_adamw import LocalShardAdamW

            chunk = CHUNK_PER_THREAD if contender.adamw == "pool" else 0  # device parameters step unchunked anyway
            return LocalShardAdamW(params, lr=1e-5, fused=True, host_chunk=chunk)
        return torch.optim.AdamW(params, lr=1e-5, fused=True)

    if name == "speedloader-overlap":
        from fsdp_speedloader.memory.optimizer_overlap import OverlappedOptimizer
        from fsdp_speedloader.memory.threads import optimizer_cpus

        optim = OverlappedOptimizer(model, build_adamw, worker_threads=contender.threads,
                                    grad_slots_in_flight=contender.slots, worker_nice=contender.nice,
                                    worker_cpus=optimizer_cpus() if contender.affinity else None)
    else:
        optim = build_adamw(model.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sub_batch * num_sub, args.seq_len), generator=gen)  # (N * n, s)
    num_tokens = num_label_tokens(ids)  # on the host: no device sync

    def fwd_bwd():  # the trainer's step: the batch is copied to the device, then one forward/backward
        input_ids = ids.to(device, non_blocking=True)
        if layer_major:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            return loss.detach()
        return canonical_forward_backward(model, input_ids, input_ids, sub_batch_size=sub_batch,
                                          num_tokens=num_tokens, gradient_sync=gradient_sync,
                                          reshard_after_forward=reshard, scope=scope,
                                          loss_chunk_tokens=head_loss_chunk(contender))

    overlap_stats: list = []  # speedloader-overlap: each step's optimizer_busy_s / optimizer_wait_s

    def optimizer_step() -> None:
        optim.step()
        if name == "speedloader-overlap":
            overlap_stats.append(optim.step_stats())
        if layer_major and name != "speedloader-overlap":  # the overlapped optimizer casts in its worker
            engine.refresh_param_transfer()  # a no-op without transfer copies
        optim.zero_grad(set_to_none=True)

    # Of the blocks' forward work, recomputed in backward (HFU): layer-major recomputes every (unit, sub-batch) pair
    # it does not keep; an FSDP2 contender the blocks whose own flag says so, where Hugging Face's model flag is on
    # (transformers 5.x: either name).
    checkpointed = bool(getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", 0)))
    pairs = len(engine.units) * num_sub if layer_major else 0
    blocks_recomputed = sum(bool(getattr(b, "gradient_checkpointing", False)) for b in adapter.blocks) * checkpointed
    recomputed = 1.0 - min(contender.keep, pairs) / pairs if layer_major else blocks_recomputed / len(adapter.blocks)

    t_steps = time.perf_counter()
    fb_times, opt_times, losses, profile, host = time_steps(
        fwd_bwd, optimizer_step, argparse.Namespace(**{**vars(args), "profile": args.profile and cuda}),
        sync=torch.cuda.synchronize if cuda else (lambda: None),
        reset_peak=torch.cuda.reset_peak_memory_stats if cuda else (lambda: None))
    # Where the worker's wall time went (the harness's wall_s adds the process's exit): a sweep point costs far more
    # than its timed steps, and these say which part to shorten.
    phases = {"before_worker": before_worker_s, "build": t_built - t_entry, "materialize": t_materialized - t_built,
              "optimizer_and_inputs": t_steps - t_materialized, **host.pop("worker_phases_s"),
              "steps_total": time.perf_counter() - t_steps}
    result = {
        "contender": name, "contender_spec": args.worker, "worker_env": dict(contender.env),
        "openmp_wait": {k: os.environ.get(k) for k in openmp_wait.USER_CHOICES},  # as the worker started
        "param_transfer_dtype": transfer, "compiled": compiled,
        "root_on_device": root_on_device, "device_units": contender.dev, "sub_batch_size": sub_batch,
        "num_sub_batches": num_sub, "max_gpu_memory_gib": cap, "experts_implementation": experts,
        "sdpa_backend": contender.sdpa, "liger_kernels": contender.liger, "float8_training": contender.fp8,
        "head_loss_chunk_tokens": None if layer_major else head_loss_chunk(contender),
        "num_fsdp_units": len(units), "blocks_per_fsdp_unit": blocks_per_fsdp_unit, "forward_prefetch": args.prefetch,
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
        **protocol.step_figures(fb_times, opt_times, losses, tokens=ids.numel(),
                                flops_per_token=adapter.flops_per_token(args.seq_len), peak_tflops=args.peak_tflops,
                                attention_flops_per_token=adapter.attention_flops_per_token(args.seq_len),
                                recomputed=recomputed, host_peak_rss_gib=harness.host_peak_rss_gib()),
        **host,  # the main thread's CPU seconds and preemptions per forward+backward (issue 40)
        "recompute": layer_major or checkpointed, "blocks_recomputed": None if layer_major else blocks_recomputed,
        "gradient_sync": gradient_sync, "reshard_after_forward": reshard,
        "peak_hbm_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_hbm_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        # cudaMalloc failures the caching allocator answered by freeing its cache and retrying, over the whole run
        # (warm-up and compilation included; alloc_retries_timed: the timed steps' alone)
        "alloc_retries": alloc_retries(),
        "worker_phases_s": phases,
    }
    if profile is not None:
        result["profile"] = profile
    if overlap_stats:  # the timed steps' medians: busy is the CPU step's seconds, wait what showed of them
        timed = overlap_stats[args.warmup:args.warmup + args.steps]
        result["optimizer_states"] = contender.states
        result["optimizer_worker_threads"] = optim.worker_threads or torch.get_num_threads()
        result["optimizer_worker_cpus"] = optim.worker_cpus
        result["optimizer_worker_nice"] = contender.nice
        result["optimizer_adamw"] = contender.adamw
        result["grad_slots_in_flight"] = contender.slots
        result["uses_grad_ring"] = optim.uses_grad_ring
        result.update({k: statistics.median(st[k] for st in timed) for k in timed[0]})
    if layer_major:
        result["host_activation_gib"] = engine.store.host_bytes / 2**30
        result["exchange"] = engine.store.step_stats()  # the last measured step: copy bytes, compute-stream waits
        result["fast_paths"] = fsdp2.fast_path_stats()  # FSDP2 fast paths engaged / fallen back, whole run
        result["keep_activations"] = contender.keep
        result["alternate_sub_batches"] = not contender.ascending
        result["kept_pair_bytes"] = engine.stats()["kept_pair_bytes"]  # GPU memory of one kept pair
        result["stale_transfer_casts"] = result["fast_paths"]["num_stale_transfer_casts"]  # casts on the unshard path
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama2_7b",
                        help=f"a shape of conf/model/ or of SHAPES ({', '.join(model_names())}), or a YAML file")
    parser.add_argument("--layers", type=int, default=8, help="blocks (the model's own layers, fewer of them)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--contender", action="append", default=[],
                        help="NAME:nxN[:option...] with NAME in speedloader, speedloader-overlap, fsdp2-offload, "
                             "fsdp2-offload-rs, ondevice, deepspeed-offload")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--activation-store", default="host")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the blocks' forward in every contender but DeepSpeed (per contender: "
                             "NAME:nxN:compile or :eager)")
    parser.add_argument("--param-transfer-dtype", default=None, choices=["bf16"],
                        help="speedloader contenders: transfer a bf16 copy of each offloaded shard (per contender: "
                             "NAME:nxN:transfer=bf16 or :transfer=fp32)")
    parser.add_argument("--max-gpu-memory-gib", type=float, default=None,
                        help="every contender's GPU cap (per contender: NAME:nxN:cap=GiB or :cap=none)")
    parser.add_argument("--experts-implementation", default="grouped_mm", choices=harness.EXPERTS_IMPLEMENTATIONS,
                        help="mixture of experts: the Hugging Face experts kernel of every contender")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a check of the workers' code path (tests); no figure means anything")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--dp-replicate", type=int, default=1,
                        help="under torchrun: HSDP replicas (the number of nodes; DeepSpeed's ZeRO-3 ignores it)")
    parser.add_argument("--profile", action="store_true", help="trace one extra step and summarize it")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model not in SHAPES:
        try:
            model_config(args)  # an unknown name fails here, before any launch
        except ValueError as e:
            parser.error(str(e))

    if args.worker:
        harness.print_result(run_worker(args))
        return

    # Every contender with expandable segments (as train.launch sets it), unless the caller chose:
    # the default allocator's fragmentation decides which sub-batch sizes fit under a cap.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    contenders = args.contender or ["speedloader:1x8", "fsdp2-offload:1x8", "ondevice:1x8"]
    for contender in contenders:
        try:
            parse_contender(contender, args.param_transfer_dtype, args.compile)  # a bad suffix fails before any run
        except ValueError as e:
            parser.error(str(e))
    rows: list = []
    cfg = model_config(args)
    summary = harness.model_summary(cfg, args.seq_len)  # on the meta device: no CUDA context in the driver
    record = {**harness.record_header("train", __file__, device=harness.cpu_name() if args.device == "cpu" else None),
              "config": {k: v for k, v in vars(args).items() if k != "worker"},
              "model": {**summary, "config": dataclasses.asdict(cfg)}, "results": rows}
    print(f"{cfg.name}, {cfg.num_layers} layers: {summary['params'] / 1e9:.2f}B parameters, "
          f"{summary['active_params'] / 1e9:.2f}B active per token; MFU on {summary['mfu_basis']}", flush=True)
    path = Path(args.out_dir, f"{args.name or f'train_{cfg.name}_L{args.layers}_s{args.seq_len}'}.json")
    for contender in contenders:
        cmd = harness.worker_command(__file__, contender, sys.argv[1:], drop=("--contender",))
        row = harness.launch_worker(cmd, contender_env(contender), timeout=args.timeout).row(contender=contender)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "step_times_s", "output_tail")}),
              flush=True)
        harness.write_record(path, record)  # after every contender: a run cut short keeps what finished
    print("\n| contender | n x N | tokens/s (fwd+bwd) | tokens/s (with optimizer) | MFU | peak HBM GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['contender']} | - | {r['status']}: {r['error'][:80]} | | | |")
        else:
            transfer = r.get("param_transfer_dtype")
            cap = r.get("max_gpu_memory_gib", args.max_gpu_memory_gib)
            label = (r.get("contender_spec", r["contender"]) + (f" ({transfer} transfer)" if transfer else "")
                     + (" compiled" if r.get("compiled") else "")
                     + (f", sdpa={r['sdpa_backend']}" if r.get("sdpa_backend", "auto") != "auto" else "")
                     + (", liger" if r.get("liger_kernels") else "")
                     + (f", fp8 {r['float8_training']}" if r.get("float8_training") else "")
                     + (f", cap {cap:g} GiB" if cap != args.max_gpu_memory_gib and cap else "")
                     + (", uncapped" if args.max_gpu_memory_gib and not cap else ""))
            print(f"| {label} | {r['sub_batch_size']}x{r['num_sub_batches']} | {r['tokens_per_s_fwd_bwd']:.0f} "
                  f"| {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['peak_hbm_gib']:.1f} |")


if __name__ == "__main__":
    main()
