"""Host memory of one rank by tier, planned from the model's shapes before anything is allocated (design §13).

Tiers, per rank, with parameters offloaded (``offload_params``):

    param_shards      the fp32 parameter shards (FSDP2's padded shards), in the pinned arena
    grads             their gradients: a slot per parameter (the exact shard), or R regions of the largest unit's
                      gradients (in-flight slots, ``OverlappedOptimizer`` without clipping) plus the root's slots
    optimizer_states  AdamW's two moments of every host-resident shard: 8 B/param fp32, 4 bf16, ~2 int8 (pageable)
    activations       the block-boundary activations of all N sub-batches (host activation store only)
    param_transfer    the bf16 transfer copies of the shards (``param_transfer_dtype``)
    checkpoint_staging  an asynchronous checkpoint's host copy of this rank's whole state (parameters and optimizer
                      states, device-resident ones too), held while the save is written

``plan_host_memory`` adds them up from shard sizes (no model, no allocation); ``check_host_plan`` refuses a plan over
the host budget in one line that names what each option would free. The trainer calls both before the model is
materialised; ``tools/arena_report.py`` prints the tiers per mode. The arena itself checks its own slots again,
to the byte, when it is built at the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from fsdp_speedloader.memory.arena import ALIGNMENT, GIB, LIMIT_ENV, HostMemoryBudget
from fsdp_speedloader.memory.compressed_adamw import num_state_bytes

TIERS = ("param_shards", "grads", "optimizer_states", "activations", "param_transfer", "checkpoint_staging")
ARENA_TIERS = ("param_shards", "grads", "activations", "param_transfer")  # page-locked; the states are pageable

Shard = tuple[int, int]
"""(padded, local) element counts of one parameter's shard on this rank: FSDP2 pads every rank's shard to
``ceil(dim 0 / shards)`` rows; the gradient and the optimizer state hold the rank's own rows only."""


def shard_numels(shape: Sequence[int], shards: int, rank: int = 0) -> Shard:
    """``shape``'s FSDP2 ``Shard(0)`` shard on ``rank`` of ``shards`` (torch.chunk's split): (padded, local)."""
    if len(shape) == 0:
        return 1, 1
    rest = math.prod(shape[1:])
    rows = -(-shape[0] // shards)
    mine = max(0, min(rows, shape[0] - rank * rows))
    return rows * rest, mine * rest


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class HostPlan:
    """Host bytes of one rank by tier (``TIERS``) and the parameters whose states this rank keeps on the host."""

    param_shards: int
    grads: int
    optimizer_states: int
    activations: int
    param_transfer: int
    num_params: int
    checkpoint_staging: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TIERS)

    @property
    def arena(self) -> int:
        """The page-locked part (everything but the optimizer states)."""
        return sum(getattr(self, t) for t in ARENA_TIERS)

    def by_tier(self) -> dict[str, int]:
        return {t: getattr(self, t) for t in TIERS}

    def bytes_per_param(self) -> dict[str, float]:
        """Each tier, and the total, per host-resident parameter."""
        n = max(1, self.num_params)
        return {**{t: getattr(self, t) / n for t in TIERS}, "total": self.total / n}

    def describe(self) -> str:
        names = {"param_shards": "parameter shards", "grads": "gradients", "optimizer_states": "optimizer states",
                 "activations": "activations", "param_transfer": "transfer copies",
                 "checkpoint_staging": "checkpoint staging copy"}
        return ", ".join(f"{names[t]} {getattr(self, t) / GIB:.2f}" for t in TIERS if getattr(self, t))


def plan_host_memory(*, units: Sequence[Sequence[Shard]], root: Sequence[Shard], root_on_host: bool = True,
                     grad_slots_in_flight: int = 0, state_dtype: str = "fp32", activation_bytes: int = 0,
                     transfer_itemsize: int = 0, param_itemsize: int = 4, checkpoint_staging_bytes: int = 0
                     ) -> HostPlan:
    """The tiers of one rank whose parameters are offloaded.

    Args:
        units: each unit's parameter shards (``shard_numels``), in unit order.
        root: the root's (embeddings, final norm, LM head); on the host only with ``root_on_host``.
        grad_slots_in_flight: R > 0: the units' gradients in min(R, units) regions of the largest unit's
            (in-flight slots); 0: a slot per parameter.
        state_dtype: AdamW's moments (``compressed_adamw.STATE_DTYPES``).
        activation_bytes: the host activation store's slots (0 when the activations stay on the device).
        transfer_itemsize: bytes per element of the transfer copies (2 for bf16; 0: none).
        param_itemsize: bytes per element of the parameter shards and gradients (4: fp32).
        checkpoint_staging_bytes: an asynchronous checkpoint's staging copy (:func:`checkpoint_staging_bytes`).
    """
    host_root = list(root) if root_on_host else []
    shards = [s for unit in units for s in unit] + host_root
    grad_bytes = [[_aligned(local * param_itemsize) for _, local in unit if local] for unit in units]
    if grad_slots_in_flight:
        unit_grads = min(grad_slots_in_flight, len(units)) * max((sum(g) for g in grad_bytes), default=0)
    else:
        unit_grads = sum(sum(g) for g in grad_bytes)
    root_grads = sum(_aligned(local * param_itemsize) for _, local in host_root if local)
    return HostPlan(param_shards=sum(_aligned(p * param_itemsize) for p, _ in shards),
                    grads=unit_grads + root_grads,
                    optimizer_states=sum(num_state_bytes(local, state_dtype) for _, local in shards),
                    activations=_aligned(activation_bytes) if activation_bytes else 0,
                    param_transfer=sum(_aligned(p * transfer_itemsize) for p, _ in shards) if transfer_itemsize
                    else 0,
                    num_params=sum(local for _, local in shards), checkpoint_staging=checkpoint_staging_bytes)


def checkpoint_staging_bytes(shards: Sequence[Shard], *, state_dtype: str = "fp32", param_itemsize: int = 4) -> int:
    """Host bytes of an asynchronous checkpoint's staging copy on one rank: every parameter shard it saves
    (``shards``: all of them, device-resident or not) at ``param_itemsize`` and its optimizer states."""
    return sum(local * param_itemsize + num_state_bytes(local, state_dtype) for _, local in shards)


Saving = tuple[str, int]
"""(the setting to change, the host bytes it frees)."""


def check_host_plan(plan: HostPlan, budget: HostMemoryBudget, *, savings: Sequence[Saving] = (), hint: str = ""
                    ) -> None:
    """``ValueError`` in one line when the plan exceeds the budget: every tier, the budget, and each setting that
    frees host memory with the GiB it frees (largest first; those that alone make the plan fit are marked)."""
    if plan.total <= budget.available_bytes:
        return
    over = plan.total - budget.available_bytes
    ranked = sorted((s for s in savings if s[1] > 0), key=lambda s: -s[1])
    options = "; ".join(f"{setting} frees {freed / GIB:.2f} GiB{' (enough)' if freed >= over else ''}"
                        for setting, freed in ranked)
    raise ValueError(
        f"the pinned host arena needs {plan.arena / GIB:.2f} GiB and the optimizer states "
        f"{plan.optimizer_states / GIB:.2f} GiB more: {plan.total / GIB:.2f} GiB of host memory ({plan.describe()} "
        f"GiB; {plan.total / max(1, plan.num_params):.2f} B per parameter), {over / GIB:.2f} GiB over: "
        f"{budget.describe()}. {('What frees host memory: ' + options + '. ') if options else ''}"
        f"{hint + '. ' if hint else ''}If this machine has more host memory than it reports, set {LIMIT_ENV}")


def savings_of(plan: HostPlan, alternatives: Sequence[tuple[str, Union[HostPlan, int, None]]]) -> list[Saving]:
    """(setting, bytes freed) of each alternative: another plan (freed = the difference in total) or bytes."""
    out = []
    for setting, alt in alternatives:
        if alt is None:
            continue
        freed = plan.total - alt.total if isinstance(alt, HostPlan) else int(alt)
        if freed > 0:
            out.append((setting, freed))
    return out


def with_tier(plan: HostPlan, **tiers: int) -> HostPlan:
    """``plan`` with some tiers replaced (e.g. no activations)."""
    return replace(plan, **tiers)


def largest_model_fitting(budget_bytes: int, bytes_per_param: float, fixed_bytes: int = 0) -> Optional[int]:
    """Parameters that fit ``budget_bytes`` at ``bytes_per_param`` after ``fixed_bytes`` (None: none)."""
    room = budget_bytes - fixed_bytes
    return int(room / bytes_per_param) if room > 0 and bytes_per_param > 0 else None
