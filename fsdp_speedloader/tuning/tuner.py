"""One-shot tuner: two trial steps, a linear memory model (``fit.py``), and the plan that fills GPU and host
memory (``plan.py``).

SpeedLoader's hyperparameter strategy (paper 3.3, A.2). With everything else fixed, memory is linear
(docs/design.md §7):

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

import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_speedloader.memory.arena import HostMemoryBudget
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.options import SpeedLoaderOptions
from fsdp_speedloader.tuning.plan import DEFAULT_GPU_MARGIN, DEVICE_STATE_BYTES_PER_PARAM, TunePlan, gib, \
    plan_from_measurements
from fsdp_speedloader.tuning.trial import Measurement, TrialModel, cuda_allocator_settings, default_optimizer, \
    reduce_over_ranks

log = logging.getLogger(__name__)


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
    plan_keep_activations: bool = True,
    plan_device_units: bool = True,
    trial_sub_batch_sizes: tuple[int, int] = (2, 4),
    trial_num_sub_batches: int = 2,
    gpu_margin: float = DEFAULT_GPU_MARGIN,
    mesh: Optional[DeviceMesh] = None,
    build_optimizer: Optional[Callable[[nn.Module], OptimizersContainer]] = None,
    seed: int = 0,
    budget_names: tuple[str, str] = ("gpu_memory_budget_bytes", "host_memory_budget_bytes"),
    cap_names: Optional[dict[str, str]] = None,
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
        plan_keep_activations: plan ``keep_activations`` (the trials keep one pair to measure its bytes; the plan
            keeps as many as the GPU memory left over holds); False: the trials and the plan keep
            ``options.keep_activations``.
        plan_device_units: with offloaded parameters on CUDA and ``options.device_units`` 0, plan it: unit 1's
            states on the GPU when the memory left over holds them (16 B per parameter), before kept pairs.
            False, or ``options.device_units`` set: the plan keeps the options' value (the trials ran with it).
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
        cap_names: what the plan's ``limited_by`` calls each cap (``max_sub_batch_size``, ``max_num_sub_batches``,
            ``target_batch_size``) that stopped n or N; default: the argument's name.
        overrides: fields of ``SpeedLoaderOptions`` as keywords, applied over ``options`` (as
            ``apply_speedloader`` takes them): ``tune(model, seq_len=4096, offload_params=True)``.
    Returns:
        The :class:`TunePlan`. Raises ``ValueError`` when a budget cannot hold one sequence per sub-batch.
    """
    options = (options or SpeedLoaderOptions()).replace(**overrides)
    if plan_keep_activations:
        options = options.replace(keep_activations=1)
    trials = _prepare(options, tune_blocks_per_unit=tune_blocks_per_unit, trial_sub_batch_sizes=trial_sub_batch_sizes,
                      trial_num_sub_batches=trial_num_sub_batches, mesh=mesh,
                      gpu_memory_budget_bytes=gpu_memory_budget_bytes,
                      host_memory_budget_bytes=host_memory_budget_bytes, budget_names=budget_names)
    start = time.perf_counter()
    measurements = _run_trials(model, trials, seq_len, build_optimizer=build_optimizer or default_optimizer, seed=seed)
    budgets = _after_trials(trials.budgets, host_given=host_memory_budget_bytes is not None, device=trials.device)
    plan_units = (plan_device_units and options.offload_params and options.device_units == 0
                  and trials.device.type == "cuda")
    plan = plan_from_measurements(
        measurements, num_layers=model_num_layers(model), gpu_margin=gpu_margin,
        blocks_per_unit=[o.blocks_per_unit for o in trials.options], max_sub_batch_size=max_sub_batch_size,
        max_num_sub_batches=max_num_sub_batches, target_batch_size=target_batch_size,
        keep_activations=None if plan_keep_activations else options.keep_activations,
        device_units=None if plan_units else options.device_units,
        device_unit_bytes_per_block=device_unit_bytes_per_block(model, trials.mesh) if plan_units else 0,
        cap_names=cap_names, trial_s=time.perf_counter() - start, **budgets.plan_fields(),
        **_device_fields(trials.device))
    if not dist.is_initialized() or dist.get_rank() == 0:
        target_name = (cap_names or {}).get("target_batch_size", "target_batch_size")
        for warning in (plan.target_warning(target_name), plan.single_sub_batch_warning(budget_names)):
            if warning is not None:
                log.warning(warning)
        if plan.whole_batch_fits():
            log.info("the whole target batch fits one sub-batch: N=1 (n=%d), each unit loaded once per direction for "
                     "all of it; layer-major (N >= 2) is for batches the budget cannot hold at once, where it saves "
                     "loads (to force it: schedule=speedloader schedule.num_sub_batches=2)", plan.sub_batch_size)
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


def _after_trials(budgets: "Budgets", *, host_given: bool, device: torch.device) -> "Budgets":
    """A detected host budget measured again after the trials, the smaller taken: what the process holds once they
    ran (the allocator's kept pages, the trial model's leftovers) is held by the run too, and a plan made with the
    memory before them filled the host to the brim and failed the run's own arena check."""
    if host_given and device.type == "cuda":
        return budgets
    gc.collect()
    after = HostMemoryBudget.detect()
    available = int(reduce_over_ranks([after.available_bytes], dist.ReduceOp.MIN)[0])
    host, host_source = budgets.host_bytes, budgets.host_source
    if not host_given and available < host:
        host, host_source = available, f"detected after the trials: {after.describe()}"
    gpu, gpu_source = budgets.gpu_bytes, budgets.gpu_source
    if device.type != "cuda" and gpu_source.startswith("the CPU stand-in") and available < gpu:
        gpu = available
    return Budgets(gpu, gpu_source, host, host_source)


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
        gpu_source = f"the device's {gib(total):.1f} GiB" + (f" x fraction {fraction:.3f}" if fraction < 1 else "")
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
                     "%.2f s", n, m.num_sub_batches, m.blocks_per_unit, gib(m.gpu_peak_bytes),
                     gib(m.gpu_reserved_bytes), gib(m.host_bytes), m.step_s)
    return out[::-1]


def _device_fields(device: torch.device) -> dict:
    """The plan's record of how GPU memory was measured on ``device``."""
    if device.type == "cuda":
        return {"device": "cuda", "gpu_measure": "torch.cuda.max_memory_allocated, max_memory_reserved",
                "gpu_allocator_settings": cuda_allocator_settings()}
    return {"device": device.type, "gpu_measure": "CPU stand-in: resident model states + profiled peak allocation"}


def device_unit_bytes_per_block(model: ModelConfig, mesh: DeviceMesh) -> int:
    """GPU bytes of one block's states on one rank when its unit stays on the GPU (``device_units``): the largest
    block's parameters over the ranks that shard them, times ``DEVICE_STATE_BYTES_PER_PARAM``."""
    from fsdp_speedloader.models import build_model, get_adapter
    from fsdp_speedloader.parallel import shard_size

    blocks = get_adapter(build_model(model, device="meta")).blocks
    shards = shard_size(mesh)
    largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    return -(-largest // shards) * DEVICE_STATE_BYTES_PER_PARAM


def model_num_layers(model: ModelConfig) -> int:
    """Transformer blocks of the model (read from the checkpoint's config when ``model.path`` is set)."""
    if model.path is None:
        return model.num_layers
    from fsdp_speedloader.models import build_hf_config

    return build_hf_config(model).num_hidden_layers
