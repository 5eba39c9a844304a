"""Opt-in kernel levers of the training step, all off by default (docs/design.md, "Kernel levers").

    sdpa.py    sdpa_backend(name): scaled_dot_product_attention pinned to cuDNN, flash, efficient or math
    liger.py   apply_liger_kernels(model, blocks): Liger's RMSNorm and SwiGLU per module; liger_rope: RoPE, scoped
    float8.py  apply_float8_training(blocks, recipe): torchao's Float8Linear for the blocks' linears

Two moments: ``apply_kernels`` changes modules in place before sharding (so FSDP2 wraps what will run), and the
scope of ``kernel_scope`` is entered around every run of the blocks that builds or replays a graph. Both
``apply_speedloader`` and the trainer's canonical schedule call them, so the two schedules run the same kernels.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

from torch import nn

from fsdp_speedloader.kernels.float8 import FLOAT8_RECIPES, apply_float8_training, check_float8_training
from fsdp_speedloader.kernels.liger import LIGER_FAMILIES, apply_liger_kernels, check_liger_kernels, liger_rope, \
    warn_liger_in_compiled_blocks
from fsdp_speedloader.kernels.sdpa import SDPA_BACKENDS, check_sdpa_backend, sdpa_backend

KernelScope = Callable[[], ContextManager[None]]


def apply_kernels(model: nn.Module, blocks: nn.ModuleList, *, device_type: str, sdpa: str = "auto",
                  liger_kernels: bool = False, float8_training: Optional[str] = None,
                  compiled: bool = False) -> KernelScope:
    """Checks every asked-for lever first (ValueError in one line: what is missing, what to set), then applies
    Liger and float8 to ``model`` in place; returns the scope the blocks' runs enter. ``compiled``: the blocks will
    run compiled (Liger there is warned about: it measured faster in one compiled configuration, slower in others)."""
    check_sdpa_backend(sdpa, model=model, device_type=device_type)
    if liger_kernels:
        check_liger_kernels(model, device_type=device_type)
        if compiled:
            warn_liger_in_compiled_blocks()
    if float8_training is not None:
        check_float8_training(float8_training, device_type=device_type)
    if liger_kernels:
        apply_liger_kernels(model, blocks)
    if float8_training is not None:  # after Liger: its SwiGLU forward calls the (then float8) gate/up/down linears
        apply_float8_training(blocks, float8_training)
    return kernel_scope(sdpa=sdpa, rope=liger_rope(blocks) if liger_kernels else None)


def kernel_scope(*, sdpa: str = "auto", rope: Optional[KernelScope] = None) -> KernelScope:
    """The scope factory of ``apply_kernels``: the SDPA backend and Liger's RoPE (``contextlib.nullcontext`` when
    neither is asked for)."""
    if sdpa == "auto" and rope is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        with sdpa_backend(sdpa), (rope() if rope is not None else contextlib.nullcontext()):
            yield

    return scope


__all__ = ["FLOAT8_RECIPES", "KernelScope", "LIGER_FAMILIES", "SDPA_BACKENDS", "apply_float8_training", "apply_kernels",
           "apply_liger_kernels", "check_float8_training", "check_liger_kernels", "check_sdpa_backend", "kernel_scope",
           "liger_rope", "sdpa_backend"]
