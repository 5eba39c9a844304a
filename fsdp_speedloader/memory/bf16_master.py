"""bf16 master weights: the host copy of the parameters in 2 bytes, updated with stochastic rounding (opt-in).

With every model state on the host, in-flight gradient slots and int8 moments leave the fp32 parameter shards as
4 of the ~6.6 bytes per parameter (docs/design.md §13). Keeping the shards in bf16 halves them, and the gradients
FSDP2 reduces into the shards' dtype with them: about 4.5 bytes per parameter in all, which is what lets a ~25B model
train in 128 GiB. The model's compute is unchanged (FSDP2 all-gathers the bf16 shards, as it casts fp32 ones).

Rounding each updated parameter to the nearest bf16 would drop every update smaller than half a bf16 step (2^-9 of
the value): with a learning rate of 1e-5 most updates are. Stochastic rounding keeps them in expectation: a value
between two bf16 neighbours is rounded up with probability equal to its distance from the lower one, in units of
the step (Gupta et al., 2015; torchao's ``bf16_stochastic_round``). Non-exact, so opt-in
(``optim.master_dtype=bf16``) and checked against fp32 masters like the compressed moments
(``tools/convergence_check.py``).

The random bits are a counter-based generator: element ``i``'s 16 bits are a hash of (a key, ``i``), the key a hash of
(seed, parameter index, step) (``noise_key``). The hash is SplitMix64 (Steele, Lea & Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014; the generator of java.util.SplittableRandom): the bits are the top 16
of its output number ``i + 1`` from the state ``key``, ``mix64(key + (i + 1) * GOLDEN)`` with ``GOLDEN`` the 64-bit
golden-ratio increment and ``mix64`` its variant-13 finalizer (two xor-shift-multiplies; SplitMix64 passes TestU01's BigCrush). A
function of (seed, index, step, position) only: a run reproduces itself whatever its chunking and thread count, and
a resumed run reproduces an uninterrupted one, with no random state in the checkpoint. The fused C++ kernel
(``csrc/adamw_chunk.cpp``) computes the same bits inside its loop; ``random_bits`` computes them with torch's int64
operations (multiplication wraps around modulo 2^64 as the kernel's unsigned arithmetic does; ``>>`` on int64 is
arithmetic, so each shift is masked), for the torch-ops step, on any device.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence

import torch
from torch import nn

MASTER_BYTES_PER_PARAM = {"fp32": 4, "bf16": 2}

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's state increment: 2^64 / the golden ratio, odd."""
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Elements per piece of random_bits' int64 scratch: on the host two buffers of 512 KiB, which stay in the core's
# cache across the dozen passes a piece takes; on an accelerator larger pieces, fewer kernel launches.
_HOST_PIECE = 1 << 16
_DEVICE_PIECE = 1 << 22
_scratch = threading.local()


def _signed(u: int) -> int:
    """An unsigned 64-bit value as the int64 with its bits (torch's scalars are signed)."""
    u &= _MASK64
    return u - (1 << 64) if u >> 63 else u


def mix64(z: int) -> int:
    """SplitMix64's finalizer (Stafford's variant 13) of a 64-bit value, in Python integers."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def noise_key(seed: int, index: int, step: int) -> int:
    """The random bits' key for parameter ``index`` at ``step`` (unsigned 64-bit, as an int64 for torch and the
    kernel): (seed, index, step) absorbed one at a time, each through ``mix64``."""
    key = 0
    for value in (seed, index, step):
        key = mix64((key ^ (value & _MASK64)) + GOLDEN)
    return _signed(key)


def reference_bits(key: int, position: int) -> int:
    """Element ``position``'s 16 bits under ``key``, one at a time in Python integers (the definition; tests)."""
    return mix64(key + (position + 1) * GOLDEN) >> 48


def _piece_scratch(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's int64 buffers of at least ``n`` elements on ``device`` (z and a shifted copy), and the
    increments ``i * GOLDEN`` (mod 2^64) for i < n."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    entry = bufs.get(device)
    if entry is None or entry[0].numel() < n:
        steps = torch.arange(n, dtype=torch.int64, device=device).mul_(_signed(GOLDEN))
        entry = bufs[device] = (torch.empty(n, dtype=torch.int64, device=device),
                                torch.empty(n, dtype=torch.int64, device=device), steps)
    return entry


def random_bits(n: int, *, seed: int, index: int, step: int, offset: int = 0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """16 random bits per element (int32, 0 .. 65535) for elements ``offset .. offset + n`` of parameter ``index``
    at ``step``, into ``out`` (int32, ``n`` elements, on any device: a reused scratch buffer saves a fresh
    allocation's page faults) if given: ``reference_bits(noise_key(seed, index, step), offset + i)`` for element
    ``i``, the bits the fused kernel computes (module docstring)."""
    out = torch.empty(n, dtype=torch.int32) if out is None else out
    if out.dtype != torch.int32 or out.numel() != n:
        raise ValueError(f"random_bits: out must be int32 of {n} elements; got {out.dtype} {tuple(out.shape)}")
    key = noise_key(seed, index, step)
    if n == 0:
        return out
    piece = min(n, _HOST_PIECE if out.device.type == "cpu" else _DEVICE_PIECE)
    z_buf, t_buf, increments = _piece_scratch(out.device, piece)
    for start in range(0, n, piece):
        take = min(piece, n - start)
        z, t = z_buf[:take], t_buf[:take]
        torch.add(increments[:take], _signed(key + (offset + start + 1) * GOLDEN), out=z)
        torch.bitwise_right_shift(z, 30, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << 34) - 1)).mul_(_signed(_MIX1))
        torch.bitwise_right_shift(z, 27, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << 37) - 1)).mul_(_signed(_MIX2))
        # The finalizer's last xor-shift (z ^= z >> 31) leaves the top 16 bits as they are: left out.
        torch.bitwise_right_shift(z, 48, out=t)
        out[start : start + take].copy_(t.bitwise_and_(0xFFFF))
    return out


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> None:
    """``out`` (bf16) = ``x`` (fp32, 1-D, overwritten) rounded to one of its two bf16 neighbours, up with probability
    equal to the fraction of a bf16 step it lies above the lower one (toward larger magnitude, either sign), drawn
    from ``bits`` (``random_bits``: 16 uniform bits per element, int32, on ``x``'s device).

    bf16 is fp32's upper 16 bits: adding 16 uniform random bits to the lower half and clearing it carries into
    the upper half with exactly that probability; the cleared value converts to bf16 exactly. Infinities and NaNs
    are copied as they are (clearing a NaN's lower half could make it an infinity)."""
    if out.dtype != torch.bfloat16 or x.dtype != torch.float32 or not (out.numel() == x.numel() == bits.numel()):
        raise ValueError(f"stochastic_round_: bf16 out, fp32 x and int32 bits of one size; got {out.dtype} "
                         f"{tuple(out.shape)}, {x.dtype} {tuple(x.shape)}, {bits.dtype} {tuple(bits.shape)}")
    kept = None
    if not math.isfinite(float(x.sum())):  # one cheap pass; isfinite() per element costs 20x the rounding itself
        nonfinite = ~x.isfinite()
        kept, nonfinite = (x[nonfinite], nonfinite) if bool(nonfinite.any()) else (None, None)
    x.view(torch.int32).add_(bits.to(x.device)).bitwise_and_(-65536)  # -65536 = 0xFFFF0000: bf16's 16 bits
    out.copy_(x)
    if kept is not None:
        out[nonfinite] = kept.to(torch.bfloat16)


def cast_host_masters_(model: nn.Module, blocks: nn.ModuleList, *, include_root: bool,
                       keep: Sequence[nn.Module] = ()) -> int:
    """Makes the parameters whose master copy lives on the host bf16, on a model not yet sharded (meta or CPU):
    every block's but those of ``keep`` (the blocks of units whose states stay on the GPU, ``device_units``: fp32
    there, stepped by torch's AdamW), and with ``include_root`` every other parameter too (embeddings, final norm,
    LM head). Returns how many parameters it cast. Buffers (rotary frequencies) keep their dtype."""
    in_blocks = {id(p) for p in blocks.parameters()}
    kept = {id(p) for module in keep for p in module.parameters()}
    cast = 0
    for p in model.parameters():
        if (p.is_floating_point() and p.dtype != torch.bfloat16 and id(p) not in kept
                and (include_root or id(p) in in_blocks)):
            p.data = p.data.to(torch.bfloat16)
            cast += 1
    return cast
