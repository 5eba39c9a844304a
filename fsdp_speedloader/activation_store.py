"""Where block-boundary activations of all N sub-batches wait between units: GPU or host memory.

Slots: slot l holds x_l, the output of unit l, for every sub-batch i (slot 0: the embeddings), so
a step with U units has U + 1 slots. In backward the gradient dL/dx_l goes to slot min(l + 1, U):
the slot of an activation that no step needs any more (as in the paper), so gradients cost no
memory beyond the activations. ``grad_slot`` is the one place that rule lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch


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

    @property
    def device_bytes(self) -> int:
        return 0

    @property
    def host_bytes(self) -> int:
        return 0


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

    Copies are synchronous here; ``ExchangeActivationStore`` overlaps them with compute.
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffer: Optional[torch.Tensor] = None

    def _allocate(self) -> None:
        self._buffer = None  # free the old buffer before taking the new one
        pin = self.device.type == "cuda"
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


def build_activation_store(kind: str, *, offload_params: bool) -> ActivationStore:
    """'device', 'host', or 'auto' (host when parameters are offloaded: HBM is the scarce resource)."""
    if kind == "auto":
        kind = "host" if offload_params else "device"
    if kind == "device":
        return DeviceActivationStore()
    if kind == "host":
        return HostActivationStore()
    raise ValueError(f"activation_store={kind!r}; choose 'device', 'host' or 'auto'")
