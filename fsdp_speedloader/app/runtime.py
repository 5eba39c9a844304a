"""What every entry point (train, tune, generate) resolves from its config before building a model: the device,
the dtypes, the GPU memory cap, the seeds, and the engine's options."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from fsdp_speedloader.app.config import TrainConfig
from fsdp_speedloader.options import SpeedLoaderOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Config dtype names -> torch dtypes."""


def resolve_device_type(device: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; ValueError for 'cuda' without a GPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available; use device=cpu or auto")
    return device


def resolve_param_dtype(param_dtype: str, device_type: str) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU."""
    if param_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[param_dtype]


def gpu_memory_fraction(cap_gib: float, total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` argument for a cap of ``cap_gib``; ValueError if it exceeds the card."""
    cap_bytes = cap_gib * 2**30
    if cap_bytes > total_bytes:
        raise ValueError(f"max_gpu_memory_gib: {cap_gib} GiB is more than this GPU's {total_bytes / 2**30:.2f} GiB; "
                         "lower it or set it to null for no cap")
    return cap_bytes / total_bytes


def maybe_cap_gpu_memory(cap_gib: Optional[float], device: torch.device) -> None:
    """Emulates a smaller card: this process may allocate at most ``cap_gib`` GiB on ``device``."""
    if cap_gib is None:
        return
    if device.type != "cuda":
        raise ValueError(f"max_gpu_memory_gib: caps GPU memory but the run is on {device.type}; "
                         "set max_gpu_memory_gib=null or device=cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction(cap_gib, total), device)


def seed_everything(seed: int) -> None:
    """Seeds python, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def speedloader_options(cfg: TrainConfig, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                        num_sub_batches: Optional[int] = None) -> SpeedLoaderOptions:
    """The engine's options of a training run (the trainer, the tuner's trials and the benchmarks share it)."""
    sched = cfg.schedule
    return SpeedLoaderOptions(
        num_sub_batches=sched.num_sub_batches if num_sub_batches is None else num_sub_batches,
        blocks_per_unit=sched.blocks_per_unit, activation_store=sched.activation_store,
        offload_params=cfg.offload.params, pin_memory=cfg.offload.pin_memory, param_dtype=param_dtype,
        reduce_dtype=reduce_dtype, forward_prefetch=sched.forward_prefetch, loss_chunk_tokens=sched.loss_chunk_tokens,
        param_transfer_dtype=DTYPES.get(cfg.offload.param_transfer_dtype), compile_blocks=sched.compile_blocks,
        offload_root=cfg.offload.root, device_units=cfg.offload.device_units, keep_activations=sched.keep_activations,
        alternate_sub_batches=sched.alternate_sub_batches, sdpa_backend=cfg.kernels.sdpa_backend,
        liger_kernels=cfg.kernels.liger_kernels, float8_training=cfg.kernels.float8_training)
