"""Host-to-device parameter loads staged ahead of use when FSDP2 has one rank per shard group.

With one rank, FSDP2 skips the all-gather: ``FSDPParamGroup.unshard()`` (where prefetching happens) only
records a placeholder result, and ``wait_for_unshard()`` reads ``all_gather_inputs`` -- for offloaded
parameters the whole host-to-device copy and the cast to the compute dtype -- on the compute stream, when
the unit is needed. Every unit's parameter load then stalls compute. For the groups marked by
``enable_single_rank_prefetch``, ``unshard()`` stages that copy on FSDP2's all-gather copy-in stream, and
``wait_for_unshard()`` makes the compute stream wait for it; FSDP2 then reads the staged tensors through the
patched ``all_gather_inputs`` (``param_transfer.STAGED_INPUT``) instead of copying again.

Counted: ``num_staged_loads`` (staged and read by FSDP2); ``num_staged_load_fallbacks`` (a marked group's
unshard did not take the world-size-1 branch as read, or FSDP2 did not read a staged input: FSDP2's own load
ran, with a warning).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from fsdp_speedloader.fsdp2.contract import private
from fsdp_speedloader.fsdp2.counters import COUNTERS, fall_back
from fsdp_speedloader.fsdp2.groups import fsdp_param_groups_of
from fsdp_speedloader.fsdp2.param_transfer import STAGED_INPUT, patch_all_gather_inputs, unstaged_inputs

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

log = logging.getLogger(__name__)

_FLAG = "_speedloader_stage_single_rank"  # set on the marked groups
_STAGED_EVENT = "_speedloader_staged_event"
_original_unshard = None  # FSDP2's own FSDPParamGroup.unshard / wait_for_unshard, kept when patching
_original_wait = None


def _single_rank_shortcut(group: FSDPParamGroup) -> bool:
    """Whether the group's pending unshard is FSDP2's world-size-1 placeholder (no work, no inputs)."""
    result = group._all_gather_result
    return (result is not None and getattr(result, "all_gather_work", 1) is None
            and not getattr(result, "param_all_gather_input_numels", [1]))


def _unshard(self: FSDPParamGroup, async_op: bool = False):
    pending = self._all_gather_result is not None or self.is_unsharded
    out = _original_unshard(self, async_op)
    if pending or not getattr(self, _FLAG, False) or self._all_gather_result is None:
        return out  # not marked, or FSDP2 had nothing to start (already unsharded, or skipped in backward)
    if not _single_rank_shortcut(self):
        fall_back("num_staged_load_fallbacks", "prefetch:not-placeholder", log,
                  "a one-rank FSDP2 group started a real all-gather (torch %s): its parameters load FSDP2's "
                  "way, on the compute stream", torch.__version__, count=len(self.fsdp_params))
        return out
    stream = self.comm_ctx.all_gather_copy_in_stream
    stream.wait_stream(torch.cuda.current_stream())  # e.g. a previous reshard of the same memory
    with torch.cuda.stream(stream):
        for fsdp_param in self.fsdp_params:
            fsdp_param.__dict__[STAGED_INPUT] = unstaged_inputs(fsdp_param)[0]
    setattr(self, _STAGED_EVENT, stream.record_event())
    return out


def _wait_for_unshard(self: FSDPParamGroup):
    event = self.__dict__.pop(_STAGED_EVENT, None)
    if event is None:
        return _original_wait(self)
    compute = torch.cuda.current_stream()
    compute.wait_event(event)
    staged = [p for p in self.fsdp_params if STAGED_INPUT in p.__dict__]
    for fsdp_param in staged:
        fsdp_param.__dict__[STAGED_INPUT].record_stream(compute)  # allocated on the copy-in stream, read on compute
    out = _original_wait(self)
    unread = [p for p in staged if p.__dict__.pop(STAGED_INPUT, None) is not None]  # never handed to a later load
    COUNTERS.num_staged_loads += len(staged) - len(unread)
    if unread:
        fall_back("num_staged_load_fallbacks", "prefetch:unread", log,
                  "FSDP2's wait_for_unshard did not read all_gather_inputs of %d staged parameters (torch %s): "
                  "they loaded FSDP2's way", len(unread), torch.__version__, count=len(unread))
    return out


def _stageable(group: FSDPParamGroup) -> bool:
    """CUDA, one rank per shard group (FSDP2 skips the all-gather), some parameters offloaded."""
    return (group.device.type == "cuda" and getattr(group.mesh_info, "shard_mesh_size", 1) == 1
            and any(p.offload_to_cpu for p in group.fsdp_params))


def _patch_group_methods() -> None:
    global _original_unshard, _original_wait
    group_cls = private("FSDPParamGroup")
    if group_cls.unshard is _unshard:
        return
    _original_unshard, _original_wait = group_cls.unshard, group_cls.wait_for_unshard
    _unshard.__wrapped__, _wait_for_unshard.__wrapped__ = _original_unshard, _original_wait  # for the contract
    group_cls.unshard, group_cls.wait_for_unshard = _unshard, _wait_for_unshard


def enable_single_rank_prefetch(modules: Sequence[nn.Module]) -> int:
    """Lets the FSDP groups of ``modules`` that are CUDA, offloaded and one rank per shard group load their
    parameters ahead of use; returns how many groups were marked. Patches ``FSDPParamGroup.unshard`` /
    ``wait_for_unshard`` and ``FSDPParam.all_gather_inputs`` once; unmarked groups run FSDP2's own."""
    groups = [g for m in modules for g in fsdp_param_groups_of(m) if _stageable(g)]
    if groups:
        patch_all_gather_inputs()
        _patch_group_methods()
    for group in groups:
        setattr(group, _FLAG, True)
    return len(groups)
