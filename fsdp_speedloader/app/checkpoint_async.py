"""Asynchronous DCP saves (``checkpoint.async_save=true``): the training loop stalls only while this rank's state is
copied into host memory (the staging copy); the files are written by DCP's upload thread while training goes on.

- ``torch.distributed.checkpoint.async_save`` with :class:`ShardStager`, which stages synchronously (the copy is taken
  before ``start`` returns, so the next optimizer step cannot change what is saved) into host buffers reused from one
  save to the next, page-locked on a GPU (the device-to-host copy runs at full speed), pageable on a CPU. Each
  DTensor's local shard is copied and wrapped again in the original's spec (FSDP2's own way of wrapping a shard,
  which leaves it where it is: ``DTensor.from_local`` moves a host tensor to a CUDA mesh's GPU). Torch's
  ``DefaultStager`` copies a tensor's storage and takes a DTensor wrapper whose shard sits at an offset into a larger
  buffer (the pinned host arena's) for a tensor with storage of its own, and fails (torch 2.11-2.13: ``copy_() on an
  invalid python storage``).
- The upload's collectives run on a gloo group of their own: in a thread beside the training loop's, they must
  never interleave with the training's collectives on the default group (and async_save needs a CPU backend).
- The staging copy holds a whole checkpoint of this rank (model and optimizer state) in host memory while it is
  written: the host-memory plan counts it (``app/host_memory.py``) and refuses a run where it does not fit.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class ShardStager(AsyncStager):
    """Stages a state dict into host buffers of its own, one per entry, kept from one save to the next: tensors are
    copied; DTensors are their local shard copied and wrapped again (same mesh, placements, global shape and
    stride); anything else is deep-copied. ``pin_memory``: page-locked buffers (on a GPU)."""

    _synchronize_after_execute = False  # stage() returns with the copy done

    def __init__(self, *, pin_memory: bool) -> None:
        self._pin = pin_memory and torch.cuda.is_available()  # page-locking needs CUDA
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = self._stage(state_dict, ())
        if self._pin:
            torch.cuda.synchronize()  # the device-to-host copies are done before the next step changes the state
        return staged

    def _stage(self, value: Any, path: tuple) -> Any:
        if isinstance(value, DTensor):
            # The copy wrapped in the original's spec, where it is (host memory). DTensor.from_local would move a
            # host shard of a CUDA mesh to the GPU: a second copy of every offloaded state in GPU memory.
            return DTensor(self._copy(value.to_local(), path), value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._copy(value, path)
        if isinstance(value, dict):
            return {k: self._stage(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._stage(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _copy(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        # Reusing a buffer is safe: AsyncSaver starts a save only once the previous one is written.
        buffer = self._buffers.get(path)
        if buffer is None or (buffer.shape, buffer.stride(), buffer.dtype) != (tensor.shape, tensor.stride(),
                                                                                tensor.dtype):
            buffer = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu",
                                         pin_memory=self._pin)
            self._buffers[path] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=self._pin)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


class AsyncSaver:
    """One asynchronous DCP save in flight at a time (:meth:`start`, then :meth:`done` / :meth:`result`).

    Args:
        pin_memory: stage into page-locked memory (on a GPU: the device-to-host copy runs at full speed).
    """

    def __init__(self, *, pin_memory: bool) -> None:
        # Every rank constructs this at the same point (new_group is a collective).
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._stager = ShardStager(pin_memory=pin_memory)
        self._future: Optional[Future] = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """Copies ``state_dict``'s tensors into host memory, then returns; the upload thread writes them into
        ``checkpoint_id`` (all ranks call this, like ``dcp.save``)."""
        assert self._future is None, "the previous asynchronous save is still in flight"
        response = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self._group,
                                  async_stager=self._stager)
        # Torch returns an AsyncSaveResponse only for a stager that stages asynchronously; ours stages in place.
        self._future = getattr(response, "upload_completion", response)

    def done(self) -> bool:
        """Whether the save in flight has finished (written or failed); False when there is none."""
        return self._future is not None and self._future.done()

    def result(self) -> None:
        """Waits for the save in flight; raises its error if it failed. On the coordinator (rank 0), a finished save
        means every rank's files are written: DCP's coordinator writes ``.metadata`` only after it has gathered every
        rank's write results."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        """Waits for the save in flight (its error, if any, is raised), then frees the staging copy and the group."""
        try:
            self.result()
        finally:
            self._stager.close()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

