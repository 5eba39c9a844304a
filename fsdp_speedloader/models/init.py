"""Seeded initialisation of fresh weights, drawn in parallel and only for this rank's shards.

Hugging Face's families initialise matrices (linear and embedding weights, routers, the experts' stacked
(E, out, in) projections) as N(0, std), biases as zeros, norm scales as ones and Gemma's zero-centred norms as
zeros. We draw the same distributions from seeded generators so that a run reproduces itself: element ``i`` of
parameter ``name`` (flattened, row-major) comes from a generator seeded by (seed, name, ``i // INIT_CHUNK``). The
weights therefore depend on neither the world size, the mesh, offloading nor the thread count, and a rank fills
its shard without drawing the rest of the tensor.

Why stretches: one generator per parameter draws serially on one core at about 6 ns per element, minutes for a
20B-parameter model; seeded stretches are drawn on every core at once (``torch`` releases the GIL in its ops),
straight into the shards' memory, whose first touch (its page faults) is then spread over the cores too.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
from torch import nn

from fsdp_speedloader.memory.threads import run_on_host_threads
from fsdp_speedloader.models.shards import copy_full_tensor_, local_stretch

INIT_CHUNK = 1 << 18
"""Elements per seeded stretch (1 MiB of fp32): small enough to spread a layer over many cores, large enough that
seeding a generator and a task's Python overhead stay far below the draw itself."""


def _zero_centred_norm(module: nn.Module) -> bool:
    name = type(module).__name__  # FSDP2 prefixes the class name of the modules it shards
    return "Gemma" in name and "RMSNorm" in name


def _constant(module: nn.Module, name: str, shape: tuple) -> Optional[float]:
    """The constant a non-random parameter starts at (0 for biases and Gemma's norms, 1 for norm scales), or None
    for the N(0, std) matrices."""
    if len(shape) >= 2:
        return None
    return 0.0 if name.endswith("bias") or _zero_centred_norm(module) else 1.0


def _generator(seed: int, name: str, chunk: int) -> torch.Generator:
    mixed = ((seed * 1_000_003 + zlib.crc32(name.encode())) * 0x9E3779B1 + chunk) % (1 << 63)
    return torch.Generator().manual_seed(mixed)


def initial_fill_tasks(out: torch.Tensor, module: nn.Module, name: str, shape: tuple, *, start: int, seed: int,
                       std: float) -> list[Callable[[], None]]:
    """Tasks that together write elements ``start .. start + out.numel()`` of parameter ``name``'s flattened
    initial value into ``out`` (a 1-D contiguous CPU tensor of any floating dtype); independent, so they may run
    on any threads in any order."""
    numel, end = out.numel(), start + out.numel()
    constant = _constant(module, name, shape)
    if constant is not None:
        return [lambda: out.fill_(constant)]
    padding = None  # an embedding's padding row starts at zero, as Hugging Face's init leaves it
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        row = shape[1] if len(shape) > 1 else 1
        padding = (module.padding_idx * row, (module.padding_idx + 1) * row)
    total = 1
    for s in shape:
        total *= s

    def draw(chunk: int) -> None:
        first = chunk * INIT_CHUNK
        size = min(INIT_CHUNK, total - first)  # the same draw whatever part of the stretch this rank keeps
        lo, hi = max(start, first), min(end, first + size)
        target = out[lo - start : hi - start]
        if lo == first and hi == first + size and out.dtype == torch.float32:
            target.normal_(0.0, std, generator=_generator(seed, name, chunk))
        else:  # part of the stretch, or another dtype: draw it whole in fp32, keep (and cast) this rank's part
            drawn = torch.empty(size, dtype=torch.float32).normal_(0.0, std, generator=_generator(seed, name, chunk))
            target.copy_(drawn[lo - first : hi - first])
        if padding is not None and padding[0] < hi and lo < padding[1]:
            out[max(lo, padding[0]) - start : min(hi, padding[1]) - start].zero_()

    if numel == 0:
        return []
    return [lambda c=c: draw(c) for c in range(start // INIT_CHUNK, (end - 1) // INIT_CHUNK + 1)]


def initial_value(module: nn.Module, name: str, shape: tuple, *, seed: int, std: float,
                  dtype: torch.dtype = torch.float32, threads: Optional[int] = None) -> torch.Tensor:
    """The full initial value of parameter ``name`` (owned by ``module``) on the CPU, in ``dtype``."""
    full = torch.empty(shape, dtype=dtype)
    tasks = initial_fill_tasks(full.view(-1), module, name, tuple(shape), start=0, seed=seed, std=std)
    run_on_host_threads(tasks, threads)
    return full


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, std: float, threads: Optional[int] = None) -> None:
    """Fills every (possibly sharded, possibly offloaded) parameter with its seeded initial value: this rank's
    stretches only, on ``threads`` threads (default: torch's intra-op thread count)."""
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    tasks, device_copies = [], []
    for name, param in model.named_parameters():
        shape, module = tuple(param.shape), owners[id(param)]
        stretch = local_stretch(param)
        if stretch is None:  # an unusual placement: the full tensor, then this rank's part
            copy_full_tensor_(param, initial_value(module, name, shape, seed=seed, std=std, threads=threads))
            continue
        local, start = stretch
        if local.device.type != "cpu":  # drawn on the host, copied once
            host = torch.empty(local.shape, dtype=local.dtype)
            device_copies.append((local, host))
            local = host
        tasks += initial_fill_tasks(local, module, name, shape, start=start, seed=seed, std=std)
    run_on_host_threads(tasks, threads)
    for local, host in device_copies:
        local.copy_(host)
