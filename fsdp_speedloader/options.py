"""``SpeedLoaderOptions``: the one declaration of the layer-major engine's options.

``apply_speedloader``, the tuner and its trials, the trainer, the generation CLI and the benchmark tools all
take or build one of these, so an option added here reaches every path (and ``tune`` measures the run it
plans). Every check raises ``ValueError`` naming the option and what to change, before anything is sharded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from fsdp_speedloader.kernels import FLOAT8_RECIPES, SDPA_BACKENDS
from fsdp_speedloader.validation import check, check_choice

ACTIVATION_STORES = ("auto", "device", "host", "host_sync")


@dataclass(frozen=True)
class SpeedLoaderOptions:
    """How ``apply_speedloader`` shards a model and runs its layer-major step."""

    num_sub_batches: int = 1
    """N: every forward takes N x sub_batch_size sequences; each unit is loaded once for all N."""
    blocks_per_unit: int = 1
    """Consecutive transformer blocks per FSDP unit and chain step (the paper's on-device layers)."""
    activation_store: str = "auto"
    """Block-boundary activations: 'device', 'host' (exact-size pinned arena, copies overlapped with compute),
    'host_sync' (synchronous copies) or 'auto' (host when parameters are offloaded, else device)."""
    offload_params: bool = False
    """Parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy)."""
    pin_memory: bool = True
    """Page-lock offloaded shards and gradients (with CUDA); with the host store they live in its arena."""
    param_dtype: Optional[torch.dtype] = None
    """FSDP mixed precision: the compute dtype of unsharded parameters (None: the parameters' own)."""
    reduce_dtype: Optional[torch.dtype] = torch.float32
    """FSDP mixed precision: the dtype of the gradient reduce-scatter."""
    forward_prefetch: int = 1
    """Units whose unshard is issued ahead in forward (0: FSDP2's default only)."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the chunked cross-entropy (full-vocabulary logits never exist for the batch)."""
    param_transfer_dtype: Optional[torch.dtype] = None
    """None, or ``param_dtype``: keep a copy of every offloaded shard in that dtype in the arena (cast on the
    CPU after each optimizer step, never used stale) and copy it to the device instead of the fp32 shard.
    Needs offload_params, pin_memory and the host (or auto) activation store."""
    compile_blocks: bool = False
    """Run the blocks of the training step through one ``torch.compile``d function (forward and recompute)."""
    offload_root: bool = True
    """With offload_params, also offload the root's states (embeddings, final norm, LM head); False keeps
    them on the GPU (no load, gradient copy or CPU optimizer step for them in each step)."""
    device_units: int = 0
    """With offload_params, units 1 .. K keep their states on the GPU, as ``offload_root=False`` keeps the
    root's: no load, gradient copy or CPU optimizer step for them. The first units because the next step reads
    them first: unit 1's CPU step, which can start only when the backward ends, is otherwise the one the GPU
    waits for. Each costs its parameters, gradients and optimizer states in GPU memory (16 B per parameter with
    fp32 AdamW); more than the number of units keeps them all."""
    alternate_sub_batches: bool = True
    """Each loop over the sub-batches runs in the reverse order of the loop before, so that it starts with the
    sub-batch whose input was just computed: the host store hands it over on the device, without a round trip
    through the host. False: every loop 0 .. N-1, whose fp32 sums of sub-batch gradients then equal FSDP2's gradient
    accumulation bit for bit (the default differs from it in the last bits)."""
    keep_activations: int = 0
    """(unit, sub-batch) pairs, counted from the last unit back, whose activations inside the unit stay on
    the GPU from forward to backward, so that their backward skips the recompute (exact). Each costs one
    sub-batch's activations of one unit in GPU memory; 0: every pair is recomputed; more than units x
    num_sub_batches: none is. ``tune`` sizes it to the GPU memory left over."""
    sdpa_backend: str = "auto"
    """The one ``scaled_dot_product_attention`` backend the blocks may use in forward and recompute: 'cudnn',
    'flash', 'efficient', 'math', or 'auto' (PyTorch picks per call)."""
    liger_kernels: bool = False
    """Liger's Triton kernels for RMSNorm, the SwiGLU MLP and RoPE (LLaMA-layout families, CUDA, liger-kernel
    installed: the ``kernels`` extra), bound per module before sharding; the state dict is unchanged."""
    float8_training: Optional[str] = None
    """None, or a torchao recipe ('tensorwise', 'rowwise', 'rowwise_with_gw_hp'): the blocks' linears compute
    in float8 (sm89+, torchao installed: the ``kernels`` extra); weights, transfers and optimizer stay as they are."""

    def __post_init__(self) -> None:
        for name, low in (("num_sub_batches", 1), ("blocks_per_unit", 1), ("forward_prefetch", 0),
                          ("loss_chunk_tokens", 1), ("keep_activations", 0), ("device_units", 0)):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            check(ok, name, f"got {value!r}; it must be an integer >= {low}")
        check_choice(self.activation_store, "activation_store", ACTIVATION_STORES)
        check_choice(self.sdpa_backend, "sdpa_backend", SDPA_BACKENDS)
        check(isinstance(self.liger_kernels, bool), "liger_kernels", f"got {self.liger_kernels!r}; pass True or False")
        if self.float8_training is not None:
            check_choice(self.float8_training, "float8_training", FLOAT8_RECIPES)
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            check(value is None or isinstance(value, torch.dtype) and value.is_floating_point, name,
                  f"got {value!r}; pass a floating-point torch.dtype such as torch.bfloat16, or None")
        if self.param_transfer_dtype is not None:
            self._check_param_transfer()
        check(self.device_units == 0 or self.offload_params, "device_units",
              f"got {self.device_units} with offload_params=False: every unit already keeps its states on the "
              "device; set offload_params=True (offload=params), or device_units=0")

    def _check_param_transfer(self) -> None:
        """The transfer copies live in the host arena next to the offloaded shards, and must be what FSDP2
        casts to on the device anyway."""
        dtype, name = self.param_transfer_dtype, "param_transfer_dtype (offload.param_transfer_dtype)"
        check(isinstance(dtype, torch.dtype) and dtype.is_floating_point, name,
              f"got {dtype!r}; pass a floating-point torch.dtype such as torch.bfloat16, or None")
        check(self.offload_params and self.pin_memory and self.uses_arena_store, name,
              f"{dtype} keeps its copies in the host arena next to the offloaded parameter shards; it needs "
              f"offload_params=True, pin_memory=True and activation_store='host' or 'auto' (got "
              f"offload_params={self.offload_params}, pin_memory={self.pin_memory}, activation_store="
              f"{self.activation_store!r}): set offload=params, or param_transfer_dtype=None")
        check(dtype == self.param_dtype, name,
              f"{dtype} differs from param_dtype={self.param_dtype}: FSDP2 casts the transferred parameters to "
              "param_dtype on the device anyway; set param_transfer_dtype=param_dtype (e.g. both bfloat16) or None")

    @property
    def resolved_activation_store(self) -> str:
        """The store 'auto' stands for: host when parameters are offloaded (HBM is the scarce resource)."""
        if self.activation_store == "auto":
            return "host" if self.offload_params else "device"
        return self.activation_store

    @property
    def uses_arena_store(self) -> bool:
        """Activations in the exact-size pinned arena (which then also holds offloaded shards and grads)."""
        return self.resolved_activation_store == "host"

    def replace(self, **changes) -> "SpeedLoaderOptions":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

