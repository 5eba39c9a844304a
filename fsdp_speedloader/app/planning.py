"""``schedule=auto``: the tuner's plan for a training run's config, and the schedule that runs it."""

from __future__ import annotations

import dataclasses

import torch

from fsdp_speedloader.app.config import ScheduleConfig, TrainConfig
from fsdp_speedloader.app.optim import build_optimizer
from fsdp_speedloader.app.runtime import DTYPES
from fsdp_speedloader.tuning.tuner import GIB, TunePlan, tune


def tune_train_config(cfg: TrainConfig, *, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> TunePlan:
    """``tune`` for a training run's config (``schedule.name=auto``): the same model, shapes, offload,
    store, optimizer and budgets the run will use."""
    sched = cfg.schedule
    gib = lambda v: None if v is None else int(v * GIB)  # noqa: E731
    gpu_name, gpu_budget = ("schedule.gpu_memory_budget_gib", sched.gpu_memory_budget_gib)
    if gpu_budget is None:
        gpu_name, gpu_budget = "max_gpu_memory_gib", cfg.max_gpu_memory_gib
    return tune(cfg.model, seq_len=cfg.data.seq_len, gpu_memory_budget_bytes=gib(gpu_budget),
                host_memory_budget_bytes=gib(sched.host_memory_budget_gib), target_batch_size=sched.target_batch_size,
                blocks_per_unit=sorted({sched.blocks_per_unit, *sched.tune_blocks_per_unit}),
                offload_params=cfg.offload.params, activation_store=sched.activation_store,
                pin_memory=cfg.offload.pin_memory, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                forward_prefetch=sched.forward_prefetch, loss_chunk_tokens=sched.loss_chunk_tokens,
                param_transfer_dtype=DTYPES.get(cfg.offload.param_transfer_dtype), offload_root=cfg.offload.root,
                mesh=mesh,
                build_optimizer=lambda m: build_optimizer(m, cfg.optim), seed=cfg.seed,
                budget_names=(gpu_name, "schedule.host_memory_budget_gib"))


def planned_schedule(plan: TunePlan, base: ScheduleConfig) -> ScheduleConfig:
    """``base`` as a layer-major schedule with the plan's n, N and blocks_per_unit."""
    return dataclasses.replace(base, name="speedloader", sub_batch_size=plan.sub_batch_size,
                               num_sub_batches=plan.num_sub_batches, blocks_per_unit=plan.blocks_per_unit)
