"""Everything that reaches into FSDP2's private state, in one place.

Each function names the FSDP2 attribute it relies on; all were read in torch 2.11 and 2.13
(``FSDPParamGroup.fsdp_params``, ``FSDPParam.unsharded_accumulated_grad`` and its two helpers,
``FSDPParam.all_gather_inputs``, the world-size-1 branch of ``FSDPParamGroup.unshard`` /
``wait_for_unshard``, the gradient copy to the host in ``foreach_reduce``, and for the parameter
transfer copies ``FSDPParam._sharded_param_data``, ``sharded_param``, ``sharded_state``,
``offload_to_cpu``, ``param_dtype``, ``device`` and ``_sharded_local_tensor``, and for generation on
the local shards ``mesh_info.shard_mesh_size``, ``_orig_size``, ``sharded_state`` and
``_setattr_on_modules``). The state's group attribute is ``_fsdp_param_group`` in 2.11 and
``_fsdp_param_groups`` (a list) in 2.13.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)


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


def move_unoffloaded_shards(model: nn.Module, device: torch.device) -> int:
    """After ``model.to_empty(device=host)``: gives the parameters of FSDP groups that do not offload
    (``offload_root=False``'s root) fresh, uninitialised shards on ``device``; returns how many moved.

    Each parameter keeps its object (``torch.utils.swap_tensors``, as ``nn.Module._apply`` does, so tied
    parameters stay tied and optimizers built later see them), then ``FSDPParam.reset_sharded_param``
    re-reads its local shard, as FSDP2's own ``_apply`` does after ``to_empty``.
    """
    moved = 0
    with torch.no_grad():
        for group in [g for m in model.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups_of(m)]:
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
#
# When every parameter's shard group has one rank, its weights are on the compute device and need no
# cast, FSDP2's unshard copies a tensor that is already whole into its all-gather buffer and out
# again, once per unit per step, behind Python hooks. For generation, where no gradient needs FSDP2's
# bookkeeping, the modules can run on the local shards themselves.


def local_shard_params(model: nn.Module) -> Optional[list[FSDPParam]]:
    """The model's FSDPParams if each local shard IS its whole parameter, on the compute device, in the
    compute dtype (one rank per shard group, not offloaded, no mixed-precision cast); else None."""
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups_of(m)]
    params = []
    for group in groups:  # the group's policy: FSDPParam.param_dtype exists only after FSDP2's lazy init
        for p in group.fsdp_params:
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
    swapped = []
    try:
        for p in fsdp_params:
            if p.sharded_state == ShardedState.SHARDED:
                p._setattr_on_modules(nn.Parameter(p.sharded_param.to_local(), requires_grad=False))
                swapped.append(p)
        yield
    finally:
        for p in swapped:
            p._setattr_on_modules(p.sharded_param)


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
    return [staged] if staged is not None else _unstaged_inputs(self)


def _unstaged_inputs(fsdp_param: FSDPParam) -> list[torch.Tensor]:
    """FSDP2's own ``all_gather_inputs``, or the same tensors read from the parameter's transfer copy."""
    copy = _transfer_source(fsdp_param)
    if copy is None:
        return _original_inputs.fget(fsdp_param)
    return [copy.to(fsdp_param.device, non_blocking=True)]  # already param_dtype: FSDP's cast is a no-op


def _patch_all_gather_inputs() -> None:
    if not isinstance(FSDPParam.__dict__.get("all_gather_inputs"), property) or \
            FSDPParam.all_gather_inputs.fget is not _all_gather_inputs:
        FSDPParam.all_gather_inputs = property(_all_gather_inputs)


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
            fsdp_param._speedloader_staged_input = _unstaged_inputs(fsdp_param)[0]
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
        _patch_all_gather_inputs()
        FSDPParamGroup.unshard = _unshard
        FSDPParamGroup.wait_for_unshard = _wait_for_unshard
    for group in groups:
        setattr(group, _FLAG, True)



# --- offloaded gradients into preplanned host slots -----------------------------------------------
#
# FSDP2's ``foreach_reduce`` (the same lines in torch 2.11 and 2.13) ends, per parameter, with
#
#     to_accumulate_grad = fsdp_param.sharded_param.grad is not None
#     if fsdp_param.offload_to_cpu:
#         non_blocking = fsdp_param.pin_memory and not to_accumulate_grad  # 2.13: and no post-accumulate hook
#         new_sharded_grad = new_sharded_grad.to(torch.device("cpu"), non_blocking=non_blocking)
#         if non_blocking: fsdp_param.grad_offload_event = post_reduce_stream.record_event()
#     if to_accumulate_grad: fsdp_param.sharded_param.grad._local_tensor += new_sharded_grad
#     else: fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(new_sharded_grad)
#
# all on the post-reduce stream, in ``fsdp_params`` order. A non-blocking ``.to("cpu")`` takes a
# fresh page-locked block from the caching host allocator every step, rounded to a power of two.
# For parameters given a slot by ``set_grad_slots``, ``foreach_reduce`` runs under a
# ``TorchFunctionMode`` (thread-local, this call only) that turns exactly that ``.to`` into
# ``slot.copy_(new_sharded_grad, non_blocking=<FSDP's own flag>)`` and returns the slot: FSDP then
# wraps and assigns it as before, and records ``grad_offload_event`` after it on the same stream, so
# FSDP's own wait (``finalize_backward``) and ``OverlappedOptimizer``'s still cover the copy. Only
# when FSDP would create a fresh gradient (``sharded_param.grad is None``): accumulation into an
# existing gradient (which then is the slot) stays FSDP's own path, blocking copy and CPU add.
# The slot is reused only when nothing holds the previous gradient any more (a weak reference to
# the tensor FSDP wrapped); else, and on anything unexpected, FSDP's own path runs, with a warning.

grad_copy_delay_cycles = 0  # tests: GPU clock cycles queued before each gradient copy (exposes missing waits)

_GRAD_SLOT = "_speedloader_grad_slot"
_PATCH_MARK = "_speedloader_grads_into_slots"
_state = threading.local()  # .active: a _GradsIntoSlots mode is running on this thread
_warned: set[str] = set()


class _GradSlot:
    """A parameter's host gradient slot: ``tensor`` (``sharded_size``, the parameter's dtype) and a weak
    reference to the tensor last handed to FSDP as the gradient (None: never, or dead)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.last: Optional[weakref.ref] = None


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _fqn(fsdp_param: FSDPParam) -> str:
    return getattr(fsdp_param, "_param_fqn", None) or "a parameter"


def _is_host_copy(func, args, kwargs) -> bool:
    """``tensor.to(torch.device("cpu"), non_blocking=...)``, the exact form of FSDP2's gradient copy."""
    return (func is torch.Tensor.to and len(args) == 2 and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.device) and args[1].type == "cpu" and set(kwargs) <= {"non_blocking"})


class _GradsIntoSlots(TorchFunctionMode):
    """Lands FSDP2's host copies of the reduce-scattered gradients of ``fsdp_params`` in their slots."""

    def __init__(self, fsdp_params: Sequence[FSDPParam]) -> None:
        super().__init__()
        self._expected = [p for p in fsdp_params if p.offload_to_cpu]  # one host copy each, in this order
        self._next = 0
        self._source_ptr: Optional[int] = None  # every copy reads a view of the one reduce-scatter output

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._next < len(self._expected) and _is_host_copy(func, args, kwargs):
            out = self._land(args[0], bool(kwargs.get("non_blocking", False)))
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _land(self, src: torch.Tensor, non_blocking: bool) -> Optional[torch.Tensor]:
        fsdp_param = self._expected[self._next]
        ptr = src.untyped_storage().data_ptr()
        if tuple(src.shape) != tuple(fsdp_param.sharded_size) or self._source_ptr not in (None, ptr):
            # Not the copy foreach_reduce was read to make: leave this call to FSDP altogether.
            _warn_once("order", "FSDP2's gradient copies are not in the expected order (torch %s); offloaded "
                       "gradients stay in FSDP2's own page-locked blocks", torch.__version__)
            self._next = len(self._expected)
            return None
        self._next += 1
        self._source_ptr = ptr
        slot: Optional[_GradSlot] = fsdp_param.__dict__.get(_GRAD_SLOT)
        if slot is None or fsdp_param.sharded_param.grad is not None:
            return None  # no slot, or FSDP adds to the existing gradient (blocking copy, CPU add)
        if src.dtype != slot.tensor.dtype or src.shape != slot.tensor.shape:
            _warn_once(f"shape:{id(fsdp_param)}", "gradient of %s is %s %s, its host slot %s %s: left to FSDP2",
                       _fqn(fsdp_param), tuple(src.shape), src.dtype, tuple(slot.tensor.shape),
                       slot.tensor.dtype)
            return None
        if slot.last is not None and slot.last() is not None:
            _warn_once(f"held:{id(fsdp_param)}", "the previous gradient of %s is still referenced after "
                       "zero_grad; this step's gradient goes to FSDP2's own (page-locked) memory instead of its "
                       "arena slot (drop references to .grad before the next backward)", _fqn(fsdp_param))
            return None
        out = slot.tensor.view(slot.tensor.shape)  # a new tensor object per step: its liveness is tracked
        if grad_copy_delay_cycles and src.is_cuda:
            torch.cuda._sleep(grad_copy_delay_cycles)
        out.copy_(src, non_blocking=non_blocking)  # on the current (post-reduce) stream, like FSDP's .to
        slot.last = weakref.ref(out)
        return out


def _wrap_foreach_reduce(inner):
    def foreach_reduce(fsdp_params, *args, **kwargs):
        if getattr(_state, "active", False) or not any(_GRAD_SLOT in p.__dict__ for p in fsdp_params):
            return inner(fsdp_params, *args, **kwargs)
        _state.active = True
        try:
            with _GradsIntoSlots(fsdp_params):
                return inner(fsdp_params, *args, **kwargs)
        finally:
            _state.active = False

    setattr(foreach_reduce, _PATCH_MARK, True)
    return foreach_reduce


def set_grad_slots(slots: Sequence[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Makes FSDP2 put the host gradient of each offloaded ``FSDPParam`` into its ``tensor`` (a host tensor
    of the parameter's ``sharded_size`` and dtype, e.g. an arena slot); see the comment above.

    Patches the module global ``foreach_reduce`` of ``torch.distributed.fsdp._fully_shard._fsdp_param_group``
    (what ``FSDPParamGroup.post_backward`` calls, with ``fsdp_params`` first, in 2.11 and 2.13) once;
    parameters without a slot are unaffected. Reads ``FSDPParam.offload_to_cpu``, ``sharded_size``,
    ``sharded_param.grad``; a re-plan calls it again with the new slots (a gradient still in an old slot
    stays valid: it keeps the old memory alive).
    """
    if not getattr(_fsdp_param_group.foreach_reduce, _PATCH_MARK, False):
        _fsdp_param_group.foreach_reduce = _wrap_foreach_reduce(_fsdp_param_group.foreach_reduce)
    for fsdp_param, tensor in slots:
        if tuple(tensor.shape) != tuple(fsdp_param.sharded_size) or tensor.device.type != "cpu":
            raise ValueError(f"gradient slot of {_fqn(fsdp_param)}: {tuple(tensor.shape)} on {tensor.device}; "
                             f"FSDP2 needs {tuple(fsdp_param.sharded_size)} on the host")
        fsdp_param.__dict__[_GRAD_SLOT] = _GradSlot(tensor)


def grad_slot_of(fsdp_param: FSDPParam) -> Optional[torch.Tensor]:
    """The host slot FSDP2 writes ``fsdp_param``'s gradient into, or None."""
    slot = fsdp_param.__dict__.get(_GRAD_SLOT)
    return None if slot is None else slot.tensor


# --- parameters transferred in the compute dtype --------------------------------------------------
#
# With CPU offload, FSDP2's ``all_gather_inputs`` (SHARDED state, no tensor-subclass extension; the
# same lines in torch 2.11 and 2.13), read by the all-gather and by the world-size-1 branch alike, is
#
#     sharded_param_data = self._sharded_param_data
#     if self.offload_to_cpu: sharded_param_data = sharded_param_data.to(self.device, non_blocking=True)
#     return [_to_dtype_if_needed(sharded_param_data, self.param_dtype)]
#
# i.e. the fp32 shard crosses to the device (4 B/param) and is cast there. For a parameter given a
# transfer copy by ``set_param_transfer`` (a host tensor of the padded shard in ``param_dtype``, e.g. an
# arena slot), the patched property copies that copy instead (2 B/param for bf16), and FSDP's cast has
# nothing left to do. Same bits: the host cast rounds to nearest even, as the device's does.
#
# Never stale. A copy records what it was cast from: the ``_sharded_param_data`` and ``sharded_param``
# objects and their version counters (``_version``; in-place writes through ``sharded_param``, e.g.
# ``load_state_dict``, bump the DTensor's counter, writes through ``to_local()`` the shard's). torch.optim's
# foreach and fused AdamW update a DTensor's local tensor without bumping either counter (measured on
# torch 2.13), so a global optimizer step post-hook also marks the copies of every parameter a torch.optim
# optimizer stepped. A copy that is not fresh when FSDP reads it is refreshed right there, synchronously
# (correct, slow: the cast lands on the unshard's critical path); the fast path is
# ``refresh_param_transfer`` right after the step (``OverlappedOptimizer``'s worker, unit by unit).
# Writers outside both must call ``refresh_param_transfer(..., force=True)``: an optimizer that is not a
# ``torch.optim.Optimizer`` and bumps no counter, and ``torch.distributed.checkpoint.load`` straight into
# ``model.state_dict()`` (it bumps no counter either, measured on 2.13; loading through
# ``set_model_state_dict`` / ``load_state_dict`` is seen).

_TRANSFER = "_speedloader_transfer_copy"
_by_param: dict[int, weakref.ref] = {}  # id(sharded_param) -> its FSDPParam, for the step post-hook
_hook_handle = None


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


_logged_slow = False
num_stale_transfer_casts = 0  # copies refreshed on the unshard path (the slow path), since import


def _transfer_source(fsdp_param: FSDPParam) -> Optional[torch.Tensor]:
    """The fresh transfer copy FSDP2 should copy to the device instead of ``_sharded_param_data``, or None."""
    global _logged_slow, num_stale_transfer_casts
    copy: Optional[_TransferCopy] = fsdp_param.__dict__.get(_TRANSFER)
    if (copy is None or fsdp_param.sharded_state != ShardedState.SHARDED or not fsdp_param.offload_to_cpu
            or hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
            or copy.tensor.dtype != fsdp_param.param_dtype
            or copy.tensor.numel() != fsdp_param._sharded_param_data.numel()):
        return None
    if not copy.fresh(fsdp_param):
        if not _logged_slow:
            _logged_slow = True
            log.debug("transfer copy of %s is stale when FSDP2 loads it: cast on the unshard path (call "
                      "refresh_param_transfer after the optimizer step to take the cast off it)", _fqn(fsdp_param))
        copy.refresh(fsdp_param)
        num_stale_transfer_casts += 1
    return copy.tensor


def set_param_transfer(copies: Sequence[tuple[FSDPParam, torch.Tensor]]) -> None:
    """Makes FSDP2 copy each offloaded ``FSDPParam``'s ``tensor`` to the device instead of its fp32 shard.

    ``tensor``: a 1-D host tensor of the padded shard's numel in the parameter's ``param_dtype`` (e.g. an
    arena slot); it is cast from ``_sharded_param_data`` here and whenever it is stale (see the comment
    above). Patches ``FSDPParam.all_gather_inputs`` (class-wide, once; parameters without a copy keep
    FSDP2's own) and registers one global optimizer step post-hook.
    """
    global _hook_handle
    for fsdp_param, tensor in copies:
        data = fsdp_param._sharded_param_data
        if (tensor.device.type != "cpu" or tensor.dim() != 1 or tensor.numel() != data.numel()
                or tensor.dtype != fsdp_param.param_dtype):
            raise ValueError(f"transfer copy of {_fqn(fsdp_param)}: {tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}; FSDP2 needs ({data.numel()},) {fsdp_param.param_dtype} on the host")
    _patch_all_gather_inputs()
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
