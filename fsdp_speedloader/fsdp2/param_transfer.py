"""Parameters transferred in the compute dtype, and the one patched read of a parameter's unshard input.

With CPU offload, FSDP2's ``FSDPParam.all_gather_inputs`` (SHARDED state, no tensor-subclass extension),
read by the all-gather and by the world-size-1 branch of ``wait_for_unshard`` alike, is

    sharded_param_data = self._sharded_param_data
    if self.offload_to_cpu: sharded_param_data = sharded_param_data.to(self.device, non_blocking=True)
    return [_to_dtype_if_needed(sharded_param_data, self.param_dtype)]

i.e. the fp32 shard crosses to the device (4 B/param) and is cast there. For a parameter given a transfer
copy by ``set_param_transfer`` (a host tensor of the padded shard in ``param_dtype``, e.g. an arena slot),
the patched property copies that copy instead (2 B/param for bf16), and FSDP's cast has nothing left to
do. Same bits: the host cast rounds to nearest even, as the device's does.

The patched property is also where a staged input waits (``STAGED_INPUT``, put there by ``prefetch.py``):
FSDP2 reads it instead of loading the parameter again. So the property lives here, below ``prefetch.py``,
which stages what ``unstaged_inputs`` returns.

Never stale. A copy records what it was cast from: the ``_sharded_param_data`` and ``sharded_param``
objects and their version counters (``_version``; in-place writes through ``sharded_param``, e.g.
``load_state_dict``, bump the DTensor's counter, writes through ``to_local()`` the shard's). torch.optim's
foreach and fused AdamW update a DTensor's local tensor without bumping either counter, so a global optimizer
step post-hook also marks the copies of every parameter a torch.optim optimizer stepped. A copy that is not
fresh when FSDP reads it is refreshed right there, synchronously (correct, slow: the cast lands on the
unshard's critical path; counted in ``num_stale_transfer_casts``); the fast path is
``refresh_param_transfer`` right after the step (``OverlappedOptimizer``'s worker, unit by unit). Writers
outside both must call ``refresh_param_transfer(..., force=True)``: an optimizer that is not a
``torch.optim.Optimizer`` and bumps no counter, and ``torch.distributed.checkpoint.load`` straight into
``model.state_dict()`` (it bumps no counter either; loading through ``set_model_state_dict`` /
``load_state_dict`` is seen).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_speedloader.fsdp2.contract import private
from fsdp_speedloader.fsdp2.counters import COUNTERS, fall_back
from fsdp_speedloader.fsdp2.groups import param_name

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

log = logging.getLogger(__name__)

STAGED_INPUT = "_speedloader_staged_input"  # FSDPParam.__dict__ key: a device input staged ahead of use
_TRANSFER = "_speedloader_transfer_copy"
_original_inputs: Optional[property] = None  # FSDP2's own FSDPParam.all_gather_inputs, kept when patching
_by_param: dict[int, weakref.ref] = {}  # id(sharded_param) -> its FSDPParam, for the step post-hook
_hook_handle = None
_logged_slow = False


# --- the patched FSDPParam.all_gather_inputs -------------------------------------------------------


def _all_gather_inputs(self: FSDPParam) -> list[torch.Tensor]:
    staged = self.__dict__.pop(STAGED_INPUT, None)
    return [staged] if staged is not None else unstaged_inputs(self)


def unstaged_inputs(fsdp_param: FSDPParam) -> list[torch.Tensor]:
    """FSDP2's own ``all_gather_inputs``, or the same tensors read from the parameter's transfer copy."""
    copy = _transfer_source(fsdp_param)
    if copy is None:
        return _original_inputs.fget(fsdp_param)
    return [copy.to(fsdp_param.device, non_blocking=True)]  # already param_dtype: FSDP's cast is a no-op


def patch_all_gather_inputs() -> None:
    """Replaces ``FSDPParam.all_gather_inputs`` (class-wide, once); parameters with neither a staged input
    nor a transfer copy read FSDP2's own."""
    global _original_inputs
    fsdp_param_cls = private("FSDPParam")
    current = fsdp_param_cls.__dict__.get("all_gather_inputs")
    if isinstance(current, property) and current.fget is _all_gather_inputs:
        return
    if not isinstance(current, property):
        raise RuntimeError(f"FSDPParam.all_gather_inputs is not a property in torch {torch.__version__} "
                           "(see fsdp_speedloader.fsdp2.require_fsdp2_internals)")
    _original_inputs = current
    _all_gather_inputs.__wrapped__ = current.fget  # the contract reads FSDP2's own through it
    fsdp_param_cls.all_gather_inputs = property(_all_gather_inputs)


# --- transfer copies -------------------------------------------------------------------------------


class _TransferCopy:
    """A parameter's host copy in the transfer dtype, and what it was last cast from."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # (padded shard numel,), the compute dtype
        self.stamp: Optional[tuple] = None  # (ref to _sharded_param_data, ref to sharded_param, their versions)
        self.dirty = True  # an optimizer stepped the parameter since the last refresh

    def fresh(self, fsdp_param: FSDPParam) -> bool:
        if self.dirty or self.stamp is None:
            return False
        data_ref, param_ref, versions = self.stamp
        data, param = fsdp_param._sharded_param_data, fsdp_param.sharded_param
        return data_ref() is data and param_ref() is param and versions == (data._version, param._version)

    @torch.no_grad()
    def refresh(self, fsdp_param: FSDPParam) -> None:
        data, param = fsdp_param._sharded_param_data, fsdp_param.sharded_param
        self.dirty = False  # first: a step that starts after this line marks the copy again
        self.stamp = (weakref.ref(data), weakref.ref(param), (data._version, param._version))
        self.tensor.copy_(data)  # the cast, round to nearest even
        _by_param[id(param)] = weakref.ref(fsdp_param)


def _mark_stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global ``torch.optim`` step post-hook: the stepped parameters' copies are stale."""
    if not _by_param:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            ref = _by_param.get(id(param))
            fsdp_param = ref() if ref is not None else None
            if fsdp_param is not None and fsdp_param.sharded_param is param:
                copy = fsdp_param.__dict__.get(_TRANSFER)
                if copy is not None:
                    copy.dirty = True


def _unusable(copy: _TransferCopy, fsdp_param: FSDPParam) -> Optional[str]:
    """Why FSDP2 must read its own shard although the parameter has a copy, or None."""
    if fsdp_param.sharded_state != private("ShardedState").SHARDED:
        return f"it is in state {fsdp_param.sharded_state} (FSDP2 then reads its post-forward shard)"
    if not fsdp_param.offload_to_cpu:
        return "it is not offloaded"
    if hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
        return "its shard is a tensor subclass with its own all-gather input (fsdp_pre_all_gather)"
    if copy.tensor.dtype != fsdp_param.param_dtype or copy.tensor.numel() != fsdp_param._sharded_param_data.numel():
        return (f"its copy is ({copy.tensor.numel()},) {copy.tensor.dtype}, its shard "
                f"({fsdp_param._sharded_param_data.numel()},) in {fsdp_param.param_dtype}")
    return None


def _transfer_source(fsdp_param: FSDPParam) -> Optional[torch.Tensor]:
    """The fresh transfer copy FSDP2 should copy to the device instead of ``_sharded_param_data``, or None."""
    global _logged_slow
    copy: Optional[_TransferCopy] = fsdp_param.__dict__.get(_TRANSFER)
    if copy is None:
        return None
    reason = _unusable(copy, fsdp_param)
    if reason is not None:
        fall_back("num_param_transfer_fallbacks", "param_transfer:unusable", log,
                  "the transfer copy of %s is not used: %s; FSDP2 loads its own fp32 shard", param_name(fsdp_param),
                  reason)
        return None
    if not copy.fresh(fsdp_param):
        if not _logged_slow:
            _logged_slow = True
            log.debug("transfer copy of %s is stale when FSDP2 loads it: cast on the unshard path (call "
                      "refresh_param_transfer after the optimizer step to take the cast off it)",
                      param_name(fsdp_param))
        copy.refresh(fsdp_param)
        COUNTERS.num_stale_transfer_casts += 1
    COUNTERS.num_param_transfers += 1
    return copy.tensor


def set_param_transfer(copies: Sequence[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Makes FSDP2 copy each offloaded ``FSDPParam``'s ``tensor`` to the device instead of its fp32 shard.

    ``tensor``: a 1-D host tensor of the padded shard's numel in the parameter's ``param_dtype`` (e.g. an
    arena slot); it is cast from ``_sharded_param_data`` here and whenever it is stale (see the module
    docstring). Patches ``FSDPParam.all_gather_inputs`` (class-wide, once; parameters without a copy keep
    FSDP2's own) and registers one global optimizer step post-hook.
    """
    global _hook_handle
    for fsdp_param, tensor in copies:
        data = fsdp_param._sharded_param_data
        if (tensor.device.type != "cpu" or tensor.dim() != 1 or tensor.numel() != data.numel()
                or tensor.dtype != fsdp_param.param_dtype):
            raise ValueError(f"transfer copy of {param_name(fsdp_param)}: {tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}; FSDP2 needs ({data.numel()},) {fsdp_param.param_dtype} on the host")
    patch_all_gather_inputs()
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_post_hook(_mark_stepped)
    for fsdp_param, tensor in copies:
        copy = _TransferCopy(tensor)
        copy.refresh(fsdp_param)
        fsdp_param.__dict__[_TRANSFER] = copy


def refresh_param_transfer(fsdp_params: Sequence[FSDPParam], *, force: bool = False) -> int:
    """Casts the stale transfer copies of ``fsdp_params`` (all with ``force``); returns how many were cast."""
    cast = 0
    for fsdp_param in fsdp_params:
        copy = fsdp_param.__dict__.get(_TRANSFER)
        if copy is not None and (force or not copy.fresh(fsdp_param)):
            copy.refresh(fsdp_param)
            cast += 1
    return cast


def param_transfer_of(fsdp_param: FSDPParam) -> Optional[torch.Tensor]:
    """The host copy FSDP2 transfers for ``fsdp_param`` (its ``param_dtype``), or None."""
    copy = fsdp_param.__dict__.get(_TRANSFER)
    return None if copy is None else copy.tensor
