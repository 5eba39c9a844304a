"""Process group, device mesh and FSDP2 sharding: the only module that calls ``fully_shard``.

Meshes: 1-D ``("dp_shard",)`` over all ranks (FSDP), or 2-D ``("dp_replicate", "dp_shard")`` (HSDP:
shard within a node, replicate across nodes -- the FSDP2 counterpart of ZeRO++'s hierarchical
partitioning). Units are lists of consecutive blocks sharded as one FSDP group, so a unit is one
all-gather and one reduce-scatter however many blocks it holds.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def maybe_init_process_group(device_type: Optional[str] = None, timeout_s: float = 1800.0) -> None:
    """Joins the torchrun group, or makes a one-process group when launched as plain ``python``.

    NCCL carries CUDA tensors and gloo CPU tensors (CPU-offloaded gradients, object broadcasts).
    ``device_type`` only validates that the requested device exists.
    """
    if dist.is_initialized():
        return
    # Both backends whenever CUDA exists: CPU meshes (tests, offloaded state) and CUDA meshes
    # can then share the one default group, whichever is built first.
    if torch.cuda.is_available():
        if device_type != "cpu":  # a CPU run on a GPU host may have more ranks than GPUs
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        if device_type == "cuda":
            raise ValueError("device=cuda but CUDA is not available; use device=cpu or device=auto")
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if (store := _restarted_attempt_store(timeout)) is not None:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    elif "RANK" in os.environ:  # torchrun (or any env:// launcher)
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # plain python: a group of one, in-process (no port, no environment variables touched)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _restarted_attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """torchrun's own store, seen under a per-attempt prefix, in an attempt after a restart; else None.

    torchrun's c10d agent keeps ONE store across ``--max-restarts`` attempts and its workers use it
    unprefixed, so the keys a failed attempt wrote (gloo/NCCL addresses, barriers) are read as the
    new attempt's, and ``init_process_group`` hangs or connects to dead ranks (pytorch#135712; seen
    on torch 2.13 with gloo). Every agent restarts its workers together, so the restart count is
    the same on every rank. (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun does the same.)
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fsdp_speedloader/attempt_{attempt}", store)


def compute_device(device_type: str) -> torch.device:
    """This rank's compute device."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(device_type: str, dp_replicate: int = 1) -> DeviceMesh:
    """FSDP over all ranks, or HSDP with ``dp_replicate`` replicas of ``world / dp_replicate`` shards."""
    world = dist.get_world_size()
    if dp_replicate < 1 or world % dp_replicate != 0:
        raise ValueError(f"dp_replicate={dp_replicate} must divide the world size {world}; "
                         "set it to the number of nodes (or 1 for plain FSDP)")
    if dp_replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, world // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def shard_size(mesh: DeviceMesh) -> int:
    """Ranks a parameter is sharded over: the ``dp_shard`` dimension, or a user's unnamed mesh's last one (FSDP2
    shards over the last dimension and replicates over the first of a 2-D mesh)."""
    names = mesh.mesh_dim_names
    return mesh.shape[names.index("dp_shard")] if names and "dp_shard" in names else mesh.shape[-1]


def check_mesh(mesh: DeviceMesh) -> None:
    """The engine needs a mesh over exactly the ranks of the default process group."""
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"mesh has {mesh.size()} ranks but the process group has {world}; pass mesh=None "
                         "or a mesh over all ranks (fsdp_speedloader.parallel.build_mesh)")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (FSDP) or 2-D (HSDP), got {mesh.ndim}-D")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Sequence[Sequence[nn.Module]],
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    offload_params: bool = False,
    pin_memory: bool = True,
    reshard_after_forward: bool = True,
    offload_root: bool = True,
    device_units: int = 0,
) -> list[FSDPModule]:
    """Shards each unit (a group of blocks) and then the root (embeddings, final norm, LM head).

    ``offload_root=False`` keeps the root's states on the device even with ``offload_params``, and
    ``device_units=K`` those of units 1 .. K.
    Returns the FSDP module of each unit: the first module of its group, which holds the state.
    """
    check_mesh(mesh)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinning needs CUDA; on a CPU-only machine the "host" is the device, nothing to pin.
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=pin_memory and torch.cuda.is_available())
                              if offload_params else OffloadPolicy())
    unit_modules = []
    for index, blocks in enumerate(units):
        blocks = list(blocks)
        fully_shard(blocks if len(blocks) > 1 else blocks[0], mesh=mesh, mp_policy=mp_policy,
                    offload_policy=offload if index >= device_units else OffloadPolicy(),
                    reshard_after_forward=reshard_after_forward)
        unit_modules.append(blocks[0])
    # The root stays unsharded between forward and backward: it is small and used at both ends.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload if offload_root else OffloadPolicy(),
                reshard_after_forward=False)
    return unit_modules


def set_forward_prefetch(root: FSDPModule, units: Sequence[FSDPModule], depth: int) -> None:
    """Issues each unit's all-gather (and host-to-device copy) ``depth`` units ahead in forward."""
    if depth <= 0 or not units:
        return
    root.set_modules_to_forward_prefetch(list(units[:depth]))
    for i, unit in enumerate(units):
        nxt = list(units[i + 1 : i + 1 + depth])
        if nxt:
            unit.set_modules_to_forward_prefetch(nxt)


def destroy_process_group() -> None:
    """Barrier, then tear down (a rank leaving early would hang the others' last collective)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
