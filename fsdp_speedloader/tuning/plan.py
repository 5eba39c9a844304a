"""The plan: from the fitted memory model (``fit.py``) and the budgets, the largest sub-batch size n whose
predicted GPU peak fits, then the largest number of sub-batches N whose host memory fits; and, when a run
runs out of memory anyway, the error that names the budget that was wrong (``TunePlan.memory_error``)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from fsdp_speedloader.tuning.fit import GIB, LinearFit, fit_host, fit_linear, gpu_values
from fsdp_speedloader.tuning.trial import Measurement, slot_host_bytes

DEFAULT_GPU_MARGIN = 0.10  # of the GPU budget, left for what the fits miss (fragmentation is in the reserved fit)
DEVICE_STATE_BYTES_PER_PARAM = 16
"""GPU bytes of a parameter whose states stay there: the fp32 shard, its fp32 gradient and AdamW's two fp32 moments
(with compressed host states or bf16 host masters too: the GPU's keep fp32, ``app.optim.build_adamw``)."""
HOST_STEP_SHARE = 0.45
"""With an overlapped optimizer: the most of the step's forward+backward (without recompute) that the CPU step, as the
trials time it on a quiet host, may take. Between what the trials predicted on issue 40's busy-host table for one
unit on the GPU (its CPU step showed after the backward with a quarter of the host's cores busy) and for two (it
stayed hidden): docs/tuner.md."""
HARD_CAP = 1 << 24  # a search bound: no sub-batch or number of sub-batches is larger


def gib(nbytes: float) -> float:
    return nbytes / GIB


def format_bytes(nbytes: float) -> str:
    """'1.234 GiB', or MiB below 0.1 GiB (tiny models on the CPU)."""
    return f"{nbytes / GIB:.3f} GiB" if abs(nbytes) >= 0.1 * GIB else f"{nbytes / (1 << 20):.3f} MiB"


def num_units(num_layers: int, blocks_per_unit: int) -> int:
    return -(-num_layers // blocks_per_unit)


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
    keep_activations: int = 0
    """(unit, sub-batch) pairs that keep their activations (skip the recompute) in the GPU memory left over."""
    kept_pair_bytes: int = 0
    """GPU memory of one kept pair at the planned n (from the trials' measurement; 0: not measured)."""
    device_units: int = 0
    """Units 1 .. K whose states stay on the GPU (``offload.device_units``): planned before the kept pairs."""
    host_step_share: float = 0.0
    """With an overlapped optimizer: the predicted CPU step at ``device_units`` over the predicted forward+backward
    without recompute (``HOST_STEP_SHARE`` is the most the plan wants); 0: not timed."""
    device_unit_bytes: int = 0
    """GPU memory the states of one unit kept there take (from the parameter count; 0: not planned)."""
    trial_s: float = 0.0
    target_batch_size: Optional[int] = None
    """The target effective batch the plan was capped by (None: none given)."""
    schedule: str = "speedloader"
    """What runs: 'speedloader' (this plan) or 'canonical' (``app.schedule_choice``: gradient accumulation over
    ``canonical_sub_batch_size``-sequence micro-batches of the same batch, the model gathered once, no recompute)."""
    schedule_reason: str = ""
    """Why (the two measured step times, or why the canonical candidate was not tried); '' if no choice was made."""
    canonical_sub_batch_size: int = 0
    """The canonical candidate's micro-batch m (0: none fitted, or none was tried)."""
    speedloader_step_s: float = 0.0
    """This plan's step of the whole batch, as the choice measured it (0: not measured)."""
    canonical_step_s: float = 0.0
    """The canonical candidate's step of the same batch (0: not measured)."""

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
        return self.gpu_fit.predict(gpu_values(n, b)) + self._device_slot_bytes(n, N, b)

    def predict_gpu_reserved_bytes(self, n: int, N: int = 1, b: Optional[int] = None) -> float:
        """Peak GPU memory reserved: what a cap limits. Never below the allocated peak (the two lines may
        cross far from the trials); the allocated peak itself without a reserved measurement (CPU)."""
        b = self.blocks_per_unit if b is None else b
        allocated = self.predict_gpu_bytes(n, N, b)
        if self.gpu_reserved_fit is None:
            return allocated
        return max(allocated, self.gpu_reserved_fit.predict(gpu_values(n, b)) + self._device_slot_bytes(n, N, b))

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
        """The training overrides that run this plan (or the canonical schedule chosen over it) without tuning again."""
        units = [f"offload.device_units={self.device_units}"] if self.device_units else []
        if self.schedule == "canonical":
            m = self.canonical_sub_batch_size
            return ["schedule=canonical", f"schedule.sub_batch_size={m}",
                    f"schedule.num_sub_batches={self.batch_size // m}", f"schedule.blocks_per_unit={self.blocks_per_unit}",
                    "schedule.activation_checkpointing=false", "schedule.gradient_sync=last",
                    "schedule.reshard_after_forward=false", "optim.overlap_with_backward=false"] + units
        return ["schedule=speedloader", f"schedule.sub_batch_size={self.sub_batch_size}",
                f"schedule.num_sub_batches={self.num_sub_batches}", f"schedule.blocks_per_unit={self.blocks_per_unit}",
                f"schedule.keep_activations={self.keep_activations}"] + units

    def memory_error(self, error: BaseException) -> Optional[Exception]:
        """For a GPU out-of-memory error, or the arena's host budget error, raised while running this plan:
        an error that names the budget that was wrong and by how much. None for any other error."""
        if isinstance(error, PlanMemoryError) or self.schedule != "speedloader":  # the canonical run's error as is
            return None
        if isinstance(error, torch.OutOfMemoryError):
            return self._gpu_error(error)
        if isinstance(error, ValueError) and _ARENA_NEEDS.search(str(error)):
            return self._host_error(error)
        return None

    def _name(self) -> str:
        return f"n={self.sub_batch_size} x N={self.num_sub_batches}, blocks_per_unit={self.blocks_per_unit}"

    def whole_batch_fits(self) -> bool:
        """The whole target batch in one sub-batch (N = 1, n = target_batch_size): the plan meant, not a shortfall.
        Each unit is loaded once per direction for the whole batch (the canonical order, with the engine's
        overlapped host optimizer); where a batch fits the GPU that ran faster than layer-major's sub-batches
        (docs/results.md, the regime map's 80 GiB point)."""
        return self.num_sub_batches == 1 and self.sub_batch_size == self.target_batch_size

    def target_warning(self, target_name: str = "target_batch_size") -> Optional[str]:
        """When n x N falls short of the target (N = target // n: the target is not a multiple of n, and no smaller n
        that divides it fits the whole target within the budgets and caps), what to set; else None."""
        if self.target_batch_size is None or self.batch_size >= self.target_batch_size:
            return None
        n = self.sub_batch_size
        return (f"{target_name}={self.target_batch_size} is not a multiple of the planned n={n}: the plan runs "
                f"n x N = {n} x {self.num_sub_batches} = {self.batch_size} sequences (N = {self.target_batch_size} // "
                f"{n}; no smaller n that divides {self.target_batch_size} fits its {self.target_batch_size} / n "
                f"sub-batches); a multiple of {n} (e.g. {-(-self.target_batch_size // n) * n}) runs exactly that batch")

    def single_sub_batch_warning(self, budget_names: tuple[str, str] = ("gpu_memory_budget_bytes",
                                                                        "host_memory_budget_bytes")) -> Optional[str]:
        """When the plan has N = 1 (no layer-major reuse: each unit is loaded for a single sub-batch, as without
        SpeedLoader) for want of memory or by a cap, what to change for N >= 2; None for N >= 2, and where the whole
        target batch fits one sub-batch (:meth:`whole_batch_fits`: the faster plan there, not a shortfall).
        ``budget_names``: the settings of the two budgets."""
        if self.num_sub_batches != 1 or self.whole_batch_fits():
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
            how = (f"the step needed at least {format_bytes(needed)} allocated ({format_bytes(allocated)} allocated and "
                   f"{format_bytes(reserved)} reserved when {format_bytes(tried)} more were asked for): {format_bytes(short)} "
                   f"({short / max(predicted, 1):.1%}) more than predicted")
            if short > 0:
                fix += f" to about {gib(self.gpu_budget_bytes - short / (1.0 - self.gpu_margin)):.1f}"
        if self.device == "cuda" and "expandable_segments:True" not in self.gpu_allocator_settings:
            fix += " (or tune and run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: less fragmentation)"
        exc = GpuPlanMemoryError(
            f"out of GPU memory with the tuned plan ({self._name()}): the GPU memory budget was wrong. The tuner "
            f"predicted a peak of {format_bytes(predicted)} ({format_bytes(self.predicted_gpu_reserved_bytes)} reserved) within "
            f"{format_bytes(self.gpu_target_bytes)} (budget {format_bytes(self.gpu_budget_bytes)} from {self.gpu_budget_source}, "
            f"less {self.gpu_margin:.0%}); {how}. {fix}, or set the schedule by hand (schedule=speedloader). "
            f"The error: {error}")
        exc.predicted_bytes, exc.needed_bytes = predicted, needed
        return exc

    def _host_error(self, error: BaseException) -> Exception:
        needs = int(_ARENA_NEEDS.search(str(error)).group(1))
        available = _ARENA_AVAILABLE.search(str(error))
        short = needs - int(available.group(1)) if available else None
        shortfall = (f"only {format_bytes(needs - short)} were available for its {format_bytes(needs)}: short by "
                     f"{format_bytes(short)}" if short is not None else f"its {format_bytes(needs)} did not fit")
        exc = HostPlanMemoryError(
            f"the tuned plan ({self._name()}) does not fit in host memory: the host memory budget was wrong. The "
            f"tuner predicted {format_bytes(self.predicted_host_bytes)} of host memory (model states and activation "
            f"slots) within a budget of {format_bytes(self.host_budget_bytes)} ({self.host_budget_source}), but when "
            f"the pinned arena was planned {shortfall}. Lower schedule.host_memory_budget_gib by that much, or free "
            f"host memory. The error: {error}")
        exc.predicted_bytes = self.predicted_host_bytes
        exc.needed_bytes = self.predicted_host_bytes + short if short is not None else None
        return exc

    def first_step_metrics(self, metrics: dict) -> dict:
        """The predicted peak next to the one the first real step measured (CUDA only), for the logger."""
        measured = metrics.get("peak_gpu_mem_allocated_gib")
        if self.device != "cuda" or not measured or self.schedule != "speedloader":  # predicted for this plan only
            return {}
        predicted = gib(self.predicted_gpu_bytes)
        out = {"tune/predicted_gpu_peak_gib": predicted, "tune/measured_gpu_peak_gib": measured,
               "tune/gpu_prediction_error": predicted / measured - 1.0}
        reserved = metrics.get("peak_gpu_mem_reserved_gib")
        if reserved:
            out.update({"tune/predicted_gpu_reserved_gib": gib(self.predicted_gpu_reserved_bytes),
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
               "tune/gpu_budget_gib": gib(self.gpu_budget_bytes), "tune/gpu_target_gib": gib(self.gpu_target_bytes),
               "tune/host_budget_gib": gib(self.host_budget_bytes),
               "tune/predicted_gpu_peak_gib": gib(self.predicted_gpu_bytes),
               "tune/predicted_gpu_reserved_gib": gib(self.predicted_gpu_reserved_bytes),
               "tune/predicted_host_gib": gib(self.predicted_host_bytes), "tune/trial_s": self.trial_s,
               "tune/keep_activations": self.keep_activations, "tune/kept_pair_gib": gib(self.kept_pair_bytes),
               "tune/device_units": self.device_units, "tune/device_unit_gib": gib(self.device_unit_bytes),
               "tune/host_step_share": self.host_step_share, "tune/canonical": int(self.schedule == "canonical"),
               "tune/canonical_sub_batch_size": self.canonical_sub_batch_size,
               "tune/speedloader_step_s": self.speedloader_step_s, "tune/canonical_step_s": self.canonical_step_s}
        fits = {"gpu": self.gpu_fit, "gpu_reserved": self.gpu_reserved_fit, "host": self.host_fit}
        for name, fit in fits.items():
            if fit is None:
                continue
            out.update({f"tune/{name}_r2": fit.r2, f"tune/{name}_fit_points": fit.num_points})
            for f, c in zip(fit.features, fit.coef):
                key = "intercept_gib" if f == "1" else f.replace("*", "_x_") + "_bytes"
                out[f"tune/{name}_coef_{key}"] = gib(c) if f == "1" else c
        for k, m in enumerate(self.measurements):
            measured = {"gpu": m.gpu_peak_bytes, "gpu_reserved": m.gpu_reserved_bytes, "host": m.host_bytes}
            for name, predicted in self._fitted(m).items():
                if fits[name] is not None:
                    out.update({f"tune/trial{k}/measured_{name}_gib": gib(measured[name]),
                                f"tune/trial{k}/fitted_{name}_gib": gib(predicted)})
        return out

    def summary(self) -> str:
        """A few lines for the console: the plan, both fits and budgets, a table of the trials."""
        lines = [
            f"plan: n={self.sub_batch_size} sequences per sub-batch (limited by {self.limited_by['sub_batch_size']}), "
            f"N={self.num_sub_batches} sub-batches (limited by {self.limited_by['num_sub_batches']}), blocks_per_unit="
            f"{self.blocks_per_unit}: {self.batch_size} x {self.seq_len} tokens per rank per step",
            f"GPU ({self.gpu_measure}): predicted peak {format_bytes(self.predicted_gpu_bytes)} allocated, "
            f"{format_bytes(self.predicted_gpu_reserved_bytes)} reserved <= {format_bytes(self.gpu_target_bytes)} (budget "
            f"{format_bytes(self.gpu_budget_bytes)} from {self.gpu_budget_source}, less {self.gpu_margin:.0%}); allocated "
            f"{self.gpu_fit.describe()}",
            f"keep_activations={self.keep_activations} of {num_units(self.num_layers, self.blocks_per_unit)} x "
            f"{self.num_sub_batches} (unit, sub-batch) pairs skip the recompute ({format_bytes(self.kept_pair_bytes)} each, "
            "in the GPU memory the plan leaves over)",
            f"host (exact accounting): predicted {format_bytes(self.predicted_host_bytes)} <= budget "
            f"{format_bytes(self.host_budget_bytes)} ({self.host_budget_source}); {self.host_fit.describe(1.0, 'B')}",
            "| trial | n | N | blocks/unit | GPU GiB measured | fitted | reserved GiB measured | fitted "
            "| host GiB measured | predicted | step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
        if self.device_units or self.device_unit_bytes:
            each = format_bytes(self.device_unit_bytes) if self.device_unit_bytes else "as configured"
            host = (f"; the overlapped CPU step predicted at {self.host_step_share:.2f} of the forward+backward, at "
                    f"most {HOST_STEP_SHARE} wanted" if self.host_step_share else "")
            lines.insert(3, f"device_units={self.device_units}: the first {self.device_units} unit(s) keep their "
                            f"states on the GPU ({each} a unit; unit 1's CPU optimizer step then does not delay the "
                            f"next step{host})")
        if self.gpu_reserved_fit is not None:
            lines.insert(2, f"GPU reserved (allocator settings: {self.gpu_allocator_settings or 'defaults'}): "
                            f"{self.gpu_reserved_fit.describe()}")
        for k, m in enumerate(self.measurements):
            fitted = self._fitted(m)
            reserved = (f"{gib(m.gpu_reserved_bytes):.3f} | {gib(fitted['gpu_reserved']):.3f}"
                        if self.gpu_reserved_fit is not None else "- | -")
            lines.append(f"| {k} | {m.sub_batch_size} | {m.num_sub_batches} | {m.blocks_per_unit} | "
                         f"{gib(m.gpu_peak_bytes):.3f} | {gib(fitted['gpu']):.3f} | {reserved} | "
                         f"{gib(m.host_bytes):.3f} | {gib(fitted['host']):.3f} | {m.step_s:.2f} |")
        if self.schedule_reason:
            lines.append(f"schedule: {self.schedule} ({self.schedule_reason})")
        lines.append("run it: " + " ".join(self.overrides()))
        return "\n".join(lines)


def _largest(ok: Callable[[int], bool], cap: Optional[int]) -> int:
    """The largest k in [1, cap] with ok(k) (ok monotone: true up to some k); 0 if ok(1) is false."""
    hi = min(cap or HARD_CAP, HARD_CAP)
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
    target_batch_size: Optional[int] = None, keep_activations: Optional[int] = None,
    device_units: Optional[int] = None, device_unit_bytes_per_block: int = 0,
    cap_names: Optional[dict[str, str]] = None, **plan_fields,
) -> TunePlan:
    """Fits the two memory models to ``measurements`` and picks the plan (no model runs here).

    n: the largest sub-batch size for which one sub-batch fits both budgets; N: then the largest number
    of sub-batches that fits both (GPU memory does not depend on N unless the activations are on the
    GPU). The GPU budget holds for the peak allocated and, when the trials measured it (CUDA), the peak
    reserved. With several ``blocks_per_unit`` candidates the plan with the most sequences per step wins
    (then the larger n, then the smaller blocks_per_unit). ``plan_fields``: more :class:`TunePlan`
    fields (budget sources, device, ...). Raises ``ValueError`` naming the budget that cannot hold one
    sequence per sub-batch. ``keep_activations``: None plans it (as many kept pairs as the GPU memory left over
    holds, from the trials' ``kept_pair_bytes``), an integer keeps it. ``device_units``: an integer keeps it (the
    trials ran with it); None plans it: unit 1's states on the GPU (``device_unit_bytes_per_block`` x blocks per
    unit) when the memory left over holds them, before any kept pair (measured per GB, unit 1 was worth more than
    kept activations: docs/results.md); 0 bytes per block: not planned (no CUDA, or nothing offloaded).
    ``cap_names``: what ``limited_by`` calls a cap (key: the argument's name), e.g. the setting it came from.
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
    gpu_rows = [gpu_values(m.sub_batch_size, m.blocks_per_unit) for m in measurements]
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
    names = {**{name: name for name in caps}, **(cap_names or {})}
    choices = [c for c in (_choose(plan, b, names=names, **caps) for b in candidates) if c is not None]
    if not choices:
        raise _too_small_error(plan, candidates[0])
    _, n, N, b, limited = max(choices, key=lambda c: c[0])
    plan.sub_batch_size, plan.num_sub_batches, plan.blocks_per_unit, plan.limited_by = n, N, b, limited
    plan.target_batch_size = target_batch_size
    plan.predicted_gpu_bytes = int(plan.predict_gpu_bytes(n, N, b))
    plan.predicted_gpu_reserved_bytes = int(plan.predict_gpu_reserved_bytes(n, N, b))
    plan.predicted_host_bytes = int(plan.predict_host_bytes(n, N, b))
    _plan_device_units(plan, device_units, device_unit_bytes_per_block * b,
                       [m for m in measurements if m.blocks_per_unit == b])
    plan.keep_activations, plan.kept_pair_bytes = _kept_pairs(plan, [m for m in measurements if m.blocks_per_unit == b])
    if keep_activations is not None:
        plan.keep_activations = keep_activations
    elif plan.keep_activations > 1:  # the trials' peaks hold one kept pair; the others come on top
        extra = (plan.keep_activations - 1) * plan.kept_pair_bytes
        plan.predicted_gpu_bytes += extra
        plan.predicted_gpu_reserved_bytes += extra
    return plan


def _plan_device_units(plan: TunePlan, given: Optional[int], unit_bytes: int,
                       measurements: Sequence[Measurement]) -> None:
    """``device_units``: ``given`` as it is (the trials held those states), else as many as the CPU step needs
    (``HOST_STEP_SHARE``; at least 1) and the GPU memory left under the target holds (their bytes added to the
    predicted peak), else 0. Unit 1 always: its CPU step starts only when the backward ends, and the next step waits
    for it. More where an overlapped CPU step would outlast what the backward hides."""
    if given is not None:
        plan.device_units = given
        return
    if unit_bytes <= 0:
        return
    plan.device_unit_bytes = unit_bytes
    left = plan.gpu_target_bytes - max(plan.predicted_gpu_bytes, plan.predicted_gpu_reserved_bytes)
    fit = min(int(left // unit_bytes), num_units(plan.num_layers, plan.blocks_per_unit))
    if fit < 1:
        return
    share = _host_step_share(plan, measurements, unit_bytes)
    # the fewest units whose CPU step is within the share wanted; all that fit when none is; 1 when nothing was timed
    plan.device_units = 1 if share is None else next((k for k in range(1, fit + 1) if share(k) <= HOST_STEP_SHARE), fit)
    plan.host_step_share = share(plan.device_units) if share else 0.0
    plan.predicted_gpu_bytes += plan.device_units * unit_bytes
    plan.predicted_gpu_reserved_bytes += plan.device_units * unit_bytes


def _host_step_share(plan: TunePlan, measurements: Sequence[Measurement],
                     unit_bytes: int) -> Optional[Callable[[int], float]]:
    """K -> the overlapped CPU step with units 1 .. K on the GPU over the plan's forward+backward, both predicted
    from the timed trials (which ran with every unit offloaded); None when they timed no CPU step. The CPU step does
    not depend on the batch and shrinks with the parameters it updates; the forward+backward is taken without
    recompute (a recomputed pair runs its forward, a third of its forward+backward, again), the least the run's
    backward can hide behind, on a line fitted to the trials' sequences per step."""
    timed = [m for m in measurements if m.fwd_bwd_s > 0 and m.host_step_s > 0 and m.host_step_params > 0]
    if not timed:
        return None
    rows = [{"sequences": m.sub_batch_size * m.num_sub_batches} for m in timed]
    seconds = [m.fwd_bwd_s / (1.0 + m.recomputed_share / 3.0) for m in timed]
    line = fit_linear(rows, seconds, ("1", "sequences")) if len({r["sequences"] for r in rows}) > 1 else None
    if line is not None and line.coef[1] > 0.0:
        fwd_bwd = line.predict({"sequences": plan.batch_size})
    else:  # one batch size, or noise: in proportion to the largest trial's
        largest = max(range(len(rows)), key=lambda k: rows[k]["sequences"])
        fwd_bwd = seconds[largest] * plan.batch_size / rows[largest]["sequences"]
    host_s = sum(m.host_step_s for m in timed) / len(timed)
    params = max(m.host_step_params for m in timed)
    unit_params = unit_bytes / DEVICE_STATE_BYTES_PER_PARAM
    return lambda k: host_s * max(0.0, params - k * unit_params) / params / fwd_bwd


def _kept_pairs(plan: TunePlan, measurements: Sequence[Measurement]) -> tuple[int, int]:
    """(keep_activations, bytes per kept pair) at the plan's n: as many pairs as the GPU memory left under the
    target holds. A kept pair's bytes grow with its sequences; the trials that measured them kept one pair each,
    which their peaks (and so the fits) already hold. (0, 0) when the trials kept none (CPU, or not asked)."""
    measured = [m for m in measurements if m.kept_pair_bytes > 0]
    if not measured:
        return 0, 0
    pair = max(m.kept_pair_bytes / m.sub_batch_size for m in measured) * plan.sub_batch_size  # the larger slope
    left = plan.gpu_target_bytes - max(plan.predicted_gpu_bytes, plan.predicted_gpu_reserved_bytes)
    pairs = num_units(plan.num_layers, plan.blocks_per_unit) * plan.num_sub_batches
    return min(pairs, 1 + max(0, int(left // pair))), int(pair)


def _fits(plan: TunePlan, n: int, N: int, b: int) -> tuple[bool, bool]:
    """(GPU fits, host fits) for the plan's fitted models at (n, N, b), to the byte (the fit's rounding aside)."""
    return (round(plan.predict_gpu_reserved_bytes(n, N, b)) <= plan.gpu_target_bytes,  # >= the allocated peak
            round(plan.predict_host_bytes(n, N, b)) <= plan.host_budget_bytes)


def _choose(plan: TunePlan, b: int, *, max_sub_batch_size: Optional[int], max_num_sub_batches: Optional[int],
            target_batch_size: Optional[int], names: dict[str, str]) -> Optional[tuple]:
    """((sort key), n, N, b, limited_by) for blocks_per_unit b, or None if not one sequence fits."""
    n_cap = _min_cap((max_sub_batch_size, names["max_sub_batch_size"]),
                     (target_batch_size, names["target_batch_size"]))
    n = _largest(lambda k: all(_fits(plan, k, 1, b)), n_cap[0])
    if n == 0:
        return None
    if n == HARD_CAP:
        raise ValueError("neither budget bounds the sub-batch size (no memory grows with it in the fits); "
                         "set target_batch_size or max_sub_batch_size")

    def n_times(size: int) -> tuple[int, tuple[Optional[int], str]]:  # (the largest N that fits at n = size, N's cap)
        cap = _min_cap((max_num_sub_batches, names["max_num_sub_batches"]),
                       (target_batch_size // size if target_batch_size else None, names["target_batch_size"]))
        return _largest(lambda k: all(_fits(plan, size, k, b)), cap[0]), cap

    def limit(value: int, cap: tuple[Optional[int], str], next_fits: tuple[bool, bool]) -> str:
        if cap[0] is not None and value >= cap[0]:
            return cap[1]
        return "host budget" if next_fits[0] else "gpu budget"

    N, N_cap = n_times(n)
    n_limit = limit(n, n_cap, _fits(plan, n + 1, 1, b))
    # A target the largest n does not divide (n x N short of it): the largest smaller n that divides it and whose N
    # fits the whole of it (8 x 4 rather than 13 x 2 for 32); none: n x N stays short (the plan's target_warning).
    if target_batch_size and n * N < target_batch_size:
        for k in (k for k in range(n - 1, 0, -1) if target_batch_size % k == 0):
            K, K_cap = n_times(k)
            if k * K == target_batch_size:
                # the n that fit stays in the label: a target with a divisor nearer it runs larger sub-batches
                n, N, N_cap, n_limit = k, K, K_cap, f"{names['target_batch_size']} (the largest n dividing it; {n} fit)"
                break
    limited = {"sub_batch_size": n_limit, "num_sub_batches": limit(N, N_cap, _fits(plan, n, N + 1, b))}
    return (N * n, n, -b), n, N, b, limited


def _too_small_error(plan: TunePlan, b: int) -> ValueError:
    """The error when not even n = N = 1 fits: it names the budget, what one sequence needs, what to change."""
    s = plan.seq_len
    if not _fits(plan, 1, 1, b)[0]:
        return ValueError(
            f"GPU memory budget too small for even one sub-batch: one sequence of {s} tokens per sub-batch "
            f"(blocks_per_unit={b}) needs a predicted peak of {format_bytes(plan.predict_gpu_bytes(1, 1, b))} allocated, "
            f"{format_bytes(plan.predict_gpu_reserved_bytes(1, 1, b))} reserved (fitted from the trial steps: "
            f"{plan.gpu_fit.describe()}), but the budget is {format_bytes(plan.gpu_budget_bytes)} "
            f"from {plan.gpu_budget_source}, {format_bytes(plan.gpu_target_bytes)} after the {plan.gpu_margin:.0%} "
            "margin. Raise schedule.gpu_memory_budget_gib (or max_gpu_memory_gib), shorten data.seq_len, or offload "
            "the parameters (offload=params)")
    d0, per_token = plan.host_fit.coef
    return ValueError(
        f"host memory budget too small for even one sub-batch: the model states and the activation slots of one "
        f"sequence of {s} tokens (blocks_per_unit={b}) need {format_bytes(plan.predict_host_bytes(1, 1, b))} "
        f"({format_bytes(d0)} fixed + {per_token:.0f} bytes x {num_units(plan.num_layers, b) + 1} slots x {s} "
        f"tokens), but the budget is {format_bytes(plan.host_budget_bytes)} ({plan.host_budget_source}). Raise "
        "schedule.host_memory_budget_gib or, if this machine has more memory than it reports, set "
        "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB; or shorten data.seq_len, or raise schedule.blocks_per_unit")
