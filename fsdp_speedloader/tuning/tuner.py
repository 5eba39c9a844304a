"""One-shot tuner: two trial steps, a linear memory model, and the plan that fills GPU and host memory.

SpeedLoader's hyperparameter strategy (paper 3.3, A.2). With everything else fixed, memory is linear
(DESIGN.md section 7):

    peak GPU bytes = c0 + c_n n                      (+ c_b b + c_nb n b when blocks_per_unit b is tuned)
    host bytes     = d0 + d_t (U + 1) N n s          (model states + U + 1 activation slots of N x n x s tokens)

``tune`` builds a throw-away copy of the model exactly as the run will, from the run's own
``SpeedLoaderOptions`` (``trial.TrialModel``), runs one short training step at each of two sub-batch
sizes, measures peak GPU memory (allocator) and host memory (exact accounting), and picks the largest
sub-batch size n whose predicted peak fits the GPU budget, then the largest number of sub-batches N whose
host memory fits the host budget (a target effective batch, if given, caps n x N).

GPU: two lines fitted on n, one for the peak allocated and one for the peak reserved, and the plan
keeps both within the budget less the margin. A memory cap (``set_per_process_memory_fraction``, or the
card) limits reserved memory, and with PyTorch's default caching allocator fragmentation makes it far
larger than the allocated peak for this workload (docs/tuner.md has the figures); with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` reserved stays close to allocated and the plan grows
accordingly. The trials measure under the process's own allocator settings, which the run must share.
With two points a line goes through both: R^2 = 1 by construction, and the plan says so;
``tools/sweep_plan.py`` checks linearity on a grid.

Host: only the activation slots grow with the tokens, and their bytes are known exactly (``fit_host``):
the line's slope is h x element size, and the intercept is the largest constant the trials measured.
When activations stay on the GPU (activation_store 'device') their exact bytes, (U + 1) N n s h x
element size, are added to the GPU lines and N is bounded by the GPU budget too.

If the plan runs out of memory anyway, :meth:`TunePlan.memory_error` names the budget that was wrong
and by how much (the trainer uses it for ``schedule.name=auto``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_speedloader.memory.arena import HostMemoryBudget
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.options import SpeedLoaderOptions
from fsdp_speedloader.tuning.trial import (Measurement, TrialModel, cuda_allocator_settings, default_optimizer,
                                           reduce_over_ranks, slot_host_bytes)

log = logging.getLogger(__name__)

GIB = float(1 << 30)
DEFAULT_GPU_MARGIN = 0.10  # of the GPU budget, left for what the fits miss (fragmentation is in the reserved fit)
_HARD_CAP = 1 << 24  # a search bound: no sub-batch or number of sub-batches is larger


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _size(nbytes: float) -> str:
    """'1.234 GiB', or MiB below 0.1 GiB (tiny models on the CPU)."""
    return f"{nbytes / GIB:.3f} GiB" if abs(nbytes) >= 0.1 * GIB else f"{nbytes / (1 << 20):.3f} MiB"


def num_units(num_layers: int, blocks_per_unit: int) -> int:
    return -(-num_layers // blocks_per_unit)


# --- measurements and fits -----------------------------------------------------------------------


LEAST_SQUARES = "least squares"


@dataclass(frozen=True)
class LinearFit:
    """``y = sum(coef[k] * feature[k])``; feature '1' is the intercept. ``method``: how the coefficients
    were found (least squares, or ``fit_host``'s known slope); ``r2``: of the measured points either way."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float
    num_points: int
    method: str = LEAST_SQUARES

    @property
    def exact(self) -> bool:
        """A least-squares line through as many points as coefficients: it meets every point, R^2 = 1 says nothing."""
        return self.method == LEAST_SQUARES and self.num_points <= len(self.features)

    def predict(self, values: dict[str, float]) -> float:
        return float(sum(c * (1.0 if f == "1" else values[f]) for f, c in zip(self.features, self.coef)))

    def describe(self, unit: float = GIB, unit_name: str = "GiB") -> str:
        terms = " + ".join(f"{c / unit:.4g} {unit_name}" + ("" if f == "1" else f" x {f}")
                           for f, c in zip(self.features, self.coef))
        quality = (f"R^2 = 1 by construction ({self.num_points} points, {len(self.features)} coefficients)"
                   if self.exact else f"R^2 = {self.r2:.6f} over {self.num_points} points")
        return f"{terms}  [{quality}{'' if self.method == LEAST_SQUARES else '; ' + self.method}]"


def _r2(y: Sequence[float], predicted: Sequence[float]) -> float:
    y, predicted = np.asarray(y, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - predicted) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0


def fit_linear(rows: Sequence[dict[str, float]], y: Sequence[float], features: Sequence[str]) -> LinearFit:
    """Least-squares fit of ``y`` on ``features`` (each row maps a feature name to its value)."""
    X = np.array([[1.0 if f == "1" else float(r[f]) for f in features] for r in rows], dtype=np.float64)
    Y = np.asarray(y, dtype=np.float64)
    if len(rows) < len(features) or np.linalg.matrix_rank(X) < len(features):
        raise ValueError(f"cannot fit {' + '.join(features)} from {len(rows)} trial(s) at "
                         f"{[dict(r) for r in rows]}: the trials must differ in every tuned setting "
                         "(two different trial_sub_batch_sizes, and two blocks_per_unit values when tuning it)")
    coef, *_ = np.linalg.lstsq(X, Y, rcond=None)
    return LinearFit(tuple(features), tuple(float(c) for c in coef), _r2(Y, X @ coef), len(rows))


HOST_METHOD = "slope: activation slot bytes per token, exact; intercept: the largest measured constant"


def fit_host(measurements: Sequence[Measurement]) -> LinearFit:
    """Host bytes on activation_tokens, without fitting: only the activation slots grow with the tokens,
    and their bytes are known (h x element size per token, with the store's rounding: ``slot_host_bytes``).
    Everything else -- model states, parameter and gradient shards, page-locked blocks of PyTorch's
    caching host allocator -- does not depend on n or N, but the trials see it at different levels (that
    allocator keeps what earlier steps freed; docs/tuner.md). A line through two trials turns
    that growth into a slope and stops N far too early, so the constant is the largest measured, not
    extrapolated. Predictions use ``TunePlan.predict_host_bytes`` (the slope is exact up to the rounding)."""
    assert len({(m.activation_storage, m.activation_bytes_per_token) for m in measurements}) == 1, \
        "the trials of one tune() share their activation store"
    m0 = measurements[0]
    per_token = 0 if m0.activations_on_device else m0.activation_bytes_per_token
    constant = max(m.host_bytes - m.host_activation_bytes for m in measurements)
    r2 = _r2([m.host_bytes for m in measurements], [constant + m.host_activation_bytes for m in measurements])
    return LinearFit(("1", "activation_tokens"), (float(constant), float(per_token)), r2, len(measurements),
                     HOST_METHOD)


def _gpu_values(n: int, b: int) -> dict[str, float]:
    return {"n": n, "b": b, "n*b": n * b}


# --- the plan ----------------------------------------------------------------------------------


class PlanMemoryError:
    """Mixin of the errors raised when a tuned plan runs out of memory: which budget, by how much."""

    budget: str = ""
    predicted_bytes: Optional[int] = None
    needed_bytes: Optional[int] = None


class GpuPlanMemoryError(PlanMemoryError, torch.OutOfMemoryError):
    """The GPU memory budget (or the fit) was wrong: the tuned plan ran out of GPU memory."""

    budget = "gpu"


class HostPlanMemoryError(PlanMemoryError, ValueError):
    """The host memory budget was wrong: the tuned plan's pinned arena does not fit."""

    budget = "host"


_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)\b")
_UNITS = {"GiB": GIB, "MiB": float(1 << 20), "KiB": 1024.0, "B": 1.0}
_ARENA_NEEDS = re.compile(r"pinned host arena needs [\d.]+ GiB \((\d+) bytes")
_ARENA_AVAILABLE = re.compile(r"available: .*?\((\d+) bytes\)")


@dataclass
class TunePlan:
    """The tuner's answer: the plan, the fitted memory models, the budgets and the trial measurements."""

    sub_batch_size: int
    num_sub_batches: int
    blocks_per_unit: int
    seq_len: int
    num_layers: int
    gpu_fit: LinearFit
    """Peak GPU bytes allocated on n (and b, n x b), without the activation slots when they are on the GPU."""
    host_fit: LinearFit
    """Host bytes on activation_tokens = (U + 1) x N x n x s (``fit_host``)."""
    gpu_budget_bytes: int
    gpu_budget_source: str
    gpu_margin: float
    host_budget_bytes: int
    host_budget_source: str
    gpu_reserved_fit: Optional[LinearFit] = None
    """Peak GPU bytes reserved by the caching allocator, as ``gpu_fit``; None without CUDA (not measured)."""
    gpu_allocator_settings: str = ""
    """The CUDA allocator settings the trials ran under ('' for the defaults); the run must use the same."""
    predicted_gpu_bytes: int = 0
    """Peak allocated."""
    predicted_gpu_reserved_bytes: int = 0
    predicted_host_bytes: int = 0
    limited_by: dict = dataclasses.field(default_factory=dict)
    """What stopped n and N: 'gpu budget', 'host budget', 'target_batch_size', 'max_sub_batch_size', ..."""
    measurements: list = dataclasses.field(default_factory=list)
    device: str = "cpu"
    gpu_measure: str = "CPU stand-in"
    activation_storage: str = "arena"
    """Where the activation slots live (``trial.ACTIVATION_STORAGES``)."""
    activation_bytes_per_token: int = 0
    """Bytes of one token in one activation slot (h x element size)."""
    trial_s: float = 0.0

    # --- the memory model ----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Sequences per rank per optimizer step."""
        return self.sub_batch_size * self.num_sub_batches

    @property
    def activations_on_device(self) -> bool:
        return self.activation_storage == "device"

    @property
    def gpu_target_bytes(self) -> int:
        """What the predicted peak may reach: the budget less the margin."""
        return int(self.gpu_budget_bytes * (1.0 - self.gpu_margin))

    def activation_tokens(self, n: int, N: int, b: int) -> int:
        return (num_units(self.num_layers, b) + 1) * N * n * self.seq_len

    def _device_slot_bytes(self, n: int, N: int, b: int) -> int:
        return self.activation_tokens(n, N, b) * self.activation_bytes_per_token if self.activations_on_device else 0

    def predict_gpu_bytes(self, n: int, N: int = 1, b: Optional[int] = None) -> float:
        """Peak GPU memory allocated."""
        b = self.blocks_per_unit if b is None else b
        return self.gpu_fit.predict(_gpu_values(n, b)) + self._device_slot_bytes(n, N, b)

    def predict_gpu_reserved_bytes(self, n: int, N: int = 1, b: Optional[int] = None) -> float:
        """Peak GPU memory reserved: what a cap limits. Never below the allocated peak (the two lines may
        cross far from the trials); the allocated peak itself without a reserved measurement (CPU)."""
        b = self.blocks_per_unit if b is None else b
        allocated = self.predict_gpu_bytes(n, N, b)
        if self.gpu_reserved_fit is None:
            return allocated
        return max(allocated, self.gpu_reserved_fit.predict(_gpu_values(n, b)) + self._device_slot_bytes(n, N, b))

    def predict_host_bytes(self, n: int, N: int, b: Optional[int] = None) -> float:
        b = self.blocks_per_unit if b is None else b
        nbytes = self.activation_tokens(n, N, b) * self.activation_bytes_per_token
        return self.host_fit.coef[0] + slot_host_bytes(nbytes, self.activation_storage)

    def _fitted(self, m: Measurement) -> dict[str, float]:
        args = (m.sub_batch_size, m.num_sub_batches, m.blocks_per_unit)
        return {"gpu": self.predict_gpu_bytes(*args), "gpu_reserved": self.predict_gpu_reserved_bytes(*args),
                "host": self.predict_host_bytes(*args)}

    # --- using it --------------------------------------------------------------------------------
    def overrides(self) -> list[str]:
        """The training overrides that run this plan without tuning again."""
        return ["schedule=speedloader", f"schedule.sub_batch_size={self.sub_batch_size}",
                f"schedule.num_sub_batches={self.num_sub_batches}", f"schedule.blocks_per_unit={self.blocks_per_unit}"]

    def memory_error(self, error: BaseException) -> Optional[Exception]:
        """For a GPU out-of-memory error, or the arena's host budget error, raised while running this plan:
        an error that names the budget that was wrong and by how much. None for any other error."""
        if isinstance(error, PlanMemoryError):
            return None
        if isinstance(error, torch.OutOfMemoryError):
            return self._gpu_error(error)
        if isinstance(error, ValueError) and _ARENA_NEEDS.search(str(error)):
            return self._host_error(error)
        return None

    def _name(self) -> str:
        return f"n={self.sub_batch_size} x N={self.num_sub_batches}, blocks_per_unit={self.blocks_per_unit}"

    def single_sub_batch_warning(self, budget_names: tuple[str, str] = ("gpu_memory_budget_bytes",
                                                                        "host_memory_budget_bytes")) -> Optional[str]:
        """When the plan has N = 1 (no layer-major reuse: each unit is loaded for a single sub-batch, as without
        SpeedLoader), what to change for N >= 2; None for N >= 2. ``budget_names``: the settings of the two budgets."""
        if self.num_sub_batches != 1:
            return None
        cpu = "; on a CPU both budgets are host memory" if self.device == "cpu" else ""
        return (f"the tuned plan has N=1 sub-batch (n={self.sub_batch_size}; N limited by "
                f"{self.limited_by.get('num_sub_batches', '?')}): no layer-major reuse, each unit is loaded for one "
                f"sub-batch as without SpeedLoader. For N >= 2 lower {budget_names[0]} (smaller sub-batches, more of "
                f"them) or raise {budget_names[1]}{cpu}; or set the schedule by hand (schedule=speedloader with "
                "schedule.num_sub_batches >= 2)")

    def _gpu_error(self, error: BaseException) -> Exception:
        predicted, needed = self.predicted_gpu_bytes, None
        fix = "Lower schedule.gpu_memory_budget_gib"
        how = "the error does not say how much was needed"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            match = _TRIED.search(str(error))
            tried = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            needed = int(max(torch.cuda.max_memory_allocated(), allocated + tried))
            # The cap limits reserved memory: fragmentation beyond the reserved fit fails a step whose
            # allocated peak was predicted right.
            short = max(needed - predicted, reserved + tried - self.predicted_gpu_reserved_bytes)
            how = (f"the step needed at least {_size(needed)} allocated ({_size(allocated)} allocated and "
                   f"{_size(reserved)} reserved when {_size(tried)} more were asked for): {_size(short)} "
                   f"({short / max(predicted, 1):.1%}) more than predicted")
            if short > 0:
                fix += f" to about {_gib(self.gpu_budget_bytes - short / (1.0 - self.gpu_margin)):.1f}"
        if self.device == "cuda" and "expandable_segments:True" not in self.gpu_allocator_settings:
            fix += " (or tune and run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: less fragmentation)"
        exc = GpuPlanMemoryError(
            f"out of GPU memory with the tuned plan ({self._name()}): the GPU memory budget was wrong. The tuner "
            f"predicted a peak of {_size(predicted)} ({_size(self.predicted_gpu_reserved_bytes)} reserved) within "
            f"{_size(self.gpu_target_bytes)} (budget {_size(self.gpu_budget_bytes)} from {self.gpu_budget_source}, "
            f"less {self.gpu_margin:.0%}); {how}. {fix}, or set the schedule by hand (schedule=speedloader). "
            f"The error: {error}")
        exc.predicted_bytes, exc.needed_bytes = predicted, needed
        return exc

    def _host_error(self, error: BaseException) -> Exception:
        needs = int(_ARENA_NEEDS.search(str(error)).group(1))
        available = _ARENA_AVAILABLE.search(str(error))
        short = needs - int(available.group(1)) if available else None
        shortfall = (f"only {_size(needs - short)} were available for its {_size(needs)}: short by "
                     f"{_size(short)}" if short is not None else f"its {_size(needs)} did not fit")
        exc = HostPlanMemoryError(
            f"the tuned plan ({self._name()}) does not fit in host memory: the host memory budget was wrong. The "
            f"tuner predicted {_size(self.predicted_host_bytes)} of host memory (model states and activation "
            f"slots) within a budget of {_size(self.host_budget_bytes)} ({self.host_budget_source}), but when "
            f"the pinned arena was planned {shortfall}. Lower schedule.host_memory_budget_gib by that much, or free "
            f"host memory. The error: {error}")
        exc.predicted_bytes = self.predicted_host_bytes
        exc.needed_bytes = self.predicted_host_bytes + short if short is not None else None
        return exc

    def first_step_metrics(self, metrics: dict) -> dict:
        """The predicted peak next to the one the first real step measured (CUDA only), for the logger."""
        measured = metrics.get("peak_gpu_mem_allocated_gib")
        if self.device != "cuda" or not measured:
            return {}
        predicted = _gib(self.predicted_gpu_bytes)
        out = {"tune/predicted_gpu_peak_gib": predicted, "tune/measured_gpu_peak_gib": measured,
               "tune/gpu_prediction_error": predicted / measured - 1.0}
        reserved = metrics.get("peak_gpu_mem_reserved_gib")
        if reserved:
            out.update({"tune/predicted_gpu_reserved_gib": _gib(self.predicted_gpu_reserved_bytes),
                        "tune/measured_gpu_reserved_gib": reserved})
        return out

    # --- reporting -------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        """Everything, JSON-ready; each measurement with what the fits give at its point."""
        out = dataclasses.asdict(self)
        out.update(batch_size=self.batch_size, gpu_target_bytes=self.gpu_target_bytes)
        for record, m in zip(out["measurements"], self.measurements):
            record.update({f"fitted_{k}_bytes": v for k, v in self._fitted(m).items()},
                          activation_tokens=m.activation_tokens, host_activation_bytes=m.host_activation_bytes)
        return out

    def as_metrics(self) -> dict:
        """Flat scalars under ``tune/`` (W&B, metrics.jsonl); intercepts in GiB, slopes in bytes."""
        out = {"tune/sub_batch_size": self.sub_batch_size, "tune/num_sub_batches": self.num_sub_batches,
               "tune/blocks_per_unit": self.blocks_per_unit, "tune/batch_size": self.batch_size,
               "tune/gpu_budget_gib": _gib(self.gpu_budget_bytes), "tune/gpu_target_gib": _gib(self.gpu_target_bytes),
               "tune/host_budget_gib": _gib(self.host_budget_bytes),
               "tune/predicted_gpu_peak_gib": _gib(self.predicted_gpu_bytes),
               "tune/predicted_gpu_reserved_gib": _gib(self.predicted_gpu_reserved_bytes),
               "tune/predicted_host_gib": _gib(self.predicted_host_bytes), "tune/trial_s": self.trial_s}
        fits = {"gpu": self.gpu_fit, "gpu_reserved": self.gpu_reserved_fit, "host": self.host_fit}
        for name, fit in fits.items():
            if fit is None:
                continue
            out.update({f"tune/{name}_r2": fit.r2, f"tune/{name}_fit_points": fit.num_points})
            for f, c in zip(fit.features, fit.coef):
                key = "intercept_gib" if f == "1" else f.replace("*", "_x_") + "_bytes"
                out[f"tune/{name}_coef_{key}"] = _gib(c) if f == "1" else c
        for k, m in enumerate(self.measurements):
            measured = {"gpu": m.gpu_peak_bytes, "gpu_reserved": m.gpu_reserved_bytes, "host": m.host_bytes}
            for name, predicted in self._fitted(m).items():
                if fits[name] is not None:
                    out.update({f"tune/trial{k}/measured_{name}_gib": _gib(measured[name]),
                                f"tune/trial{k}/fitted_{name}_gib": _gib(predicted)})
        return out

    def summary(self) -> str:
        """A few lines for the console: the plan, both fits and budgets, a table of the trials."""
        lines = [
            f"plan: n={self.sub_batch_size} sequences per sub-batch (limited by {self.limited_by['sub_batch_size']}), "
            f"N={self.num_sub_batches} sub-batches (limited by {self.limited_by['num_sub_batches']}), blocks_per_unit="
            f"{self.blocks_per_unit}: {self.batch_size} x {self.seq_len} tokens per rank per step",
            f"GPU ({self.gpu_measure}): predicted peak {_size(self.predicted_gpu_bytes)} allocated, "
            f"{_size(self.predicted_gpu_reserved_bytes)} reserved <= {_size(self.gpu_target_bytes)} (budget "
            f"{_size(self.gpu_budget_bytes)} from {self.gpu_budget_source}, less {self.gpu_margin:.0%}); allocated "
            f"{self.gpu_fit.describe()}",
            f"host (exact accounting): predicted {_size(self.predicted_host_bytes)} <= budget "
            f"{_size(self.host_budget_bytes)} ({self.host_budget_source}); {self.host_fit.describe(1.0, 'B')}",
            "| trial | n | N | blocks/unit | GPU GiB measured | fitted | reserved GiB measured | fitted "
            "| host GiB measured | predicted | step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
        if self.gpu_reserved_fit is not None:
            lines.insert(2, f"GPU reserved (allocator settings: {self.gpu_allocator_settings or 'defaults'}): "
                            f"{self.gpu_reserved_fit.describe()}")
        for k, m in enumerate(self.measurements):
            fitted = self._fitted(m)
            reserved = (f"{_gib(m.gpu_reserved_bytes):.3f} | {_gib(fitted['gpu_reserved']):.3f}"
                        if self.gpu_reserved_fit is not None else "- | -")
            lines.append(f"| {k} | {m.sub_batch_size} | {m.num_sub_batches} | {m.blocks_per_unit} | "
                         f"{_gib(m.gpu_peak_bytes):.3f} | {_gib(fitted['gpu']):.3f} | {reserved} | "
                         f"{_gib(m.host_bytes):.3f} | {_gib(fitted['host']):.3f} | {m.step_s:.2f} |")
        lines.append("run it: " + " ".join(self.overrides()))
        return "\n".join(lines)


def _largest(ok: Callable[[int], bool], cap: Optional[int]) -> int:
    """The largest k in [1, cap] with ok(k) (ok monotone: true up to some k); 0 if ok(1) is false."""
    hi = min(cap or _HARD_CAP, _HARD_CAP)
    if not ok(1):
        return 0
    lo, probe = 1, 2
    while probe <= hi and ok(probe):  # exponential probe, then bisect
        lo, probe = probe, probe * 2
    hi = min(hi, probe - 1) if probe <= hi else hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _min_cap(*caps: tuple[Optional[int], str]) -> tuple[Optional[int], str]:
    given = [(c, name) for c, name in caps if c is not None]
    return min(given) if given else (None, "")


def plan_from_measurements(
    measurements: Sequence[Measurement], *, num_layers: int, gpu_budget_bytes: int, host_budget_bytes: int,
    gpu_margin: float = DEFAULT_GPU_MARGIN, blocks_per_unit: Optional[Sequence[int]] = None,
    max_sub_batch_size: Optional[int] = None, max_num_sub_batches: Optional[int] = None,
    target_batch_size: Optional[int] = None, **plan_fields,
) -> TunePlan:
    """Fits the two memory models to ``measurements`` and picks the plan (no model runs here).

    n: the largest sub-batch size for which one sub-batch fits both budgets; N: then the largest number
    of sub-batches that fits both (GPU memory does not depend on N unless the activations are on the
    GPU). The GPU budget holds for the peak allocated and, when the trials measured it (CUDA), the peak
    reserved. With several ``blocks_per_unit`` candidates the plan with the most sequences per step wins
    (then the larger n, then the smaller blocks_per_unit). ``plan_fields``: more :class:`TunePlan`
    fields (budget sources, device, ...). Raises ``ValueError`` naming the budget that cannot hold one
    sequence per sub-batch.
    """
    if not measurements:
        raise ValueError("no trial measurements to fit")
    if not 0.0 <= gpu_margin < 1.0:
        raise ValueError(f"gpu_margin={gpu_margin}; use a fraction in [0, 1)")
    caps = {"max_sub_batch_size": max_sub_batch_size, "max_num_sub_batches": max_num_sub_batches,
            "target_batch_size": target_batch_size}
    for name, value in caps.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}; it must be an integer >= 1 (or None)")
    measured_b = sorted({m.blocks_per_unit for m in measurements})
    candidates = sorted(set(blocks_per_unit or measured_b))
    if len(measured_b) == 1 and candidates != measured_b:
        raise ValueError(f"blocks_per_unit {candidates} asked for, but the trials ran at {measured_b} only")
    gpu_features = ("1", "n", "b", "n*b") if len(measured_b) > 1 else ("1", "n")
    gpu_rows = [_gpu_values(m.sub_batch_size, m.blocks_per_unit) for m in measurements]
    reserved_fit = None
    if any(m.gpu_reserved_bytes for m in measurements):  # CUDA: the caching allocator's fragmentation
        reserved_fit = fit_linear(gpu_rows, [m.gpu_reserved_bytes - m.device_activation_bytes for m in measurements],
                                  gpu_features)
    m0 = measurements[0]
    plan = TunePlan(
        sub_batch_size=0, num_sub_batches=0, blocks_per_unit=candidates[0], seq_len=m0.seq_len, num_layers=num_layers,
        gpu_fit=fit_linear(gpu_rows, [m.gpu_peak_bytes - m.device_activation_bytes for m in measurements],
                           gpu_features),
        host_fit=fit_host(measurements), gpu_reserved_fit=reserved_fit,
        gpu_budget_bytes=int(gpu_budget_bytes), gpu_margin=gpu_margin, host_budget_bytes=int(host_budget_bytes),
        measurements=list(measurements), activation_storage=m0.activation_storage,
        activation_bytes_per_token=m0.activation_bytes_per_token,
        **{"gpu_budget_source": "gpu_memory_budget_bytes", "host_budget_source": "host_memory_budget_bytes",
           **plan_fields})
    choices = [c for c in (_choose(plan, b, **caps) for b in candidates) if c is not None]
    if not choices:
        raise _too_small_error(plan, candidates[0])
    _, n, N, b, limited = max(choices, key=lambda c: c[0])
    plan.sub_batch_size, plan.num_sub_batches, plan.blocks_per_unit, plan.limited_by = n, N, b, limited
    plan.predicted_gpu_bytes = int(plan.predict_gpu_bytes(n, N, b))
    plan.predicted_gpu_reserved_bytes = int(plan.predict_gpu_reserved_bytes(n, N, b))
    plan.predicted_host_bytes = int(plan.predict_host_bytes(n, N, b))
    return plan


def _fits(plan: TunePlan, n: int, N: int, b: int) -> tuple[bool, bool]:
    """(GPU fits, host fits) for the plan's fitted models at (n, N, b), to the byte (the fit's rounding aside)."""
    return (round(plan.predict_gpu_reserved_bytes(n, N, b)) <= plan.gpu_target_bytes,  # >= the allocated peak
            round(plan.predict_host_bytes(n, N, b)) <= plan.host_budget_bytes)


def _choose(plan: TunePlan, b: int, *, max_sub_batch_size: Optional[int], max_num_sub_batches: Optional[int],
            target_batch_size: Optional[int]) -> Optional[tuple]:
    """((sort key), n, N, b, limited_by) for blocks_per_unit b, or None if not one sequence fits."""
    n_cap = _min_cap((max_sub_batch_size, "max_sub_batch_size"), (target_batch_size, "target_batch_size"))
    n = _largest(lambda k: all(_fits(plan, k, 1, b)), n_cap[0])
    if n == 0:
        return None
    if n == _HARD_CAP:
        raise ValueError("neither budget bounds the sub-batch size (no memory grows with it in the fits); "
                         "set target_batch_size or max_sub_batch_size")
    N_cap = _min_cap((max_num_sub_batches, "max_num_sub_batches"),
                     (target_batch_size // n if target_batch_size else None, "target_batch_size"))
    N = _largest(lambda k: all(_fits(plan, n, k, b)), N_cap[0])

    def limit(value: int, cap: tuple[Optional[int], str], next_fits: tuple[bool, bool]) -> str:
        if cap[0] is not None and value >= cap[0]:
            return cap[1]
        return "host budget" if next_fits[0] else "gpu budget"

    limited = {"sub_batch_size": limit(n, n_cap, _fits(plan, n + 1, 1, b)),
               "num_sub_batches": limit(N, N_cap, _fits(plan, n, N + 1, b))}
    return (N * n, n, -b), n, N, b, limited


def _too_small_error(plan: TunePlan, b: int) -> ValueError:
    """The error when not even n = N = 1 fits: it names the budget, what one sequence needs, what to change."""
    s = plan.seq_len
    if not _fits(plan, 1, 1, b)[0]:
        return ValueError(
            f"GPU memory budget too small for even one sub-batch: one sequence of {s} tokens per sub-batch "
            f"(blocks_per_unit={b}) needs a predicted peak of {_size(plan.predict_gpu_bytes(1, 1, b))} allocated, "
            f"{_size(plan.predict_gpu_reserved_bytes(1, 1, b))} reserved (fitted from the trial steps: "
            f"{plan.gpu_fit.describe()}), but the budget is {_size(plan.gpu_budget_bytes)} "
            f"from {plan.gpu_budget_source}, {_size(plan.gpu_target_bytes)} after the {plan.gpu_margin:.0%} "
            "margin. Raise schedule.gpu_memory_budget_gib (or max_gpu_memory_gib), shorten data.seq_len, or offload "
            "the parameters (offload=params)")
    d0, per_token = plan.host_fit.coef
    return ValueError(
        f"host memory budget too small for even one sub-batch: the model states and the activation slots of one "
        f"sequence of {s} tokens (blocks_per_unit={b}) need {_size(plan.predict_host_bytes(1, 1, b))} "
        f"({_size(d0)} fixed + {per_token:.0f} bytes x {num_units(plan.num_layers, b) + 1} slots x {s} "
        f"tokens), but the budget is {_size(plan.host_budget_bytes)} ({plan.host_budget_source}). Raise "
        "schedule.host_memory_budget_gib or, if this machine has more memory than it reports, set "
        "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB; or shorten data.seq_len, or raise schedule.blocks_per_unit")


# --- the tuner -----------------------------------------------------------------------------------


def tune(
    model: ModelConfig,
    options: Optional[SpeedLoaderOptions] = None,
    *,
    seq_len: int,
    gpu_memory_budget_bytes: Optional[int] = None,
    host_memory_budget_bytes: Optional[int] = None,
    target_batch_size: Optional[int] = None,
    max_sub_batch_size: Optional[int] = None,
    max_num_sub_batches: Optional[int] = None,
    tune_blocks_per_unit: Sequence[int] = (),
    trial_sub_batch_sizes: tuple[int, int] = (2, 4),
    trial_num_sub_batches: int = 2,
    gpu_margin: float = DEFAULT_GPU_MARGIN,
    mesh: Optional[DeviceMesh] = None,
    build_optimizer: Optional[Callable[[nn.Module], OptimizersContainer]] = None,
    seed: int = 0,
    budget_names: tuple[str, str] = ("gpu_memory_budget_bytes", "host_memory_budget_bytes"),
    **overrides,
) -> TunePlan:
    """Plans ``sub_batch_size`` x ``num_sub_batches`` (and ``blocks_per_unit``) for a layer-major run.

    Args:
        model: the model to plan for; a throw-away copy is built from it for the trial steps.
        options: the run's engine options (:class:`~fsdp_speedloader.options.SpeedLoaderOptions`): the trials
            build the model with them (offload, store, dtypes, transfer copies, compiled blocks, root
            placement), so they hold the run's states where the run will. Their ``num_sub_batches`` is what
            the plan chooses (the trials run ``trial_num_sub_batches``); their ``blocks_per_unit`` is a
            candidate.
        seq_len: tokens per sequence s.
        gpu_memory_budget_bytes: GPU memory the run may fill (peak allocated, and peak reserved on CUDA);
            the plan keeps ``gpu_margin`` of it free. None: the device's memory (times its per-process fraction, if
            capped); without CUDA the CPU stands in for the GPU and the detected host memory is used.
        host_memory_budget_bytes: host memory for model states and activation slots. None: detected at
            the start (``HostMemoryBudget.detect``: ``$FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB``, the memory
            cgroup or MemTotal, less 10% and what is in use).
        target_batch_size: at most this many sequences per rank per step (caps n x N).
        max_sub_batch_size / max_num_sub_batches: caps on n and N (e.g. a sweep's grid).
        tune_blocks_per_unit: more ``blocks_per_unit`` values to choose from besides ``options.blocks_per_unit``
            (two trial steps each; GPU memory is then fitted on n, b and n x b).
        trial_sub_batch_sizes: the two sub-batch sizes of the trial steps. Not 1: at n = 1 some kernels
            take other paths, and the step from 1 to 2 is not the slope beyond. If the larger one runs out
            of GPU memory, the trials run again at (1, the smaller one).
        trial_num_sub_batches: N of the trial steps.
        mesh: as ``apply_speedloader`` (every rank runs the trials; the maximum over ranks is fitted).
        build_optimizer: the run's optimizers for a model (their state is part of the memory); default:
            ``default_optimizer`` (fused AdamW).
        seed: weights and tokens of the trial model (the global RNG is left as it was).
        budget_names: what the plan and its errors call the two budgets when given (the trainer passes
            its config keys).
        overrides: fields of ``SpeedLoaderOptions`` as keywords, applied over ``options`` (as
            ``apply_speedloader`` takes them): ``tune(model, seq_len=4096, offload_params=True)``.
    Returns:
        The :class:`TunePlan`. Raises ``ValueError`` when a budget cannot hold one sequence per sub-batch.
    """
    options = (options or SpeedLoaderOptions()).replace(**overrides)
    trials = _prepare(options, tune_blocks_per_unit=tune_blocks_per_unit, trial_sub_batch_sizes=trial_sub_batch_sizes,
                      trial_num_sub_batches=trial_num_sub_batches, mesh=mesh,
                      gpu_memory_budget_bytes=gpu_memory_budget_bytes,
                      host_memory_budget_bytes=host_memory_budget_bytes, budget_names=budget_names)
    start = time.perf_counter()
    measurements = _run_trials(model, trials, seq_len, build_optimizer=build_optimizer or default_optimizer, seed=seed)
    plan = plan_from_measurements(
        measurements, num_layers=model_num_layers(model), gpu_margin=gpu_margin,
        blocks_per_unit=[o.blocks_per_unit for o in trials.options], max_sub_batch_size=max_sub_batch_size,
        max_num_sub_batches=max_num_sub_batches, target_batch_size=target_batch_size,
        trial_s=time.perf_counter() - start, **trials.budgets.plan_fields(), **_device_fields(trials.device))
    warning = plan.single_sub_batch_warning(budget_names)
    if warning is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning(warning)
    return plan


@dataclass(frozen=True)
class Budgets:
    """The two memory budgets (bytes, the minimum over ranks) and where each came from."""

    gpu_bytes: int
    gpu_source: str
    host_bytes: int
    host_source: str

    def plan_fields(self) -> dict:
        return {"gpu_budget_bytes": self.gpu_bytes, "gpu_budget_source": self.gpu_source,
                "host_budget_bytes": self.host_bytes, "host_budget_source": self.host_source}


@dataclass(frozen=True)
class TrialSetup:
    """What the trial steps run: one options per ``blocks_per_unit`` candidate, at two sub-batch sizes."""

    options: tuple[SpeedLoaderOptions, ...]
    """The run's options with the trials' ``num_sub_batches`` and each candidate ``blocks_per_unit``."""
    sub_batch_sizes: tuple[int, int]
    """Ascending."""
    mesh: DeviceMesh
    device: torch.device
    budgets: Budgets
    """Resolved before the trials take memory."""


def _prepare(options: SpeedLoaderOptions, *, tune_blocks_per_unit: Sequence[int],
             trial_sub_batch_sizes: tuple[int, int], trial_num_sub_batches: int, mesh: Optional[DeviceMesh],
             gpu_memory_budget_bytes: Optional[int], host_memory_budget_bytes: Optional[int],
             budget_names: tuple[str, str]) -> TrialSetup:
    """Checks the trial settings (before any memory is taken), then the mesh, the device and the budgets."""
    from fsdp_speedloader.parallel import build_mesh, compute_device, maybe_init_process_group

    n1, n2 = trial_sub_batch_sizes
    if n1 == n2 or min(n1, n2) < 1:
        raise ValueError(f"trial_sub_batch_sizes={trial_sub_batch_sizes}; two different sizes >= 1 are needed")
    if not isinstance(trial_num_sub_batches, int) or trial_num_sub_batches < 1:
        raise ValueError(f"trial_num_sub_batches={trial_num_sub_batches!r}; it must be an integer >= 1")
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in tune_blocks_per_unit):
        raise ValueError(f"tune_blocks_per_unit={tune_blocks_per_unit!r}; give integers >= 1")
    candidates = sorted({options.blocks_per_unit, *tune_blocks_per_unit})
    trial_options = tuple(options.replace(num_sub_batches=trial_num_sub_batches, blocks_per_unit=b)
                          for b in candidates)
    if mesh is None:
        maybe_init_process_group()
        mesh = build_mesh("cuda" if torch.cuda.is_available() else "cpu")
    device = compute_device(mesh.device_type)
    budgets = _resolve_budgets(device, gpu_memory_budget_bytes, host_memory_budget_bytes, budget_names)
    return TrialSetup(options=trial_options, sub_batch_sizes=(min(n1, n2), max(n1, n2)), mesh=mesh, device=device,
                      budgets=budgets)


def _resolve_budgets(device: torch.device, gpu_budget: Optional[int], host_budget: Optional[int],
                     names: tuple[str, str]) -> Budgets:
    detected = None
    if host_budget is None or (gpu_budget is None and device.type != "cuda"):
        detected = HostMemoryBudget.detect()
    if host_budget is not None:
        host_source = names[1]
    else:
        host_budget, host_source = detected.available_bytes, f"detected: {detected.describe()}"
    if gpu_budget is not None:
        gpu_source = names[0]
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(device) if get_fraction is not None else 1.0
        gpu_budget = int(total * fraction)
        gpu_source = f"the device's {_gib(total):.1f} GiB" + (f" x fraction {fraction:.3f}" if fraction < 1 else "")
    else:
        gpu_budget, gpu_source = detected.available_bytes, "the CPU stand-in: detected host memory"
    gpu_budget, host_budget = (int(v) for v in reduce_over_ranks([gpu_budget, host_budget], dist.ReduceOp.MIN))
    return Budgets(gpu_budget, gpu_source, host_budget, host_source)


def _run_trials(model: ModelConfig, trials: TrialSetup, seq_len: int, *,
                build_optimizer: Callable[[nn.Module], OptimizersContainer], seed: int) -> list[Measurement]:
    """Two trial steps per ``blocks_per_unit`` candidate; the global RNG is left as it was."""
    device = trials.device
    measurements = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for options in trials.options:
            measurements += _measure_candidate(model, options, trials, seq_len, build_optimizer=build_optimizer,
                                               seed=seed)
    return measurements


def _measure_candidate(model: ModelConfig, options: SpeedLoaderOptions, trials: TrialSetup, seq_len: int, *,
                       build_optimizer, seed: int) -> list[Measurement]:
    """The two trial steps of one candidate; if the larger runs out of GPU memory, again at (1, the smaller)."""
    sizes = trials.sub_batch_sizes
    while True:
        try:
            return _measure_trials(model, options, sizes, seq_len, mesh=trials.mesh, build_optimizer=build_optimizer,
                                   seed=seed)
        except torch.OutOfMemoryError as e:
            failed = (f"the trial steps at n={sizes} x N={options.num_sub_batches} (blocks_per_unit="
                      f"{options.blocks_per_unit}) ran out of GPU memory ({e})")
        # Out of the except block, the failed step's tensors are gone: try smaller sub-batches.
        if sizes[0] == 1:
            raise ValueError(f"GPU memory budget: {failed}; the GPU cannot run one sequence of {seq_len} "
                             "tokens per sub-batch: shorten data.seq_len or offload the parameters")
        log.warning("%s; trying smaller sub-batches", failed)
        gc.collect()
        if trials.device.type == "cuda":
            torch.cuda.empty_cache()
        sizes = (1, sizes[0])


def _measure_trials(model: ModelConfig, options: SpeedLoaderOptions, sizes: tuple[int, int], seq_len: int, *,
                    mesh: DeviceMesh, build_optimizer, seed: int) -> list[Measurement]:
    """Builds a trial model, primes it at the larger size, measures one step at each size, frees it."""
    out = []
    with TrialModel(model, options, mesh=mesh, build_optimizer=build_optimizer, seed=seed) as trial:
        trial.prime(sizes[-1], seq_len)  # at the largest trial geometry: the arena is planned once
        for n in reversed(sizes):  # the largest first, right after the prime; the smaller primes again
            m = trial.measure(n, seq_len)
            out.append(m)
            log.info("tune trial n=%d N=%d blocks_per_unit=%d: GPU peak %.3f GiB (%.3f GiB reserved), host %.3f GiB, "
                     "%.2f s", n, m.num_sub_batches, m.blocks_per_unit, _gib(m.gpu_peak_bytes),
                     _gib(m.gpu_reserved_bytes), _gib(m.host_bytes), m.step_s)
    return out[::-1]


def _device_fields(device: torch.device) -> dict:
    """The plan's record of how GPU memory was measured on ``device``."""
    if device.type == "cuda":
        return {"device": "cuda", "gpu_measure": "torch.cuda.max_memory_allocated, max_memory_reserved",
                "gpu_allocator_settings": cuda_allocator_settings()}
    return {"device": device.type, "gpu_measure": "CPU stand-in: resident model states + profiled peak allocation"}


def model_num_layers(model: ModelConfig) -> int:
    """Transformer blocks of the model (read from the checkpoint's config when ``model.path`` is set)."""
    if model.path is None:
        return model.num_layers
    from fsdp_speedloader.models import build_hf_config

    return build_hf_config(model).num_hidden_layers
