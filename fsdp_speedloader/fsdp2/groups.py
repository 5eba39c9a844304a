"""FSDP2's parameter groups and parameters of a module, and the fold of unsharded gradients.

Every other module of the seam (and of the engine) finds FSDP2's groups here: ``fully_shard.state(module)``
and its group attribute, ``_fsdp_param_groups`` (a list, torch 2.13) or ``_fsdp_param_group`` (2.11).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_speedloader.fsdp2.contract import STATE_GROUP_ATTRIBUTES

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def fsdp_param_groups_of(module: nn.Module) -> list[FSDPParamGroup]:
    """The FSDP parameter groups whose state lives on ``module`` (a unit's first module, or the root)."""
    state = fully_shard.state(module)
    if state is None:
        return []
    for name in STATE_GROUP_ATTRIBUTES:
        if hasattr(state, name):
            groups = getattr(state, name)
            return list(groups) if isinstance(groups, (list, tuple)) else ([] if groups is None else [groups])
    raise RuntimeError(f"FSDP2's state of {type(module).__name__} has none of {STATE_GROUP_ATTRIBUTES} "
                       "(see fsdp_speedloader.fsdp2.require_fsdp2_internals)")


def fsdp_params_of(module: nn.Module) -> list[FSDPParam]:
    """The FSDPParams of the groups whose state lives on ``module``."""
    return [p for g in fsdp_param_groups_of(module) for p in g.fsdp_params]


def fsdp_param_groups_under(root: nn.Module) -> list[FSDPParamGroup]:
    """Every FSDP parameter group of ``root`` and its submodules, once each, in module order."""
    out, seen = [], set()
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups_of(module):
                if id(group) not in seen:
                    seen.add(id(group))
                    out.append(group)
    return out


def offloaded_fsdp_params(root: nn.Module) -> list[FSDPParam]:
    """FSDP2's ``FSDPParam`` objects under ``root`` whose shards live on the host (CPU offload)."""
    return [p for g in fsdp_param_groups_under(root) for p in g.fsdp_params if p.offload_to_cpu]


def param_name(fsdp_param: FSDPParam) -> str:
    """The parameter's name from the root, for messages."""
    return getattr(fsdp_param, "_param_fqn", None) or "a parameter"


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
