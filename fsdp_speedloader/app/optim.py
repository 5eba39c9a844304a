"""The training run's optimizers and learning-rate schedule: AdamW (fused where supported) behind the library's
optimizer interface -- one over the model (``OptimizersContainer``), or one per unit stepped beside the backward
or the next forward (``OverlappedOptimizer``) -- clipping the global gradient norm (``optim.grad_clip``) and
skipping non-finite steps (``optim.skip_nonfinite``) either way, with warmup then cosine/linear decay, one schedule
per inner optimizer, each stepped right after its optimizer's step. The moments are fp32 (exact) unless
``optim.state_dtype`` compresses them (``memory/compressed_adamw.py``)."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from typing import Optional

import torch

from fsdp_speedloader.app.config import OptimConfig
from fsdp_speedloader.memory.compressed_adamw import CHUNK_PER_THREAD, CompressedAdamW
from fsdp_speedloader.memory.local_adamw import LocalShardAdamW
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer, OverlappedOptimizer
from fsdp_speedloader.memory.threads import optimizer_cpus

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, seed: int = 0) -> OptimizersContainer:
    """AdamW, weight decay on matrices only (>= 2-D: not on norms and biases); fused where supported.

    With ``cfg.overlap_with_backward`` an :class:`OverlappedOptimizer` (``model`` prepared with
    ``apply_speedloader``): one such AdamW per unit and one for the root, each stepped as soon as its
    gradients are on the host, or, with ``cfg.grad_clip > 0``, as soon as the global norm is known (during the
    next forward). Either clips to ``cfg.grad_clip`` and, when it clips, skips steps whose gradient norm is not
    finite (``cfg.skip_nonfinite``). The trainer uses either the same way. ``seed``: with bf16 master weights, the
    stochastic rounding's (each inner optimizer its own, in the order they are built: units, then the root).
    """
    inner = itertools.count()

    def build(parameters: list) -> torch.optim.Optimizer:
        return build_adamw(parameters, cfg, seed=seed * 1_000_003 + next(inner))

    skip = cfg.skip_nonfinite and cfg.grad_clip > 0
    if cfg.overlap_with_backward:
        return OverlappedOptimizer(model, build, max_norm=cfg.grad_clip, skip_nonfinite=skip,
                                   grad_slots_in_flight=cfg.grad_slots_in_flight, worker_threads=cfg.worker_threads,
                                   worker_nice=cfg.worker_nice,
                                   worker_cpus=optimizer_cpus() if cfg.worker_affinity else None)
    return OptimizersContainer(model, build, max_norm=cfg.grad_clip, skip_nonfinite=skip)


def build_adamw(parameters: list, cfg: OptimConfig, *, seed: int = 0) -> torch.optim.Optimizer:
    """One AdamW over the trainable ``parameters``: matrices with weight decay, the rest without. Its moments in
    ``cfg.state_dtype``: fp32 (``torch.optim.AdamW``, stepping DTensors through their local shards:
    ``LocalShardAdamW``; host ones in chunks on the host pool with ``cfg.fp32_host_step=pool``), or bf16 / int8
    (``CompressedAdamW``) for parameters in host memory; parameters on the GPU (``offload.root=false``'s root, or no
    offload) keep fp32 moments, stepped by the fused kernel on the device.
    bf16 parameters (``cfg.master_dtype=bf16``) are updated with stochastic rounding seeded by ``seed``."""
    params = [p for p in parameters if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.state_dtype != "fp32" and all(p.device.type == "cpu" for p in params):
        return CompressedAdamW(groups, state_dtype=cfg.state_dtype, kernel=cfg.host_kernel,
                               rounding="stochastic" if cfg.master_dtype == "bf16" else "nearest", seed=seed, **kwargs)
    chunk = CHUNK_PER_THREAD if cfg.fp32_host_step == "pool" else 0  # device parameters step unchunked anyway
    try:  # fused runs on CUDA and (torch >= 2.4) on CPU; on FSDP2's DTensors through their local shards
        return LocalShardAdamW(groups, fused=True, host_chunk=chunk, **kwargs)
    except (RuntimeError, TypeError) as e:
        log.warning("fused AdamW is not supported here (%s); using the foreach implementation", e)
        return LocalShardAdamW(groups, foreach=True, **kwargs)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """LR multiplier of the ``step``-th optimizer step (0-based): linear warmup, then decay to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizers: OptimizersContainer, cfg: OptimConfig, total_steps: int) -> LRSchedulersContainer:
    """Warmup then decay (``lr_factor``): one ``LambdaLR`` per inner optimizer, each stepped after its optimizer."""
    fn = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                           schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
    return LRSchedulersContainer([torch.optim.lr_scheduler.LambdaLR(opt, fn) for opt in optimizers],
                                 optimizers=optimizers)


class LRSchedulersContainer:
    """LR schedulers stepped together, saved and loaded as one.

    ``optimizers``: the container whose inner optimizers the schedulers wrap, in order. ``step()`` then steps
    scheduler i once optimizer i's last step is applied (``call_after_step``): at once after a plain step; after
    each unit's deferred step in the overlapped optimizer's worker, so that the step reads the LR it was issued
    with, as in a plain step-then-schedule.

    Checkpoint layout: the scheduler's own state dict when there is one scheduler (one optimizer over the model),
    ``{"schedulers": [each one's]}`` when there are several (an ``OverlappedOptimizer``'s, one per unit and the
    root): the layouts checkpoints held before this container existed, so those still load.
    """

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler], *,
                 optimizers: Optional[OptimizersContainer] = None) -> None:
        self.schedulers = schedulers
        self.optimizers = optimizers

    def step(self) -> None:
        for index, scheduler in enumerate(self.schedulers):
            if self.optimizers is None:
                scheduler.step()
            else:
                self.optimizers.call_after_step(index, scheduler.step)

    def get_last_lr(self) -> list[float]:
        return [lr for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict:
        if self.optimizers is not None:  # the schedulers' steps still queued behind deferred optimizer steps
            self.optimizers.wait()
        states = [scheduler.state_dict() for scheduler in self.schedulers]
        return states[0] if len(states) == 1 else {"schedulers": states}

    def load_state_dict(self, state: dict) -> None:
        states = state["schedulers"] if "schedulers" in state else [state]
        if len(states) != len(self.schedulers):
            raise ValueError(f"checkpoint: it holds {len(states)} LR scheduler(s), this run has "
                             f"{len(self.schedulers)}; resume with the same optim.overlap_with_backward and model "
                             "depth / schedule.blocks_per_unit")
        for scheduler, s in zip(self.schedulers, states):
            scheduler.load_state_dict(s)

    def configured(self) -> list[tuple[list[float], list[dict]]]:
        """This run's settings, before a checkpoint's replace them: each scheduler's base LRs and its optimizer's
        param-group hyperparameters (weight decay, betas, eps, ...; not the parameters or the current LR)."""
        return [(list(s.base_lrs), [{k: v for k, v in g.items() if k not in _SCHEDULED} for g in s.optimizer.param_groups])
                for s in self.schedulers]

    def reapply(self, configured: list[tuple[list[float], list[dict]]]) -> list[str]:
        """After a resume: ``configured`` (:meth:`configured`) replaces what the checkpoint held, the schedule going on
        from the checkpoint's step with it, as a resumed run's command line says (a lower ``optim.lr`` after a loss
        that went to NaN). Returns the settings that changed, as "name old -> new" (each once)."""
        changes: dict[str, str] = {}
        for scheduler, (base_lrs, groups) in zip(self.schedulers, configured):
            for group, settings in zip(scheduler.optimizer.param_groups, groups):
                for key, value in settings.items():
                    if not _same(group.get(key), value):
                        changes.setdefault(key, f"{key} {group.get(key)} -> {value}")
                        group[key] = value
            for old, new in zip(scheduler.base_lrs, base_lrs):
                if not _same(old, new):
                    changes.setdefault("lr", f"lr {old:g} -> {new:g}")
            scheduler.base_lrs = base_lrs
            epoch = scheduler.last_epoch
            for group, base, factor in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
                group["initial_lr"], group["lr"] = base, base * factor(epoch)
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        return list(changes.values())


_SCHEDULED = ("params", "lr", "initial_lr")  # a group's parameters, and what the LR schedule sets


def _same(a, b) -> bool:
    """Equal settings, a tuple and the list a checkpoint made of it alike (AdamW's betas)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b
