"""The int8 moment codes of a host chunk, decoded and encoded by compiled kernels, and its bf16 parameters
stochastically rounded by one (``CompressedAdamW`` on the CPU).

Eager, a chunk's codes take about twenty elementwise operations: each one a pass over the chunk's fp32 scratch and
one Python call. On a 16-core host stepping chunks on 16 threads, those calls contend for the interpreter and the
passes for memory bandwidth: the 20.6B model's host step took ~60 s, ~3 s per 1e9 parameters against ~0.2 s for
fused fp32 AdamW (docs/results.md). Here the decode of both moments is one ``torch.compile``'d kernel and their
encode another (a per-block maximum, then the codes), called once per chunk; the AdamW arithmetic between them stays
torch's fused kernel. With bf16 master weights the stochastic rounding is a third kernel, whose 16 random bits per
element are a hash of (seed, parameter, step, position) computed in place (``hashed_bits``) instead of drawn from a
seeded generator (``bf16_master.random_bits``: half of the eager step's time): as reproducible, counter-based like
Philox, and unbiased (``tests/test_host_codes.py``).

The codes are those of ``compressed_adamw``'s eager functions (the same operations in the same order), with one
difference: the eager CPU square root is not always correctly rounded (ATen's vectorised one), the compiled one is,
as on the GPU. So the compiled codes can differ from the eager CPU ones in the last bit of a root, and a run uses one
or the other throughout. The kernels work block by block (a ragged last block padded with zeros, as the eager codes
pad it), so the result does not depend on how a parameter is cut into chunks.

Compiled once per process for symbolic sizes, each kernel parallel over the calling thread's intra-op threads: a
compiled CPU kernel holds the interpreter lock while it runs, so the chunks go one after another on the optimizer's
thread (large ones, ``compressed_adamw.COMPILED_CHUNK``) instead of one per pool thread as the eager codes do. Where
``torch.compile`` cannot build a CPU kernel (no C++ compiler), the eager codes are used, with one warning.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

BLOCK = 2048  # elements per block, one fp32 scale each (compressed_adamw.BLOCK)
_TINY = torch.finfo(torch.float32).tiny
_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # a 32-bit integer hash's (below 2^27: every product fits in int64)


def _mix(x):
    """A 32-bit integer hash of ``x`` in [0, 2^32): an int64 tensor, or a Python int."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK32
    return (x >> 16) ^ x


def rounding_key(seed: int, index: int, step: int) -> int:
    """The stochastic rounding's key of parameter ``index`` at ``step`` (< 2^32)."""
    return _mix(_mix(_mix(seed & _MASK32) ^ (index & _MASK32)) ^ (step & _MASK32))


def hashed_bits(n: int, key: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64, [0, 2^16)) for elements ``offset .. offset + n``: the top half of a hash of the
    position mixed with ``key`` (0-d int64 tensors)."""
    position = (torch.arange(n, dtype=torch.int64) + offset) & _MASK32
    return _mix(_mix(position) ^ key) >> 16


def round_chunk(out: torch.Tensor, x32: torch.Tensor, key: torch.Tensor, offset: torch.Tensor) -> None:
    """``out`` (bf16) = ``x32`` rounded up to its upper bf16 neighbour with probability equal to the fraction of a bf16
    step it lies above the lower one (``bf16_master.stochastic_round_``'s carry into fp32's upper half), with
    :func:`hashed_bits`; infinities and NaNs as they are."""
    raw = x32.view(torch.int32).to(torch.int64)
    carried = ((raw + hashed_bits(x32.numel(), key, offset)) & -65536).to(torch.int32).view(torch.float32)
    out.copy_(torch.where(torch.isfinite(x32), carried, x32))


def decode_chunk(mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor, vs: torch.Tensor, m32: torch.Tensor,
                 v32: torch.Tensor) -> None:
    """``m32`` = exp_avg from its int8 codes ``mq`` and block scales ``ms`` (sign(y) y^2), ``v32`` = exp_avg_sq from
    its uint8 codes ``vq`` and scales ``vs`` (a code 0 decodes as half a step; then y^4). Whole blocks."""
    m = mq.view(-1, BLOCK) * ms[:, None]
    m32.view(-1, BLOCK).copy_(m * m.abs())
    v = torch.maximum(vq.view(-1, BLOCK) * vs[:, None], vs[:, None] * 0.5)
    v32.view(-1, BLOCK).copy_(v.square().square())


def encode_chunk(m32: torch.Tensor, v32: torch.Tensor, mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor,
                 vs: torch.Tensor) -> None:
    """The codes and block scales of ``m32`` (sign(x) sqrt(|x|), 127 levels a side) and ``v32`` (x^(1/4), 255
    levels), each scaled by its block's largest and rounded to nearest. Whole blocks."""
    rows = m32.view(-1, BLOCK)
    mag = rows.abs().sqrt()
    peak = mag.amax(dim=1, keepdim=True)
    ms.copy_(peak.view(-1) / 127.0)
    mq.view(-1, BLOCK).copy_((mag * (127.0 / peak.clamp_min(_TINY))).copysign(rows).round())
    root = v32.view(-1, BLOCK).sqrt().sqrt()
    peak = root.amax(dim=1, keepdim=True)
    vs.copy_(peak.view(-1) / 255.0)
    vq.view(-1, BLOCK).copy_((root * (255.0 / peak.clamp_min(_TINY))).round())


class HostCodec:
    """The compiled :func:`decode_chunk`, :func:`encode_chunk` and :func:`round_chunk`, for chunks of any length
    (compiled for symbolic sizes; a ragged last block is padded with zeros, as the eager codes pad it).

    Called by one thread (the optimizer's), which they parallelise over its intra-op threads themselves: a compiled
    CPU kernel holds the interpreter lock while it runs, so kernels on several Python threads would run one at a
    time."""

    def __init__(self) -> None:
        self._decode = _compiled(decode_chunk)
        self._encode = _compiled(encode_chunk)
        self._round = _compiled(round_chunk)

    @staticmethod
    def _whole(n: int) -> int:
        return -(-n // BLOCK) * BLOCK

    @torch.no_grad()
    def decode(self, mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor, vs: torch.Tensor, m32: torch.Tensor,
               v32: torch.Tensor) -> None:
        """Decodes ``n = mq.numel()`` elements into ``m32[:n]``, ``v32[:n]`` (scratch of at least ``n`` rounded up to
        whole blocks; the padding holds zeros afterwards)."""
        n, whole = mq.numel(), self._whole(mq.numel())
        if n < whole:  # the ragged last block: its codes padded (the padding's values are zeroed below)
            mq, vq = _padded(mq, whole), _padded(vq, whole)
        self._decode(mq, ms, vq, vs, m32[:whole], v32[:whole])
        m32[n:whole].zero_()
        v32[n:whole].zero_()

    @torch.no_grad()
    def encode(self, m32: torch.Tensor, v32: torch.Tensor, mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor,
               vs: torch.Tensor) -> None:
        """Encodes ``m32``, ``v32`` (zero from ``n = mq.numel()`` to the end of its last block) into ``mq``, ``ms``,
        ``vq``, ``vs``."""
        n, whole = mq.numel(), self._whole(mq.numel())
        if n == whole:
            self._encode(m32[:n], v32[:n], mq, ms, vq, vs)
            return
        pmq, pvq = torch.empty(whole, dtype=mq.dtype), torch.empty(whole, dtype=vq.dtype)
        self._encode(m32[:whole], v32[:whole], pmq, ms, pvq, vs)
        mq.copy_(pmq[:n])
        vq.copy_(pvq[:n])

    @torch.no_grad()
    def round_bf16(self, out: torch.Tensor, x32: torch.Tensor, *, seed: int, index: int, step: int,
                   offset: int) -> None:
        """Stochastically rounds ``x32[:n]`` into ``out`` (bf16, ``n`` elements: those at positions ``offset ..`` of
        parameter ``index``), seeded by (``seed``, ``index``, ``step``)."""
        key = torch.tensor(rounding_key(seed, index, step), dtype=torch.int64)
        self._round(out, x32[: out.numel()], key, torch.tensor(offset, dtype=torch.int64))


def _compiled(fn: Callable) -> Callable:
    """``fn`` compiled for symbolic sizes. Each intra-op thread count is a kernel of its own (the count is compiled
    in), so more than dynamo's default 8 variants may exist in one process (tests change the count often)."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def call(*args):
        with torch._dynamo.config.patch(recompile_limit=64):
            return compiled(*args)

    return call


def _padded(codes: torch.Tensor, whole: int) -> torch.Tensor:
    out = torch.zeros(whole, dtype=codes.dtype)
    out[: codes.numel()].copy_(codes)
    return out


_codec: list[Optional[HostCodec]] = []
_lock = threading.Lock()


def host_codec() -> Optional[HostCodec]:
    """The process's compiled kernels; None where ``torch.compile`` cannot build a CPU kernel (said once)."""
    with _lock:
        if not _codec:
            codec: Optional[HostCodec] = HostCodec()
            try:  # compile now, on a block and on a ragged block, so that a failure shows here
                m32, v32 = torch.zeros(2 * BLOCK), torch.zeros(2 * BLOCK)
                for n in (2 * BLOCK, BLOCK + 1):
                    mq, vq = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
                    ms, vs = torch.zeros(-(-n // BLOCK)), torch.zeros(-(-n // BLOCK))
                    codec.encode(m32, v32, mq, ms, vq, vs)
                    codec.decode(mq, ms, vq, vs, m32, v32)
                    codec.round_bf16(torch.empty(n, dtype=torch.bfloat16), m32, seed=0, index=0, step=1, offset=0)
            except Exception as e:  # noqa: BLE001 - any compile failure: the eager codes, said once
                log.warning("the int8 moment codes run eager on the CPU (torch.compile could not build a CPU "
                            "kernel: %s: %s); several times slower", type(e).__name__, str(e).splitlines()[0])
                codec = None
            _codec.append(codec)
        return _codec[0]
