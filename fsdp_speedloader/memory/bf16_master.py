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

The random bits are a function of (seed, parameter index, step, element position): a run reproduces itself, and a
resumed run reproduces an uninterrupted one, with no random state in the checkpoint.
"""

from __future__ import annotations

import math
import threading
from typing import Optional, Sequence

import torch
from torch import nn

MASTER_BYTES_PER_PARAM = {"fp32": 4, "bf16": 2}
NOISE_SEGMENT = 1 << 16
"""Elements per seeded stretch of random bits: the bits of element i of a parameter depend on (seed, the parameter's
index, its step, i // NOISE_SEGMENT) only, not on how the optimizer chunks the parameter (its thread count)."""
_generators = threading.local()


def _generator(seed: int, index: int, step: int, segment: int) -> torch.Generator:
    """This thread's CPU generator, seeded by (seed, parameter index, step, segment) (a cheap integer mix)."""
    gen = getattr(_generators, "gen", None)
    if gen is None:
        gen = _generators.gen = torch.Generator()
    mixed = (((seed * 0x9E3779B1 + index) * 0x85EBCA77 + step) * 0xC2B2AE3D + segment) % (1 << 63)
    return gen.manual_seed(mixed)


def random_bits(n: int, *, seed: int, index: int, step: int, offset: int = 0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """16 random bits per element (int32) for elements ``offset .. offset + n`` of parameter ``index`` at ``step``,
    into ``out`` (int32, ``n`` elements: a reused scratch buffer saves a fresh allocation's page faults) if given.
    A seeded generator draws serially: the optimizer draws its chunks' bits on its pool's threads."""
    out = torch.empty(n, dtype=torch.int32) if out is None else out
    pos = offset
    while pos < offset + n:
        segment, within = divmod(pos, NOISE_SEGMENT)
        take = min(NOISE_SEGMENT - within, offset + n - pos)
        gen = _generator(seed, index, step, segment)
        target = out[pos - offset : pos - offset + take]
        if within == 0:  # a segment's first `take` draws, straight into place
            torch.randint(0, 1 << 16, (take,), dtype=torch.int32, generator=gen, out=target)
        else:  # the draws of a segment that started before `offset`: its prefix, then the part asked for
            target.copy_(torch.randint(0, 1 << 16, (within + take,), dtype=torch.int32, generator=gen)[within:])
        pos += take
    return out


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> None:
    """``out`` (bf16) = ``x`` (fp32, 1-D, overwritten) rounded to one of its two bf16 neighbours, up with probability
    equal to the fraction of a bf16 step it lies above the lower one (toward larger magnitude, either sign), drawn
    from ``bits`` (``random_bits``: 16 uniform bits per element, int32).

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
