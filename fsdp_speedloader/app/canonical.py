"""The canonical schedule: FSDP2 gradient accumulation over micro-batches (the baseline, and what ``schedule=auto``
runs where ``schedule_choice`` measured it faster), and the sharding both schedules start from (``apply_schedule``).

Each micro-batch's loss is a token sum over the label-token count of the WHOLE effective batch, so the micro-batch
losses add up to the effective-batch mean and the accumulated gradients are the full batch's.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_speedloader import parallel
from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.app.runtime import speedloader_options
from fsdp_speedloader.engine.speedloader import apply_speedloader
from fsdp_speedloader.kernels import KernelScope, apply_kernels
from fsdp_speedloader.models import get_adapter
from fsdp_speedloader.models.chunked_loss import causal_lm_loss


def enable_activation_checkpointing(model: torch.nn.Module, every: int = 1) -> int:
    """Hugging Face's per-block recompute, non-reentrant (the variant that composes with FSDP2), on every ``every``-th
    block (blocks k, 2k, ... counted from 1): the others keep their activations. Returns how many blocks recompute."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = list(get_adapter(model).blocks)
    for i, block in enumerate(blocks, start=1):
        if i % every:  # the flag each block's checkpointing wrapper reads (GradientCheckpointingLayer)
            block.gradient_checkpointing = False
    return len(blocks) // every


def apply_schedule(model: torch.nn.Module, cfg: TrainConfig, mesh: DeviceMesh, *, param_dtype: torch.dtype,
                   reduce_dtype: torch.dtype) -> KernelScope:
    """Shards the (meta) ``model`` in place for ``cfg.schedule.name``; returns the scope the canonical step enters
    (``canonical_forward_backward``'s ``scope``: the SDPA backend, Liger's RoPE).

    canonical: ``cfg.kernels`` applied, optional per-block activation checkpointing, FSDP2 units of
    ``blocks_per_unit`` blocks, forward prefetch, optionally compiled blocks. speedloader: ``apply_speedloader``
    (which applies the kernels and shards the same units itself; its units enter the scope).
    """
    sched = cfg.schedule
    if sched.name == "speedloader":
        apply_speedloader(model, speedloader_options(cfg, param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                          mesh=mesh)
        return contextlib.nullcontext
    kernels = cfg.kernels
    scope = apply_kernels(model, get_adapter(model).blocks, device_type=mesh.device_type, sdpa=kernels.sdpa_backend,
                          liger_kernels=kernels.liger_kernels, float8_training=kernels.float8_training,
                          compiled=sched.compile_blocks)
    if sched.activation_checkpointing:  # before sharding: FSDP's hooks then sit inside the checkpoint
        enable_activation_checkpointing(model, sched.activation_checkpointing_every)
    if sched.compile_blocks:  # lazy; before sharding, so a refusal leaves the model untouched
        get_adapter(model).compile_blocks(as_forward=True)
    blocks = list(get_adapter(model).blocks)
    units = [blocks[i : i + sched.blocks_per_unit] for i in range(0, len(blocks), sched.blocks_per_unit)]
    unit_modules = parallel.apply_fsdp(model, mesh, units=units, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                       offload_params=cfg.offload.params, pin_memory=cfg.offload.pin_memory,
                                       offload_root=cfg.offload.root, device_units=cfg.offload.device_units,
                                       reshard_after_forward=sched.reshard_after_forward)
    parallel.set_forward_prefetch(model, unit_modules, sched.forward_prefetch)
    return scope


def micro_batches(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: Optional[torch.Tensor],
                  size: int) -> list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """(input_ids, labels, position_ids or None) of each micro-batch of ``size`` sequences, in order."""
    positions = [None] * -(-len(input_ids) // size) if position_ids is None else position_ids.split(size)
    return list(zip(input_ids.split(size), labels.split(size), positions))


def canonical_forward_backward(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *,
                               sub_batch_size: int, num_tokens: int, gradient_sync: str = "every",
                               reshard_after_forward: bool = True,
                               scope: KernelScope = contextlib.nullcontext,
                               position_ids: Optional[torch.Tensor] = None, loss_chunk_tokens: int = 0) -> torch.Tensor:
    """The canonical schedule's step (FSDP2 gradient accumulation): one forward and backward per micro-batch of
    ``sub_batch_size``; returns the effective-batch mean loss, detached. ``loss_chunk_tokens`` > 0: the head's logits
    exist for that many tokens at a time, as layer-major's (``models.chunked_loss``; 0: the model's own loss).
    ``gradient_sync='last'`` reduce-scatters only after the last micro-batch (unsharded gradients accumulate on the
    device meanwhile).
    ``reshard_after_forward=False`` (the model sharded so, ``schedule.reshard_after_forward``) also keeps the
    parameters unsharded between micro-batches: each unit is all-gathered once per step. ``scope``
    (``apply_schedule``'s) covers the backward too: activation checkpointing recomputes the blocks there.
    ``position_ids`` (packed documents, ``data.document_mask``) are split with the micro-batches."""
    total = torch.zeros((), device=input_ids.device)
    pieces = micro_batches(input_ids, labels, position_ids, sub_batch_size)
    for k, (ids, lab, pos) in enumerate(pieces):
        last = k == len(pieces) - 1
        if gradient_sync == "last":  # no reduce-scatter until the last micro-batch's backward
            model.set_requires_gradient_sync(last)
        if not reshard_after_forward:  # the next micro-batch's forward finds its parameters gathered
            model.set_reshard_after_backward(last)
        # Token sum / T of the whole batch: the micro-batch losses add up to the batch mean.
        with scope():
            loss = causal_lm_loss(model, ids, lab, num_tokens=num_tokens, chunk_tokens=loss_chunk_tokens,
                                  position_ids=pos)
            loss.backward()
        total += loss.detach()
    return total
