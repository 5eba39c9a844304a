"""Offloaded gradients copied into preplanned host slots instead of fresh page-locked blocks.

FSDP2's ``foreach_reduce`` ends, per parameter, with

    to_accumulate_grad = fsdp_param.sharded_param.grad is not None
    if fsdp_param.offload_to_cpu:
        non_blocking = fsdp_param.pin_memory and not to_accumulate_grad  # 2.13: and no post-accumulate hook
        new_sharded_grad = new_sharded_grad.to(torch.device("cpu"), non_blocking=non_blocking)
        if non_blocking: fsdp_param.grad_offload_event = post_reduce_stream.record_event()
    if to_accumulate_grad: fsdp_param.sharded_param.grad._local_tensor += new_sharded_grad
    else: fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(new_sharded_grad)

all on the post-reduce stream, in ``fsdp_params`` order. A non-blocking ``.to("cpu")`` takes a fresh
page-locked block from the caching host allocator every step, rounded to a power of two. For parameters
given a slot by ``set_grad_slots``, ``foreach_reduce`` runs under a ``TorchFunctionMode`` (thread-local,
this call only) that turns exactly that ``.to`` into ``slot.copy_(new_sharded_grad, non_blocking=<FSDP's
own flag>)`` and returns the slot: FSDP then wraps and assigns it as before, and records
``grad_offload_event`` after it on the same stream, so FSDP's own wait (``finalize_backward``) and
``OverlappedOptimizer``'s still cover the copy. Only when FSDP would create a fresh gradient
(``sharded_param.grad is None``): accumulation into an existing gradient (which then is the slot) stays
FSDP's own path, blocking copy and CPU add.

The slot is reused only when nothing holds the previous gradient any more (a weak reference to the tensor
FSDP wrapped). Counted: ``num_grads_into_slots``; ``num_grad_slot_fallbacks``, each with a warning once per
reason: the previous gradient is still referenced, the copy does not match the slot, or FSDP2 created a
slotted parameter's gradient without the copy read above (a changed ``foreach_reduce``).

In-flight slots (``GradRing``, ``set_grad_ring``): when a consumer takes each unit's gradients as they land and
is done with them before the backward ends (``OverlappedOptimizer`` without clipping steps unit l on the CPU
while the GPU runs units l-1 .. 1), the units need not have a slot each: R regions, each the size of the largest
unit's gradients, serve all units in turn. A unit takes a free region in its ``foreach_reduce``, on the main
thread, before FSDP2 queues its copies (blocking until the consumer has given one back: the consumer's
``release(unit)`` comes after its CPU step has read the gradients and dropped them, so no copy can overwrite a
gradient still to be read: the copy is queued only after the release happened), and keeps it until the consumer
releases it. Counted: ``num_grad_ring_waits`` (foreach_reduce calls that waited for a region), and timed:
``grad_ring_wait_s`` (how long they blocked; ``OverlappedOptimizer.step_stats`` reports it per step).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from fsdp_speedloader.fsdp2.contract import private_module
from fsdp_speedloader.fsdp2.counters import COUNTERS, fall_back
from fsdp_speedloader.fsdp2.groups import param_name

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

log = logging.getLogger(__name__)

grad_copy_delay_cycles = 0  # tests: GPU clock cycles queued before each gradient copy (exposes missing waits)

_GRAD_SLOT = "_speedloader_grad_slot"
_PATCH_MARK = "_speedloader_grads_into_slots"
_state = threading.local()  # .active: a _GradsIntoSlots mode is running on this thread


class _GradSlot:
    """A parameter's host gradient slot: ``tensor`` (``sharded_size``, the parameter's dtype) and a weak
    reference to the tensor last handed to FSDP as the gradient (None: never, or dead). In-flight slots have no
    tensor of their own: ``ring``, ``unit`` and ``offset`` (bytes into the unit's region) place it."""

    def __init__(self, tensor: Optional[torch.Tensor], *, ring: Optional["GradRing"] = None, unit: int = 0,
                 offset: int = 0, shape: tuple = (), dtype: Optional[torch.dtype] = None) -> None:
        self.tensor = tensor
        self.last: Optional[weakref.ref] = None
        self.ring, self.unit, self.offset, self.shape, self.dtype = ring, unit, offset, tuple(shape), dtype

    def view(self) -> Optional[torch.Tensor]:
        """Where this step's gradient goes: the slot, or its place in the region its unit holds (None: none)."""
        if self.ring is None:
            return self.tensor
        return self.ring.view(self.unit, self.offset, self.shape, self.dtype)


class GradRing:
    """``regions`` (uint8 host tensors, each as large as the largest unit's gradients) handed to units in turn.

    ``acquire(unit)`` (the main thread, in the unit's ``foreach_reduce``) takes a free region, blocking until one
    is released; ``release(unit, dropped)`` (the consumer, once its CPU step has read the unit's gradients and
    dropped them) gives it back, with weak references to the gradients it dropped (the ``.grad`` tensors). A
    region is handed out only when none of those is alive any more; one still referenced (kept for logging, say)
    stays out of the ring, and a unit that finds no other gets its gradients in FSDP2's own memory that step
    (counted as a fallback), until the reference is gone.
    ``close()`` (the consumer is gone) makes a waiting ``acquire`` fail instead of waiting forever.
    """

    def __init__(self, regions: Sequence[torch.Tensor]) -> None:
        if not regions:
            raise ValueError("a gradient ring needs at least one region")
        self.regions = list(regions)
        self.region_bytes = min(r.numel() for r in self.regions)
        self._free = list(range(len(self.regions)))  # region indices, the longest free first
        self._held: dict[int, int] = {}  # unit -> region
        self._views: dict[int, list[weakref.ref]] = {r: [] for r in range(len(self.regions))}
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, unit: int, timeout_s: float = 600.0) -> bool:
        """Gives ``unit`` a region (it keeps the one it holds); False when every free region is still viewed by
        a live tensor (the caller leaves this step's gradients to FSDP2). Raises when the ring is closed, or no
        region came free within ``timeout_s`` (a consumer that never releases)."""
        with self._cond:
            if unit in self._held:
                return True
            if not self._free:
                self._wait_for_release(timeout_s)
            for k, region in enumerate(self._free):
                if not any(ref() is not None for ref in self._views[region]):
                    del self._free[k]
                    self._held[unit] = region
                    self._views[region] = []
                    return True
            return False

    def _wait_for_release(self, timeout_s: float) -> None:
        """Blocks (holding ``_cond``'s lock between waits) until a region is free; counted and timed, and named in
        profiler traces: while it blocks, the GPU runs only what the backward queued before it."""
        start = time.perf_counter()
        with torch.profiler.record_function("speedloader::grad_ring_wait"):
            while not self._free:
                if self._closed:
                    raise RuntimeError("the gradient ring's consumer is gone (OverlappedOptimizer closed?) and "
                                       "every region is held: nothing would release one")
                if not self._cond.wait(timeout_s):
                    raise RuntimeError(f"no gradient ring region came free in {timeout_s:.0f} s: the consumer "
                                       "(OverlappedOptimizer's worker) releases none")
        COUNTERS.num_grad_ring_waits += 1
        COUNTERS.grad_ring_wait_s += time.perf_counter() - start

    def release(self, unit: int, dropped: Sequence[weakref.ref] = ()) -> None:
        """``unit``'s region goes back to the ring (a no-op when it holds none); ``dropped``: weak references to
        the gradient tensors that viewed it (the region is reused once all are dead)."""
        with self._cond:
            region = self._held.pop(unit, None)
            if region is not None:
                self._views[region] = list(dropped)
                self._free.append(region)
                self._cond.notify_all()

    def holds(self, unit: int) -> bool:
        with self._cond:
            return unit in self._held

    def view(self, unit: int, offset: int, shape: tuple, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The gradient of shape ``shape`` at ``offset`` bytes into ``unit``'s region (None: it holds none)."""
        with self._cond:
            region = self._held.get(unit)
            if region is None:
                return None
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            return self.regions[region][offset : offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _is_host_copy(func, args, kwargs) -> bool:
    """``tensor.to(torch.device("cpu"), non_blocking=...)``, the exact form of FSDP2's gradient copy."""
    return (func is torch.Tensor.to and len(args) == 2 and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.device) and args[1].type == "cpu" and set(kwargs) <= {"non_blocking"})


class _GradsIntoSlots(TorchFunctionMode):
    """Lands FSDP2's host copies of the reduce-scattered gradients of ``fsdp_params`` in their slots."""

    def __init__(self, fsdp_params: Sequence[FSDPParam]) -> None:
        super().__init__()
        self._expected = [p for p in fsdp_params if p.offload_to_cpu]  # one host copy each, in this order
        self._next = 0
        self._source_ptr: Optional[int] = None  # every copy reads a view of the one reduce-scatter output
        self.seen: set[int] = set()  # id(FSDPParam) of every copy this mode saw (landed or declined)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._next < len(self._expected) and _is_host_copy(func, args, kwargs):
            out = self._land(args[0], bool(kwargs.get("non_blocking", False)))
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _land(self, src: torch.Tensor, non_blocking: bool) -> Optional[torch.Tensor]:
        fsdp_param = self._expected[self._next]
        ptr = src.untyped_storage().data_ptr()
        if tuple(src.shape) != tuple(fsdp_param.sharded_size) or self._source_ptr not in (None, ptr):
            # Not the copy foreach_reduce was read to make: leave this call, and the rest, to FSDP2
            # (the check after foreach_reduce counts the gradients FSDP2 then made without a slot).
            self._next = len(self._expected)
            return None
        self._next += 1
        self._source_ptr = ptr
        self.seen.add(id(fsdp_param))
        slot: Optional[_GradSlot] = fsdp_param.__dict__.get(_GRAD_SLOT)
        if slot is None or fsdp_param.sharded_param.grad is not None:
            return None  # no slot, or FSDP adds to the existing gradient (blocking copy, CPU add)
        if slot.ring is None and slot.last is not None and slot.last() is not None:
            fall_back("num_grad_slot_fallbacks", "grad_slots:held", log,
                      "the previous gradient of %s is still referenced after zero_grad; this step's gradient goes "
                      "to FSDP2's own (page-locked) memory instead of its arena slot (drop references to .grad "
                      "before the next backward)", param_name(fsdp_param))
            return None
        target = slot.view()
        if target is None:  # in-flight: its unit holds no region (every free one still viewed: see acquire)
            fall_back("num_grad_slot_fallbacks", "grad_slots:ring-held", log,
                      "a gradient ring region is still referenced after its consumer released it; the gradients "
                      "of %s's unit go to FSDP2's own (page-locked) memory this step (drop references to .grad)",
                      param_name(fsdp_param))
            return None
        if src.dtype != target.dtype or src.shape != target.shape:
            fall_back("num_grad_slot_fallbacks", "grad_slots:shape", log,
                      "gradient of %s is %s %s, its host slot %s %s: left to FSDP2", param_name(fsdp_param),
                      tuple(src.shape), src.dtype, tuple(target.shape), target.dtype)
            return None
        out = target.view(target.shape)  # a new tensor object per step: its liveness is tracked
        if grad_copy_delay_cycles and src.is_cuda:
            torch.cuda._sleep(grad_copy_delay_cycles)
        out.copy_(src, non_blocking=non_blocking)  # on the current (post-reduce) stream, like FSDP's .to
        slot.last = weakref.ref(out)
        COUNTERS.num_grads_into_slots += 1
        return out


def _wrap_foreach_reduce(inner):
    @functools.wraps(inner)
    def foreach_reduce(fsdp_params, *args, **kwargs):
        if getattr(_state, "active", False) or not any(_GRAD_SLOT in p.__dict__ for p in fsdp_params):
            return inner(fsdp_params, *args, **kwargs)
        fresh = [p for p in fsdp_params if _GRAD_SLOT in p.__dict__ and p.offload_to_cpu
                 and p.sharded_param.grad is None]
        # In-flight slots: the unit takes a region before FSDP2 queues any copy into it (blocks until one is free).
        for ring, unit in {(slot.ring, slot.unit) for p in fresh if (slot := p.__dict__[_GRAD_SLOT]).ring is not None}:
            ring.acquire(unit)
        mode = _GradsIntoSlots(fsdp_params)
        _state.active = True
        try:
            with mode:
                out = inner(fsdp_params, *args, **kwargs)
        finally:
            _state.active = False
        # A fresh gradient FSDP2 made without the host copy this mode intercepts: FSDP2 changed.
        missed = [p for p in fresh if id(p) not in mode.seen and p.sharded_param.grad is not None]
        if missed:
            fall_back("num_grad_slot_fallbacks", "grad_slots:not-seen", log,
                      "FSDP2's foreach_reduce made the gradient of %s (and %d more) without the host copy "
                      "tensor.to(torch.device('cpu'), non_blocking=...) it was read to make (torch %s): "
                      "offloaded gradients stay in FSDP2's own page-locked blocks", param_name(missed[0]),
                      len(missed) - 1, torch.__version__, count=len(missed))
        return out

    setattr(foreach_reduce, _PATCH_MARK, True)
    return foreach_reduce


def set_grad_slots(slots: Sequence[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Makes FSDP2 put the host gradient of each offloaded ``FSDPParam`` into its ``tensor`` (a host tensor
    of the parameter's ``sharded_size`` and dtype, e.g. an arena slot); see the module docstring.

    Replaces the module global ``foreach_reduce`` of FSDP2's ``_fsdp_param_group`` (what
    ``FSDPParamGroup.post_backward`` calls, ``fsdp_params`` first) once; parameters without a slot are
    unaffected. A re-plan calls it again with the new slots (a gradient still in an old slot stays valid: it
    keeps the old memory alive).
    """
    module = private_module("foreach_reduce")
    if not getattr(module.foreach_reduce, _PATCH_MARK, False):
        module.foreach_reduce = _wrap_foreach_reduce(module.foreach_reduce)
    for fsdp_param, tensor in slots:
        if tuple(tensor.shape) != tuple(fsdp_param.sharded_size) or tensor.device.type != "cpu":
            raise ValueError(f"gradient slot of {param_name(fsdp_param)}: {tuple(tensor.shape)} on {tensor.device}; "
                             f"FSDP2 needs {tuple(fsdp_param.sharded_size)} on the host")
        fsdp_param.__dict__[_GRAD_SLOT] = _GradSlot(tensor)


def grad_ring_layout(units: Sequence[Sequence[FSDPParam]], alignment: int) -> tuple[int, list[list[int]]]:
    """(region bytes, each unit's gradients' byte offsets): a unit's offloaded gradients laid out one after the
    other in a region, each at its exact shard size (``sharded_size``, the parameter's dtype) aligned to
    ``alignment``; the region is as large as the largest unit's layout. Parameters without a gradient slot
    (``ring_params``) get offset -1."""
    offsets, largest = [], 0
    for params in units:
        unit_offsets, end = [], 0
        for p in params:
            if not _wants_slot(p):
                unit_offsets.append(-1)
                continue
            unit_offsets.append(end)
            nbytes = math.prod(p.sharded_size) * p.sharded_param.element_size()
            end += (nbytes + alignment - 1) // alignment * alignment
        offsets.append(unit_offsets)
        largest = max(largest, end)
    return largest, offsets


def _wants_slot(fsdp_param: FSDPParam) -> bool:
    sharded = getattr(fsdp_param, "sharded_param", None)
    return (sharded is not None and sharded.requires_grad and fsdp_param.offload_to_cpu
            and math.prod(fsdp_param.sharded_size) > 0)


def set_grad_ring(ring: GradRing, units: Sequence[Sequence[FSDPParam]], offsets: Sequence[Sequence[int]]) -> None:
    """Makes FSDP2 put the host gradients of unit k's parameters (``units[k - 1]``, 1-based unit keys) at
    ``offsets`` (``grad_ring_layout``) into the region unit k holds in ``ring`` (see ``GradRing``)."""
    module = private_module("foreach_reduce")
    if not getattr(module.foreach_reduce, _PATCH_MARK, False):
        module.foreach_reduce = _wrap_foreach_reduce(module.foreach_reduce)
    for unit, (params, unit_offsets) in enumerate(zip(units, offsets), start=1):
        for fsdp_param, offset in zip(params, unit_offsets):
            if offset < 0:
                fsdp_param.__dict__.pop(_GRAD_SLOT, None)
                continue
            fsdp_param.__dict__[_GRAD_SLOT] = _GradSlot(None, ring=ring, unit=unit, offset=offset,
                                                        shape=tuple(fsdp_param.sharded_size),
                                                        dtype=fsdp_param.sharded_param.dtype)


def grad_slot_of(fsdp_param: FSDPParam) -> Optional[torch.Tensor]:
    """The host slot FSDP2 writes ``fsdp_param``'s gradient into, or None (also for an in-flight slot: its memory
    is its unit's region while the unit holds one)."""
    slot = fsdp_param.__dict__.get(_GRAD_SLOT)
    return None if slot is None else slot.tensor


def grad_ring_of(fsdp_param: FSDPParam) -> Optional[GradRing]:
    """The ring whose regions hold ``fsdp_param``'s gradient (in-flight slots), or None."""
    slot = fsdp_param.__dict__.get(_GRAD_SLOT)
    return None if slot is None else slot.ring
