"""The seam: everything that reaches into FSDP2's private state, and its contract.

Read against torch >=2.11, <2.14 (``version.TESTED_TORCH``; another torch warns once, ``check_torch_version``).
Every private name, signature and source line the seam relies on is listed in ``contract.py``;
``require_fsdp2_internals`` checks them and ``apply_speedloader`` calls it first, so a missing one fails
there, named with the torch version, not in the middle of a step. FSDP2's private modules are imported only
when first used, never by ``import fsdp_speedloader``.

    groups.py          a module's FSDP2 parameter groups and parameters; the fold of unsharded gradients
    prefetch.py        one rank per shard group: parameter loads staged on FSDP2's copy-in stream
    grad_slots.py      offloaded gradients copied into host slots (a TorchFunctionMode around foreach_reduce),
                       one per parameter or a ring of regions for the units in flight
    param_transfer.py  parameters transferred in the compute dtype (the patched all_gather_inputs)
    shards.py          shards moved into the arena or onto the device; generation on the local shards
    counters.py        how often each fast path engaged or fell back: ``fast_path_stats()``

A fast path that cannot engage runs FSDP2's own path (slower, correct), counts the fallback and warns once.
"""

from fsdp_speedloader.fsdp2.contract import missing_fsdp2_internals, require_fsdp2_internals
from fsdp_speedloader.fsdp2.counters import fast_path_stats
from fsdp_speedloader.fsdp2.grad_slots import GradRing, grad_ring_layout, grad_ring_of, grad_slot_of, set_grad_ring, \
    set_grad_slots
from fsdp_speedloader.fsdp2.groups import fold_unsharded_grads, fsdp_param_groups_of, fsdp_param_groups_under, \
    fsdp_params_of, offloaded_fsdp_params
from fsdp_speedloader.fsdp2.param_transfer import param_transfer_of, refresh_param_transfer, set_param_transfer
from fsdp_speedloader.fsdp2.prefetch import enable_single_rank_prefetch
from fsdp_speedloader.fsdp2.shards import bind_fsdp_grads_to_arena, bind_fsdp_param_transfer, local_shard_params, \
    move_fsdp_shards_into_arena, move_unoffloaded_shards, plan_fsdp_grads, plan_fsdp_param_transfer, \
    plan_fsdp_shards, run_on_local_shards
from fsdp_speedloader.fsdp2.version import TESTED_TORCH, check_torch_version, is_tested_torch

__all__ = [
    "GradRing", "TESTED_TORCH", "grad_ring_layout", "grad_ring_of", "set_grad_ring", "bind_fsdp_grads_to_arena", "bind_fsdp_param_transfer", "check_torch_version",
    "enable_single_rank_prefetch", "fast_path_stats", "fold_unsharded_grads", "fsdp_param_groups_of",
    "fsdp_param_groups_under", "fsdp_params_of", "grad_slot_of", "is_tested_torch", "local_shard_params",
    "missing_fsdp2_internals", "move_fsdp_shards_into_arena", "move_unoffloaded_shards", "offloaded_fsdp_params",
    "param_transfer_of", "plan_fsdp_grads", "plan_fsdp_param_transfer", "plan_fsdp_shards", "refresh_param_transfer",
    "require_fsdp2_internals", "run_on_local_shards", "set_grad_slots", "set_param_transfer",
]
