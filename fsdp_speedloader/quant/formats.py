"""Group-wise weight formats: int8 (symmetric) and int4 (asymmetric, two codes per byte), with their scales.

A linear weight ``W`` (out, in) is cut along its input dimension into groups of ``g`` consecutive elements
(``in % g == 0``); each group gets its own scale (and, for int4, its own minimum)::

    int8   q = round(W / s)            s = max|W_group| / 127      q in [-127, 127]    W' = q * s
    int4   q = round((W - m) / s)      s = (max - min) / 15,       q in [0, 15]        W' = q * s + m
                                       m = min(W_group)

The codes of int4 are packed two per byte along the input dimension (element ``2k`` in the low nibble,
``2k + 1`` in the high one), so a weight is ``out x in / 2`` bytes. Scales and minima are stored in the
compute dtype (bf16 on the GPU), as torchao's and DeepSpeed's group-wise formats store theirs: ``(out, in / g)``
each. Bits per weight: int8 g=128 with bf16 scales 8.125, int4 g=64 with bf16 scale and minimum 4.5.

These are the formats of torchao's ``Int4WeightOnlyConfig`` (asymmetric, float minimum, groups along the input
dimension) and of DeepSpeed ZeRO-Inference's ``quantized_initialization`` without their kernels' tile packing:
the bytes are plain row-major, so they can sit in host memory, cross the link as one copy per unit, and be
dequantized on any device by elementwise kernels (``dequantize``; one fused kernel on a GPU), after which the
matrix product is the ordinary bf16 one (cuBLAS), the right kernel for the hundreds to thousands of rows a
layer-major step multiplies at once (docs/generation.md says why no int4 matmul kernel).

Quantization runs on whatever device holds the weight (the CPU while loading), one row block at a time
(``quantize_into``), so a weight is never held in fp32 whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

WEIGHT_FORMATS = ("int8", "int4")
DEFAULT_GROUP_SIZE = {"int8": 128, "int4": 64}
_ROWS_PER_BLOCK_ELEMENTS = 1 << 24  # quantize_into: fp32 temporaries of at most 64 MiB
_DUMMY_TILE = 1 << 16  # fill_dummy: bytes of the repeated pattern


@dataclass(frozen=True)
class WeightFormat:
    """A group-wise weight format: ``name`` 'int8' or 'int4', ``group_size`` elements per scale."""

    name: str
    group_size: int

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.name!r}; choose one of {', '.join(map(repr, WEIGHT_FORMATS))}")
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
            raise ValueError(f"weight quantization group size {g!r}; it must be an even integer >= 2 (typical: 64, "
                             "128)")

    @property
    def bits(self) -> int:
        return 8 if self.name == "int8" else 4

    @property
    def has_minimum(self) -> bool:
        return self.name == "int4"

    def check_shape(self, out_features: int, in_features: int, what: str) -> None:
        if in_features % self.group_size:
            raise ValueError(f"{what}: in_features={in_features} is not a multiple of the {self.name} group size "
                             f"{self.group_size}; pass a group size that divides it (weight_quant_group_size)")

    def code_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, in_features if self.bits == 8 else in_features // 2)

    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, in_features // self.group_size)

    def nbytes(self, out_features: int, in_features: int, scale_dtype: torch.dtype) -> int:
        """Bytes of one weight in this format: codes, scales and (int4) minima."""
        scale_bytes = (out_features * (in_features // self.group_size) * torch.empty((), dtype=scale_dtype).element_size())
        codes = out_features * in_features * self.bits // 8
        return codes + scale_bytes * (2 if self.has_minimum else 1)


def weight_format(name: str, group_size: Optional[int] = None) -> WeightFormat:
    """``WeightFormat`` of ``name`` ('int8' or 'int4'); ``group_size`` None: 128 for int8, 64 for int4."""
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"weight_quant={name!r}; choose one of {', '.join(map(repr, WEIGHT_FORMATS))} (or None for "
                         "the compute dtype)")
    return WeightFormat(name, DEFAULT_GROUP_SIZE[name] if group_size is None else group_size)


@dataclass(eq=False)
class PackedWeight:
    """One quantized weight: its codes, scales and (int4) minima, wherever they lie (views of a unit's buffer)."""

    format: WeightFormat
    shape: tuple[int, int]  # (out_features, in_features) of the weight it stands for
    codes: torch.Tensor  # (out, in) int8, or (out, in / 2) uint8
    scales: torch.Tensor  # (out, in / g), the compute dtype
    minima: Optional[torch.Tensor]  # (out, in / g) for int4, else None

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight (out, in) in ``dtype`` (default: the scales' dtype), on the codes' device."""
        return dequantize(self, dtype)

    def to(self, device: torch.device) -> "PackedWeight":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return PackedWeight(self.format, self.shape, move(self.codes), move(self.scales), move(self.minima))


def dequantize(packed: PackedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``W'`` (out, in) from ``packed`` in ``dtype`` (default: the scales' dtype), on the codes' device: on a
    GPU one fused kernel (``torch.compile``: reads the codes, writes the weight, no temporaries), elsewhere a
    few elementwise kernels (int8 2, int4 5)."""
    fmt = packed.format
    dtype = dtype or packed.scales.dtype
    args = (packed.codes, packed.scales, packed.minima, fmt.bits, fmt.group_size, dtype)
    if packed.codes.is_cuda:
        return _fused_dequantize(*args)
    return _dequantize_codes(*args)


def _dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, minima: Optional[torch.Tensor], bits: int,
                      group_size: int, dtype: torch.dtype) -> torch.Tensor:
    out_features, groups = scales.shape
    in_features = groups * group_size
    scales = scales.to(dtype).unsqueeze(-1)  # (out, G, 1)
    if bits == 8:
        return (codes.to(dtype).view(out_features, groups, group_size) * scales).view(out_features, in_features)
    # (out, in / 2) uint8: element 2k low nibble, 2k + 1 high nibble
    q = torch.stack((codes & 0xF, codes >> 4), dim=-1).view(out_features, groups, group_size)
    return torch.addcmul(minima.to(dtype).unsqueeze(-1), q.to(dtype), scales).view(out_features, in_features)


_compiled_dequantize = None  # torch.compile(_dequantize_codes), made at the first GPU call


def _fused_dequantize(*args) -> torch.Tensor:
    """``_dequantize_codes`` as one generated kernel. Eager, the int4 path launches 5 kernels and writes ~3.5
    bytes of temporaries per weight, and a decoding step dequantizes every linear of every layer: those launches
    bound the step's host time (docs/generation.md). Compiled with dynamic shapes, once per process and
    (dtype, format): every linear shape shares the kernel, far from torch.compile's recompile limit. Where
    compiling fails (no Triton) it warns once and stays eager; ``TORCHDYNAMO_DISABLE=1`` turns it off."""
    global _compiled_dequantize
    if _compiled_dequantize is None:
        _compiled_dequantize = torch.compile(_dequantize_codes, fullgraph=True, dynamic=True)
    if _compiled_dequantize is _dequantize_codes:
        return _dequantize_codes(*args)
    try:
        return _compiled_dequantize(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a compiler that cannot run here: correct results, eager speed
        warnings.warn(f"fused dequantization unavailable ({type(error).__name__}: {error}); dequantizing eagerly")
        _compiled_dequantize = _dequantize_codes
        return _dequantize_codes(*args)


@torch.no_grad()
def quantize_into(weight: torch.Tensor, packed: PackedWeight) -> None:
    """Quantizes ``weight`` (out, in, any float dtype) into ``packed``'s tensors (same device), a block of
    rows at a time. The codes are rounded against the stored (compute-dtype) scales, so dequantizing
    reproduces exactly what was rounded to."""
    fmt, (out_features, in_features) = packed.format, packed.shape
    if tuple(weight.shape) != (out_features, in_features):
        raise ValueError(f"quantize: weight {tuple(weight.shape)} for a packed weight of {packed.shape}")
    groups, g = in_features // fmt.group_size, fmt.group_size
    rows = max(1, _ROWS_PER_BLOCK_ELEMENTS // in_features)
    for r0 in range(0, out_features, rows):
        r1 = min(out_features, r0 + rows)
        w = weight[r0:r1].to(torch.float32).view(r1 - r0, groups, g)
        if fmt.bits == 8:
            scale = (w.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
            stored = scale.to(packed.scales.dtype)
            packed.scales[r0:r1].copy_(stored)
            q = torch.round(w / stored.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
            packed.codes[r0:r1].copy_(q.clamp_(-127, 127).to(torch.int8).view(r1 - r0, in_features))
            continue
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale_stored = ((high - low) / 15.0).to(packed.scales.dtype)
        low_stored = low.to(packed.minima.dtype)
        packed.scales[r0:r1].copy_(scale_stored)
        packed.minima[r0:r1].copy_(low_stored)
        s = scale_stored.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        q = torch.round((w - low_stored.to(torch.float32).unsqueeze(-1)) / s).clamp_(0, 15).to(torch.uint8)
        q = q.view(r1 - r0, in_features // 2, 2)
        packed.codes[r0:r1].copy_(q[..., 0] | (q[..., 1] << 4))


def fill_dummy(packed: PackedWeight, *, std: float = 0.02) -> None:
    """Codes and scales of a weight of magnitude about ``std`` without computing any weight (benchmarks):
    a byte pattern in the codes, constant scales (and minima). No bf16 weight ever exists."""
    fmt = packed.format
    flat = packed.codes.view(-1).view(torch.uint8)
    # A fixed pseudo-random tile repeated over the codes: memcpy speed, and no all-zero weights (a GPU multiplies
    # zeros faster than data: docs/generation.md's method note).
    tile = torch.randint(0, 256, (_DUMMY_TILE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    if fmt.bits == 8:
        tile = tile.view(torch.int8).clamp_(-127, 127).view(torch.uint8)
    tile = tile.to(flat.device)
    whole = flat.numel() // _DUMMY_TILE * _DUMMY_TILE
    flat[:whole].view(-1, _DUMMY_TILE).copy_(tile.expand(whole // _DUMMY_TILE, -1))
    flat[whole:].copy_(tile[: flat.numel() - whole])
    if fmt.bits == 8:
        packed.scales.fill_(std / 64)
    else:
        packed.scales.fill_(2 * std / 15)
        packed.minima.fill_(-std)
