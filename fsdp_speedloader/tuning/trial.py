"""Trial steps for the tuner: a throw-away copy of the model, and the memory one training step takes.

``TrialModel`` builds the model exactly as a run does (meta -> ``apply_speedloader`` with the run's
``SpeedLoaderOptions`` -> materialise, the run's optimizers), and ``measure(n)`` runs one step (forward,
backward, optimizer step) at sub-batch size n and returns a :class:`Measurement`:

- GPU: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the step, the caching
  allocator's cache emptied first so that the reserved peak is the step's own (fragmentation included:
  a memory cap limits reserved memory, not allocated). Without CUDA the CPU stands in for the GPU:
  the bytes of the model states resident on the compute device (those not offloaded) plus the highest
  net allocation during the step, from the profiler's allocator events (``torch.profiler`` with
  ``profile_memory=True``). It follows the same law as GPU memory, so the tuner runs and is testable
  on a CPU; the figures then mean CPU memory.
- Host, exactly (``measure_host_bytes``): the activation store's pinned arena as a fresh one would be
  planned at this geometry (activations, parameter shards, ..., with alignment), every other host
  storage of parameters, gradients and optimizer state (when offloaded), and on CUDA the page-locked
  blocks of PyTorch's caching host allocator in use at the step's end (FSDP2's gradient copies when
  they are not arena slots, with that allocator's rounding). Only the activation slots depend on n and
  N (``Measurement.host_activation_bytes``); the tuner takes the rest as a constant.

``prime`` does the one-time work first, in one step at lr 0 (FSDP lazy init, planning the arena at the
largest trial geometry and moving the parameter shards into it, first-backward buffers, the optimizer
state), and ``measure`` primes again when the sub-batch size changed (buffers sized for the last one,
such as the exchange's ring, would otherwise still hold reserved memory), so every measured step is a
steady-state step at its own geometry. Several ranks measure together: each figure is the maximum over
ranks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_speedloader.engine.activation_store import DeviceActivationStore
from fsdp_speedloader.engine.speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.memory.arena import ALIGNMENT
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer
from fsdp_speedloader.models.config import ModelConfig
from fsdp_speedloader.options import SpeedLoaderOptions
from fsdp_speedloader.parallel import compute_device


def _align(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


ACTIVATION_STORAGES = ("arena", "pinned", "pageable", "device")


def slot_host_bytes(nbytes: int, storage: str) -> int:
    """Host bytes that activation slots of ``nbytes`` take, as the store holds them: 'arena' (the exchange
    store: one arena slot, 512-byte aligned), 'pinned' (the synchronous store on CUDA: one block of
    PyTorch's caching host allocator, which rounds up to a power of two), 'pageable' (that store on the
    CPU: as is) or 'device' (none on the host)."""
    if storage == "arena":
        return _align(nbytes)
    if storage == "pinned":
        return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
    assert storage in ACTIVATION_STORAGES, storage
    return nbytes if storage == "pageable" else 0


def cuda_allocator_settings() -> str:
    """The CUDA caching allocator's settings in effect ('' for the defaults, e.g. no expandable segments).
    The trials' reserved memory holds for a run under the same settings."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch >= 2.9
    return (get() if get is not None else "") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or \
        os.environ.get("PYTORCH_ALLOC_CONF", "")


@dataclass
class Measurement:
    """One trial step: its geometry and the memory it took (bytes; the maximum over ranks)."""

    sub_batch_size: int
    num_sub_batches: int
    blocks_per_unit: int
    seq_len: int
    num_slots: int
    """Activation slots: units + 1."""
    gpu_peak_bytes: int
    """Peak GPU memory allocated during the step (the CPU stand-in without CUDA)."""
    host_bytes: int
    """Host memory, exactly: the sum of ``host_breakdown``."""
    host_breakdown: dict = field(default_factory=dict)
    gpu_reserved_bytes: int = 0
    """Peak reserved by the CUDA caching allocator during the step (0 on CPU: not measured)."""
    activation_bytes_per_token: int = 0
    """Bytes of one token's activation in one slot (h x element size)."""
    activation_storage: str = "arena"
    """Where the activation slots live: one of ``ACTIVATION_STORAGES`` (``slot_host_bytes``)."""
    step_s: float = 0.0
    kept_pair_bytes: int = 0
    """With ``keep_activations``: the GPU memory one kept (unit, sub-batch) pair held (0: none kept, or no CUDA)."""
    fwd_bwd_s: float = 0.0
    """The step's forward and backward, the GPU synchronized after it (0: not timed, the CPU stand-in)."""
    recomputed_share: float = 0.0
    """Of the step's (unit, sub-batch) pairs, the share whose blocks ran again in the backward (not kept)."""
    host_step_s: float = 0.0
    """An overlapped optimizer's busy seconds in the step: the CPU AdamW of the host states (0: none overlapped)."""
    host_step_params: int = 0
    """Parameters whose states live on the host (this rank's shards): what that CPU step updates."""

    @property
    def activations_on_device(self) -> bool:
        """The activation slots live in GPU memory (activation_store 'device')."""
        return self.activation_storage == "device"

    @property
    def activation_tokens(self) -> int:
        """Tokens held in activation slots: (U + 1) x N x n x s."""
        return self.num_slots * self.num_sub_batches * self.sub_batch_size * self.seq_len

    @property
    def host_activation_bytes(self) -> int:
        """Host bytes of the activation slots (exact, from the geometry); the rest of ``host_bytes`` does not
        depend on n or N."""
        return slot_host_bytes(self.activation_tokens * self.activation_bytes_per_token, self.activation_storage)

    @property
    def device_activation_bytes(self) -> int:
        return self.activation_tokens * self.activation_bytes_per_token if self.activations_on_device else 0


def _state_tensors(model: nn.Module, optimizers: OptimizersContainer, *, grads: bool = True) -> Iterable:
    for p in model.parameters():
        yield p
        if grads and p.grad is not None:
            yield p.grad
    for opt in optimizers:
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _cpu_storage_bytes(tensors: Iterable, *, seen: set, skip_pinned: bool = False) -> int:
    """Bytes of the distinct CPU storages under ``tensors`` (``seen``: storage pointers already counted)."""
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if not (skip_pinned and t.is_pinned()):
            total += storage.nbytes()
    return total


def measure_host_bytes(model: nn.Module, optimizer: OptimizersContainer, *, offload_params: bool) -> dict:
    """Host memory of a layer-major model right after its optimizer step (bytes, exact, this rank).

    ``arena``: the store's arena as a fresh one would be planned at the current geometry;
    ``model_states``: other host storages of parameters, gradients and optimizer state (offloaded);
    ``pinned``: caching-host-allocator blocks in use (CUDA); ``store``: a host store's buffer outside an
    arena (CPU only: on CUDA it is one of the ``pinned`` blocks).
    """
    store = speedloader_engine(model).store
    cuda = store.device.type == "cuda"
    out = {"arena": 0, "arena_activations": 0, "model_states": 0, "pinned": 0, "store": 0}
    seen = set()
    arena = getattr(store, "arena", None)
    if arena is not None and "activations" in arena:
        seen.add(arena.slot("activations").untyped_storage().data_ptr())  # parameter shards in it: counted here
        # The arena may be planned for a larger geometry and re-carved: count this geometry's share.
        out["arena"] = arena.nbytes - _align(arena.capacity("activations")) + _align(store.host_bytes)
        out["arena_activations"] = store.host_bytes
    elif not cuda:
        out["store"] = store.host_bytes
    if offload_params:
        out["model_states"] = _cpu_storage_bytes(_state_tensors(model, optimizer), seen=seen, skip_pinned=cuda)
    if cuda:  # in use now, at the step's end, while every gradient copy is alive
        try:
            stats = torch.cuda.host_memory_stats()
        except (AttributeError, RuntimeError):  # a torch without host allocator statistics
            stats = {}
        out["pinned"] = int(stats.get("active_bytes.current", stats.get("allocated_bytes.current", 0)))
    out["total"] = out["arena"] + out["model_states"] + out["pinned"] + out["store"]
    return out


# What the profiler itself prints, from C++ straight to file descriptor 2, on every profiled step: Kineto's stage
# lines ("USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start", "STAGE:... Completed Stage: Warm Up") and
# c10's warning about blocks allocated before the profiler started (which the step frees: expected here).
_PROFILER_NOISE = re.compile(r"^(?:VERBOSE|INFO|WARNING|STAGE|ERROR|USDT):\d{4}-\d\d-\d\d [^\]]*\.cpp:\d+\] |"
                             r"Memory block of unknown size was allocated before the profiling started")


@contextlib.contextmanager
def _without_profiler_messages() -> Iterator[None]:
    """Holds back what is written to file descriptor 2 meanwhile, then writes it out less the profiler's own lines
    (``_PROFILER_NOISE``): a tuning step is a measurement, and its console shows the trials' results, not the
    profiler's bookkeeping. Anything else written meanwhile (a warning of the step) still reaches stderr."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_NOISE.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def profiled_peak_bytes(fn: Callable[[], None]) -> int:
    """Highest net CPU allocation while ``fn`` runs, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_messages(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")), key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def release_memory(device: torch.device) -> None:
    """After a throw-away model is dropped: its memory back to the system (the GPU's cache, and the page-locked
    host blocks of PyTorch's caching host allocator), so the next trial or the run starts from what it needs."""
    gc.collect()  # FSDP's hooks make reference cycles
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host_cache = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                            or getattr(torch._C, "_host_emptyCache", None))  # the name before torch 2.13
        if empty_host_cache is not None:  # cached page-locked blocks (gradient copies) go back to the OS
            empty_host_cache()


def reduce_over_ranks(values: list[float], op=None) -> list[float]:
    """``values`` reduced over every rank (default: maximum); unchanged with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)  # gloo: the default group has it for CPU tensors
    dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
    return t.tolist()


def default_optimizer(model: nn.Module) -> OptimizersContainer:
    """AdamW over every trainable parameter, fused where supported (its two fp32 moments are what the
    trials must hold)."""

    def adamw(params: list) -> torch.optim.Optimizer:
        try:
            return torch.optim.AdamW(params, fused=True)
        except (RuntimeError, TypeError):
            return torch.optim.AdamW(params, foreach=True)

    return OptimizersContainer(model, adamw)


class TrialModel:
    """A throw-away copy of the model, built and sharded as the run will build it. A context manager:
    leaving it frees the model, its optimizer state and its arena.

    Args:
        model_config: the model.
        options: the engine's options as the run will pass them to ``apply_speedloader`` (with the trial's
            ``num_sub_batches`` and ``blocks_per_unit``).
        mesh: as ``apply_speedloader``; the compute device is this rank's of its device type.
        build_optimizer: the run's optimizers for a model (``default_optimizer``: fused AdamW).
        seed: weights and tokens.
    """

    def __init__(self, model_config: ModelConfig, options: SpeedLoaderOptions, *, mesh: DeviceMesh,
                 build_optimizer: Callable[[nn.Module], OptimizersContainer] = default_optimizer,
                 seed: int = 0) -> None:
        from fsdp_speedloader.models import build_model, materialize_model

        self.options = options
        self.device = device = compute_device(mesh.device_type)
        self.offload_params = options.offload_params
        self.num_sub_batches = options.num_sub_batches
        self.blocks_per_unit = options.blocks_per_unit
        model = build_model(model_config, device="meta")
        model.train()
        apply_speedloader(model, options, mesh=mesh)
        materialize_model(model, model_config, device=device, seed=seed,
                          param_device=torch.device("cpu") if self.offload_params else device)
        self.model = model
        self.optimizer = build_optimizer(model)
        self.generator = torch.Generator().manual_seed(seed)
        self._last_sub_batch_size: Optional[int] = None

    def _ids(self, n: int, seq_len: int) -> torch.Tensor:
        shape = (self.num_sub_batches * n, seq_len)
        return torch.randint(0, self.model.config.vocab_size, shape, generator=self.generator)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prime(self, n: int, seq_len: int) -> None:
        """One-time work before any measured step: one full step at sub-batch size n and lr 0 (lazy init,
        the arena planned for this geometry -- give the largest --, first-backward buffers, the optimizer
        state), so that every measured step is a steady-state step. The weights do not move."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        try:
            self._step(self._ids(n, seq_len))
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        self._last_sub_batch_size = n

    def step(self, n: int, seq_len: int) -> None:
        """One training step at sub-batch size n, the GPU synchronized after it (``schedule_choice`` times it)."""
        self._step(self._ids(n, seq_len))
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()

    def _step(self, ids: torch.Tensor, marks: Optional[list] = None) -> None:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        if marks is not None:  # the forward and backward's end, for the planner's host-step rule
            self._sync()
            marks.append(time.perf_counter())
        self.optimizer.step()  # and the transfer copies it made stale, as in the run
        self.optimizer.wait()  # an overlapped optimizer that clips applies its steps later: all of them, now

    def measure(self, n: int, seq_len: int) -> Measurement:
        """One training step (forward, backward, optimizer step) at sub-batch size n, and its memory."""
        if n != self._last_sub_batch_size:
            self.prime(n, seq_len)
        ids = self._ids(n, seq_len)
        step = functools.partial(self._step, ids)
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # else the reserved peak starts at what earlier (larger) steps left cached
            torch.cuda.reset_peak_memory_stats(self.device)
        step_stats = getattr(self.optimizer, "step_stats", None)  # an overlapped optimizer's worker figures
        if step_stats is not None:
            step_stats()  # from here on: this step's
        marks: list = []
        start = time.perf_counter()
        if self.device.type == "cuda":
            self._step(ids, marks)
            self._sync()
            gpu_peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
        else:  # the CPU stand-in (module docstring)
            resident = 0 if self.offload_params else _cpu_storage_bytes(
                [*_state_tensors(self.model, self.optimizer, grads=False), *self.model.buffers()], seen=set())
            gpu_peak, reserved = resident + profiled_peak_bytes(step), 0
        step_s = time.perf_counter() - start
        fwd_bwd_s = marks[0] - start if marks else 0.0
        host_step_s = step_stats()["optimizer_busy_s"] if step_stats is not None else 0.0
        host = measure_host_bytes(self.model, self.optimizer, offload_params=self.offload_params)
        self.optimizer.zero_grad(set_to_none=True)
        gpu_peak, reserved, host_total, fwd_bwd_s, host_step_s, host_params = reduce_over_ranks(
            [gpu_peak, reserved, host["total"], fwd_bwd_s, host_step_s, self._host_params()])
        store = speedloader_engine(self.model).store
        if isinstance(store, DeviceActivationStore):
            storage = "device"
        elif getattr(store, "arena", None) is not None:
            storage = "arena"
        else:  # the synchronous host store: page-locked through PyTorch's allocator on CUDA
            storage = "pinned" if store.device.type == "cuda" else "pageable"
        return Measurement(
            sub_batch_size=n, num_sub_batches=self.num_sub_batches, blocks_per_unit=self.blocks_per_unit,
            seq_len=seq_len, num_slots=store.num_slots, gpu_peak_bytes=int(gpu_peak), host_bytes=int(host_total),
            host_breakdown=host, gpu_reserved_bytes=int(reserved),
            activation_bytes_per_token=store.shape[-1] * torch.empty((), dtype=store.dtype).element_size(),
            activation_storage=storage, step_s=step_s,
            kept_pair_bytes=int(reduce_over_ranks([speedloader_engine(self.model).stats()["kept_pair_bytes"]])[0]),
            fwd_bwd_s=fwd_bwd_s, recomputed_share=self._recomputed_share(store.num_slots - 1), host_step_s=host_step_s,
            host_step_params=int(host_params))

    def _host_params(self) -> int:
        """This rank's parameter elements whose states live on the host."""
        local = (p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters())
        return sum(t.numel() for t in local if t.device.type == "cpu") if self.offload_params else 0

    def _recomputed_share(self, units: int) -> float:
        """The share of (unit, sub-batch) pairs that do not keep their activations (``keep_activations``)."""
        pairs = units * self.num_sub_batches
        return 1.0 - min(self.options.keep_activations, pairs) / pairs if pairs else 0.0

    def close(self) -> None:
        """Frees the model, its optimizer state and its arena (host and GPU memory go back)."""
        if self.model is None:
            return
        store = speedloader_engine(self.model).store
        if hasattr(store, "close"):
            store.close()
        self.optimizer.close()  # an overlapped optimizer's worker thread
        for opt in self.optimizer:
            opt.state.clear()
        self.model = self.optimizer = None
        release_memory(self.device)

    def __enter__(self) -> "TrialModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
