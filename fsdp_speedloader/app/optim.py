"""The training run's optimizer and learning-rate schedule: AdamW (fused where supported), or one AdamW per unit
stepped during the backward (``OverlappedOptimizer``), with warmup then cosine/linear decay."""

from __future__ import annotations

import functools
import logging
import math

import torch

from fsdp_speedloader.app.config import OptimConfig
from fsdp_speedloader.memory.optimizer_overlap import OverlappedOptimizer

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer | OverlappedOptimizer:
    """AdamW, weight decay on matrices only (>= 2-D: not on norms and biases); fused where supported.

    With ``cfg.overlap_with_backward`` an :class:`OverlappedOptimizer` (``model`` prepared with
    ``apply_speedloader``): one such AdamW per unit and one for the root, each stepped as soon as its
    gradients are on the host.
    """
    if cfg.overlap_with_backward:
        return OverlappedOptimizer(model, functools.partial(_build_adamw, cfg=cfg))
    return _build_adamw(list(model.parameters()), cfg)


def _build_adamw(parameters: list, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in parameters if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:  # fused runs on CUDA and (torch >= 2.4) on CPU, including FSDP2's offloaded CPU DTensors
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError) as e:
        log.warning("fused AdamW is not supported here (%s); using the foreach implementation", e)
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


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


def build_lr_scheduler(optimizer: torch.optim.Optimizer | OverlappedOptimizer, cfg: OptimConfig,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR | LRSchedulerGroup:
    """Warmup then decay (``lr_factor``); for an :class:`OverlappedOptimizer`, one per inner optimizer."""
    fn = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                           schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
    if isinstance(optimizer, OverlappedOptimizer):
        return LRSchedulerGroup([torch.optim.lr_scheduler.LambdaLR(opt, fn) for opt in optimizer.optimizers])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class LRSchedulerGroup:
    """LR schedulers stepped together, saved and loaded as one (the inner optimizers of an OverlappedOptimizer)."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return {"schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["schedulers"]) != len(self.schedulers):
            raise ValueError(f"checkpoint: it holds {len(state['schedulers'])} LR schedulers, this run has "
                             f"{len(self.schedulers)}; resume with the same optim.overlap_with_backward and "
                             "model depth / schedule.blocks_per_unit")
        for scheduler, s in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(s)
