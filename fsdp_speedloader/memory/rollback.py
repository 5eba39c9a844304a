"""A copy of what one optimizer step changes, to put back bit for bit: the speculation of the overlapped optimizer.

A float AdamW update cannot be undone by arithmetic, so the speculated step of a unit (``OverlappedOptimizer``'s
``speculative_units``, design §9) is preceded by ``Snapshot.take``: a copy of each parameter's local shard and of
every tensor of its optimizer state (moments, step count; a compressed optimizer's codes and scales), in buffers
kept from one step to the next. ``Snapshot.restore`` copies them back, and drops the state of a parameter that had
none (an optimizer's first step creates it: the step taken again creates the same). Any ``torch.optim.Optimizer``
whose state is tensors and plain values in ``optimizer.state[param]`` works this way.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s bits on this rank (a DTensor's local shard, which FSDP2 keeps as a view)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _copy(source: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
        buffer = torch.empty_like(source, memory_format=torch.contiguous_format)
    return buffer.copy_(source)


class Snapshot:
    """The parameters and optimizer state of one optimizer, as they were at the last :meth:`take`."""

    def __init__(self) -> None:
        # per parameter: (copies of the parameter's and the state's tensors by key, the state's other values),
        # or None when the parameter had no state yet
        self._saved: dict[torch.Tensor, tuple[dict[str, torch.Tensor], dict] | None] = {}

    @torch.no_grad()
    def take(self, optimizer: torch.optim.Optimizer) -> None:
        """Copies every parameter of ``optimizer`` and its state (reusing the buffers of the last copy)."""
        saved = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                old = self._saved.get(p)
                buffers = old[0] if old is not None else {}
                copies = {"": _copy(_local(p), buffers.get(""))}
                state = optimizer.state.get(p)
                if state is None:
                    saved[p] = (copies, None)
                    continue
                others = {}
                for key, value in state.items():
                    if torch.is_tensor(value):
                        copies[key] = _copy(_local(value), buffers.get(key))
                    else:
                        others[key] = value
                saved[p] = (copies, others)
        self._saved = saved

    @torch.no_grad()
    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts back what :meth:`take` copied: the parameters, and the state (or none where there was none)."""
        for p, (copies, others) in self._saved.items():
            _local(p).copy_(copies[""])
            if others is None:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in copies and k not in others]:
                del state[key]
            for key, copy in copies.items():
                if key:
                    _local(state[key]).copy_(copy)
            state.update(others)

    @property
    def nbytes(self) -> int:
        """Host bytes the copies hold."""
        return sum(c.numel() * c.element_size() for copies, _ in self._saved.values() for c in copies.values())
