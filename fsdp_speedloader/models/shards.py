"""A full tensor and this rank's part of it: FSDP2 shards parameters along dim 0 (``torch.chunk``'s split: ceil(rows /
ranks) rows per rank, the last ranks fewer or none), replicated across HSDP's replica dimension."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def copy_full_tensor_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copies this rank's part of the full tensor ``full`` into ``param`` (a DTensor or a plain tensor)."""
    if full.shape != param.shape:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(full.shape)} vs parameter {tuple(param.shape)}")
    if not isinstance(param, DTensor):
        param.data.copy_(full)
        return
    local = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(local, param.device_mesh.size(mesh_dim), dim=placement.dim)
            rank = param.device_mesh.get_local_rank(mesh_dim)
            local = chunks[rank] if rank < len(chunks) else local.narrow(placement.dim, 0, 0)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"unsupported placement {placement}")
    param.to_local().copy_(local)


def local_stretch(param: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    """(this rank's values of ``param`` as a 1-D view, the flat index of their first element in the full tensor)
    when they are one contiguous stretch of it: a plain tensor, or a DTensor sharded along dim 0 only (FSDP2,
    HSDP), split as ``torch.chunk`` splits. None otherwise."""
    if not isinstance(param, DTensor):
        data = param.data
        return (data.view(-1), 0) if data.is_contiguous() else None
    if param.dim() == 0:
        return None
    first_row, rows = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                return None
            size, rank = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
            per_rank = -(-rows // size)  # torch.chunk: ceil(rows / size) rows per rank, the last ones fewer or none
            first_row, rows = first_row + rank * per_rank, max(0, min(per_rank, rows - rank * per_rank))
        elif not isinstance(placement, Replicate):
            return None
    local = param.to_local().detach()  # filled in place, possibly on other threads (grad mode is per thread)
    row_numel = local.numel() // rows if rows else 0
    if not local.is_contiguous() or (rows and local.shape[0] != rows):
        return None
    return local.view(-1), first_row * row_numel
