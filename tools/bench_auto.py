"""The ``auto`` contender of tools/bench_train.py: the trainer itself with ``schedule=auto``, as a user runs it.

Where the other contenders are set by hand (a schedule, a micro-batch, a recompute policy), this one is given only
what a user gives: the batch (``schedule.target_batch_size``), the GPU-memory cap (``max_gpu_memory_gib``: the
tuner's budget, less its margin) and the modules the table lets every offloading contender keep on the GPU
(``:root=device``, ``:dev=K``). The tuner plans n, N and the kept pairs from its trial steps and, where the model fits
the GPU gathered, times the canonical schedule beside its plan and runs the faster (docs/tuner.md). The row is the
schedule it chose, timed as the trainer runs it: each step's wall time from the trainer's own metrics (data, forward,
backward, optimizer, one synchronisation at the step's end), the median over the timed steps after the warm-up ones.
The tuning's seconds are recorded (``tune_s``), not counted in the rate: a run tunes once.

Spec: ``auto:B[:compile|:eager][:root=device][:dev=K][:cap=GiB|none][kernel levers]`` (bench_train.parse_contender).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def auto_train_config(args: argparse.Namespace, contender, batch: int, cap, output_dir: str):
    """The ``TrainConfig`` of the row: ``schedule=auto`` over ``batch`` sequences of ``args.seq_len`` random tokens,
    every model state on the host but the modules the contender keeps on the GPU, the CPU AdamW stepping each unit
    during the backward without clipping (as the layer-major rows), no logger, no checkpoint."""
    from bench_train import model_config

    from fsdp_speedloader.app.config import CheckpointConfig, DataConfig, KernelsConfig, LoggerConfig, \
        OffloadConfig, OptimConfig, ScheduleConfig, TrainConfig

    return TrainConfig(
        model=model_config(args), data=DataConfig(source="synthetic", seq_len=args.seq_len),
        schedule=ScheduleConfig(name="auto", target_batch_size=batch, compile_blocks=contender.compiled,
                                forward_prefetch=args.prefetch),
        offload=OffloadConfig(params=True, root=not contender.root_on_device, device_units=contender.dev),
        optim=OptimConfig(overlap_with_backward=True, grad_clip=0.0),
        kernels=KernelsConfig(sdpa_backend=contender.sdpa, liger_kernels=contender.liger,
                              float8_training=contender.fp8),
        logger=LoggerConfig(backend="none"),
        checkpoint=CheckpointConfig(save_final=False, every_minutes=None),
        steps=args.warmup + args.steps, device=args.device,
        max_gpu_memory_gib=cap if args.device == "cuda" else None,  # the trainer refuses a GPU cap on the CPU
        param_dtype="bfloat16" if args.device == "cuda" else "float32", peak_tflops=args.peak_tflops,
        output_dir=output_dir)


def run_auto(args: argparse.Namespace, contender, cap) -> dict:
    """One ``auto`` contender in this process: tune, train ``--warmup`` + ``--steps`` steps, return its row."""
    import bench_run
    import harness

    from fsdp_speedloader.app.trainer import Trainer

    batch = int(contender.shape)
    with tempfile.TemporaryDirectory(prefix="fsl_bench_auto_") as out:
        cfg = auto_train_config(args, contender, batch, cap, out)
        t0 = time.perf_counter()
        trainer = Trainer(cfg)  # tunes (schedule=auto), then builds the schedule chosen
        tune_s = time.perf_counter() - t0
        plan, chosen = trainer.tune_plan, trainer.cfg
        history = trainer.train()
    timed = history[args.warmup:]
    steady = bench_run.summarize(timed, warmup_steps=0)  # the trainer's runs' own summary, over the timed steps
    step_s = steady["step_time_s"]["median"]
    tokens = chosen.schedule.sub_batch_size * chosen.schedule.num_sub_batches * args.seq_len
    return {
        "contender": "auto", "contender_spec": args.worker, "compiled": contender.compiled,
        "root_on_device": contender.root_on_device, "max_gpu_memory_gib": cap,
        "sdpa_backend": contender.sdpa, "liger_kernels": contender.liger, "float8_training": contender.fp8,
        # what the tuner chose
        "schedule": chosen.schedule.name, "schedule_reason": plan.schedule_reason or None,
        "sub_batch_size": chosen.schedule.sub_batch_size, "num_sub_batches": chosen.schedule.num_sub_batches,
        "keep_activations": chosen.schedule.keep_activations if chosen.schedule.name == "speedloader" else None,
        "device_units": chosen.offload.device_units, "target_batch_size": batch,
        "speedloader_step_s": plan.speedloader_step_s or None, "canonical_step_s": plan.canonical_step_s or None,
        "tune_s": tune_s, "tune_plan": plan.summary(),
        # the timed steps, as the trainer measured them
        "tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "step_times_s": [m["step_time_s"] for m in timed],
        "data_wait_s": statistics.median(m["data_wait_s"] for m in timed),
        "mfu": steady["mfu"]["median"], "losses": [m["loss"] for m in timed],
        "peak_hbm_gib": steady["peak_gpu_mem_allocated_gib"],
        "gpu_alloc_retries_timed": sum(m.get("gpu_alloc_retries", 0) for m in timed),
        "host_peak_rss_gib": harness.host_peak_rss_gib(),
    }
