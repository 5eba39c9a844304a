"""``PinnedArena``: one exact-size page-locked host region per process, carved into named typed slots.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's caching host allocator rounds every
page-locked block up to a power of two (1.5 GiB asked, 2 GiB locked), and FSDP2's CPU offload pins
every shard separately through it. The arena maps ONE anonymous region of exactly the planned size
and registers it with ``cudaHostRegister``: registered memory reports ``is_pinned()`` and copies
asynchronously, and nothing is rounded beyond each slot's 512-byte alignment.

Lifecycle (plan -> check -> allocate, once before step 1):

    plan = ArenaPlan().add("activations", "activations", (U + 1, N, n, s, h), torch.bfloat16)
    arena = PinnedArena(plan, budget=HostMemoryBudget.detect(), hint="lower schedule.num_sub_batches")
    x = arena.slot("activations")            # a typed view; page-locked when CUDA is present

The budget check runs BEFORE any allocation and names the setting to change. On a CPU-only machine
the same code runs with plain (unregistered) memory.

Registration follows the memory, not the ``PinnedArena`` object: the region is unregistered and
unmapped when the last tensor viewing it dies (FSDP may hold parameter shards in the arena longer
than the store that built it). ``close()`` drops the arena's own references.

The arena knows nothing of FSDP2: ``fsdp_speedloader/fsdp2/shards.py`` plans FSDP2's offloaded parameter
shards, their gradients and their compute-dtype transfer copies into slots and points FSDP2 at them.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)

ALIGNMENT = 512  # bytes; every slot starts on this boundary (>= any dtype, DMA-friendly)
DEFAULT_MARGIN = 0.10  # fraction of the host limit kept free for everything the plan does not see
LIMIT_ENV = "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB"  # explicit host budget when nothing is passed
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as ~2^63
GIB = float(1 << 30)


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# --- plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotSpec:
    """One named slot: ``kind`` groups slots in the accounting ('activations', 'param_shards', ...)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class ArenaPlan:
    """The slots of an arena, in layout order. Nothing is allocated until a ``PinnedArena`` is built."""

    slots: list[SlotSpec] = field(default_factory=list)
    alignment: int = ALIGNMENT

    def add(self, name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> "ArenaPlan":
        if any(s.name == name for s in self.slots):
            raise ValueError(f"arena slot {name!r} is planned twice")
        if any(d < 0 for d in shape):
            raise ValueError(f"arena slot {name!r}: negative dimension in {tuple(shape)}")
        self.slots.append(SlotSpec(name, kind, tuple(int(d) for d in shape), dtype))
        return self

    def offsets(self) -> dict[str, int]:
        """Byte offset of every slot: consecutive, each aligned."""
        out, offset = {}, 0
        for s in self.slots:
            out[s.name] = offset
            offset += _align(s.nbytes, self.alignment)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the region: the slots with their alignment padding."""
        return sum(_align(s.nbytes, self.alignment) for s in self.slots)

    @property
    def requested_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def bytes_by_kind(self, *, aligned: bool = False) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.slots:
            out[s.kind] = out.get(s.kind, 0) + (_align(s.nbytes, self.alignment) if aligned else s.nbytes)
        return out


# --- host memory budget --------------------------------------------------------------------------


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out


def _cgroup_limit_and_usage() -> Optional[tuple[int, int, str]]:
    """(limit, usage without reclaimable page cache, source) of this process's memory cgroup, if limited."""
    for limit_file, usage_file, stat_file, cache_key in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
         "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
    ):
        limit = _read_int(limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _read_int(usage_file) or 0
        cache = 0
        try:
            with open(stat_file) as f:
                for line in f:
                    key, value = line.split()
                    if key == cache_key:
                        cache = int(value)
        except (OSError, ValueError):
            pass
        return limit, max(0, usage - cache), f"cgroup {limit_file}"
    return None


def host_memory_limit_from_env() -> Optional[int]:
    """``$FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB`` in bytes; None when unset or empty. ValueError naming the
    variable when it is not a positive number of GiB."""
    value = os.environ.get(LIMIT_ENV, "").strip()
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{LIMIT_ENV}={value!r} is not a number of GiB > 0; set it to the host memory this machine "
                         f"may use (e.g. {LIMIT_ENV}=64) or unset it (the limit is then detected)")
    return int(gib * GIB)


@dataclass(frozen=True)
class HostMemoryBudget:
    """How much host memory a new arena may take: ``(limit * (1 - margin) - used) / processes``.

    ``processes`` is the number of ranks sharing the host (``LOCAL_WORLD_SIZE``): each rank plans
    its own arena, so each gets an equal share of what is left.
    """

    limit_bytes: int
    used_bytes: int
    margin: float = DEFAULT_MARGIN
    processes: int = 1
    source: str = "explicit"

    @property
    def available_bytes(self) -> int:
        return max(0, int(self.limit_bytes * (1.0 - self.margin)) - self.used_bytes) // max(1, self.processes)

    @classmethod
    def detect(cls, limit_bytes: Optional[int] = None, *, margin: float = DEFAULT_MARGIN) -> "HostMemoryBudget":
        """The limit, in this order: ``limit_bytes``; the ``FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB``
        environment variable; the memory cgroup's limit; ``MemTotal``.

        Pass an explicit limit on machines whose ``MemTotal`` understates what they can use (a
        Firecracker VM starts small and grows its memory on demand). Usage is the cgroup's usage
        without inactive page cache when the limit comes from the cgroup, else ``MemTotal -
        MemAvailable`` (the whole machine's, which is right on a machine dedicated to the job).
        """
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"host memory margin {margin} must be in [0, 1)")
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        meminfo = _meminfo()
        system_used = max(0, meminfo.get("MemTotal", 0) - meminfo.get("MemAvailable", meminfo.get("MemTotal", 0)))
        if limit_bytes is None and (from_env := host_memory_limit_from_env()) is not None:
            limit_bytes, source = from_env, LIMIT_ENV
        else:
            source = "host_memory_limit_bytes"
        if limit_bytes is not None:
            return cls(int(limit_bytes), system_used, margin, processes, source)
        cgroup = _cgroup_limit_and_usage()
        if cgroup is not None:
            limit, used, source = cgroup
            return cls(limit, used, margin, processes, source)
        return cls(meminfo.get("MemTotal", 0), system_used, margin, processes, "/proc/meminfo MemTotal")

    def describe(self) -> str:
        share = f", split over {self.processes} local ranks" if self.processes > 1 else ""
        return (f"{self.available_bytes / GIB:.2f} GiB available: limit {self.limit_bytes / GIB:.2f} GiB "
                f"({self.source}) minus {self.margin:.0%} margin minus {self.used_bytes / GIB:.2f} GiB in use{share}")


def check_plan(plan: ArenaPlan, budget: HostMemoryBudget, *, hint: str, resident_bytes: int = 0) -> None:
    """Raises ``ValueError`` (before anything is allocated) when the plan exceeds the budget.

    ``resident_bytes``: bytes of the plan already in host memory that moving into the arena frees
    piece by piece (pageable parameter shards), so they do not count twice.
    """
    needed = plan.nbytes - resident_bytes
    if needed <= budget.available_bytes:
        return
    kinds = ", ".join(f"{kind} {nbytes / GIB:.2f} GiB" for kind, nbytes in plan.bytes_by_kind(aligned=True).items())
    moved = f", {resident_bytes / GIB:.2f} GiB of which move in from host memory" if resident_bytes else ""
    raise ValueError(
        f"the pinned host arena needs {needed / GIB:.2f} GiB ({needed} bytes; {kinds}{moved}) but "
        f"{budget.describe()} ({budget.available_bytes} bytes). {hint}; or, if this machine has more host "
        f"memory than it reports, set {LIMIT_ENV} (or pass host_memory_limit_bytes)")


# --- the arena -----------------------------------------------------------------------------------


class _Region(mmap.mmap):
    """An anonymous private mapping; page-locked while registered. Lives as long as any tensor on it."""

    registered = False

    def __del__(self) -> None:
        # Runs when the last tensor viewing the region dies, before the mapping is removed. That is
        # teardown or a re-plan, never the steady state: wait for copies still reading or writing it.
        if self.registered:
            self.registered = False
            try:
                torch.cuda.synchronize()
            except Exception:  # interpreter shutdown: the CUDA context may already be gone
                pass
            try:
                torch.cuda.cudart().cudaHostUnregister(self._ptr)
            except Exception:
                pass


class PinnedArena:
    """One host region of exactly ``plan.nbytes`` bytes, registered with CUDA when ``pin`` is true.

    Args:
        plan: the slots. An empty plan allocates nothing.
        budget: checked before allocating; None skips the check.
        hint: the part of the error message that says which setting to lower.
        pin: register the region with CUDA; default: when CUDA is available.
        resident_bytes: bytes of the plan already in host memory and freed as they move in (see
            ``check_plan``).
        defer_pin: leave registration to a later ``pin()``, after the caller has filled slots by
            copies (each page is then committed once, by the copy).
    """

    def __init__(self, plan: ArenaPlan, *, budget: Optional[HostMemoryBudget] = None,
                 hint: str = "shrink the plan", pin: Optional[bool] = None, resident_bytes: int = 0,
                 defer_pin: bool = False) -> None:
        if budget is not None:
            check_plan(plan, budget, hint=hint, resident_bytes=resident_bytes)
        self.plan = plan
        self._specs = {s.name: s for s in plan.slots}
        self._offsets = plan.offsets()
        self.nbytes = plan.nbytes
        self.pin_requested = bool(torch.cuda.is_available() if pin is None else pin) and self.nbytes > 0
        self.pinned = False
        self._region: Optional[_Region] = None
        self._buffer: Optional[torch.Tensor] = None  # uint8 (nbytes,)
        if self.nbytes == 0:
            return
        # Page-aligned; pages are committed on first touch, so slots filled by copies (parameter
        # shards moved in one by one) never exist twice in host memory.
        self._region = _Region(-1, self.nbytes, flags=mmap.MAP_PRIVATE)
        self._buffer = torch.frombuffer(self._region, dtype=torch.uint8)  # its storage keeps the region alive
        if self.pin_requested and not defer_pin:
            self._buffer.zero_()  # commit every page on all intra-op threads; registration then only locks
            self.pin()

    def pin(self) -> None:
        """Registers the whole region with CUDA (page-locks it). Commit pages first: faulting them in
        with a multi-threaded write is faster than letting the registration do it."""
        if not self.pin_requested or self.pinned:
            return
        start = time.perf_counter()
        ptr = self._buffer.data_ptr()
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with cudaError {rc}; the host "
                               "may be out of lockable memory (ulimit -l) or a previous CUDA call failed")
        self._region._ptr, self._region.registered, self.pinned = ptr, True, True
        log.info("pinned arena: %.3f GiB in %d slots page-locked in %.2f s", self.nbytes / GIB, len(self.plan.slots),
                 time.perf_counter() - start)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def capacity(self, name: str) -> int:
        """Bytes slot ``name`` may hold (its planned size)."""
        return self._specs[name].nbytes

    def slot(self, name: str, shape: Optional[tuple[int, ...]] = None, dtype: Optional[torch.dtype] = None
             ) -> torch.Tensor:
        """A view of slot ``name``: the planned shape and dtype, or any other that fits in its bytes."""
        if self._buffer is None and self.nbytes:
            raise RuntimeError("the arena is closed")
        spec = self._specs[name]
        shape = spec.shape if shape is None else tuple(shape)
        dtype = spec.dtype if dtype is None else dtype
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > spec.nbytes:
            raise ValueError(f"arena slot {name!r} holds {spec.nbytes} bytes; {shape} {dtype} needs {nbytes}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        offset = self._offsets[name]
        return self._buffer[offset : offset + nbytes].view(dtype).view(shape)

    def contains(self, t: torch.Tensor) -> bool:
        """Whether all of ``t``'s bytes lie inside this arena's region."""
        if self._buffer is None or t.device.type != "cpu" or t.numel() == 0:
            return False
        lo, start = self._buffer.data_ptr(), t.data_ptr()
        return lo <= start and start + t.numel() * t.element_size() <= lo + self.nbytes

    def slots(self, kind: Optional[str] = None) -> Iterator[SlotSpec]:
        return (s for s in self.plan.slots if kind is None or s.kind == kind)

    def stats(self) -> dict:
        """Bytes requested by the slots and bytes page-locked, per kind and in total."""
        out = {"arena_requested_bytes": self.plan.requested_bytes,
               "arena_bytes": self.nbytes,
               "arena_page_locked_bytes": self.nbytes if self.pinned else 0}
        aligned = self.plan.bytes_by_kind(aligned=True)
        for kind, requested in self.plan.bytes_by_kind().items():
            out[f"arena_{kind}_requested_bytes"] = requested
            out[f"arena_{kind}_page_locked_bytes"] = aligned[kind] if self.pinned else 0
        return out

    def close(self) -> None:
        """Drops the arena's references; the region is unregistered and unmapped once no tensor views it.

        The caller makes sure no copy into or out of the arena is still queued.
        """
        self._buffer = self._region = None
