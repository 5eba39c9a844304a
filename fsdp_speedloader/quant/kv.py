"""Keys and values in 8 bits: one scale per (position, sequence, head), over the head dimension.

    int8   codes = round(x / s)      s = max|x| / 127     codes in [-127, 127]
    fp8    codes = e4m3(x / s)       s = max|x| / 448     (torch.float8_e4m3fn, no infinities)

    x' = codes * s   (in the compute dtype)

One scale per token and head, for keys and values alike: the granularity a cache written one position at a
time can keep (KIVI's per-channel key scales need a window of positions before they can be fixed). Every
position's codes are independent of the others: a position is quantized once, when it is written, never again.
Scales are stored in the compute dtype, 2 bytes per head_dim codes (1.6% for d = 128).

Host attention reads codes and scales where they lie (``host_attention.py``): the cache hands it the codes
with their scales attached (``attach_scales`` / ``scales_of``), and it dequantizes a few sequences at a time, so
the compute-dtype copy of the keys never has to go through host memory in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

KV_CACHE_DTYPES = ("int8", "fp8")
_SCALES = "_speedloader_kv_scales"
_CHUNK_ELEMENTS = 1 << 24  # fp32 temporaries of the quantizer: 64 MiB at a time


@dataclass(frozen=True)
class KVCodec:
    """How 8-bit keys and values are stored: ``name`` 'int8' or 'fp8' (e4m3)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.name!r}; choose one of {', '.join(map(repr, KV_CACHE_DTYPES))} "
                             "(or None for the compute dtype)")

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.name == "int8" else torch.float8_e4m3fn

    @property
    def qmax(self) -> float:
        return 127.0 if self.name == "int8" else 448.0

    def quantize(self, x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., d) -> codes (..., d) and scales (...) in ``scale_dtype``; codes are rounded against the stored
        scales. The fp32 division runs ``_CHUNK_ELEMENTS`` at a time: a prefill's sub-batch widened to fp32 whole
        was what ran a 24 GiB GPU out of memory (docs/generation.md, OPT-30B int4 at 56 sequences)."""
        tiny = torch.finfo(torch.float32).tiny
        # max|x| in x's own dtype is exact (abs and max only pick values), so no fp32 copy of x is needed for it.
        scales = (x.abs().amax(dim=-1).to(torch.float32) / self.qmax).clamp_min(tiny).to(scale_dtype)
        codes = torch.empty(x.shape, dtype=self.code_dtype, device=x.device)
        d = x.shape[-1]
        rows_x, rows_codes, row_scales = x.reshape(-1, d), codes.view(-1, d), scales.reshape(-1)
        step = max(1, _CHUNK_ELEMENTS // max(d, 1))
        for i in range(0, rows_x.shape[0], step):
            y = rows_x[i:i + step].to(torch.float32) / row_scales[i:i + step].to(torch.float32).clamp_min(tiny)[:, None]
            if self.name == "int8":
                y.round_().clamp_(-127, 127)
            else:
                y.clamp_(-448.0, 448.0)
            rows_codes[i:i + step] = y  # the cast to the code dtype
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """codes (..., d), scales (...) -> (..., d) in ``dtype``."""
        return dequantize_kv(codes, scales, dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What attention reads back of ``x`` once it went through the cache (in ``x``'s dtype)."""
        return self.dequantize(*self.quantize(x, x.dtype), x.dtype)


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., d) of either codec, scales (...) -> (..., d) in ``dtype``: one rounding, in ``dtype``."""
    return codes.to(dtype).mul_(scales.to(dtype).unsqueeze(-1))


def kv_codec(name: Optional[str]) -> Optional[KVCodec]:
    """The codec of ``kv_cache_dtype`` ``name``; None: keys and values in the compute dtype."""
    return None if name is None else KVCodec(name)


def attach_scales(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hands ``scales`` along with the ``codes`` tensor object (to the attention that reads them)."""
    setattr(codes, _SCALES, scales)
    return codes


def scales_of(codes: torch.Tensor) -> Optional[torch.Tensor]:
    """The scales attached to ``codes`` by ``attach_scales``, or None."""
    return getattr(codes, _SCALES, None)
