"""Everything that reaches into FSDP2's private state, in one place.

Each function names the FSDP2 attribute it relies on; all were read in torch 2.11 and 2.13
(``FSDPParamGroup.fsdp_params``, ``FSDPParam.unsharded_accumulated_grad`` and its two helpers,
``FSDPParam.all_gather_inputs``, the world-size-1 branch of ``FSDPParamGroup.unshard`` /
``wait_for_unshard``). The state's group attribute is ``_fsdp_param_group`` in 2.11 and
``_fsdp_param_groups`` (a list) in 2.13.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def fsdp_param_groups_of(module: nn.Module) -> list[FSDPParamGroup]:
    """The FSDP parameter groups whose state lives on ``module`` (a unit's first module, or the root)."""
    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_params_of(module: nn.Module) -> list[FSDPParam]:
    """The FSDPParams of the groups whose state lives on ``module``."""
    return [p for g in fsdp_param_groups_of(module) for p in g.fsdp_params]


def fold_unsharded_grads(fsdp_params: Sequence[FSDPParam]) -> None:
    """Moves the unsharded gradients just computed into FSDP's reduce-dtype accumulator.

    Layer-major backward runs N sub-batches through one unsharded unit; autograd would sum their
    gradients in the compute dtype (bf16). FSDP keeps an fp32 ``unsharded_accumulated_grad`` for
    exactly this (it is how gradient accumulation without sync works) and its post-backward
    reduce-scatters that accumulator, so folding after every sub-batch makes the sum fp32, as
    precise as canonical accumulation. A no-op when the compute dtype is the reduce dtype.
    """
    for fsdp_param in fsdp_params:
        if fsdp_param.unsharded_accumulated_grad is None:
            fsdp_param.to_accumulated_grad_if_needed()
        else:
            fsdp_param.accumulate_unsharded_grad_if_needed()


# --- host-to-device prefetch at world size 1 ------------------------------------------------------
#
# With one rank, FSDP2 skips the all-gather: ``unshard()`` (where prefetching happens) does nothing,
# and ``wait_for_unshard()`` reads ``all_gather_inputs`` -- for offloaded parameters the whole
# host-to-device copy and the cast to the compute dtype -- on the compute stream. Every unit's
# parameter load then stalls compute (measured on an H200: 30% of a 7B-width step idle). For the
# groups marked by ``enable_single_rank_prefetch``, ``unshard()`` now stages that copy on FSDP's
# all-gather copy-in stream, and ``wait_for_unshard()`` makes the compute stream wait for it and
# consumes the staged tensors instead of copying again.

_FLAG = "_speedloader_stage_single_rank"
_original_inputs = FSDPParam.all_gather_inputs
_original_unshard = FSDPParamGroup.unshard
_original_wait = FSDPParamGroup.wait_for_unshard


def _all_gather_inputs(self: FSDPParam) -> list[torch.Tensor]:
    staged = self.__dict__.pop("_speedloader_staged_input", None)
    return [staged] if staged is not None else _original_inputs.fget(self)


def _single_rank_shortcut(group: FSDPParamGroup) -> bool:
    result = group._all_gather_result  # the world-size-1 branch leaves an empty placeholder result
    return (result is not None and getattr(result, "all_gather_work", 1) is None
            and not getattr(result, "param_all_gather_input_numels", [1]))


def _unshard(self: FSDPParamGroup, async_op: bool = False):
    pending = self._all_gather_result is not None or self.is_unsharded
    out = _original_unshard(self, async_op)
    if pending or not getattr(self, _FLAG, False) or not _single_rank_shortcut(self):
        return out
    stream = self.comm_ctx.all_gather_copy_in_stream
    stream.wait_stream(torch.cuda.current_stream())  # e.g. a previous reshard of the same memory
    with torch.cuda.stream(stream):
        for fsdp_param in self.fsdp_params:
            fsdp_param._speedloader_staged_input = _original_inputs.fget(fsdp_param)[0]
    self._speedloader_staged_event = stream.record_event()
    return out


def _wait_for_unshard(self: FSDPParamGroup):
    event = self.__dict__.pop("_speedloader_staged_event", None)
    if event is not None:
        compute = torch.cuda.current_stream()
        compute.wait_event(event)
        for fsdp_param in self.fsdp_params:
            staged = fsdp_param.__dict__.get("_speedloader_staged_input")
            if staged is not None:
                staged.record_stream(compute)  # allocated on the copy-in stream, read on compute
    return _original_wait(self)


def enable_single_rank_prefetch(modules: Sequence[nn.Module]) -> None:
    """Lets the FSDP groups of ``modules`` (CUDA, offloaded, one rank) load parameters ahead of use."""
    groups = [g for m in modules for g in fsdp_param_groups_of(m)]
    groups = [g for g in groups if g.device.type == "cuda" and any(p.offload_to_cpu for p in g.fsdp_params)]
    if not groups:
        return
    if FSDPParamGroup.unshard is not _unshard:  # patch the classes once; unmarked groups are unaffected
        FSDPParam.all_gather_inputs = property(_all_gather_inputs)
        FSDPParamGroup.unshard = _unshard
        FSDPParamGroup.wait_for_unshard = _wait_for_unshard
    for group in groups:
        setattr(group, _FLAG, True)
