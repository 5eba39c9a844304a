"""Where the quantized weights live: one buffer of packed bytes per transformer block.

Per block, the codes, scales and minima of its ``QuantizedLinear`` modules lie back to back in one uint8
buffer (each piece aligned to 64 bytes), so moving a block to the GPU is ONE host-to-device copy of exactly
its packed bytes, and the same offsets give typed views of the copy (``BlockWeights.views``)::

    block buffer   [ q_proj codes | scales | (minima) | k_proj codes | ... | down_proj minima ]

Offloaded (``offload=True``) the buffers are slots of one exact-size page-locked ``PinnedArena`` (plain memory
without CUDA) checked against the host budget before anything is allocated; otherwise they are allocated on the
compute device and the modules dequantize from there (weights resident in 2x / 4x less GPU memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from fsdp_speedloader.memory.arena import DEFAULT_MARGIN, ArenaPlan, HostMemoryBudget, PinnedArena
from fsdp_speedloader.quant.formats import PackedWeight, WeightFormat
from fsdp_speedloader.quant.linear import QuantizedLinear

_ALIGN = 64  # bytes: every piece of a block buffer starts on it (any dtype's view, DMA-friendly)
_ATTRIBUTE = "_speedloader_quantized_weights"  # on the model: its QuantizedWeights


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class _Piece:
    offset: int  # bytes into the block buffer
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(eq=False)
class _Entry:
    module: QuantizedLinear
    name: str  # the module's name in the model (checkpoint keys are '<name>.weight')
    codes: _Piece
    scales: _Piece
    minima: Optional[_Piece]

    def view(self, buffer: torch.Tensor) -> PackedWeight:
        m = self.module
        return PackedWeight(m.format, (m.out_features, m.in_features), self.codes.view(buffer),
                            self.scales.view(buffer), None if self.minima is None else self.minima.view(buffer))


@dataclass(eq=False)
class BlockWeights:
    """One block's packed bytes (``buffer``, where they live) and the layout of its linears in them."""

    entries: list[_Entry]
    nbytes: int
    buffer: Optional[torch.Tensor] = None  # (nbytes,) uint8: an arena slot, or on the compute device

    def views(self, buffer: Optional[torch.Tensor] = None) -> list[tuple[QuantizedLinear, PackedWeight]]:
        """Each linear and its packed weight, as views of ``buffer`` (a copy of this block's bytes, e.g. on
        the GPU) or of the block's own buffer."""
        buffer = self.buffer if buffer is None else buffer
        return [(e.module, e.view(buffer)) for e in self.entries]

    @property
    def modules(self) -> list[QuantizedLinear]:
        return [e.module for e in self.entries]


@dataclass(eq=False)
class QuantizedWeights:
    """Every block's packed weights: ``blocks`` in the model's block order."""

    format: WeightFormat
    blocks: list[BlockWeights]
    block_index: dict[int, int]  # id(block module) -> its index in ``blocks``
    offloaded: bool  # in host memory (streamed per unit) rather than on the compute device
    arena: Optional[PinnedArena] = None
    stats: dict = field(default_factory=dict)  # how they were filled (materialize_quantized_weights)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def of_block(self, block: nn.Module) -> BlockWeights:
        return self.blocks[self.block_index[id(block)]]


def plan_block(block: nn.Module, prefix: str) -> BlockWeights:
    """The layout of ``block``'s quantized linears in one buffer (nothing allocated). ``prefix``: the block's
    name in the model."""
    entries, offset = [], 0
    for name, module in block.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        fmt, out_f, in_f = module.format, module.out_features, module.in_features
        pieces = []
        for shape, dtype in ((fmt.code_shape(out_f, in_f), fmt.code_dtype()),
                             (fmt.scale_shape(out_f, in_f), module.dtype),
                             *(((fmt.scale_shape(out_f, in_f), module.dtype),) if fmt.has_minimum else ())):
            piece = _Piece(offset, tuple(shape), dtype)
            offset = _aligned(offset + piece.nbytes)
            pieces.append(piece)
        entries.append(_Entry(module, f"{prefix}.{name}" if name else prefix, pieces[0], pieces[1],
                              pieces[2] if fmt.has_minimum else None))
    return BlockWeights(entries, offset)


def allocate(blocks: list[BlockWeights], *, offload: bool, device: torch.device,
             host_memory_limit_bytes: Optional[int] = None) -> Optional[PinnedArena]:
    """Gives every block its buffer: arena slots (offload; page-locked with CUDA, registered after the caller
    filled them: ``arena.pin()``), or device memory. Returns the arena, if any."""
    if not offload:
        for b in blocks:
            b.buffer = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        return None
    plan = ArenaPlan()
    for k, b in enumerate(blocks):
        plan.add(f"quantized_block_{k}", "quantized_weights", (b.nbytes,), torch.uint8)
    total = sum(b.nbytes for b in blocks)
    hint = (f"the quantized weights take {total / 2**30:.2f} GiB: use int4 instead of int8, or a machine with more "
            "host memory")
    arena = PinnedArena(plan, budget=HostMemoryBudget.detect(host_memory_limit_bytes, margin=DEFAULT_MARGIN),
                        hint=hint, pin=device.type == "cuda", defer_pin=True)
    for k, b in enumerate(blocks):
        b.buffer = arena.slot(f"quantized_block_{k}")
    return arena


def set_quantized_weights(model: nn.Module, weights: QuantizedWeights) -> None:
    setattr(model, _ATTRIBUTE, weights)


def quantized_weights(model: nn.Module) -> Optional[QuantizedWeights]:
    """The model's quantized weights (``materialize_quantized_weights``), or None for a model in its compute
    dtype."""
    return getattr(model, _ATTRIBUTE, None)
