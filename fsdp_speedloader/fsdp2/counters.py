"""How often each fast path of the seam engaged, and how often it fell back to FSDP2's own path.

A fast path that cannot engage for a reason its design does not expect (FSDP2 did not behave as read, a
buffer does not match) runs FSDP2's own path instead: slower, correct, never silent: ``fall_back`` counts
it and warns once per reason. Counts are per process, since import, over every model; the engine's
``SpeedLoader.stats()`` reports them with the store's per-step figures.
"""

from __future__ import annotations

import dataclasses
import logging


@dataclasses.dataclass
class FastPathCounters:
    num_staged_loads: int = 0  # parameter loads staged on FSDP2's copy-in stream and read by FSDP2 (prefetch)
    num_staged_load_fallbacks: int = 0  # loads of a staged group that FSDP2 made on the compute stream
    num_grads_into_slots: int = 0  # offloaded gradients FSDP2 copied into their host slot (grad_slots)
    num_grad_slot_fallbacks: int = 0  # gradients of a slotted parameter left in FSDP2's own memory
    num_grad_ring_waits: int = 0  # units whose gradients waited for an in-flight ring region (grad_slots.GradRing)
    grad_ring_wait_s: float = 0.0  # seconds those waits blocked the thread that runs the backward
    num_param_transfers: int = 0  # parameter loads that read a transfer copy (param_transfer)
    num_stale_transfer_casts: int = 0  # of those, copies cast on the unshard path (stale, the slow path)
    num_param_transfer_fallbacks: int = 0  # loads of a parameter with a copy that read FSDP2's own shard


COUNTERS = FastPathCounters()
_warned: set[str] = set()  # the reasons warned about in this process


def fast_path_stats() -> dict[str, float]:
    """Every counter of ``FastPathCounters``, by name."""
    return dataclasses.asdict(COUNTERS)


def fall_back(counter: str, reason: str, log: logging.Logger, message: str, *args, count: int = 1) -> None:
    """Counts ``count`` fallbacks in ``counter``; logs ``message % args`` the first time ``reason`` occurs."""
    setattr(COUNTERS, counter, getattr(COUNTERS, counter) + count)
    if reason not in _warned:
        _warned.add(reason)
        log.warning(message + " (further cases are counted in fsdp_speedloader.fsdp2.fast_path_stats()['%s'])",
                    *args, counter)
