"""A training run's host memory plan, by tier (``memory/host_plan.py``), from its config and the model's shapes:
what the trainer checks before the model takes host memory, and what ``tools/arena_report.py`` prints per mode.

``host_memory_plan(model, cfg, shards=...)`` gives the plan of rank 0 (the largest shards) and, for each setting
that would shrink it, the plan with that setting changed; ``check_host_memory(model, cfg, shards=...)`` refuses a
plan over the host budget in one line naming those settings and the GiB each frees. ``check_cpu_memory`` does the
same for a run on the CPU, where every model state is in host memory.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.memory.arena import GIB, LIMIT_ENV, HostMemoryBudget
from fsdp_speedloader.memory.bf16_master import MASTER_BYTES_PER_PARAM
from fsdp_speedloader.memory.host_plan import HostPlan, Shard, check_host_plan, checkpoint_staging_bytes, \
    plan_host_memory, savings_of, shard_numels
from fsdp_speedloader.models import get_adapter

_SMALLER_STATES = {"fp32": ("bf16", "int8"), "bf16": ("int8",), "int8": ()}


def unit_and_root_shards(model: nn.Module, *, blocks_per_unit: int, shards: int, rank: int = 0
                         ) -> tuple[list[list[Shard]], list[Shard]]:
    """Each unit's parameter shards (``blocks_per_unit`` consecutive blocks per unit) and the root's (every other
    parameter), on ``rank`` of ``shards``; from the parameters' global shapes (a meta model, sharded or not)."""
    blocks = list(get_adapter(model).blocks)
    units, seen = [], set()
    for start in range(0, len(blocks), blocks_per_unit):
        params = [p for block in blocks[start : start + blocks_per_unit] for p in block.parameters()]
        seen.update(id(p) for p in params)
        units.append([shard_numels(tuple(p.shape), shards, rank) for p in params if p.requires_grad])
    root = [shard_numels(tuple(p.shape), shards, rank) for p in model.parameters()
            if id(p) not in seen and p.requires_grad]
    return units, root


def _uses_ring(cfg: TrainConfig) -> bool:
    """In-flight gradient slots: the overlapped optimizer stepping during the backward (no clipping), the arena
    holding the gradients (offloaded, pinned)."""
    return (cfg.optim.overlap_with_backward and cfg.optim.grad_clip == 0 and cfg.optim.grad_slots_in_flight > 0
            and cfg.offload.params and cfg.offload.pin_memory)


def _activations_on_host(cfg: TrainConfig, on_cpu: bool = False) -> bool:
    """Whether a layer-major step's block-boundary activations take host memory: in the host store, or anywhere
    when the device is the CPU."""
    store = cfg.schedule.activation_store
    return cfg.schedule.name in ("speedloader", "auto") and (on_cpu or store in ("host", "host_sync") or
                                                              store == "auto" and cfg.offload.params)


def plan_for(cfg: TrainConfig, units: list[list[Shard]], root: list[Shard], *, hidden_size: int,
             activation_itemsize: int = 2, on_cpu: bool = False) -> HostPlan:
    """The host plan of ``cfg`` for these shards (activation slots: U + 1 of N x n x s x h; units 1 ..
    ``offload.device_units`` keep their states on the GPU; ``checkpoint.async_save``: the staging copy of all of
    them). ``on_cpu``: the device is the CPU, so what stays "on the device" (the root, units 1 .. K, the
    activations) is in host memory too."""
    sched = cfg.schedule
    activations = ((len(units) + 1) * sched.num_sub_batches * sched.sub_batch_size * cfg.data.seq_len * hidden_size
                   * activation_itemsize) if _activations_on_host(cfg, on_cpu) else 0
    return plan_host_memory(units=units if on_cpu else units[cfg.offload.device_units:], root=root,
                            root_on_host=on_cpu or cfg.offload.root,
                            grad_slots_in_flight=cfg.optim.grad_slots_in_flight if _uses_ring(cfg) else 0,
                            state_dtype=cfg.optim.state_dtype, activation_bytes=activations,
                            transfer_itemsize=2 if cfg.offload.param_transfer_dtype else 0,
                            param_itemsize=MASTER_BYTES_PER_PARAM[cfg.optim.master_dtype],
                            checkpoint_staging_bytes=async_staging_bytes(cfg, units, root))


def async_staging_bytes(cfg: TrainConfig, units: list[list[Shard]], root: list[Shard]) -> int:
    """``checkpoint.async_save``'s staging copy on this rank (every unit's and the root's shards), else 0."""
    if not cfg.checkpoint.async_save:
        return 0
    return checkpoint_staging_bytes([s for unit in units for s in unit] + list(root), state_dtype=cfg.optim.state_dtype,
                                    param_itemsize=MASTER_BYTES_PER_PARAM[cfg.optim.master_dtype])


def _with(cfg: TrainConfig, **sections) -> Optional[TrainConfig]:
    """``cfg`` with fields of its sections replaced (``optim={"state_dtype": "bf16"}``); None when that config is
    not a valid one (another setting would have to change with it)."""
    try:
        changes = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
        return dataclasses.replace(cfg, **changes)
    except ValueError:
        return None


def host_memory_plan(model: nn.Module, cfg: TrainConfig, *, shards: int, activation_itemsize: int = 2,
                     on_cpu: bool = False) -> tuple[HostPlan, list[tuple[str, HostPlan]]]:
    """(rank 0's plan, [(setting, the plan with that setting changed)]) for a run with offloaded parameters;
    ``on_cpu``: on a machine without a GPU (no setting that moves memory to the GPU is offered)."""
    units, root = unit_and_root_shards(model, blocks_per_unit=cfg.schedule.blocks_per_unit, shards=shards)
    hidden = model.config.hidden_size

    def plan(c: Optional[TrainConfig]) -> Optional[HostPlan]:
        return None if c is None else plan_for(c, units, root, hidden_size=hidden,
                                               activation_itemsize=activation_itemsize, on_cpu=on_cpu)

    alternatives = [(f"optim.state_dtype={dtype}", plan(_with(cfg, optim={"state_dtype": dtype})))
                    for dtype in _SMALLER_STATES[cfg.optim.state_dtype]]
    if cfg.optim.master_dtype == "fp32":  # bf16 master weights need compressed moments: bf16 ones unless smaller
        states = cfg.optim.state_dtype if cfg.optim.state_dtype != "fp32" else "bf16"
        also = "" if states == cfg.optim.state_dtype else " optim.state_dtype=bf16"
        alternatives.append((f"optim.master_dtype=bf16{also} (bf16 master weights, stochastic rounding)",
                             plan(_with(cfg, optim={"master_dtype": "bf16", "state_dtype": states},
                                        offload={"param_transfer_dtype": None}))))
    if _uses_ring(cfg) and cfg.optim.grad_slots_in_flight > 2:  # fewer regions in flight: less slack, less memory
        alternatives.append(("optim.grad_slots_in_flight=2", plan(_with(cfg, optim={"grad_slots_in_flight": 2}))))
    if not _uses_ring(cfg) and cfg.offload.pin_memory:
        ring = _with(cfg, optim={"overlap_with_backward": True, "grad_clip": 0.0,
                                 "grad_slots_in_flight": cfg.optim.grad_slots_in_flight or 2})
        alternatives.append(("optim.overlap_with_backward=true optim.grad_clip=0 (in-flight gradient slots)",
                             plan(ring)))
    if _activations_on_host(cfg) and not on_cpu:
        alternatives.append(("schedule.activation_store=device (activations on the GPU)",
                             plan(_with(cfg, schedule={"activation_store": "device"}))))
    if cfg.offload.root and not on_cpu:
        alternatives.append(("offload.root=false (the root's states on the GPU)",
                             plan(_with(cfg, offload={"root": False}))))
    if cfg.checkpoint.async_save:
        alternatives.append(("checkpoint.async_save=false (no staging copy; each save then stalls for its write)",
                             plan(_with(cfg, checkpoint={"async_save": False}))))
    if cfg.offload.param_transfer_dtype:
        alternatives.append(("offload.param_transfer_dtype=null",
                             plan(_with(cfg, offload={"param_transfer_dtype": None}))))
    # The three that keep the run's shape together (the smallest states, in-flight gradients, activations on the GPU).
    combined, names = cfg, []
    if cfg.optim.state_dtype != "int8":
        combined, names = _with(combined, optim={"state_dtype": "int8"}), names + ["optim.state_dtype=int8"]
    if combined is not None and not _uses_ring(combined) and cfg.offload.pin_memory:
        combined = _with(combined, optim={"overlap_with_backward": True, "grad_clip": 0.0,
                                          "grad_slots_in_flight": cfg.optim.grad_slots_in_flight or 2})
        names.append("in-flight gradient slots")
    if combined is not None and _activations_on_host(combined) and not on_cpu:
        combined = _with(combined, schedule={"activation_store": "device"})
        names.append("schedule.activation_store=device")
    if len(names) > 1:
        alternatives.append((f"all of {' + '.join(names)}", plan(combined)))
    return plan(cfg), [(setting, alt) for setting, alt in alternatives if alt is not None]


def check_host_memory(model: nn.Module, cfg: TrainConfig, *, shards: int, activation_dtype: torch.dtype,
                      budget: Optional[HostMemoryBudget] = None, on_cpu: bool = False) -> HostPlan:
    """Rank 0's plan (``host_memory_plan``); ``ValueError`` in one line, naming what each setting frees, when it
    exceeds the host budget (detected when None: the arena's own budget)."""
    itemsize = torch.empty((), dtype=activation_dtype).element_size()
    plan, alternatives = host_memory_plan(model, cfg, shards=shards, activation_itemsize=itemsize, on_cpu=on_cpu)
    sched = cfg.schedule
    hint = (f"Or lower schedule.num_sub_batches (N={sched.num_sub_batches}), schedule.sub_batch_size "
            f"(n={sched.sub_batch_size}) or data.seq_len (s={cfg.data.seq_len}), or raise schedule.blocks_per_unit; "
            "the parameter shards shrink only with more ranks")
    if on_cpu:
        hint += ("; on the CPU (no GPU) every model state and the activations are in host memory, offloaded or not: "
                 "train a smaller model, or on a CUDA GPU")
    check_host_plan(plan, budget or HostMemoryBudget.detect(), savings=savings_of(plan, alternatives), hint=hint)
    return plan


def check_cpu_memory(model: nn.Module, cfg: TrainConfig, *, shards: int,
                     budget: Optional[HostMemoryBudget] = None) -> HostPlan:
    """Training on the CPU (no CUDA device) keeps every model state in host memory: rank 0's parameter shards,
    gradients and AdamW moments (and ``checkpoint.async_save``'s staging copy). ``ValueError`` in one line, before
    the shards are materialised, when they exceed the host budget: a 7B model would otherwise fill the machine's
    memory until the kernel kills the process. Returns the plan."""
    units, root = unit_and_root_shards(model, blocks_per_unit=cfg.schedule.blocks_per_unit, shards=shards)

    def plan(c: TrainConfig) -> HostPlan:
        return plan_host_memory(units=units, root=root, state_dtype=c.optim.state_dtype,
                                checkpoint_staging_bytes=async_staging_bytes(c, units, root))

    need, budget = plan(cfg), budget or HostMemoryBudget.detect()
    if need.total <= budget.available_bytes:
        return need
    over = need.total - budget.available_bytes
    changed = [(f"optim.state_dtype={dtype}", _with(cfg, optim={"state_dtype": dtype}))
               for dtype in _SMALLER_STATES[cfg.optim.state_dtype]]
    if cfg.checkpoint.async_save:
        changed.append(("checkpoint.async_save=false", _with(cfg, checkpoint={"async_save": False})))
    alternatives = [(setting, plan(c)) for setting, c in changed if c is not None]
    frees = "".join(f"; {setting} frees {freed / GIB:.2f} GiB" for setting, freed in savings_of(need, alternatives))
    raise ValueError(
        f"training on the CPU keeps every model state in host memory: {need.total / GIB:.2f} GiB for "
        f"{need.num_params:,} parameters on this rank ({need.describe()} GiB), before the step's "
        f"activations, {over / GIB:.2f} GiB over: {budget.describe()}. Train a smaller model (model=llama_tiny, or "
        f"fewer model.num_layers){frees}; or train on a CUDA GPU (offload=params computes there and keeps the states "
        f"in host memory). If this machine has more host memory than it reports, set {LIMIT_ENV}")


def check_async_staging(model: nn.Module, cfg: TrainConfig, *, shards: int,
                        budget: Optional[HostMemoryBudget] = None) -> int:
    """``checkpoint.async_save`` without offloaded parameters (the states live on the GPU, the staging copy is the
    host's part): ``ValueError`` in one line when rank 0's copy exceeds the host budget. Returns its bytes."""
    units, root = unit_and_root_shards(model, blocks_per_unit=cfg.schedule.blocks_per_unit, shards=shards)
    need = async_staging_bytes(cfg, units, root)
    budget = budget or HostMemoryBudget.detect()
    if need > budget.available_bytes:
        raise ValueError(f"checkpoint.async_save=true: its staging copy (this rank's parameters and optimizer states) "
                         f"needs {need / GIB:.2f} GiB of host memory: {budget.describe()}; set "
                         "checkpoint.async_save=false (each save then stalls for its write), or run on more ranks "
                         "(the copy shrinks with the shards)")
    return need
