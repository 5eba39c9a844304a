"""Fault injection: make a rank die, or run out of memory, at a chosen step (tests of fault tolerance).

Set ``$FSDP_SPEEDLOADER_INJECT_FAULT`` before launching; the trainer reads it once at start-up
and triggers it just before the chosen step runs (after the previous step's checkpoint, if any).

    KIND[:key=value,key=value...]

    KIND            exit: ``os._exit(1)`` at once, no cleanup, no barrier (as if the process were killed)
                    oom:  raises ``torch.OutOfMemoryError`` (what a too-large batch does on a GPU)
    rank=R          only on global rank R (default: every rank)
    step=K          before step K (1-based) runs (default: 1)
    attempt=A       only in torchrun attempt A, 0 the first (``$TORCHELASTIC_RESTART_COUNT``; default: all)
    min_batch_size=B  only when a rank's batch (sub_batch_size x num_sub_batches) has >= B sequences:
                    a memory wall, so that in a sweep only the large points fail

Examples: ``exit:rank=1,step=5,attempt=0`` (rank 1 dies before step 5 of the first attempt;
``torchrun --max-restarts=1`` restarts and the run resumes); ``oom:min_batch_size=8``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

FAULT_ENV = "FSDP_SPEEDLOADER_INJECT_FAULT"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
_KINDS = ("exit", "oom")
_KEYS = ("rank", "step", "attempt", "min_batch_size")


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring for the fields)."""

    kind: str
    rank: Optional[int] = None
    step: int = 1
    attempt: Optional[int] = None
    min_batch_size: Optional[int] = None

    def applies_to(self, *, rank: int, attempt: int, batch_size: int) -> bool:
        return ((self.rank is None or self.rank == rank) and (self.attempt is None or self.attempt == attempt)
                and (self.min_batch_size is None or batch_size >= self.min_batch_size))

    def trigger(self) -> None:
        message = f"injected by {FAULT_ENV}={os.environ.get(FAULT_ENV, '')!r} before step {self.step}"
        if self.kind == "exit":
            print(f"fault: exiting ({message})", flush=True)
            os._exit(1)
        raise torch.OutOfMemoryError(f"CUDA out of memory ({message})")


def parse_fault(spec: str) -> Fault:
    """``KIND[:key=value,...]`` -> :class:`Fault`; ValueError names what is wrong."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in _KINDS:
        raise ValueError(f"{FAULT_ENV}: fault kind {kind!r} is not one of {', '.join(_KINDS)} (got {spec!r})")
    fields = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in _KEYS or not eq or not value.strip().isdigit():
            raise ValueError(f"{FAULT_ENV}: {item!r} is not key=<non-negative integer> with key in "
                             f"{', '.join(_KEYS)} (got {spec!r})")
        fields[key] = int(value)
    if fields.get("step", 1) < 1:
        raise ValueError(f"{FAULT_ENV}: step must be >= 1 (got {spec!r})")
    return Fault(kind=kind, **fields)


def fault_from_env(*, rank: int, batch_size: int) -> Optional[Fault]:
    """The fault this rank must trigger in this attempt, or None (the usual case: the variable is unset)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault = parse_fault(spec)
    attempt = int(os.environ.get(RESTART_COUNT_ENV, "0"))
    return fault if fault.applies_to(rank=rank, attempt=attempt, batch_size=batch_size) else None
