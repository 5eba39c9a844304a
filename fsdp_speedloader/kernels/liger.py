"""Liger's fused Triton kernels in an unmodified Hugging Face model: RMSNorm, SwiGLU MLP, RoPE.

Per instance, never per class: each RMSNorm and MLP module of the model gets Liger's ``forward`` bound on the
instance (its weights, names and state dict untouched, so checkpoints and the export see the model as built; any
other model in the process keeps Hugging Face's code). RoPE is a module-level function that the family's attention
calls by name, so it cannot be bound to an instance: ``liger_rope`` swaps it only inside a scope, which the
engine enters around every run of the blocks (forward and recompute) and nothing else.

RMSNorm runs with ``in_place=False``: Liger's in-place backward writes dX over the incoming gradient, which in a
pre-norm block is the same tensor autograd hands to the residual branch.

Not used: Liger's fused linear cross-entropy. The engine's head loss is already chunked over tokens
(``loss_chunk_tokens``: the full-vocabulary logits never exist) and recomputed in backward; Liger's function reads
the count of targets with ``.item()`` on every call, a host sync per chunk in the steady state.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from importlib import metadata
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)

# model_type -> the Hugging Face families whose blocks are LLaMA's (RMSNorm as LlamaRMSNorm, SwiGLU gate/up/down
# MLP, apply_rotary_pos_emb(q, k, cos, sin)); Liger's own kernels reproduce LLaMA's casts ('llama' casting mode).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_SWIGLU_ACTS = ("silu", "swish")


def check_liger_kernels(model: nn.Module, *, device_type: str) -> None:
    """ValueError unless Liger can run ``model`` here: liger_kernel and triton installed, CUDA, a LLaMA-layout
    family."""
    try:
        import liger_kernel  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError(f"liger_kernels needs liger-kernel and triton (pip install 'fsdp-speedloader[kernels]', or "
                         f"the wheel in .wheels: tools/device_wheels.sh): {e}; or set liger_kernels=false") from None
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"liger_kernels: Liger's kernels are Triton kernels for CUDA and this run is on "
                         f"{device_type}; set liger_kernels=false")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in LIGER_FAMILIES:
        raise ValueError(f"liger_kernels: {type(model).__name__} (model_type {model_type!r}) is not a LLaMA-layout "
                         f"family fsdp_speedloader applies Liger to ({', '.join(LIGER_FAMILIES)}); "
                         "set liger_kernels=false")
    act = getattr(model.config, "hidden_act", None)
    if act not in _SWIGLU_ACTS:
        raise ValueError(f"liger_kernels: Liger's SwiGLU kernel computes silu(gate) * up and the model's MLP uses "
                         f"{act!r}; set liger_kernels=false")


def compiled_liger_warning(version: Optional[str]) -> str:
    """What to tell a user who runs Liger (``version``, None: unknown) inside compiled blocks. Measured on an H200
    (docs/results.md): +3.8% and +4.6% on layer-major 2 x 4 keeping 24 of 32 pairs, but -14% to -24% on three rows
    that keep most activations and out of memory on a fourth; liger-kernel 0.8.1 and 0.8.5 did alike on the row
    compared, so no release is to blame."""
    return (f"liger_kernels with compiled blocks (liger-kernel {version or 'of unknown version'}): on an H200 it "
            "sped one compiled configuration up by ~4% and slowed three others by 14-24% (docs/results.md, "
            "'Liger'): measure before keeping kernels.liger_kernels=true")


def warn_liger_in_compiled_blocks() -> None:
    """Logs ``compiled_liger_warning`` for the installed liger-kernel (for compiled blocks)."""
    try:
        version = metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        version = None
    log.warning(compiled_liger_warning(version))


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _is_swiglu_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def apply_liger_kernels(model: nn.Module, blocks: nn.ModuleList) -> dict[str, int]:
    """Binds Liger's RMSNorm forward to every RMSNorm of ``model`` (the blocks', Qwen3's q/k norms, the final norm)
    and Liger's SwiGLU forward to every block's MLP, in place, before sharding; returns the counts per kernel."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    counts = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        if _is_rms_norm(module):
            # The attributes LigerRMSNorm.forward reads; plain attributes, not in the state dict.
            module.offset, module.casting_mode, module.in_place, module.row_mode = 0.0, "llama", False, None
            module.forward = LigerRMSNorm.forward.__get__(module)
            counts["rms_norm"] += 1
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is not None and _is_swiglu_mlp(mlp):
            mlp.forward = LigerSwiGLUMLP.forward.__get__(mlp)
            counts["swiglu"] += 1
    return counts


def liger_rope(blocks: nn.ModuleList) -> Callable[[], ContextManager[None]]:
    """A scope factory: inside, the blocks' families call Liger's RoPE instead of their ``apply_rotary_pos_emb``."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    modules = {sys.modules[type(block).__module__] for block in blocks}
    modules = [m for m in modules if callable(getattr(m, "apply_rotary_pos_emb", None))]

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        originals = [(m, m.apply_rotary_pos_emb) for m in modules]
        for m, _ in originals:
            m.apply_rotary_pos_emb = liger_rotary_pos_emb
        try:
            yield
        finally:
            for m, original in originals:
                m.apply_rotary_pos_emb = original

    return scope
