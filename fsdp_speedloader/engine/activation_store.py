"""Where block-boundary activations of all N sub-batches wait between units: GPU or host memory.

Slots: slot l holds x_l, the output of unit l, for every sub-batch i (slot 0: the embeddings), so
a step with U units has U + 1 slots. In backward the gradient dL/dx_l goes to slot min(l + 1, U):
the slot of an activation that no step needs any more (as in the paper), so gradients cost no
memory beyond the activations. ``grad_slot`` is the one place that rule lives.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable, Optional, Union

import torch
from torch import nn

from fsdp_speedloader.fsdp2 import GradRing, bind_fsdp_grads_to_arena, bind_fsdp_param_transfer, grad_ring_layout, \
    move_fsdp_shards_into_arena, offloaded_fsdp_params, plan_fsdp_grads, plan_fsdp_param_transfer, plan_fsdp_shards, \
    set_grad_ring
from fsdp_speedloader.memory.arena import ALIGNMENT, DEFAULT_MARGIN, GIB, ArenaPlan, HostMemoryBudget, PinnedArena
from fsdp_speedloader.memory.exchange import TensorExchange


def grad_slot(index: int, num_units: int) -> int:
    """The slot that holds dL/dx_index in backward."""
    return min(index + 1, num_units)


class ActivationStore(ABC):
    """Slots ``[num_slots][num_sub_batches]`` of (n, s, h) tensors."""

    def __init__(self) -> None:
        self.num_slots = 0
        self.num_sub_batches = 0
        self.shape: tuple[int, ...] = ()
        self.dtype: Optional[torch.dtype] = None
        self.device = torch.device("cpu")

    def begin_step(self, num_slots: int, num_sub_batches: int, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> None:
        """Called at the start of every forward; reallocates only when the geometry changes."""
        self.end_step()
        geometry = (num_slots, num_sub_batches, tuple(shape), dtype, device)
        if geometry != (self.num_slots, self.num_sub_batches, self.shape, self.dtype, self.device):
            self.num_slots, self.num_sub_batches, self.shape, self.dtype, self.device = geometry
            self._allocate()

    def _allocate(self) -> None:
        """Sizes the backing memory for the current geometry."""

    @abstractmethod
    def put(self, slot: int, i: int, x: torch.Tensor) -> None:
        """Stores x (on the compute device) as slot ``slot`` of sub-batch ``i``."""

    @abstractmethod
    def get(self, slot: int, i: int) -> torch.Tensor:
        """Slot ``slot`` of sub-batch ``i``, on the compute device, safe to use on the current stream."""

    def prefetch(self, slot: int, i: int) -> None:
        """Hint: ``get(slot, i)`` comes next. Stores with copy streams start the copy here."""

    def end_step(self) -> None:
        """Drops what the step kept alive (called after the embedding backward, or a no-grad forward)."""

    def step_stats(self) -> dict:
        """Metrics of the last finished step (copy traffic, stalls, host memory); empty if the store has none."""
        return {}

    @property
    def device_bytes(self) -> int:
        return 0

    @property
    def host_bytes(self) -> int:
        return 0


def for_each_sub_batch(store: ActivationStore, slots: Union[int, tuple[int, ...]], num_sub_batches: int,
                       body: Callable[..., None], *, also: Optional[Callable[[int], None]] = None,
                       reverse: bool = False, lookahead: Optional[Callable[[int], None]] = None) -> None:
    """Calls ``body(i, *tensors)`` for i = 0 .. N-1 (``reverse``: N-1 .. 0) with ``store.get(slot, i)`` of each
    slot, the copies of the next sub-batch already started. THE order of store calls for every loop over
    sub-batches (written for i = 0 .. N-1):

        prefetch(s, 0) for s in slots;  also(0)
        per i:  get(s, i) for s in slots;  unless i is the last: prefetch(s, i + 1) for s in slots, also(i + 1);
                                            for the last: lookahead(i), the next loop's first copies;
                body(i, ...): the compute on sub-batch i (and its ``put``)

    The training chain runs each loop in the reverse order of the one before (``TrainStepState.next_reversed``):
    a loop's first sub-batch is then the one the previous loop put last, which the exchange store still holds on the
    device (``ExchangeActivationStore.put``): a unit's forward starts without a host-to-device copy of its input, its
    backward without one of its incoming gradient.

    Why this order: sub-batch i + 1's copy is queued before i's compute, so it runs while i computes, and
    after ``get(i)``, so that a copy ``get`` issues itself (no prefetch, or one a ``put`` made stale) is not
    queued behind it (a copy stream runs its copies in queue order). ``also(j)`` starts another copy for
    sub-batch j right behind the store's (generation: its KV cache). ``lookahead(i)`` starts, before the last
    sub-batch's compute, what the next loop reads first (the backward: the next unit's input x of sub-batch i).

    Why a callback, not a generator: the exchange store hands a ring buffer to a new fetch only once no
    tensor aliases it. Slot s of sub-batch i is dropped here right after ``get(s, i + 1)``, so its buffer is
    free before i + 2's copy is queued; a generator's caller would still hold it in its loop variable then,
    and the ring would grow (``test_exchange_traffic_per_step``). For the same reason a body keeps nothing
    of sub-batch i after it returns.
    """
    order = (slots,) if isinstance(slots, int) else tuple(slots)
    indices = list(range(num_sub_batches))[::-1 if reverse else 1]

    def start(i: int) -> None:
        for slot in order:
            store.prefetch(slot, i)
        if also is not None:
            also(i)

    if indices:
        start(indices[0])
    held: list = [None] * len(order)
    for k, i in enumerate(indices):
        for j, slot in enumerate(order):
            held[j] = store.get(slot, i)
        if k + 1 < len(indices):
            start(indices[k + 1])
        elif lookahead is not None:
            lookahead(i)
        body(i, *held)


class DeviceActivationStore(ActivationStore):
    """Keeps the activations on the compute device: no copies, HBM grows with N."""

    def __init__(self) -> None:
        super().__init__()
        self._slots: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, slot: int, i: int, x: torch.Tensor) -> None:
        self._slots[slot, i] = x

    def get(self, slot: int, i: int) -> torch.Tensor:
        return self._slots[slot, i]

    def end_step(self) -> None:
        self._slots.clear()

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots.values())


class HostActivationStore(ActivationStore):
    """One preallocated host buffer (num_slots, N, n, s, h); page-locked when CUDA is present.

    Copies are synchronous here (``activation_store="host_sync"``); ``ExchangeActivationStore``
    overlaps them with compute.
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffer: Optional[torch.Tensor] = None

    def _allocate(self) -> None:
        pin = self.device.type == "cuda"
        old = self._buffer
        if (old is not None and old.shape[0] >= self.num_slots and old.shape[1:] == (self.num_sub_batches, *self.shape)
                and old.dtype == self.dtype and old.is_pinned() == pin):
            return  # fewer slots of the same shape (a no-grad forward's two): slots 0 .. num_slots - 1 of this one
        self._buffer = None  # free the old buffer before taking the new one
        self._buffer = torch.empty((self.num_slots, self.num_sub_batches, *self.shape), dtype=self.dtype,
                                   pin_memory=pin)

    def put(self, slot: int, i: int, x: torch.Tensor) -> None:
        self._buffer[slot, i].copy_(x)

    def get(self, slot: int, i: int) -> torch.Tensor:
        # A copy even on CPU: the caller may overwrite this slot while still holding the tensor.
        return self._buffer[slot, i].to(self.device, copy=True)

    @property
    def host_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()


class ExchangeActivationStore(ActivationStore):
    """Slots in one exact-size page-locked ``PinnedArena``; copies overlapped with compute by a ``TensorExchange``.

    Slots: one arena slot 'activations' of (num_slots, N, n, s, h), planned at the first
    ``begin_step`` and re-carved in place when a later geometry fits in it (a larger one re-plans
    the arena: not the steady state). ``prefetch`` starts the H2D copy, ``get`` waits for it and
    returns a ring buffer, ``put`` starts the D2H copy; see ``exchange.py`` for the ordering.
    Per-step metrics: ``step_stats()`` (``speedloader_engine(model).store.step_stats()``).

    With ``hold_param_shards(model)`` the arena also holds the model's offloaded FSDP2 parameter
    shards and their gradients: at the first ``begin_step`` -- inside the root's forward, after
    FSDP2's lazy init, before the first backward -- both are planned into the same arena (the
    gradients at their exact shard size), the shards are copied in and FSDP2 is pointed at them, and
    FSDP2's host copy of each reduce-scattered gradient lands in its slot from then on. Gradient
    slots come with the first step that runs with grad enabled: generation and no-grad forwards do
    not pay for them (a training step after them re-plans the arena once). With
    ``param_transfer_dtype`` (opt-in) the arena also holds a copy of each shard in that dtype, which
    FSDP2 then copies to the device instead of the fp32 shard (see ``fsdp2/param_transfer.py``).

    Hazards the engine's schedule creates, and what orders them (all on the GPU, by events):
    - ``get(l, i)`` then ``put(l, i, ...)`` in the same iteration (head backward, and the last unit's
      backward, where dL/dx overwrites the slot it was fetched from): the D2H waits on the slot's
      last H2D event, and the returned tensor is a ring buffer, not the host slot.
    - ``put(l, i)`` in one unit, ``get(l, i)`` in the next (forward x_l, backward dL/dx): the H2D waits
      on the slot's last D2H event.
    - ``prefetch(l, i)`` followed by ``put(l, i)`` before the ``get``: the prefetched copy is stale;
      ``put`` drops it and ``get`` fetches again (after the store, by the rule above).
    - The tensor returned by ``get`` is still read by kernels queued later (autograd keeps it until the
      recompute's backward ran): the ring reuses a buffer only once nothing aliases it, and orders
      the copy after a compute-stream event recorded when it was first seen free.
    - A tensor passed to ``put`` is freed by the caller right after: ``record_stream`` on the D2H
      stream keeps its block from being reused before the copy has read it.
    - A new geometry re-carves the same bytes: ``fence`` orders every later copy after every queued
      one (GPU-side); a larger one needs a new arena: the host waits for the old copies first.
    - The parameter shards in the arena: FSDP2 copies them to the device and the CPU optimizer
      updates them in place, ordered exactly as with FSDP2's own pinned shards.
    - The transfer copies: cast on the CPU after the optimizer step that changed their shard (or when
      FSDP2 reads a stale one), read by FSDP2's host-to-device copy: ordered like the shards themselves.
    - The gradient slots: FSDP2 copies into them on its post-reduce stream and records its
      ``grad_offload_event`` after the copy, which the CPU optimizer (``OverlappedOptimizer``) and
      FSDP2's end of backward wait on, as for its own pinned gradients. The next step's copy into a
      slot comes after ``optimizer.step()`` and ``zero_grad()`` have returned (the CPU read is over).
    - In-flight gradient slots (``use_grad_ring``): R regions of the largest unit's gradients instead of a
      slot per parameter; a unit's copies are queued only once its region is free, i.e. once the consumer
      (``OverlappedOptimizer``'s worker) has stepped the unit that held it and dropped its gradients
      (``fsdp2/grad_slots.py``, ``GradRing``). The root keeps a slot per parameter.
    """

    def __init__(self, *, host_memory_limit_bytes: Optional[int] = None,
                 host_memory_margin: float = DEFAULT_MARGIN) -> None:
        super().__init__()
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self.host_memory_margin = host_memory_margin
        self.arena: Optional[PinnedArena] = None
        self.exchange: Optional[TensorExchange] = None
        self._host: Optional[torch.Tensor] = None  # (num_slots, N, n, s, h) view of the arena
        self._pending: dict[tuple[int, int], object] = {}  # (slot, i) -> FetchHandle
        self._last_put: tuple = (None, None, None)  # (slot, i, device tensor) of the last put, until the next
        self._param_root: Optional[nn.Module] = None
        self._params_in_arena = False
        self.param_shard_bytes = 0
        self.grad_shard_bytes = 0
        self.param_transfer_dtype: Optional[torch.dtype] = None  # set by apply_speedloader (opt-in)
        self.param_transfer_bytes = 0
        self._grads_wanted = False  # a step with grad enabled has begun: the arena holds gradient slots
        self._grads_in_arena = False  # the current arena was planned with them
        self._ring_units: list = []  # use_grad_ring: each unit's FSDPParams (their gradients share R regions)
        self.grad_ring_regions = 0  # R, wanted; 0: a slot per parameter
        self._ring_in_arena = 0  # R the current arena was planned with
        self.grad_ring: Optional[GradRing] = None

    def use_grad_ring(self, num_regions: int, units: list) -> bool:
        """Gradient slots for ``num_regions`` units in flight (a ring of regions, each as large as the largest
        unit's gradients) instead of one per parameter, for the FSDPParams of ``units`` (one list per unit, in
        unit order; the others, the root's, keep theirs); 0 goes back to a slot per parameter. From the next
        training step on (a change re-plans the arena once). Only for a consumer that releases each unit's
        region once it has read and dropped that unit's gradients (``grad_ring.release(unit)``, unit 1-based),
        within the backward: ``OverlappedOptimizer`` without clipping. False when the arena holds no gradients
        (parameters not offloaded, or not pinned). More regions than units with offloaded gradients would only pad:
        at most that many (units kept on the GPU, ``device_units``, have none)."""
        if self._param_root is None:
            return False
        _, offsets = grad_ring_layout(units, ALIGNMENT)
        num_regions = min(int(num_regions), sum(any(o >= 0 for o in unit) for unit in offsets))
        self.grad_ring_regions, self._ring_units = num_regions, [list(u) for u in units] if num_regions else []
        if self._grads_in_arena and self._ring_in_arena != self.grad_ring_regions:
            self.num_slots = 0  # the next begin_step re-plans the arena
        return True

    def hold_param_shards(self, root: nn.Module) -> None:
        """Moves ``root``'s offloaded FSDP2 parameter shards, and their gradients, into the arena at the first step."""
        self._param_root = root

    def begin_step(self, num_slots: int, num_sub_batches: int, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> None:
        if self._param_root is not None and not self._grads_wanted and torch.is_grad_enabled():
            self._grads_wanted = True
            self.num_slots = 0  # an arena planned without gradient slots is re-planned (_allocate)
        super().begin_step(num_slots, num_sub_batches, shape, dtype, device)

    def _allocate(self) -> None:
        shape = (self.num_slots, self.num_sub_batches, *self.shape)
        slot_shape = self._activation_slot_shape(shape)
        nbytes = math.prod(slot_shape) * torch.empty((), dtype=self.dtype).element_size()
        if self.exchange is not None and self.exchange.device != TensorExchange.resolve(self.device):
            self.exchange.drain()
            self.exchange = None
        if self.exchange is None:
            self.exchange = TensorExchange(self.device)
        self.exchange.clear_ring()  # buffers of the old shape (held ones stay valid until dropped)
        missing_grads = self._grads_wanted and (not self._grads_in_arena
                                                 or self._ring_in_arena != self.grad_ring_regions)
        if self.arena is not None and self.arena.capacity("activations") >= nbytes and not missing_grads:
            # Re-carve the same bytes (generation plans its longest step first, then carves each step).
            self.exchange.fence()  # copies into the old carving finish before any into the new one
            self._host = self.arena.slot("activations", slot_shape, self.dtype)
            return
        self.exchange.drain()  # the old region may be freed: its copies must be over
        self._build_arena(shape)

    def _activation_slot_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The arena's 'activations' slot for activations of ``shape`` (num_slots, N, n, s, h)."""
        return shape

    def _build_arena(self, shape: tuple[int, ...]) -> None:
        plan = ArenaPlan().add("activations", "activations", self._activation_slot_shape(shape), self.dtype)
        fsdp_params = offloaded_fsdp_params(self._param_root) if self._param_root else []
        planned = plan_fsdp_shards(plan, fsdp_params)
        ring_units = self._ring_units if self._grads_wanted and self.grad_ring_regions else []
        in_ring = {id(p) for params in ring_units for p in params}
        region_bytes, ring_offsets = grad_ring_layout(ring_units, ALIGNMENT) if ring_units else (0, [])
        for r in range(self.grad_ring_regions if ring_units else 0):
            plan.add(f"grad_ring:{r}", "grad_shards", (region_bytes,), torch.uint8)
        planned_grads = (plan_fsdp_grads(plan, [p for p in fsdp_params if id(p) not in in_ring])
                         if self._grads_wanted else [])
        planned_transfer = (plan_fsdp_param_transfer(plan, planned, self.param_transfer_dtype)
                            if self.param_transfer_dtype is not None else [])
        n_slots, n_sub, n, s, _ = shape
        hint = (f"lower schedule.num_sub_batches (N={n_sub}), schedule.sub_batch_size (n={n}) or data.seq_len "
                f"(s={s}), or raise schedule.blocks_per_unit (the activations take {n_slots} slots of N x n x s x h)")
        by_kind = plan.bytes_by_kind(aligned=True)
        if states := by_kind.get("param_shards", 0) + by_kind.get("grad_shards", 0):
            hint += (f"; the offloaded parameter shards and their gradients ({states / GIB:.2f} GiB) shrink only "
                     "with more ranks, or leave the arena with offload.pin_memory=false (pageable, blocking copies)")
            if self._grads_wanted and not ring_units:
                hint += ("; optim.overlap_with_backward=true with optim.grad_clip=0 keeps gradient slots for "
                         "optim.grad_slots_in_flight units only")
        if transfer := by_kind.get("param_transfer", 0):
            hint += f"; offload.param_transfer_dtype=null drops the transfer copies ({transfer / GIB:.2f} GiB)"
        budget = HostMemoryBudget.detect(self.host_memory_limit_bytes, margin=self.host_memory_margin)
        # Pageable shards are freed one by one as they move in; shards in an old arena are not (its
        # region lives until the last of them has moved).
        resident = 0 if self._params_in_arena else sum(
            spec.nbytes for spec in plan.slots if spec.kind == "param_shards")
        arena = PinnedArena(plan, budget=budget, hint=hint, pin=self.device.type == "cuda", resident_bytes=resident,
                            defer_pin=True)
        if planned and self.device.type == "cuda":
            # FSDP2 may still be copying shards out of an old (page-locked) arena; a new plan is not
            # the steady state, so a device-wide wait is acceptable here.
            torch.cuda.synchronize(self.device)
        self._host = None
        old, self.arena = self.arena, arena
        self.param_shard_bytes = move_fsdp_shards_into_arena(arena, planned,
                                                             own_version_counters=bool(planned_transfer))
        self._params_in_arena = bool(planned)
        self._host = arena.slot("activations")
        self._host.zero_()  # commit its pages on all intra-op threads (the shards' are committed by their copies)
        self.grad_shard_bytes = bind_fsdp_grads_to_arena(arena, planned_grads)  # zeroes (commits) its slots
        if self.grad_ring is not None:
            self.grad_ring.close()
            self.grad_ring = None
        if ring_units:
            regions = [arena.slot(f"grad_ring:{r}") for r in range(self.grad_ring_regions)]
            for region in regions:
                region.zero_()  # commit its pages before the registration
            self.grad_ring = GradRing(regions)
            set_grad_ring(self.grad_ring, ring_units, ring_offsets)
            self.grad_shard_bytes += region_bytes * len(regions)
        self._ring_in_arena = self.grad_ring_regions if ring_units else 0
        self.param_transfer_bytes = bind_fsdp_param_transfer(arena, planned_transfer) if planned_transfer else 0
        self._grads_in_arena = self._grads_wanted
        arena.pin()
        if old is not None:
            old.close()

    def prefetch(self, slot: int, i: int) -> None:
        if (slot, i) not in self._pending and self._last_put[:2] != (slot, i):
            self._pending[slot, i] = self.exchange.fetch(self._host[slot, i])

    def get(self, slot: int, i: int) -> torch.Tensor:
        if self._last_put[:2] == (slot, i):  # still on the device: no copy back
            self.exchange.saved_fetch()
            return self._last_put[2]
        handle = self._pending.pop((slot, i), None) or self.exchange.fetch(self._host[slot, i])
        return self.exchange.wait(handle)

    def put(self, slot: int, i: int, x: torch.Tensor) -> None:
        """Starts the copy to the host and keeps ``x`` until the next ``put``: a ``get`` of the same slot before
        then returns it (what the chain's alternating order asks for first). Callers never write ``x`` again."""
        self._pending.pop((slot, i), None)  # a prefetch of the old content is stale now
        self.exchange.store(x, self._host[slot, i])
        self._last_put = (slot, i, x)

    def end_step(self) -> None:
        self._pending.clear()
        self._last_put = (None, None, None)
        if self.exchange is not None:
            self.exchange.end_step()

    def step_stats(self) -> dict:
        """The last finished step's exchange metrics and the arena's accounting (bytes)."""
        out = self.exchange.step_stats() if self.exchange is not None else {}
        if self.arena is not None:
            out.update(self.arena.stats())
        return out

    def close(self) -> None:
        """Waits for queued copies and releases the arena (parameter shards in it stay valid)."""
        self._pending.clear()
        self._last_put = (None, None, None)
        if self.exchange is not None:
            self.exchange.drain()
            self.exchange.clear_ring()
        self._host = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._grads_in_arena = False
        if self.grad_ring is not None:
            self.grad_ring.close()
            self.grad_ring = None
        self.num_slots = 0  # the next begin_step plans again

    @property
    def device_bytes(self) -> int:
        return self.exchange.ring_bytes if self.exchange is not None and self.device.type != "cpu" else 0

    @property
    def host_bytes(self) -> int:
        return 0 if self._host is None else self._host.numel() * self._host.element_size()


class DeviceActivationsHostStatesStore(ExchangeActivationStore, DeviceActivationStore):
    """Activations on the compute device (a ``DeviceActivationStore``: no copies, HBM grows with N), and the
    offloaded parameter shards, their gradients (a slot per parameter, or in-flight slots) and transfer copies in
    one exact-size pinned arena, as ``ExchangeActivationStore`` holds them: no power-of-two page-locked blocks of
    PyTorch's caching host allocator for FSDP2's shards and gradients. ``activation_store='device'`` with
    offloaded parameters (without pinning, or without ``hold_param_shards``, the arena stays empty)."""

    def _activation_slot_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (0,)

    def _allocate(self) -> None:
        if self._param_root is None:  # nothing for the arena: a plain device store
            return
        super()._allocate()

    def prefetch(self, slot: int, i: int) -> None:
        pass

    def put(self, slot: int, i: int, x: torch.Tensor) -> None:
        DeviceActivationStore.put(self, slot, i, x)

    def get(self, slot: int, i: int) -> torch.Tensor:
        return DeviceActivationStore.get(self, slot, i)

    def end_step(self) -> None:
        self._slots.clear()
        super().end_step()

    def step_stats(self) -> dict:
        return self.arena.stats() if self.arena is not None else {}

    @property
    def device_bytes(self) -> int:
        return DeviceActivationStore.device_bytes.fget(self)

    @property
    def host_bytes(self) -> int:
        return 0


def build_activation_store(kind: str, *, offload_params: bool,
                           host_memory_limit_bytes: Optional[int] = None) -> ActivationStore:
    """'device', 'host' (arena + overlapped copies), 'host_sync' (synchronous copies), or 'auto'
    (host when parameters are offloaded: HBM is the scarce resource)."""
    if kind == "auto":
        kind = "host" if offload_params else "device"
    if kind == "device":
        # Offloaded parameters: their shards and gradients in the exact-size arena (apply_speedloader hands it
        # the model when they are pinned); else a plain device store.
        return DeviceActivationsHostStatesStore(host_memory_limit_bytes=host_memory_limit_bytes) if offload_params \
            else DeviceActivationStore()
    if kind == "host":
        return ExchangeActivationStore(host_memory_limit_bytes=host_memory_limit_bytes)
    if kind == "host_sync":
        return HostActivationStore()
    raise ValueError(f"activation_store={kind!r}; choose 'device', 'host', 'host_sync' or 'auto'")
