"""``schedule=auto``: the tuner's plan for a training run's config, and the schedule that runs it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_speedloader import parallel
from fsdp_speedloader.app.config import auto_unset, ScheduleConfig, TrainConfig
from fsdp_speedloader.app.host_memory import check_cpu_memory
from fsdp_speedloader.app.optim import build_optimizer
from fsdp_speedloader.app.runtime import speedloader_options
from fsdp_speedloader.app.schedule_choice import canonical_config, choose_schedule
from fsdp_speedloader.models import build_model
from fsdp_speedloader.tuning.fit import GIB
from fsdp_speedloader.tuning.plan import TunePlan
from fsdp_speedloader.tuning.tuner import tune

log = logging.getLogger(__name__)


def tune_train_config(cfg: TrainConfig, *, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> TunePlan:
    """``tune`` for a training run's config (``schedule.name=auto``): the same model, shapes, engine options (the
    trainer's own ``speedloader_options``: offload, store, dtypes, transfer copies, compiled blocks, root
    placement), optimizers and budgets the run will use."""
    sched = cfg.schedule
    gib = lambda v: None if v is None else int(v * GIB)  # noqa: E731
    gpu_name, gpu_budget = ("schedule.gpu_memory_budget_gib", sched.gpu_memory_budget_gib)
    if gpu_budget is None and cfg.max_gpu_memory_gib is not None:  # else the setting to name is the schedule's
        gpu_name, gpu_budget = "max_gpu_memory_gib", cfg.max_gpu_memory_gib
    caps = {"max_sub_batch_size": sched.max_sub_batch_size, "target_batch_size": sched.target_batch_size}
    cap_names = {name: f"schedule.{name}" for name in caps}  # what the plan and its warnings call them
    device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")  # tune's
    if device_type == "cpu" and not cfg.offload.params:  # the trial model holds every state in host memory too
        check_cpu_memory(build_model(cfg.model, device="meta"), cfg,
                         shards=parallel.shard_size(mesh) if mesh is not None else 1)
    if device_type != "cuda" and gpu_budget is None:
        caps, configured = configured_caps(sched)
        cap_names.update(configured)
    options = speedloader_options(cfg, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    plan = tune(cfg.model, options, seq_len=cfg.data.seq_len, gpu_memory_budget_bytes=gib(gpu_budget),
                host_memory_budget_bytes=gib(sched.host_memory_budget_gib), **caps,
                tune_blocks_per_unit=sched.tune_blocks_per_unit, mesh=mesh,
                build_optimizer=lambda model: build_optimizer(model, cfg.optim, seed=cfg.seed), seed=cfg.seed,
                budget_names=(gpu_name, "schedule.host_memory_budget_gib"), cap_names=cap_names)
    try_canonical = sched.canonical_candidate if sched.canonical_candidate is not None else device_type == "cuda"
    if try_canonical:
        if mesh is None:  # as tune's
            mesh = parallel.build_mesh(device_type)
        choice = choose_schedule(cfg, plan, planned_config(plan, cfg), mesh=mesh, param_dtype=param_dtype,
                                 reduce_dtype=reduce_dtype, max_micro_batch=caps.get("max_sub_batch_size"))
        plan.schedule, plan.schedule_reason = choice.name, choice.reason
        plan.canonical_sub_batch_size = choice.sub_batch_size
        plan.speedloader_step_s, plan.canonical_step_s = choice.speedloader_step_s, choice.canonical_step_s
    return plan


CPU_NOTE = "as configured, on a CPU"


def configured_caps(sched: ScheduleConfig) -> tuple[dict[str, Optional[int]], dict[str, str]]:
    """The tuner's caps (and what ``limited_by`` calls them) on a CPU without a GPU budget: the configured
    ``sub_batch_size`` and ``num_sub_batches``, where ``max_sub_batch_size`` / ``target_batch_size`` do not say
    otherwise.

    Without CUDA the CPU stands in for the GPU, and its budget would be the detected host memory: the plan would
    fill the host with one sub-batch of thousands of sequences, N = 1, a batch nobody asked for. There is no device
    memory to fill on a CPU, so the plan keeps the configured batch, checked against host memory by the trials.
    """
    caps = {"max_sub_batch_size": sched.max_sub_batch_size or sched.sub_batch_size,
            "max_num_sub_batches": None if sched.target_batch_size else sched.num_sub_batches,
            "target_batch_size": sched.target_batch_size}
    names = {"max_num_sub_batches": f"schedule.num_sub_batches {CPU_NOTE}"}
    if not sched.max_sub_batch_size:
        names["max_sub_batch_size"] = f"schedule.sub_batch_size {CPU_NOTE}"
    batch = (f"{caps['max_sub_batch_size']} x {sched.num_sub_batches} sequences" if not sched.target_batch_size else
             f"at most {caps['max_sub_batch_size']} sequences a sub-batch, {sched.target_batch_size} a step")
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("on a CPU there is no GPU memory for the tuner to fill: the plan keeps the configured batch (%s), "
                 "checked against host memory; schedule.gpu_memory_budget_gib makes it fill a budget",
                 batch)
    return caps, names


def planned_config(plan: TunePlan, cfg: TrainConfig) -> TrainConfig:
    """``cfg`` running the plan: its schedule (``planned_schedule``) and the units it keeps on the GPU; or the
    canonical schedule where ``schedule_choice`` measured it faster (``plan.schedule``)."""
    if plan.schedule == "canonical":
        return canonical_config(cfg, plan, plan.canonical_sub_batch_size)
    return dataclasses.replace(cfg, schedule=planned_schedule(plan, cfg.schedule),
                               offload=dataclasses.replace(cfg.offload, device_units=plan.device_units))


def planned_schedule(plan: TunePlan, base: ScheduleConfig) -> ScheduleConfig:
    """``base`` as a layer-major schedule with the plan's n, N, blocks_per_unit and keep_activations; the tuner's
    budgets and caps, spent on the plan (which keeps them), are unset: a hand-set schedule refuses them."""
    return dataclasses.replace(base, name="speedloader", sub_batch_size=plan.sub_batch_size,
                               num_sub_batches=plan.num_sub_batches, blocks_per_unit=plan.blocks_per_unit,
                               keep_activations=plan.keep_activations, **auto_unset())
