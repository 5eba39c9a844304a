"""``schedule=auto``'s second candidate: the canonical schedule with the whole model gathered for the step.

Layer-major saves parameter loads: each unit crosses to the GPU once per direction for all N sub-batches, where
FSDP2's gradient accumulation gathers it again for every micro-batch. That saving is gone when the GPU budget holds
the whole model gathered (``schedule.reshard_after_forward=false``: one all-gather per unit per step) beside one
micro-batch's activations: then the canonical schedule loads each unit once per step too, and it holds one
micro-batch's activations where layer-major holds the whole batch's and recomputes every (unit, sub-batch) pair it
does not keep. There the canonical schedule can step faster (docs/results.md, the regime map's 13B-width 40 GiB
point); layer-major still wins its overlapped host optimizer step back, so which is faster is measured, not assumed:

1. layer-major's plan (``tuning.tune``) with N = 1 is the canonical order already: nothing to compare.
2. If the budget cannot hold the model's unsharded parameters and gradients (2 x parameters x param_dtype bytes on
   every rank), the canonical candidate cannot gather once: layer-major, without a trial.
3. Else a throw-away canonical copy (no recompute, gathered once, gradients reduce-scattered after the last
   micro-batch, the run's optimizer without the overlap, the plan's GPU-resident units) runs one step of two
   micro-batches at m = 1 and m = 2; peak GPU memory is linear in m (as the tuner's): the largest m dividing the
   plan's batch whose predicted peak fits the budget less the margin.
4. Both candidates run the plan's whole batch, two timed steps each after a warm-up; the faster (the better of its
   two steps) wins; layer-major unless the canonical step is ``MARGIN`` shorter (single steps are noisy, and the
   layer-major plan is the one the tuner sized for the host).

Multi-rank: every rank runs the trials; times and memory are maxima over the ranks, so all ranks choose alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_speedloader.app.config import auto_unset, TrainConfig
from fsdp_speedloader.tuning.fit import GIB
from fsdp_speedloader.tuning.plan import TunePlan
from fsdp_speedloader.tuning.trial import reduce_over_ranks, release_memory

log = logging.getLogger(__name__)

MARGIN = 0.02
"""The canonical candidate must step at least this much faster than layer-major's plan to be chosen."""

TRIAL_MICRO_BATCHES = (1, 2)
"""The two micro-batch sizes whose peaks give the canonical candidate's memory line."""


@dataclass(frozen=True)
class ScheduleChoice:
    """Which schedule ``schedule=auto`` runs, and why."""

    name: str
    """'speedloader' (the tuner's layer-major plan) or 'canonical' (gradient accumulation, gathered once)."""
    reason: str
    sub_batch_size: int = 0
    """The canonical candidate's micro-batch m (0: no canonical candidate fitted, or none was tried)."""
    speedloader_step_s: float = 0.0
    """Layer-major's plan: the better of two timed steps of the whole batch (0: not timed)."""
    canonical_step_s: float = 0.0
    """The canonical candidate at m: the same (0: not timed)."""
    canonical_predicted_gpu_bytes: int = 0
    """The candidate's predicted peak GPU memory at m (reserved on CUDA)."""


def faster(speedloader_s: float, canonical_s: float, margin: float = MARGIN) -> str:
    """The schedule to run from two measured step times of the same batch: 'canonical' only when it is more than
    ``margin`` shorter."""
    return "canonical" if canonical_s * (1.0 + margin) < speedloader_s else "speedloader"


def gathered_bytes(num_params: int, param_dtype: torch.dtype) -> int:
    """GPU bytes of the whole model's unsharded parameters and their unsharded gradients (``gradient_sync=last``
    accumulates them there), on every rank."""
    return 2 * num_params * torch.empty((), dtype=param_dtype).element_size()


def largest_micro_batch(batch: int, peaks: dict[int, float], target_bytes: float,
                        cap: Optional[int] = None) -> tuple[int, float]:
    """The largest m dividing ``batch`` (and at most ``cap``) whose peak, linear in m through the two measured
    ``peaks`` ({m: bytes}), stays within ``target_bytes``; (0, the peak at m = 1) when none does."""
    (m1, p1), (m2, p2) = sorted(peaks.items())
    slope = (p2 - p1) / (m2 - m1)
    for m in sorted((d for d in range(1, min(batch, cap or batch) + 1) if batch % d == 0), reverse=True):
        predicted = p1 + slope * (m - m1)
        if predicted <= target_bytes:
            return m, predicted
    return 0, p1 + slope * (1 - m1)


def canonical_config(cfg: TrainConfig, plan: TunePlan, micro_batch: int) -> TrainConfig:
    """``cfg`` running the plan's batch on the canonical schedule: ``micro_batch`` sequences per micro-batch, no
    recompute, the model gathered once per step, gradients reduce-scattered after the last micro-batch, the plan's
    GPU-resident units; the host optimizer steps after the backward (its overlap is layer-major's). Raises
    ValueError where a setting of ``cfg`` applies to layer-major only."""
    schedule = dataclasses.replace(
        cfg.schedule, name="canonical", sub_batch_size=micro_batch, num_sub_batches=plan.batch_size // micro_batch,
        blocks_per_unit=plan.blocks_per_unit, activation_checkpointing=False, activation_checkpointing_every=1,
        gradient_sync="last", reshard_after_forward=False, keep_activations=0, **auto_unset())
    optim = dataclasses.replace(cfg.optim, overlap_with_backward=False, worker_affinity=False)
    offload = dataclasses.replace(cfg.offload, device_units=plan.device_units)
    return dataclasses.replace(cfg, schedule=schedule, optim=optim, offload=offload)


def choose_schedule(cfg: TrainConfig, plan: TunePlan, planned: TrainConfig, *, mesh: DeviceMesh,
                    param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                    max_micro_batch: Optional[int] = None) -> ScheduleChoice:
    """Layer-major's ``plan`` or the canonical candidate, whichever steps the plan's batch faster (module
    docstring). ``cfg`` is the run's (``schedule.name=auto``), ``planned`` the same running the plan
    (``planning.planned_config``); ``max_micro_batch`` caps m as the tuner's cap on n capped the plan
    (``schedule.max_sub_batch_size``, or on a CPU the configured sub-batch)."""
    from fsdp_speedloader.models import build_model

    if plan.num_sub_batches == 1:
        return ScheduleChoice("speedloader", "N = 1: each unit is loaded once per direction for the whole batch "
                                             "already (the canonical order)")
    if cfg.optim.master_dtype != "fp32":
        return ScheduleChoice("speedloader", f"optim.master_dtype={cfg.optim.master_dtype}: the canonical candidate "
                                             "is tried with fp32 master weights only")
    try:
        candidate = canonical_config(cfg, plan, 1)
    except ValueError as e:
        return ScheduleChoice("speedloader", f"the canonical candidate does not take this run's settings: {e}")
    num_params = sum(p.numel() for p in build_model(cfg.model, device="meta").parameters())
    need = gathered_bytes(num_params, param_dtype)
    if need > plan.gpu_target_bytes:
        return ScheduleChoice("speedloader", f"the model gathered (parameters and gradients, {need / GIB:.1f} GiB) "
                                             f"does not fit the GPU budget less the margin "
                                             f"({plan.gpu_target_bytes / GIB:.1f} GiB): layer-major loads less")
    start = time.perf_counter()
    with torch.random.fork_rng(devices=_rng_devices(mesh)):
        trial = _CanonicalTrial(candidate, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        try:
            peaks = trial.peaks()
            m, predicted = largest_micro_batch(plan.batch_size, peaks, plan.gpu_target_bytes, max_micro_batch)
            if m == 0:
                return ScheduleChoice("speedloader", f"the canonical candidate does not fit the GPU budget less the "
                                                     f"margin ({plan.gpu_target_bytes / GIB:.1f} GiB) even at one "
                                                     f"sequence per micro-batch (predicted {predicted / GIB:.1f} GiB)",
                                      canonical_predicted_gpu_bytes=int(predicted))
            canonical_s = _best_of_two(lambda: trial.step(m, plan.batch_size // m))
        finally:
            trial.close()
        speedloader_s = _speedloader_step_s(planned, plan, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    name = faster(speedloader_s, canonical_s)
    log.info("schedule=auto: the whole batch (%d sequences) stepped in %.3f s layer-major (n=%d x N=%d), %.3f s "
             "canonical (%d x %d, gathered once, no recompute); %s runs (%.0f s of trials)", plan.batch_size,
             speedloader_s, plan.sub_batch_size, plan.num_sub_batches, canonical_s, m, plan.batch_size // m, name,
             time.perf_counter() - start)
    reason = (f"measured: layer-major {speedloader_s:.3f} s, canonical {canonical_s:.3f} s per step of "
              f"{plan.batch_size} sequences")
    return ScheduleChoice(name, reason, sub_batch_size=m, speedloader_step_s=speedloader_s,
                          canonical_step_s=canonical_s, canonical_predicted_gpu_bytes=int(predicted))


def _rng_devices(mesh: DeviceMesh) -> list:
    if mesh.device_type != "cuda":
        return []
    return [torch.cuda.current_device()]


class _CanonicalTrial:
    """A throw-away copy of the model on the canonical schedule of ``cfg``, built as the trainer builds it."""

    def __init__(self, cfg: TrainConfig, mesh: DeviceMesh, *, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype) -> None:
        from fsdp_speedloader import parallel
        from fsdp_speedloader.app.optim import build_optimizer
        from fsdp_speedloader.app.canonical import apply_schedule
        from fsdp_speedloader.models import build_model, materialize_model

        self.cfg = cfg
        self.device = parallel.compute_device(mesh.device_type)
        model = build_model(cfg.model, device="meta")
        model.train()
        self.scope = apply_schedule(model, cfg, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        materialize_model(model, cfg.model, device=self.device, seed=cfg.seed,
                          param_device=torch.device("cpu") if cfg.offload.params else self.device)
        self.model = model
        self.optimizer = build_optimizer(model, cfg.optim, seed=cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def step(self, micro_batch: int, num_micro_batches: int) -> None:
        """One training step (forward and backward of every micro-batch, the optimizer step)."""
        from fsdp_speedloader.app.canonical import canonical_forward_backward

        shape = (micro_batch * num_micro_batches, self.cfg.data.seq_len)
        ids = torch.randint(0, self.model.config.vocab_size, shape, generator=self.generator).to(self.device)
        canonical_forward_backward(self.model, ids, ids, sub_batch_size=micro_batch, num_tokens=ids.numel(),
                                   gradient_sync="last", reshard_after_forward=False, scope=self.scope,
                                   loss_chunk_tokens=self.cfg.schedule.loss_chunk_tokens)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peaks(self) -> dict[int, float]:
        """Peak GPU bytes (reserved on CUDA, else the profiled CPU stand-in) of one step of two micro-batches at each
        of ``TRIAL_MICRO_BATCHES`` (the second micro-batch runs with the first one's gradients held unsharded), after
        a first step (lazy init, the optimizer's states, the compile); maxima over the ranks."""
        from fsdp_speedloader.tuning.trial import profiled_peak_bytes

        self.step(TRIAL_MICRO_BATCHES[0], 2)
        peaks = []
        for m in TRIAL_MICRO_BATCHES:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
                self.step(m, 2)
                peaks.append(float(torch.cuda.max_memory_reserved(self.device)))
            else:
                peaks.append(float(profiled_peak_bytes(lambda: self.step(m, 2))))
        return dict(zip(TRIAL_MICRO_BATCHES, reduce_over_ranks(peaks)))

    def close(self) -> None:
        self.optimizer.close()  # an overlapped optimizer's worker thread (none here: the candidate runs without)
        self.model = self.optimizer = None
        release_memory(self.device)


def _best_of_two(step) -> float:
    """The shorter of two timed calls of ``step`` after one warm-up call (maximum over ranks)."""
    step()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return reduce_over_ranks([min(times)])[0]


def _speedloader_step_s(run: TrainConfig, plan: TunePlan, mesh: DeviceMesh, *, param_dtype: torch.dtype,
                        reduce_dtype: torch.dtype) -> float:
    """Layer-major's plan (``run``: the config running it), built as the run builds it (``TrialModel``), stepping the
    plan's whole batch."""
    from fsdp_speedloader.app.optim import build_optimizer
    from fsdp_speedloader.app.runtime import speedloader_options
    from fsdp_speedloader.tuning.trial import TrialModel

    options = speedloader_options(run, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    with TrialModel(run.model, options, mesh=mesh, seed=run.seed,
                    build_optimizer=lambda model: build_optimizer(model, run.optim, seed=run.seed)) as trial:
        return _best_of_two(lambda: trial.step(plan.sub_batch_size, run.data.seq_len))
