"""Per-step training metrics: throughput, model/hardware FLOPs utilisation, memory, timing.

FLOPs per token (PaLM appendix B): the model does ``6 N + 12 L h s`` (forward + backward, N the
non-embedding parameters). When blocks are recomputed in backward (always for the layer-major
schedule, for the canonical one with activation checkpointing) the hardware also redoes the blocks'
forward, ``2 N_blocks + 4 L h s`` more; MFU counts only the model FLOPs, HFU counts both.

Timing is wall clock between ``start_step`` and ``end_step``. On CUDA ``end_step`` synchronises
once, at the step boundary -- never inside the step -- so the time covers all queued kernels.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Optional

import torch
from torch import nn

GIB = float(2**30)


def host_rss_gib() -> float:
    """Resident set size of this process in GiB (``VmRSS``; peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / GIB  # reported in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB


def num_block_params(blocks: nn.Module) -> int:
    """Parameters of the transformer blocks (global counts: DTensor and meta tensors report full shapes)."""
    return sum(p.numel() for p in blocks.parameters())


def recompute_flops_per_token(*, num_block_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """FLOPs of re-running every block's forward for one token: ``2 N_blocks + 4 L h s``.

    Only the blocks are recomputed (embeddings and the LM head are not), hence N_blocks, not N.
    """
    return 2.0 * num_block_params + 4.0 * num_layers * hidden_size * seq_len


class StepMetrics:
    """Measures one optimizer step at a time: ``start_step()``, ``mark_data_ready()``, ``end_step(...)``.

    Args:
        device: the compute device (CUDA peak memory is read and reset for it; elsewhere the metrics have no
            GPU memory keys).
        world_size: number of ranks (each processes ``tokens_per_step_per_device`` tokens).
        tokens_per_step_per_device: input tokens one rank processes per optimizer step.
        flops_per_token: model FLOPs per token, forward + backward (``adapter.flops_per_token``).
        recompute_flops_per_token: extra hardware FLOPs per token from recomputation (0 if none).
        peak_tflops: dense peak TFLOP/s of one device (MFU/HFU denominator).
        attention_flops_per_token: the attention part of ``flops_per_token`` (``adapter.attention_flops_per_token``):
            ``mfu_no_attention`` leaves it out, the convention of the reports that count 6 N only.
    """

    def __init__(self, *, device: torch.device, world_size: int, tokens_per_step_per_device: int,
                 flops_per_token: float, recompute_flops_per_token: float = 0.0, peak_tflops: float,
                 attention_flops_per_token: float = 0.0) -> None:
        self.device = torch.device(device)
        self.world_size = world_size
        self.tokens_per_step_per_device = tokens_per_step_per_device
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = flops_per_token + recompute_flops_per_token
        self.attention_flops_per_token = attention_flops_per_token
        self.peak_flops = peak_tflops * 1e12
        self._is_cuda = self.device.type == "cuda"
        self._t0: Optional[float] = None
        self._t_data: Optional[float] = None

    def start_step(self) -> None:
        if self._is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._alloc_retries = alloc_retries(self.device)
        self._t0 = time.perf_counter()
        self._t_data = None

    def mark_data_ready(self) -> None:
        """Call once the batch is in hand: the time since ``start_step`` is the data wait."""
        self._t_data = time.perf_counter()

    def end_step(self, *, loss: float, lr: float, grad_norm: Optional[float], step_skipped: bool = False,
                 num_skipped_steps: int = 0) -> dict:
        """The step's metrics; synchronises CUDA once (the step boundary). ``grad_norm``: the global gradient
        norm before clipping (None: not computed); ``step_skipped``: the optimizer step was skipped (a non-finite
        gradient norm); ``num_skipped_steps``: such steps since this process started training."""
        assert self._t0 is not None, "end_step without start_step"
        if self._is_cuda:
            torch.cuda.synchronize(self.device)
        step_time = max(time.perf_counter() - self._t0, 1e-9)
        data_wait = (self._t_data - self._t0) if self._t_data is not None else 0.0
        tokens_per_s_per_device = self.tokens_per_step_per_device / step_time
        tokens_per_s = tokens_per_s_per_device * self.world_size
        # Per device: tokens/s/device x FLOPs/token over one device's peak (= global / (peak x world)).
        mfu = tokens_per_s_per_device * self.flops_per_token / self.peak_flops
        hfu = tokens_per_s_per_device * self.hardware_flops_per_token / self.peak_flops
        self._t0 = None
        metrics = {
            "loss": float(loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "step_skipped": int(step_skipped),
            "num_skipped_steps": int(num_skipped_steps),
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s_per_device,
            "flops_per_token": self.flops_per_token,
            "hardware_flops_per_token": self.hardware_flops_per_token,
            "mfu": mfu,
            "mfu_no_attention": mfu * (1.0 - self.attention_flops_per_token / self.flops_per_token),
            "hfu": hfu,
            "host_rss_gib": host_rss_gib(),
        }
        if self._is_cuda:  # no GPU, no GPU memory figures (not zeros)
            metrics["peak_gpu_mem_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            metrics["peak_gpu_mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
            # The caching allocator's retries in this step (torchtitan logs them too): reserved memory met the cap,
            # and each retry freed the cache after synchronising the GPU, with the launching thread waiting.
            metrics["gpu_alloc_retries"] = alloc_retries(self.device) - self._alloc_retries
        return metrics


def alloc_retries(device: torch.device) -> int:
    """The CUDA caching allocator's cudaMalloc retries so far on ``device``."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
