"""Where FSDP2's parameter shards live: moved into the pinned arena, onto the compute device, or run directly.

- The arena (``memory/arena.py``) plans and holds the offloaded shards, their gradients and their transfer
  copies; the functions here plan those slots from FSDP2's parameters and point FSDP2 at them.
- ``move_unoffloaded_shards``: after ``to_empty`` on the host, the groups that do not offload get shards on
  the compute device.
- ``local_shard_params`` / ``run_on_local_shards``: generation on the local shards. When every parameter's
  shard group has one rank, its weights are on the compute device and need no cast, FSDP2's unshard copies a
  tensor that is already whole into its all-gather buffer and out again, once per unit per step, behind
  Python hooks. For generation, where no gradient needs FSDP2's bookkeeping, the modules can run on the
  local shards themselves.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import nn

from fsdp_speedloader.fsdp2.contract import private
from fsdp_speedloader.fsdp2.grad_slots import set_grad_slots
from fsdp_speedloader.fsdp2.groups import fsdp_param_groups_under, param_name
from fsdp_speedloader.fsdp2.param_transfer import set_param_transfer
from fsdp_speedloader.memory.arena import ArenaPlan, PinnedArena

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

log = logging.getLogger(__name__)


# --- offloaded parameter shards in the arena ------------------------------------------------------


def _movable(fsdp_param: FSDPParam) -> bool:
    data = getattr(fsdp_param, "_sharded_param_data", None)
    local = getattr(getattr(fsdp_param, "sharded_param", None), "_local_tensor", None)
    return (type(data) is torch.Tensor and type(local) is torch.Tensor and data.device.type == "cpu"
            and data.numel() > 0 and data.is_contiguous() and local.data_ptr() == data.data_ptr()
            and hasattr(fsdp_param, "padded_sharded_param_size") and hasattr(fsdp_param, "fsdp_placement"))


def plan_fsdp_shards(plan: ArenaPlan, fsdp_params: Sequence[FSDPParam]) -> list[tuple[str, FSDPParam]]:
    """Adds one 'param_shards' slot per movable shard (its padded size and dtype); returns (slot, param)."""
    planned = []
    for k, fsdp_param in enumerate(fsdp_params):
        if not _movable(fsdp_param):
            log.warning("FSDP parameter %s stays where FSDP put it (not a plain, contiguous CPU shard)",
                        param_name(fsdp_param))
            continue
        name = f"param_shard:{k}:{getattr(fsdp_param, '_param_fqn', None) or ''}"
        plan.add(name, "param_shards", tuple(fsdp_param.padded_sharded_param_size),
                 fsdp_param._sharded_param_data.dtype)
        planned.append((name, fsdp_param))
    return planned


@torch.no_grad()
def move_fsdp_shards_into_arena(arena: PinnedArena, planned: Sequence[tuple[str, FSDPParam]], *,
                                own_version_counters: bool = False) -> int:
    """Copies each planned shard into its slot and points FSDP2 at the slot; returns the bytes moved.

    Two FSDP2 attributes change per parameter, exactly as FSDP2's own ``reset_sharded_param`` changes
    them after ``load_state_dict`` or lazy init: ``_sharded_param_data`` (the padded 1-D shard that its
    unshard copies to the device) and ``sharded_param._local_tensor`` (the unpadded view the optimizer
    updates in place). The ``nn.Parameter`` object is unchanged, so optimizers built before keep working.
    Afterwards ``reset_sharded_param`` finds the same storage and a pinned tensor and leaves both alone.

    When the arena is (to be) page-locked, ``fsdp_param.pin_memory`` is set so that FSDP2 copies the
    reduce-scattered gradient to the host without blocking (``apply_speedloader`` shards with
    ``pin_memory=False`` when the arena takes the shards, so FSDP2 pins nothing itself). Each old
    shard is freed as soon as it is moved: host memory never holds all shards twice.

    Call it when no unshard is reading the old shards from page-locked memory (pageable sources
    are staged by CUDA before the copy call returns, so FSDP2's first-forward copies are safe).

    With ``own_version_counters`` (the parameter transfer copies need it) each shard gets a version
    counter of its own (a view of the arena would share the region's with every other slot, bumped by
    each activation copy): ``_version`` then counts writes to that shard alone, which is what the
    copies check (``param_transfer.py``).
    """
    moved = 0
    for name, fsdp_param in planned:
        padded = arena.slot(name)  # padded_sharded_param_size
        if own_version_counters:
            padded = _own_version_counter(padded)
        old = fsdp_param._sharded_param_data
        padded.view(-1).copy_(old)
        shard_dim = fsdp_param.fsdp_placement.dim
        local = fsdp_param.sharded_param._local_tensor
        length = local.size(shard_dim) if local.numel() > 0 else 0
        fsdp_param._sharded_param_data = padded.view(-1)
        fsdp_param.sharded_param._local_tensor = padded.narrow(shard_dim, 0, length)
        assert fsdp_param.sharded_param._local_tensor.is_contiguous()
        if arena.pin_requested:
            fsdp_param.pin_memory = True
        moved += padded.numel() * padded.element_size()
    return moved


def _own_version_counter(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor that is no view: same storage, its own autograd version counter."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def plan_fsdp_param_transfer(plan: ArenaPlan, planned_shards: Sequence[tuple[str, FSDPParam]], dtype: torch.dtype
                             ) -> list[tuple[str, FSDPParam]]:
    """Adds one 'param_transfer' slot per planned parameter shard whose dtype is not ``dtype``: the padded
    shard (``padded_sharded_param_size``, flattened) in ``dtype``, what FSDP2 then copies to the device
    instead of the fp32 shard (half the bytes for bf16); returns (slot, param)."""
    planned = []
    for k, (_, fsdp_param) in enumerate(planned_shards):
        if fsdp_param._sharded_param_data.dtype == dtype:
            continue
        name = f"param_transfer:{k}:{getattr(fsdp_param, '_param_fqn', None) or ''}"
        plan.add(name, "param_transfer", (math.prod(fsdp_param.padded_sharded_param_size),), dtype)
        planned.append((name, fsdp_param))
    return planned


def bind_fsdp_param_transfer(arena: PinnedArena, planned: Sequence[tuple[str, FSDPParam]]) -> int:
    """Casts each planned shard into its 'param_transfer' slot (committing its pages) and makes FSDP2's
    host-to-device parameter copy read the slot (``set_param_transfer``); returns the bytes."""
    copies = [(fsdp_param, arena.slot(name)) for name, fsdp_param in planned]
    set_param_transfer(copies)
    return sum(t.numel() * t.element_size() for _, t in copies)


def plan_fsdp_grads(plan: ArenaPlan, fsdp_params: Sequence[FSDPParam]) -> list[tuple[str, FSDPParam]]:
    """Adds one 'grad_shards' slot per offloaded parameter that gets a gradient: exactly its shard
    (``sharded_size``, unpadded, in the parameter's dtype: what FSDP2's reduce-scatter leaves for this
    rank after casting back to the original dtype); returns (slot, param). Empty shards get none."""
    planned = []
    for k, fsdp_param in enumerate(fsdp_params):
        sharded = getattr(fsdp_param, "sharded_param", None)
        if sharded is None or not sharded.requires_grad or math.prod(fsdp_param.sharded_size) == 0:
            continue
        name = f"grad_shard:{k}:{getattr(fsdp_param, '_param_fqn', None) or ''}"
        plan.add(name, "grad_shards", tuple(fsdp_param.sharded_size), sharded.dtype)
        planned.append((name, fsdp_param))
    return planned


def bind_fsdp_grads_to_arena(arena: PinnedArena, planned: Sequence[tuple[str, FSDPParam]]) -> int:
    """Points FSDP2's host gradient copies of the planned parameters at their slots; returns the bytes.

    From the next backward on, a parameter whose ``.grad`` is None (``zero_grad(set_to_none=True)``)
    gets its reduce-scattered gradient copied into its slot on FSDP2's post-reduce stream (without
    blocking when the arena is page-locked) and wrapped as its ``.grad`` by FSDP2 itself; see
    ``grad_slots.py`` for the one FSDP2 call this redirects. The slots are zeroed here, which commits their
    pages before the arena is registered.
    """
    slots = []
    for name, fsdp_param in planned:
        tensor = arena.slot(name)
        tensor.zero_()
        slots.append((fsdp_param, tensor))
    set_grad_slots(slots)
    return sum(t.numel() * t.element_size() for _, t in slots)


# --- shards of the groups that do not offload ------------------------------------------------------


def move_unoffloaded_shards(model: nn.Module, device: torch.device) -> int:
    """After ``model.to_empty(device=host)``: gives the parameters of FSDP groups that do not offload
    (``offload_root=False``'s root) fresh, uninitialised shards on ``device``; returns how many moved.

    Each parameter keeps its object (``torch.utils.swap_tensors``, as ``nn.Module._apply`` does, so tied
    parameters stay tied and optimizers built later see them), then ``FSDPParam.reset_sharded_param``
    re-reads its local shard, as FSDP2's own ``_apply`` does after ``to_empty``.
    """
    moved = 0
    with torch.no_grad():
        for group in fsdp_param_groups_under(model):
            if any(p.offload_to_cpu for p in group.fsdp_params):
                continue
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                if param.device == device:
                    continue
                torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device=device),
                                                             requires_grad=param.requires_grad))
                fsdp_param.reset_sharded_param()
                moved += 1
    return moved


# --- generation on the local shards ---------------------------------------------------------------


def local_shard_params(model: nn.Module) -> Optional[list[FSDPParam]]:
    """The model's FSDPParams if each local shard IS its whole parameter, on the compute device, in the
    compute dtype (one rank per shard group, not offloaded, no mixed-precision cast); else None."""
    params = []
    for group in fsdp_param_groups_under(model):
        for p in group.fsdp_params:  # the group's policy: FSDPParam.param_dtype exists only after lazy init
            local = p.sharded_param.to_local()
            if (p.offload_to_cpu or p.mesh_info.shard_mesh_size != 1 or tuple(local.shape) != tuple(p._orig_size)
                    or group.mp_policy.param_dtype not in (None, local.dtype) or local.device != p.device):
                return None
            params.append(p)
    return params or None


@contextlib.contextmanager
def run_on_local_shards(fsdp_params: Sequence[FSDPParam]) -> Iterator[None]:
    """Within the block, the modules hold their local shards (``local_shard_params``) as plain parameters,
    so they run without FSDP2's hooks and copies; FSDP2's sharded parameters are put back on exit.
    Groups left unsharded (the root after a forward) already hold whole parameters and stay as they are."""
    sharded = private("ShardedState").SHARDED
    swapped = []
    try:
        for p in fsdp_params:
            if p.sharded_state == sharded:
                p._setattr_on_modules(nn.Parameter(p.sharded_param.to_local(), requires_grad=False))
                swapped.append(p)
        yield
    finally:
        for p in swapped:
            p._setattr_on_modules(p.sharded_param)
