"""Asynchronous DCP saves (``checkpoint.async_save=true``): the training loop stalls only while this rank's state is
copied into host memory (the staging copy); the files are written by DCP's upload thread while training goes on.

- ``torch.distributed.checkpoint.async_save`` with a ``DefaultStager`` that stages synchronously (the copy is taken
  before ``start`` returns, so the next optimizer step cannot change what is saved), into pinned host memory on a
  GPU (reused from one save to the next) and pageable memory on a CPU.
- The upload's collectives run on a gloo group of their own: in a thread beside the training loop's, they must
  never interleave with the training's collectives on the default group (and async_save needs a CPU backend).
- The staging copy holds a whole checkpoint of this rank (model and optimizer state) in host memory while it is
  written: the host-memory plan counts it (``app/host_memory.py``) and refuses a run where it does not fit.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class AsyncSaver:
    """One asynchronous DCP save in flight at a time (:meth:`start`, then :meth:`done` / :meth:`result`).

    Args:
        pin_memory: stage into page-locked memory (on a GPU: the device-to-host copy runs at full speed).
    """

    def __init__(self, *, pin_memory: bool) -> None:
        # Every rank constructs this at the same point (new_group is a collective).
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin_memory, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
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

