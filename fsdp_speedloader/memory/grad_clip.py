"""Global-norm gradient clipping in pieces, bit for bit ``torch.nn.utils.clip_grad_norm_``.

``clip_grad_norm_(parameters, max_norm)`` (torch 2.11-2.13) does, on the gradients of ``parameters`` in order:

1. per-tensor 2-norms: the gradients grouped by (device, dtype) with torch's ``_group_tensors_by_device_and_dtype``
   (its group order is the order of step 2), each group through ``torch._foreach_norm`` where foreach supports
   it (plain tensors; DTensors too in torch 2.13), else one ``torch.linalg.vector_norm`` per tensor;
2. ``total = vector_norm(stack([n.to(first gradient's device) for n in the norms in that order]))``: with
   DTensor gradients each norm is a partial (``_NormPartial``) and this is where the ranks all-reduce;
3. ``coef = clamp(max_norm / (total + 1e-6), max=1.0)``; every gradient ``*= coef.to(its device)``.

The overlapped optimizer runs step 1 unit by unit while the backward goes on (``tensor_norms``), step 2 at its
end (``total_norm``, ``clip_coefficient``) and step 3 per unit just before that unit's optimizer step
(``scale_grads_``). Each piece is the same operation on the same tensors as inside ``clip_grad_norm_``, so the
results are the same bits; only when, and on which thread, differ. Two changes of where keep the bits too
(``_norms``, ``scale_grads_``): a DTensor's norm and scaling run on its local shard (through DTensor's dispatch
the kernel would hold the interpreter lock, stalling the thread that launches the GPU's work), and host tensors'
norms run on the host threads, one tensor per thread (ATen's CPU 2-norm of one contiguous fp32 or bf16 tensor is a
single-thread loop whatever the thread count: its "reduce last dim" kernel parallelises over outputs, and a full
norm has one). The two torch helpers are private
(``torch.utils._foreach_utils``); they are imported here, only read, and the parity tests
(tests/test_overlap_clip.py) fail if their behaviour changes.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from fsdp_speedloader.memory.threads import run_on_host_threads

NormTable = dict[int, tuple[torch.Tensor, torch.Tensor, bool]]
"""id(gradient) -> (the gradient, its 2-norm, whether ``torch._foreach_norm`` computed it). A DTensor gradient's
norm may be held as its local shard's (a plain tensor), made the DTensor it stands for by ``total_norm``."""


def _groups(grads: Sequence[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor], bool]]:
    """clip_grad_norm_'s groups of ``grads``, in its order: (device, tensors, foreach)."""
    if not grads:
        return []
    grouped = _group_tensors_by_device_and_dtype([list(grads)])
    return [(device, tensors, _has_foreach_support(tensors, device))
            for (device, _), ([tensors], _) in grouped.items()]


# Host gradients whose norms run on the host threads, one tensor per thread, on a DTensor's local shard: contiguous
# CPU tensors of these dtypes. ATen's CPU 2-norm of one is a single-thread loop whatever the thread count (its
# "reduce last dim" kernel parallelises over outputs, and a full norm has one), and the CPU ``_foreach_norm`` is
# that kernel tensor by tensor: the bits of clip_grad_norm_'s call, on any thread.
_SERIAL_NORM_DTYPES = (torch.float32, torch.bfloat16)
_norm_placements: dict = {}  # (mesh, placements, ndim, dtype, foreach) -> the norm's placements, or None


def _host_placements(g: torch.Tensor, foreach: bool) -> Optional[tuple]:
    """None where ``g``'s norm is left to torch's own call; else () for a plain tensor, and for a DTensor the
    placements of the norm DTensor would give, asked of DTensor once per mesh and placements on a one-element
    shard, where that norm is the local shard's (partial over sharded mesh dimensions, replicated over
    replicated ones: FSDP2's and HSDP's gradients)."""
    local = g.to_local() if isinstance(g, DTensor) else g
    if not (local.device.type == "cpu" and local.dtype in _SERIAL_NORM_DTYPES and local.is_contiguous()):
        return None
    if not isinstance(g, DTensor):
        return ()
    key = (g.device_mesh, tuple(g.placements), g.ndim, g.dtype, foreach)
    if key not in _norm_placements:
        probe = DTensor.from_local(torch.zeros((1,) * g.ndim, dtype=g.dtype), g.device_mesh, g.placements,
                                   run_check=False)
        norm = torch._foreach_norm([probe], 2.0)[0] if foreach else torch.linalg.vector_norm(probe, 2.0)
        out = tuple(norm.placements)
        local_only = all((p.is_shard() and o.is_partial()) or (p.is_replicate() and o.is_replicate())
                         for p, o in zip(g.placements, out))
        _norm_placements[key] = out if local_only else None
    return _norm_placements[key]


def _norms(tensors: list[torch.Tensor], foreach: bool, *, wrap: bool = True) -> list[torch.Tensor]:
    """The 2-norm of each of ``tensors`` as clip_grad_norm_ takes it (``torch._foreach_norm`` of the group, or
    ``vector_norm`` of each), the same bits. Host tensors' on the host threads, one tensor per thread; a
    DTensor's on its local shard: through DTensor's dispatch the kernel would hold the interpreter lock
    (``local_adamw.py``) and stall the thread that launches the GPU's work. ``wrap``: such a norm is returned as
    the DTensor that DTensor's own call gives; else as the local norm (``_wrap`` makes the DTensor later, on the
    thread that needs it: each of the few tensor operations in wrapping takes the interpreter lock again, which
    a background thread waits for while the main thread runs Python)."""
    norms: list[Optional[torch.Tensor]] = [None] * len(tensors)
    placements = [_host_placements(g, foreach) for g in tensors]
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in tensors]

    def host_norm(i: int) -> None:
        norms[i] = torch.linalg.vector_norm(locals_[i], 2.0)

    run_on_host_threads([functools.partial(host_norm, i) for i, p in enumerate(placements) if p is not None])
    if wrap:
        norms = [_wrap(g, n, foreach) if p is not None else n for g, n, p in zip(tensors, norms, placements)]
    rest = [i for i, p in enumerate(placements) if p is None]
    if rest:
        rest_tensors = [tensors[i] for i in rest]
        rest_norms = (torch._foreach_norm(rest_tensors, 2.0) if foreach
                      else [torch.linalg.vector_norm(g, 2.0) for g in rest_tensors])
        for i, n in zip(rest, rest_norms):
            norms[i] = n
    return norms


def _wrap(g: torch.Tensor, norm: torch.Tensor, foreach: bool) -> torch.Tensor:
    """``norm`` of ``g``'s local shard as the DTensor that DTensor's own norm of ``g`` is (plain tensors: as is)."""
    if not isinstance(g, DTensor) or isinstance(norm, DTensor):
        return norm
    return DTensor.from_local(norm, g.device_mesh, _host_placements(g, foreach), run_check=False)


@torch.no_grad()
def tensor_norms(grads: Sequence[torch.Tensor], table: NormTable) -> None:
    """Adds the 2-norm of each of ``grads`` to ``table`` (step 1), computed as clip_grad_norm_ computes it.

    Local work only: on DTensor gradients the norms are partial, no rank communicates."""
    for _, tensors, foreach in _groups(grads):
        _add_norms(tensors, foreach, table, wrap=False)  # made DTensors by total_norm, on the main thread


def _add_norms(tensors: list[torch.Tensor], foreach: bool, table: NormTable, *, wrap: bool = True) -> None:
    for g, n in zip(tensors, _norms(tensors, foreach, wrap=wrap)):
        table[id(g)] = (g, n, foreach)


@torch.no_grad()
def total_norm(grads: Sequence[torch.Tensor], table: NormTable) -> torch.Tensor:
    """The global 2-norm of ``grads`` (every gradient of the model, in ``model.parameters()`` order), as
    ``clip_grad_norm_(model.parameters(), ...)`` returns it (step 2), from the per-tensor norms in ``table``.

    A norm that ``table`` lacks, or that it holds from another kind of computation than the model-wide group of its
    gradient calls for (foreach or not), is computed here, that way. Collective with DTensor gradients: every rank
    calls it at the same point."""
    if not grads:
        return torch.tensor(0.0)
    ordered = []
    for _, tensors, foreach in _groups(grads):
        stale = [g for g in tensors if (entry := table.get(id(g))) is None or entry[0] is not g or entry[2] != foreach]
        if stale:
            _add_norms(stale, foreach, table)
        ordered += [_wrap(g, table[id(g)][1], foreach) for g in tensors]
    first_device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), 2.0)


@torch.no_grad()
def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clamp(max_norm / (total + 1e-6), max=1.0)``, the expression of clip_grad_norm_ (a Python float over a
    tensor is ``reciprocal() * max_norm`` in torch, here as there). A DTensor coefficient is made replicated,
    where the gradients' multiplication would otherwise reduce it (the same reduction, done now, on this thread)."""
    max_norm = float(max_norm)
    clip_coef = max_norm / (total + 1e-6)
    coef = torch.clamp(clip_coef, max=1.0)
    if isinstance(coef, DTensor) and any(p.is_partial() for p in coef.placements):
        coef = coef.redistribute(placements=[Replicate()] * coef.device_mesh.ndim)
    return coef


@torch.no_grad()
def coefficients_by_device(coef: torch.Tensor, grads: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """``coef.to(device)`` for the device of every group of ``grads`` (made once, on the calling thread)."""
    return {device: coef.to(device) for device, _, _ in _groups(grads)}


@torch.no_grad()
def scale_grads_(grads: Sequence[torch.Tensor], coefs: dict[torch.device, torch.Tensor]) -> None:
    """``g *= coef`` for each of ``grads`` (step 3), foreach where clip_grad_norm_ uses it: element-wise, so any
    subset of the gradients, scaled in any order, gives the bits of clip_grad_norm_'s one pass."""
    for device, tensors, foreach in _groups(grads):
        coef = coefs[device]
        if device.type == "cpu" and _replicated_over(coef, tensors):
            # the local op DTensor's dispatch would call, without holding the interpreter lock through it
            tensors, coef = [g.to_local() for g in tensors], coef.to_local()
        if foreach:
            torch._foreach_mul_(tensors, coef)
        else:
            for g in tensors:
                g.mul_(coef)


def _replicated_over(coef: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether ``coef`` is a replicated DTensor on the mesh of every one of ``tensors`` (DTensors)."""
    return (isinstance(coef, DTensor) and all(p.is_replicate() for p in coef.placements)
            and all(isinstance(g, DTensor) and g.device_mesh == coef.device_mesh for g in tensors))


@torch.no_grad()
def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over ``grads`` in one call, by the pieces above (their threads, the same bits); returns
    the total norm. ``max_norm`` 0: the norm only (``get_total_norm``). A coefficient of exactly 1 multiplies
    nothing (the same bits as multiplying by it)."""
    grads = list(grads)
    total = total_norm(grads, {})
    if max_norm > 0:
        coef = clip_coefficient(total, max_norm)
        if float(full_value(coef)) != 1.0:
            scale_grads_(grads, coefficients_by_device(coef, grads))
    return total


def full_value(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's full value (no communication when it is replicated, as a total norm is), any other tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
