"""Every private FSDP2 name the seam relies on, listed once, and the check that the installed torch has them.

The lists: ``SYMBOLS`` (classes, an enum, the module global ``foreach_reduce``, each with who uses it and
for what); ``CLASS_ATTRIBUTES`` and ``INSTANCE_ATTRIBUTES`` (what the seam reads or writes on them);
``STATE_GROUP_ATTRIBUTES`` (the state's parameter groups, spelled differently in 2.11 and 2.13);
``SIGNATURES`` (the leading parameters of what the seam replaces or wraps); ``GLOBAL_READS`` (module globals
a function looks up at call time, so that replacing the global reaches it); ``SOURCE_LINES`` (lines of
FSDP2's source whose behaviour a fast path reproduces or intercepts). ``require_fsdp2_internals`` (the first
thing ``apply_speedloader`` does) checks all but the source lines and raises, naming what is missing and
the torch version; ``tests/test_fsdp2_contract.py`` asserts all of them. Nothing here runs at import:
``import fsdp_speedloader`` works on a torch whose internals moved.

The other modules of the seam import FSDP2's private modules only through ``private`` and
``private_module``, on first use.

An attribute that FSDP2 sets on instances (in ``__init__`` or its lazy init) exists on no class; it passes
when FSDP2's own methods of that class read or assign it (or declare it), which a rename would change.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fsdp_speedloader.fsdp2.version import TESTED_TORCH

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard"


@dataclass(frozen=True)
class Private:
    """``name`` (dotted: an attribute of an attribute) in ``module``; ``used_by``: who relies on it, for what."""

    module: str
    name: str
    used_by: str


SYMBOLS: dict[str, Private] = {s.name: s for s in (
    Private(f"{_FULLY_SHARD}._fsdp_param", "FSDPParam",
            "every seam module: FSDP2's per-parameter state; param_transfer patches its all_gather_inputs"),
    Private(f"{_FULLY_SHARD}._fsdp_param", "ShardedState",
            "param_transfer, shards: whether a parameter holds its shard"),
    Private(f"{_FULLY_SHARD}._fsdp_param_group", "FSDPParamGroup",
            "prefetch: patches unshard and wait_for_unshard; groups: a unit's parameters"),
    Private(f"{_FULLY_SHARD}._fsdp_param_group", "FSDPCommContext", "prefetch: FSDP2's all-gather copy-in stream"),
    Private(f"{_FULLY_SHARD}._fsdp_param_group", "foreach_reduce",
            "grad_slots: the module global FSDPParamGroup.post_backward calls, wrapped"),
    Private(f"{_FULLY_SHARD}._fsdp_collectives", "AllGatherResult",
            "prefetch: the placeholder result of a world-size-1 unshard"),
    Private(f"{_FULLY_SHARD}._fsdp_common", "FSDPMeshInfo", "prefetch, shards: the size of a parameter's shard group"),
    Private(f"{_FULLY_SHARD}._fsdp_state", "FSDPState", "groups: the state fully_shard.state returns"),
    Private("torch.distributed.fsdp", "fully_shard.state", "groups: a module's FSDP2 state"),
    Private("torch.distributed.tensor", "DTensor", "shards: a sharded parameter's _local_tensor"),
)}

# Methods, properties, enum members, fields and slots: on the class itself.
CLASS_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "FSDPParam": ("all_gather_inputs", "_sharded_local_tensor", "to_accumulated_grad_if_needed",
                  "accumulate_unsharded_grad_if_needed", "reset_sharded_param", "_setattr_on_modules"),
    "FSDPParamGroup": ("is_unsharded", "unshard", "wait_for_unshard", "post_backward"),
    "AllGatherResult": ("all_gather_work", "param_all_gather_input_numels"),
    "ShardedState": ("SHARDED",),
    "DTensor": ("_local_tensor",),
}

# Set by FSDP2 on instances (in __init__ or its lazy init): declared by, or read or assigned in, its own methods.
INSTANCE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "FSDPParam": ("sharded_param", "_sharded_param_data", "sharded_state", "sharded_size", "padded_sharded_param_size",
                  "fsdp_placement", "_orig_size", "_param_fqn", "offload_to_cpu", "pin_memory", "param_dtype",
                  "device", "mesh_info", "unsharded_accumulated_grad"),
    "FSDPParamGroup": ("fsdp_params", "_all_gather_result", "comm_ctx", "device", "mp_policy", "mesh_info"),
    "FSDPCommContext": ("all_gather_copy_in_stream",),
    "FSDPMeshInfo": ("shard_mesh_size",),
}

# FSDPState's parameter groups: the first of these it has (2.13: a list; 2.11: one group or None).
STATE_GROUP_ATTRIBUTES = ("_fsdp_param_groups", "_fsdp_param_group")

# The leading parameters of what the seam replaces or wraps; its replacements take the same.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "FSDPParamGroup.unshard": ("self", "async_op"),
    "FSDPParamGroup.wait_for_unshard": ("self",),
    "foreach_reduce": ("fsdp_params",),
}

# Module globals a function looks up when it runs: replacing the global (grad_slots) reaches the call.
GLOBAL_READS: dict[str, tuple[str, ...]] = {"FSDPParamGroup.post_backward": ("foreach_reduce",)}

# Lines of FSDP2's source (whitespace ignored) whose behaviour a fast path reproduces or intercepts. Only the
# contract test reads them (an installed torch may lack its sources); at run time each fast path notices
# when FSDP2 does not behave as read, and falls back to FSDP2's own path, counted and warned once.
SOURCE_LINES: dict[str, tuple[str, ...]] = {
    "foreach_reduce": (  # grad_slots: the host copy it lands in a slot, and what FSDP2 does around it
        "to_accumulate_grad = fsdp_param.sharded_param.grad is not None",
        'new_sharded_grad = new_sharded_grad.to(torch.device("cpu"), non_blocking=non_blocking)',
        "fsdp_param.grad_offload_event = post_reduce_stream.record_event()",
    ),
    "FSDPParam.all_gather_inputs": (  # param_transfer: what a transfer copy stands in for
        "sharded_param_data = self._sharded_param_data",
        "sharded_param_data = sharded_param_data.to(self.device, non_blocking=True)",
        "return [_to_dtype_if_needed(sharded_param_data, self.param_dtype)]",
    ),
    "FSDPParamGroup.unshard": (  # prefetch: at world size 1 the unshard loads nothing
        "all_gather_work=None",
        "param_all_gather_input_numels=[]",
    ),
    "FSDPParamGroup.wait_for_unshard": (  # prefetch: the world-size-1 load, on the current stream
        "all_gather_input = fsdp_param.all_gather_inputs[0]",
        "tensor.copy_(all_gather_input)",
    ),
}

_loaded: dict[str, Any] = {}


def _load(spec: Private) -> Any:
    obj = importlib.import_module(spec.module)
    for part in spec.name.split("."):
        obj = getattr(obj, part)
    return obj


def private(name: str) -> Any:
    """FSDP2's private ``name`` (a key of ``SYMBOLS``), imported on first use."""
    try:
        return _loaded[name]
    except KeyError:
        obj = _loaded[name] = _load(SYMBOLS[name])
        return obj


def private_module(name: str) -> types.ModuleType:
    """The module that holds ``name`` (a key of ``SYMBOLS``), e.g. to replace a module global."""
    return importlib.import_module(SYMBOLS[name].module)


def resolve(path: str) -> Any:
    """``"Symbol"`` or ``"Symbol.attribute"`` (keys of the lists above) as FSDP2 defines it: a function the seam
    replaced or wrapped is unwrapped to FSDP2's own (the seam's replacements set ``__wrapped__``)."""
    if path in SYMBOLS:
        obj = _load(SYMBOLS[path])
    else:
        owner_path, attribute = path.rsplit(".", 1)
        owner = resolve(owner_path)
        # From the class's own dict: a property as such, not what it computes.
        obj = vars(owner)[attribute] if inspect.isclass(owner) and attribute in vars(owner) else \
            getattr(owner, attribute)
    if isinstance(obj, property):
        return property(inspect.unwrap(obj.fget)) if obj.fget is not None else obj
    return inspect.unwrap(obj) if callable(obj) and not inspect.isclass(obj) else obj


def _functions(cls: type):
    """FSDP2's (torch's) own functions defined on ``cls`` and its bases, undecorated."""
    for klass in cls.__mro__[:-1]:
        for value in vars(klass).values():
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            func = inspect.unwrap(func) if callable(func) else func
            if isinstance(func, types.FunctionType) and func.__module__.startswith("torch."):
                yield func


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def declares(cls: type, name: str) -> bool:
    """Whether ``cls`` has ``name``, or declares it, or FSDP2's own methods of ``cls`` read or assign it."""
    if hasattr(cls, name) or any(name in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    return any(name in _code_names(func.__code__) for func in _functions(cls))


def _try(path: str) -> Optional[Any]:
    try:
        return resolve(path)
    except (ImportError, AttributeError, KeyError):
        return None


def missing_fsdp2_internals() -> list[str]:
    """What the installed torch lacks of the lists above (but ``SOURCE_LINES``): one line each, naming the
    private name and who uses it; empty when all is there."""
    missing, found = [], {}
    for key, spec in SYMBOLS.items():
        obj = _try(key)
        if obj is None:
            missing.append(f"{spec.module}.{spec.name} (used by {spec.used_by})")
        else:
            found[key] = obj
    for table, present in ((CLASS_ATTRIBUTES, hasattr), (INSTANCE_ATTRIBUTES, declares)):
        for owner, attributes in table.items():
            if owner in found:
                spec = SYMBOLS[owner]
                missing += [f"{spec.module}.{owner}.{a} (used by {spec.used_by})" for a in attributes
                            if not present(found[owner], a)]
    if "FSDPState" in found and not any(declares(found["FSDPState"], a) for a in STATE_GROUP_ATTRIBUTES):
        missing.append(f"{SYMBOLS['FSDPState'].module}.FSDPState.{' or .'.join(STATE_GROUP_ATTRIBUTES)} "
                       "(used by groups: a module's parameter groups)")
    for path, expected in SIGNATURES.items():
        func = _try(path)
        if func is None:
            continue  # reported above
        try:
            names = tuple(inspect.signature(func).parameters)[: len(expected)]
        except (TypeError, ValueError):
            names = ()
        if names != expected:
            missing.append(f"{path}({', '.join(expected)}, ...): torch {torch.__version__} has "
                           f"({', '.join(names)}, ...)")
    for path, globals_read in GLOBAL_READS.items():
        func = _try(path)
        if func is None:
            continue
        for name in globals_read:
            if name in SYMBOLS and name not in found:
                continue  # reported above
            if name not in _code_names(func.__code__) or name not in func.__globals__:
                missing.append(f"{path} calling the module global {name} (used by grad_slots)")
    return missing


def missing_source_lines() -> list[str]:
    """The lines of ``SOURCE_LINES`` that FSDP2's source does not contain (whitespace ignored)."""
    missing = []
    for path, lines in SOURCE_LINES.items():
        obj = resolve(path)
        source = re.sub(r"\s+", "", inspect.getsource(obj.fget if isinstance(obj, property) else obj))
        missing += [f"{path}: {line}" for line in lines if re.sub(r"\s+", "", line) not in source]
    return missing


def require_fsdp2_internals() -> None:
    """Raises ``RuntimeError`` naming each private FSDP2 name the seam relies on that the installed torch lacks."""
    missing = missing_fsdp2_internals()
    if missing:
        raise RuntimeError(
            f"fsdp_speedloader relies on FSDP2 internals that torch {torch.__version__} does not have: "
            + "; ".join(missing) + f". The seam (fsdp_speedloader/fsdp2/) was read against torch "
            f"{', '.join(TESTED_TORCH)}: install a torch in that range, or update the seam and its contract "
            "(fsdp2/contract.py, tests/test_fsdp2_contract.py)")
