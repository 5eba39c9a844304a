"""``TensorExchange``: host<->device copies on their own streams, ordered by events, overlapped with compute.

Legend (the stream that does what; "compute" is the current stream at each call):

    fetch(host) -> handle   H2D stream: copies a host slot into a ring buffer. Before the copy it waits on
                              - compute, as of when the buffer's previous tenant was first seen dead
                                in Python: every kernel that read it was queued by then (write after read);
                              - the last D2H into this host slot (read after write);
                              - a D2H still reading this ring buffer (store() of a fetched tensor).
    wait(handle) -> tensor  compute waits on the copy's event; the stall is timed with two CUDA events
                            (read out in step_stats(), at the step boundary, never mid-step).
    store(t, host)          D2H stream: waits on compute (t is complete) and on the last H2D out of
                            this host slot (write after read), copies, and calls t.record_stream(D2H)
                            so the caching allocator keeps t's block until the copy has read it.

Ring of device buffers (per shape and dtype): a buffer is handed out again only when no tensor
aliases it any more (its storage's use count is back to the ring's own reference), so a tensor
returned by ``wait`` stays valid as long as the caller holds it or anything derived from it
(views, autograd graphs). The copy into a reused buffer waits on a compute-stream event recorded
when the buffer was first seen free, and the ring prefers the buffer freed longest ago (see
``_Ring``). Tensors returned by ``wait`` must be used on the compute stream (the engine does all
its work there).

Host side: nothing reads or writes the host slots from the CPU in the steady state; ``drain()``
(before the slots are re-carved or freed) waits on the outstanding copy events. No
``torch.cuda.synchronize()``, no page-locked allocation: host memory comes from the arena.

Without CUDA the same API does synchronous copies (and the ring works the same way).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger(__name__)


def _use_count_fn():
    """``torch._C._storage_Use_Count`` (torch 2.11 and 2.13), if it counts aliases as the ring needs."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is not None:  # probe: an alias adds one, dropping it takes it back
        t = torch.empty(4)
        count = lambda: fn(t.untyped_storage()._cdata)  # noqa: E731
        base = count()
        held = [t[1:].detach()]
        aliased = count()
        held.clear()
        if not (aliased == base + 1 and count() == base):
            fn = None
    if fn is None:
        log.warning("storage use counts are unavailable: the exchange allocates a device buffer per fetch")
    return fn


_STORAGE_USE_COUNT = _use_count_fn()


def _use_count(t: torch.Tensor) -> int:
    return _STORAGE_USE_COUNT(t.untyped_storage()._cdata)


@dataclass(eq=False)
class _RingBuffer:
    tensor: torch.Tensor
    baseline: int  # storage use count while only the ring holds the buffer
    held: bool = True  # handed out and not yet seen free
    freed_at: int = -1  # the ring's tick when it was first seen free
    free_event: Optional[torch.cuda.Event] = None  # compute stream, recorded when it was first seen free
    read_done: Optional[torch.cuda.Event] = None  # a store() still reading this buffer

    def in_use(self) -> bool:
        return _use_count(self.tensor) > self.baseline


class _Ring:
    """Device buffers keyed by (shape, dtype); see the module docstring for the reuse rule.

    Every exchange call sweeps: a held buffer whose aliases have all died is stamped with an event
    recorded on the compute stream then (every kernel that read it was queued before). A fetch takes
    the free buffer freed longest ago and waits on its stamp, not on all compute queued so far; a
    buffer freed only in this very call would make the copy wait on the compute just queued, so the
    ring grows instead (up to ``max_size`` per shape). In the engine's schedule this keeps fetches
    at unit boundaries from waiting on the previous unit's last sub-batch.
    """

    def __init__(self, device: torch.device, max_size: int) -> None:
        self.device = device
        self.max_size = max_size
        self.tick = 0
        self._buffers: dict[tuple, list[_RingBuffer]] = {}
        self._by_ptr: dict[int, _RingBuffer] = {}

    def sweep(self, record_event) -> None:
        """Stamps buffers whose last alias died since the previous call; ``record_event()`` -> event or None."""
        self.tick += 1
        if _STORAGE_USE_COUNT is None:
            return
        event = None
        for buf in self.all():
            if buf.held and not buf.in_use():
                event = event or record_event()
                buf.held, buf.freed_at, buf.free_event = False, self.tick, event

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype, copy_stream) -> tuple[_RingBuffer, bool]:
        """A buffer to fetch into (marked held) and whether it is new (then the copy waits on compute)."""
        buffers = self._buffers.setdefault((shape, dtype), [])
        free = [b for b in buffers if not b.held]
        best = min(free, key=lambda b: b.freed_at) if free else None
        if best is not None and (best.freed_at < self.tick or len(buffers) >= self.max_size):
            best.held = True
            return best, False
        tensor = torch.empty(shape, dtype=dtype, device=self.device)  # on the compute stream
        if copy_stream is not None:
            tensor.record_stream(copy_stream)  # when the ring drops it, its copies are honoured
        if _STORAGE_USE_COUNT is None:  # untracked: the caching allocator frees it when the caller drops it
            return _RingBuffer(tensor, 0), True
        buf = _RingBuffer(tensor, _use_count(tensor))
        buffers.append(buf)
        self._by_ptr[tensor.data_ptr()] = buf
        if len(buffers) == self.max_size + 1:
            log.warning("exchange ring for %s %s grew past %d buffers: the caller holds many fetched tensors",
                        shape, dtype, self.max_size)
        return buf, True

    def owner(self, t: torch.Tensor) -> Optional[_RingBuffer]:
        return self._by_ptr.get(t.untyped_storage().data_ptr()) if t.device == self.device else None

    def all(self) -> list[_RingBuffer]:
        return [b for bufs in self._buffers.values() for b in bufs]

    def clear(self) -> None:
        self._buffers.clear()
        self._by_ptr.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self.all())


@dataclass(eq=False)
class FetchHandle:
    """A fetch in flight: ``tensor`` (a ring buffer alias) is valid on the compute stream after ``wait``."""

    tensor: torch.Tensor
    event: Optional[torch.cuda.Event]  # H2D copy done; None for synchronous (CPU) copies


@dataclass
class _StepRecord:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    num_fetches: int = 0
    num_stores: int = 0
    num_unpipelined: int = 0  # fetches into a new or just-freed buffer: the copy waits on all queued compute
    num_fetches_saved: int = 0  # reads the caller served from a tensor it still held on the device (``saved_fetch``)
    waits: list = field(default_factory=list)  # (start, end) timing events around compute-stream waits
    sync_copy_s: float = 0.0  # CPU: time of the synchronous copies
    resolved: Optional[dict] = None

    def active(self) -> bool:
        return bool(self.num_fetches or self.num_stores)


class TensorExchange:
    """Fetches host tensors into device buffers and stores device tensors into host tensors, asynchronously.

    Args:
        device: the compute device (a CUDA device, or CPU for synchronous copies).
        max_ring_size: ring buffers per shape the ring grows to on its own (to keep fetches from
            waiting on just-queued compute); past it, it grows only when every buffer is held, and warns.
    Test hooks (CUDA; 0 = off): a missing wait shows up as wrong numbers when one side lags.
        copy_delay_cycles: ``torch.cuda._sleep`` queued on the copy stream before every copy.
        compute_delay_cycles: ``torch.cuda._sleep`` queued on the compute stream when a fetch or
            store is issued, before the copy stream is ordered after it.
    """

    def __init__(self, device: torch.device, *, max_ring_size: int = 8) -> None:
        self.device = self.resolve(device)
        self.is_cuda = self.device.type == "cuda"
        self.h2d = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._ring = _Ring(self.device, max_ring_size)
        self._last_h2d: dict[int, torch.cuda.Event] = {}  # host data_ptr -> last fetch out of it
        self._last_d2h: dict[int, torch.cuda.Event] = {}  # host data_ptr -> last store into it
        self._step = _StepRecord()
        self._finished = _StepRecord()
        self._timing_pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.copy_delay_cycles = 0
        self.compute_delay_cycles = 0

    @staticmethod
    def resolve(device: torch.device) -> torch.device:
        """``device`` with its index (a bare 'cuda' is the current device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    # --- the three operations ------------------------------------------------------------------

    def fetch(self, host: torch.Tensor) -> FetchHandle:
        """Starts copying ``host`` (a page-locked, contiguous host tensor) into a ring buffer."""
        self._step.num_fetches += 1
        self._step.h2d_bytes += host.numel() * host.element_size()
        self._sweep()
        buf, new = self._ring.acquire(tuple(host.shape), host.dtype, self.h2d)
        self._step.num_unpipelined += new or buf.freed_at == self._ring.tick
        if not self.is_cuda:
            start = time.perf_counter()
            buf.tensor.copy_(host)
            self._step.sync_copy_s += time.perf_counter() - start
            return FetchHandle(buf.tensor.view(buf.tensor.shape), None)
        key = host.data_ptr()
        self._lag_compute()
        # Write after read on the ring buffer: its previous tenant's readers were all queued on the
        # compute stream before its stamp; a new buffer may reuse a block compute just freed.
        if new or buf.free_event is None:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.h2d.wait_event(buf.free_event)
        if (stored := self._last_d2h.get(key)) is not None:
            self.h2d.wait_event(stored)  # read after write on the host slot
        if buf.read_done is not None:
            self.h2d.wait_event(buf.read_done)  # a store() still reads the buffer
            buf.read_done = None
        with torch.cuda.stream(self.h2d):
            self._delay()
            buf.tensor.copy_(host, non_blocking=True)
        done = self.h2d.record_event()
        self._last_h2d[key] = done
        return FetchHandle(buf.tensor.view(buf.tensor.shape), done)

    def wait(self, handle: FetchHandle) -> torch.Tensor:
        """Makes the compute stream wait for the fetch; returns its device tensor."""
        self._sweep()
        if handle.event is not None:
            compute = torch.cuda.current_stream(self.device)
            start, end = self._timing_pool.pop() if self._timing_pool else (
                torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            compute.record_event(start)
            compute.wait_event(handle.event)
            compute.record_event(end)
            self._step.waits.append((start, end))
        return handle.tensor

    def store(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Starts copying ``tensor`` (computed on the compute stream) into ``host``."""
        self._step.num_stores += 1
        self._step.d2h_bytes += host.numel() * host.element_size()
        self._sweep()
        if not (self.is_cuda and tensor.is_cuda):
            start = time.perf_counter()
            host.copy_(tensor)
            self._step.sync_copy_s += time.perf_counter() - start
            return
        key = host.data_ptr()
        self._lag_compute()
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # tensor is complete
        if (fetched := self._last_h2d.get(key)) is not None:
            self.d2h.wait_event(fetched)  # WAR on the host slot: a fetch still reads it
        with torch.cuda.stream(self.d2h):
            self._delay()
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.d2h)  # the allocator must not hand out tensor's block before the copy
        done = self.d2h.record_event()
        self._last_d2h[key] = done
        if (buf := self._ring.owner(tensor)) is not None:
            buf.read_done = done  # the next fetch into this ring buffer waits for this read

    def _sweep(self) -> None:
        if self.is_cuda:
            self._ring.sweep(lambda: torch.cuda.current_stream(self.device).record_event())
        else:
            self._ring.sweep(lambda: None)

    def _delay(self) -> None:
        if self.copy_delay_cycles > 0:
            torch.cuda._sleep(int(self.copy_delay_cycles))

    def _lag_compute(self) -> None:
        if self.compute_delay_cycles > 0:
            torch.cuda._sleep(int(self.compute_delay_cycles))  # on the current (compute) stream

    # --- housekeeping --------------------------------------------------------------------------

    def drain(self) -> None:
        """Blocks the host until every queued copy has finished (before host slots are reused or freed)."""
        if self.is_cuda:
            for ev in [*self._last_h2d.values(), *self._last_d2h.values()]:
                ev.synchronize()
            for buf in self._ring.all():
                if buf.read_done is not None:
                    buf.read_done.synchronize()
                    buf.read_done = None
        self._last_h2d.clear()
        self._last_d2h.clear()

    def fence(self) -> None:
        """Orders every later copy after every queued one, on the GPU: the host slots are about to be
        re-carved with another geometry, so per-slot tracking no longer applies. No host wait."""
        if self.is_cuda:
            h2d_done, d2h_done = self.h2d.record_event(), self.d2h.record_event()
            self.h2d.wait_event(d2h_done)
            self.d2h.wait_event(h2d_done)
        self._last_h2d.clear()
        self._last_d2h.clear()

    def clear_ring(self) -> None:
        """Drops the ring buffers (held ones stay valid until their holders drop them)."""
        self._ring.clear()

    def saved_fetch(self) -> None:
        """Counts a read the caller answered from a device tensor it kept, instead of fetching (per step)."""
        self._step.num_fetches_saved += 1

    def end_step(self) -> None:
        """Closes the step's metrics record (a no-op when the step did no copies)."""
        if self._step.active():
            self._finished = self._step
            self._step = _StepRecord()

    def step_stats(self) -> dict:
        """Metrics of the last finished step. Waits for that step's last timing event (step boundary)."""
        rec = self._finished
        if rec.resolved is None:
            wait_s = 0.0
            if rec.waits:
                for _, end in rec.waits:
                    end.synchronize()  # done by now: the step is over
                wait_s = sum(start.elapsed_time(end) for start, end in rec.waits) / 1e3
                self._timing_pool.extend(rec.waits)
                rec.waits = []
            rec.resolved = {
                "exchange_h2d_bytes": rec.h2d_bytes,
                "exchange_d2h_bytes": rec.d2h_bytes,
                "exchange_num_fetches": rec.num_fetches,
                "exchange_num_stores": rec.num_stores,
                "exchange_unpipelined_fetches": rec.num_unpipelined,
                "exchange_fetches_saved": rec.num_fetches_saved,
                "exchange_wait_s": wait_s if self.is_cuda else rec.sync_copy_s,
            }
        ring = {"exchange_ring_buffers": len(self._ring.all()), "exchange_ring_bytes": self._ring.nbytes}
        return {**rec.resolved, **ring}

    @property
    def ring_bytes(self) -> int:
        return self._ring.nbytes
