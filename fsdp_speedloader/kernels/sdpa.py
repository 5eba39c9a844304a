"""The attention backend of the training step: ``torch.nn.attention.sdpa_kernel`` restricted to one backend.

PyTorch's dispatcher picks flash, memory-efficient or cuDNN attention per call from the shapes; pinning one makes
the choice explicit (and a refusal loud: with one backend allowed, an input it cannot take raises "No available
kernel" instead of silently falling back). The backward of a fused attention runs the kernel its forward chose (the
op is recorded in the graph), so the scope has to cover every forward that builds a graph: the chain's forward and
its recompute in backward (``engine.chain.Unit.forward``), or the canonical schedule's whole forward/backward.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
_CUDA_ONLY = ("cudnn", "flash", "efficient")


def sdpa_backend(name: str) -> ContextManager[None]:
    """The scope in which ``scaled_dot_product_attention`` may use only backend ``name`` ('auto': any)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel([backend])


def check_sdpa_backend(name: str, *, model, device_type: str) -> None:
    """ValueError unless backend ``name`` can serve ``model``'s attention on ``device_type``."""
    if name == "auto":
        return
    if name in _CUDA_ONLY and device_type != "cuda":
        raise ValueError(f"sdpa_backend: {name!r} is a CUDA kernel and this run is on {device_type}; "
                         "set sdpa_backend=auto (or math)")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(f"sdpa_backend: {name!r} picks a kernel of scaled_dot_product_attention, but the model "
                         f"attends with attn_implementation={impl!r}; set model.attn_implementation=sdpa or "
                         "sdpa_backend=auto")
