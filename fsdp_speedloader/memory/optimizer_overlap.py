"""The optimizers of a training step, behind one interface: ``OptimizersContainer`` (one optimizer over the
model, stepped after backward) and ``OverlappedOptimizer`` (one per unit, stepped beside the layer-major
backward, or beside the next forward when it clips). The trainer and the tuner's trials hold either without
asking which (torchtitan's ``OptimizersContainer`` / ``OptimizersInBackwardContainer``):

- ``step()`` then ``zero_grad()``; ``step`` clips the global gradient norm to ``max_norm`` first
  (``torch.nn.utils.clip_grad_norm_``'s result, bit for bit), skips the whole step when that norm is not finite
  (``skip_nonfinite``; ``last_step_skipped``, ``num_skipped_steps``), and casts the parameter transfer copies
  (``param_transfer_dtype``) that it made stale, so the next forward's unshards find them fresh;
- ``call_after_step(i, fn)``: ``fn`` once inner optimizer i's step is applied (an LR scheduler's step);
  ``wait()``: until every step issued is applied (before a checkpoint, or reading the parameters elsewhere);
- ``param_groups`` (every inner optimizer's), and the inner ``optimizers`` themselves (iterating the container
  yields them): LR schedulers wrap each, and ``torch.distributed.checkpoint.state_dict`` takes the container
  where it takes a list of optimizers;
- ``state_dict()`` / ``load_state_dict()``: DCP's optimizer state, keyed by parameter name
  (``get_optimizer_state_dict(model, optimizers)``), the layout checkpoints have always held;
- ``close()``: the overlapped one's worker thread stops (a no-op for the plain one).

Overlap. With parameters offloaded, AdamW runs on the host and, done after backward, adds its whole time to
the step (docs/design.md §9). In layer-major backward, unit l's gradient is final once FSDP's post-backward
for unit l has reduce-scattered it and copied it to the host; units l-1 .. 1 still have their backward to
run on the GPU. Without clipping, ``OverlappedOptimizer`` steps unit l's parameters in a worker thread right
then, so only the first unit and the root (embeddings, final norm, LM head) remain after ``loss.backward()``.

Clipping (``max_norm > 0``) or ``skip_nonfinite`` needs every gradient before any step. Then the worker only
takes each unit's per-tensor gradient norms as the gradients land; ``step()`` forms the global norm at the
end of backward and hands the worker the steps in forward order (the root, units 1 .. U), each unit's
gradients scaled just before its step; ``step()`` returns at once, and the next forward's unit l waits only for
the steps that its unshard (and prefetch) reads. The same bits as clip-then-step (``grad_clip.py``).

Exact: every unit is stepped once per optimizer step with its final gradient, in both modes. With
``param_transfer_dtype`` the worker also casts each unit's transfer copies right after that unit's step; the
main thread casts only those of the units it steps itself.

In-flight gradient slots (immediate mode, ``grad_slots_in_flight=R > 0``, the default 4): the units' host gradients
need not outlive the backward, so the arena holds R regions of one unit's gradients instead of a slot per
parameter (``fsdp2/grad_slots.py``, ``GradRing``; the root keeps its own). Unit l's gradients land in a free
region; the worker steps unit l, drops its gradients (``.grad`` is None from then on: read nothing from a unit's
``.grad`` after the backward) and releases the region; a unit whose region is not free yet waits for that release
before FSDP2 queues its copies (``num_grad_ring_waits``). The same copies into other memory: the same bits.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import weakref
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.fsdp2 import fsdp_params_of
from fsdp_speedloader.fsdp2.counters import COUNTERS
from fsdp_speedloader.memory.grad_clip import NormTable, clip_coefficient, clip_grads_, coefficients_by_device, \
    full_value, scale_grads_, tensor_norms, total_norm
from fsdp_speedloader.memory.threads import pin_calling_thread, set_thread_num_threads

BuildOptimizer = Callable[[list], torch.optim.Optimizer]
"""Makes one inner optimizer for a list of parameters, e.g. ``lambda params: torch.optim.AdamW(params, lr=1e-4)``."""


class OptimizersContainer:
    """One optimizer, ``build(params)``, over every trainable parameter of ``model``, stepped after backward::

        optimizers = OptimizersContainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
                                         max_norm=1.0, skip_nonfinite=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers.step()        # clip_grad_norm_(model.parameters(), 1.0), then the step unless the norm is inf/nan
        optimizers.zero_grad()

    Args:
        max_norm: clip the global 2-norm of the gradients to this (``clip_grad_norm_``); 0: no clipping.
        skip_nonfinite: a step whose global gradient norm is inf or nan changes nothing (no parameter, no
            optimizer state); ``last_step_skipped`` says so and ``num_skipped_steps`` counts them.
    """

    def __init__(self, model: nn.Module, build: BuildOptimizer, *, max_norm: float = 0.0,
                 skip_nonfinite: bool = False) -> None:
        if not max_norm >= 0:
            raise ValueError(f"max_norm={max_norm}: use a norm > 0 to clip, or 0 not to")
        self.model = model
        self.max_norm = float(max_norm)
        self.skip_nonfinite = skip_nonfinite
        self._engine = speedloader_engine(model, missing_ok=True)  # None: a model without the layer-major engine
        self._param_lists = self._partition(model)
        self.optimizers: list[torch.optim.Optimizer] = [build(params) for params in self._param_lists]
        self.last_grad_norm: Optional[torch.Tensor] = None  # the last step's global norm (before clipping)
        self.last_step_skipped = False
        self.num_skipped_steps = 0

    def _partition(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """The parameters of each inner optimizer: those in host memory, then those on the device (the root with
        ``offload_root=False``, ``device_units``), so that ``build`` may give each its own kind (compressed
        states for the host's only: ``app.optim.build_adamw``). Element-wise steps: the split changes no bit."""
        params = [p for p in model.parameters() if p.requires_grad]
        host = [p for p in params if p.device.type == "cpu"]
        device = [p for p in params if p.device.type != "cpu"]
        return [side for side in (host, device) if side] or [[]]

    @property
    def needs_grad_norm(self) -> bool:
        """Whether ``step`` computes the global gradient norm (to clip, or to skip a non-finite step)."""
        return self.max_norm > 0 or self.skip_nonfinite

    @property
    def param_groups(self) -> list[dict]:
        """Every inner optimizer's parameter groups (the dicts themselves: setting ``lr`` in one takes effect)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self) -> None:
        """Clips (``max_norm``), then steps every inner optimizer unless the step is skipped (``skip_nonfinite``),
        then casts the transfer copies the step made stale (a no-op without ``param_transfer_dtype``): now,
        rather than in the next forward's unshards."""
        self.last_grad_norm, self.last_step_skipped = None, False
        if self.needs_grad_norm:
            norm = clip_grads_([p.grad for p in self.model.parameters() if p.grad is not None], self.max_norm)
            if self._record_norm(norm):
                return
        for opt in self.optimizers:
            opt.step()
        self._refresh_param_transfer()

    def _record_norm(self, norm: torch.Tensor) -> bool:
        """Keeps the step's global gradient norm; True (and counted) when the step is to be skipped. The same
        decision on every rank: the norm is global. Reads the norm on the host (a device sync when it is there)."""
        self.last_grad_norm = full_value(norm)
        self.last_step_skipped = self.skip_nonfinite and not bool(torch.isfinite(self.last_grad_norm))
        self.num_skipped_steps += int(self.last_step_skipped)
        return self.last_step_skipped

    def _refresh_param_transfer(self, index: Optional[int] = None) -> None:
        if self._engine is not None:
            self._engine.refresh_param_transfer(index)

    def call_after_step(self, index: int, fn: Callable[[], None]) -> None:
        """Calls ``fn`` once inner optimizer ``index``'s step, issued by the last ``step()``, is applied: here at
        once (``step`` returns when it is)."""
        fn()

    def wait(self) -> None:
        """Blocks until every step issued so far is applied (here, ``step`` returns when it is)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The optimizer state keyed by parameter name, every inner optimizer in one dict (DCP's layout: what
        ``get_state_dict(model, optimizers)`` gives, so any split of the parameters saves alike)."""
        self.wait()
        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state: dict) -> None:
        """Loads :meth:`state_dict`'s layout (each inner optimizer takes the state of its own parameters)."""
        self.wait()
        set_optimizer_state_dict(self.model, self.optimizers, state)

    def close(self) -> None:
        """Stops what runs beside the optimizers (nothing here; the overlapped one's worker thread)."""


class OverlappedOptimizer(OptimizersContainer):
    """One optimizer per unit (and one for the root), stepped as soon as that unit's gradients land, or, when it
    clips or skips non-finite steps, as soon as the global norm is known, while the next forward runs.

    Use in place of :class:`OptimizersContainer` (``model`` prepared with ``apply_speedloader``)::

        optimizers = OverlappedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()          # units U .. 2 are stepped while backward runs
        optimizers.step()        # steps unit 1 and the root, waits for all steps
        optimizers.zero_grad()

    Units whose states stay on the device (``device_units``; the root with ``offload_root=False``) are stepped by
    ``step()`` on the calling thread, as device kernels, in either mode.

    With ``max_norm > 0`` or ``skip_nonfinite`` (deferred steps)::

        loss.backward()          # each unit's per-tensor gradient norms, while backward runs
        optimizers.step()        # the global norm (an all-reduce); the steps are queued in forward order
        scheduler.step()         # an LR scheduler over the inner optimizers: see call_after_step
        optimizers.zero_grad()   # each unit's, once its step is applied
        model(input_ids=ids, labels=ids)   # unit l's forward waits for unit l's step only

    Anything else that reads the parameters or the optimizer state before the next forward calls ``wait()``
    first (``state_dict`` does). One backward per ``step()``: accumulate within one layer-major step
    (``num_sub_batches``). ``optimizers``: unit 1 .. U, then the root.

    ``grad_slots_in_flight``: without clipping or skipping (the steps run during the backward), the host gradient
    slots of this many units, reused in turn, instead of one per parameter (the arena's gradients shrink from the
    units' whole size to R units'); 0: one per parameter. Each unit's ``.grad`` is None once its step ran.
    ``worker_threads``: the worker thread's CPU threads (that thread's only: ``memory/threads.py``); 0: torch's
    default. ``worker_nice``: the worker's niceness, raised by this much (Linux: per thread; its CPU threads, made
    after, inherit it), so that on a loaded host the scheduler prefers the thread that launches the GPU's work.
    ``worker_cpus``: the CPUs the worker (and the CPU threads it starts, and the pool threads its steps use) may run
    on (Linux), e.g. ``memory.threads.optimizer_cpus()``: this rank's share less the launching thread's CPU; with
    ``worker_threads=0`` the worker then computes on one thread per CPU given. None: wherever the process may.
    """

    def __init__(self, model: nn.Module, build: BuildOptimizer, *, max_norm: float = 0.0,
                 skip_nonfinite: bool = False, grad_slots_in_flight: int = 4, worker_threads: int = 0,
                 worker_nice: int = 0, worker_cpus: Optional[Sequence[int]] = None) -> None:
        if speedloader_engine(model, missing_ok=True) is None:
            raise ValueError("OverlappedOptimizer needs a model prepared with apply_speedloader")
        if not (isinstance(grad_slots_in_flight, int) and grad_slots_in_flight >= 0):
            raise ValueError(f"grad_slots_in_flight={grad_slots_in_flight!r}: use an integer >= 1 for in-flight "
                             "gradient slots, or 0 for one slot per parameter")
        if not (isinstance(worker_threads, int) and worker_threads >= 0):
            raise ValueError(f"worker_threads={worker_threads!r}: use an integer >= 1, or 0 for torch's default")
        if not (isinstance(worker_nice, int) and 0 <= worker_nice <= 19):
            raise ValueError(f"worker_nice={worker_nice!r}: use an integer in 0..19 (0: the process's priority)")
        if worker_cpus is not None and not (hasattr(os, "sched_setaffinity") and len(worker_cpus) > 0
                                            and set(worker_cpus) <= os.sched_getaffinity(0)):
            raise ValueError(f"worker_cpus={list(worker_cpus)!r}: give some of the CPUs this process may run on "
                             f"({sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 'Linux only'})"
                             ", or None")
        super().__init__(model, build, max_norm=max_norm, skip_nonfinite=skip_nonfinite)
        self._worker_threads = worker_threads or (len(worker_cpus) if worker_cpus is not None else 0)
        self.worker_cpus = sorted(worker_cpus) if worker_cpus is not None else None
        self._worker_nice = worker_nice
        self._units = [module for module, _ in self._engine.units]
        self._deferred = self.needs_grad_norm
        # The inner optimizers the worker steps in deferred mode: those over host parameters. The others (the
        # root with offload_root=False) are stepped by the main thread, as device kernels.
        self._on_worker = [all(p.device.type == "cpu" for p in params) for params in self._param_lists]
        self._stepped: set[int] = set()  # immediate mode: the units the worker stepped during this backward
        self._norms: NormTable = {}  # deferred mode: written by the worker during backward, read by step()
        self._pending: set[int] = set()  # deferred mode: inner optimizers whose queued step is not applied yet
        self._callbacks: dict[int, list[Callable[[], None]]] = {}  # to call once that step is applied
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        # Running totals, each written by one thread only: the worker's optimizer arithmetic (norms, clip scaling,
        # steps) and the main thread's time blocked on it (the next forward's waits, step()'s); step_stats()
        # reports what they grew by since its last call.
        self._busy_s = 0.0
        self._wait_s = 0.0
        self._reported = (0.0, 0.0, COUNTERS.grad_ring_wait_s)  # the ring's waits: process-wide, from here on
        self._worker = threading.Thread(target=self._run, name="fsdp_speedloader-optimizer", daemon=True)
        self._worker.start()
        self._engine.grad_ready_hook = self.on_unit_grads_ready
        # In-flight gradient slots: only where the steps run during the backward (deferred steps need every
        # gradient after it) and the arena holds the gradients.
        use_ring = getattr(self._engine.store, "use_grad_ring", None)
        self.uses_grad_ring = bool(grad_slots_in_flight and not self._deferred and use_ring is not None
                                   and use_ring(grad_slots_in_flight, [fsdp_params_of(m) for m in self._units]))
        self._root_hook = None
        if self._deferred:
            self._engine.unit_forward_hook = self.before_unit_forward
            # Before FSDP's own pre-forward hook on the root (prepend): it unshards the root, prefetches unit 1 ..
            self._root_hook = model.register_forward_pre_hook(lambda module, args: self.before_unit_forward(0),
                                                              prepend=True)

    def _partition(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """Each unit's parameters (all blocks of its group), then the root's (every other parameter)."""
        unit_params = [module_params(module) for module, _ in self._engine.units]
        seen = {id(p) for params in unit_params for p in params}
        return unit_params + [[p for p in model.parameters() if id(p) not in seen]]

    # --- the main thread's side ------------------------------------------------------------------------------
    def on_unit_grads_ready(self, index: int) -> None:
        """Called by the chain (main thread) once unit ``index``'s post-backward has run."""
        if not self._on_worker[index - 1]:
            # States on the device (``device_units``): stepped by step() as device kernels on this thread, after
            # FSDP's finalize_backward has joined its reduce-scatter stream; their norms are taken there too.
            return
        unit = self._units[index - 1]
        # The events of the non-blocking gradient copies to the host, taken now: FSDP clears them
        # when it finalises backward. None: the copy was synchronous (no CUDA, or accumulation).
        events = [e for p in fsdp_params_of(unit) if (e := getattr(p, "grad_offload_event", None)) is not None]
        if self._deferred:
            self._queue.put(("norms", index - 1, events))
        else:
            self._stepped.add(index - 1)
            self._queue.put(("step", index - 1, events))

    def step(self) -> None:
        """Immediate mode: steps what the overlap has not (the first unit and the root), then waits for all.
        Deferred mode: the global norm and the skip decision now; the steps are queued (see the class)."""
        if self._deferred:
            return self._step_deferred()
        self.last_grad_norm, self.last_step_skipped = None, False
        self._timed_wait()
        for index, opt in enumerate(self.optimizers):
            if index not in self._stepped:
                opt.step()
                self._refresh_param_transfer(index + 1)
        self._stepped.clear()

    def _step_deferred(self) -> None:
        self._timed_wait()  # the per-tensor norms of units U .. 1, from the worker
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # clip_grad_norm_'s list
        norms, self._norms = self._norms, {}
        norm = total_norm(grads, norms)  # the root's per-tensor norms are taken here; all ranks all-reduce here
        coef = clip_coefficient(norm, self.max_norm) if self.max_norm > 0 else None
        if self._record_norm(norm):
            return
        # A coefficient of exactly 1 leaves every gradient's bits as they are: no multiplication then (when
        # clipping does not trigger, the step costs what the unclipped one does).
        coefs = None if coef is None or float(full_value(coef)) == 1.0 else coefficients_by_device(coef, grads)
        num_units = len(self._units)
        order = [num_units, *range(num_units)]  # the next forward's order: the root, then units 1 .. U
        with self._cond:
            self._pending.update(i for i in order if self._on_worker[i])
        for index in order:
            if self._on_worker[index]:
                self._queue.put(("apply", index, coefs))
        for index in order:
            if not self._on_worker[index]:
                self._apply(index, coefs)

    def before_unit_forward(self, index: int) -> None:
        """Waits for the deferred steps that unit ``index``'s FSDP pre-forward reads: its own and those of the
        ``forward_prefetch`` units it prefetches (``index`` 0: the root, which prefetches units 1 ..)."""
        if not self._pending:
            return
        depth = self._engine.options.forward_prefetch
        needed = list(range(max(index, 1) - 1, min(index + depth, len(self._units))))  # inner indices of units
        if index == 0:
            needed.append(len(self._units))
        start = time.perf_counter()
        with self._cond:
            if self._error is None and any(i in self._pending for i in needed):
                with torch.profiler.record_function("speedloader::optimizer_wait"):  # named in traces, when it waits
                    while self._error is None and any(i in self._pending for i in needed):
                        self._cond.wait()
        self._wait_s += time.perf_counter() - start
        if self._error is not None:  # left for wait() / close() to report and clear
            raise RuntimeError("an overlapped optimizer step failed") from self._error

    def call_after_step(self, index: int, fn: Callable[[], None]) -> None:
        """Calls ``fn`` once inner optimizer ``index``'s step, issued by the last ``step()``, is applied: in the
        worker right after that step when it is still queued (an LR scheduler's step, so that the step reads the
        LR it was issued with), else here at once."""
        with self._cond:
            if index in self._pending:
                self._callbacks.setdefault(index, []).append(fn)
                return
        fn()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Each inner optimizer's ``zero_grad``, once its step is applied (``call_after_step``)."""
        for index, opt in enumerate(self.optimizers):
            self.call_after_step(index, functools.partial(opt.zero_grad, set_to_none=set_to_none))

    def _timed_wait(self) -> None:
        start = time.perf_counter()
        with torch.profiler.record_function("speedloader::optimizer_wait"):  # named in traces
            self.wait()
        self._wait_s += time.perf_counter() - start

    def step_stats(self) -> dict:
        """Seconds since the last call: ``optimizer_busy_s``, the worker's optimizer arithmetic;
        ``optimizer_wait_s``, the main thread's time blocked on it (the next forward's waits for deferred steps,
        ``step()``'s wait for the last unit's); ``grad_ring_wait_s``, the backward's time blocked waiting for an
        in-flight gradient region the worker had not released yet (0 without the ring). Both waits near 0 with
        busy > 0: the CPU step is hidden."""
        busy, wait, ring = self._busy_s, self._wait_s, COUNTERS.grad_ring_wait_s
        stats = {"optimizer_busy_s": busy - self._reported[0], "optimizer_wait_s": wait - self._reported[1],
                 "grad_ring_wait_s": ring - self._reported[2] if self.uses_grad_ring else 0.0}
        self._reported = (busy, wait, ring)
        return stats

    def wait(self) -> None:
        """Blocks until every queued unit step (and norm) is done; re-raises a worker error."""
        self._queue.join()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("an overlapped optimizer step failed") from error

    def close(self) -> None:
        """Applies the queued steps, then stops the worker thread (idempotent); the model's backward no longer
        queues unit work and its forward no longer waits."""
        if self._engine.grad_ready_hook == self.on_unit_grads_ready:
            self._engine.grad_ready_hook = None
        if self._engine.unit_forward_hook == self.before_unit_forward:
            self._engine.unit_forward_hook = None
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        if self.uses_grad_ring:  # nothing releases the regions any more: a slot per parameter from the next step
            self._engine.store.use_grad_ring(0, [])
            self.uses_grad_ring = False
        self._raise_error()

    @property
    def worker_threads(self) -> int:
        """The worker's CPU threads (0: torch's default)."""
        return self._worker_threads

    # --- the worker's side -----------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._worker_nice and hasattr(os, "setpriority"):  # before its CPU threads exist: they inherit it
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._worker_nice)
        if self.worker_cpus is not None:  # before its CPU threads exist: they inherit it
            pin_calling_thread(self.worker_cpus)
        if self._worker_threads:
            set_thread_num_threads(self._worker_threads)  # this thread's only: the CPU steps' arithmetic
        while (item := self._queue.get()) is not None:
            kind, index, payload = item
            try:
                if self._error is None:
                    if kind != "apply":
                        for event in payload:
                            event.synchronize()  # blocks this thread only, until the gradient is on the host
                    start = time.perf_counter()
                    if kind == "apply":
                        self._apply(index, payload)
                    elif kind == "norms":
                        tensor_norms([p.grad for p in self._param_lists[index] if p.grad is not None], self._norms)
                    else:
                        self._apply(index, None)
                    self._busy_s += time.perf_counter() - start  # this thread alone writes it
            except BaseException as e:  # reported to the main thread by wait() or before_unit_forward()
                self._fail(e)
            finally:
                if kind == "apply":
                    self._finish(index)
                elif kind == "step" and self.uses_grad_ring:
                    self._release_grads(index)
                self._queue.task_done()
        self._queue.task_done()

    def _apply(self, index: int, coefs: Optional[dict]) -> None:
        """Scales inner optimizer ``index``'s gradients by the clip coefficient (``coefs``: per device; None: not
        at all), steps it, and casts its units' transfer copies."""
        if coefs is not None:
            scale_grads_([p.grad for p in self._param_lists[index] if p.grad is not None], coefs)
        self.optimizers[index].step()
        self._refresh_param_transfer(index + 1)

    def _release_grads(self, index: int) -> None:
        """In-flight slots: drops inner optimizer ``index``'s gradients (its unit's step has read them), then gives
        the unit's region back to the ring, where the next unit's copies may land (also after a failed step: the
        backward must not wait forever; the error is reported by ``wait()``)."""
        dropped = [weakref.ref(p.grad) for p in self._param_lists[index] if p.grad is not None]
        try:
            self.optimizers[index].zero_grad(set_to_none=True)
        finally:
            ring = self._engine.store.grad_ring
            if ring is not None:
                ring.release(index + 1, dropped)

    def _finish(self, index: int) -> None:
        """Runs the callbacks of inner optimizer ``index``'s applied step (also those added meanwhile), then marks
        it applied."""
        while True:
            with self._cond:
                callbacks = self._callbacks.pop(index, [])
                if not callbacks:
                    self._pending.discard(index)
                    self._cond.notify_all()
                    return
            for fn in callbacks:
                try:
                    if self._error is None:
                        fn()
                except BaseException as e:
                    self._fail(e)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()


def module_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP manages for the unit whose state lives on ``module`` (all blocks of its group)."""
    return [p.sharded_param for p in fsdp_params_of(module)]
