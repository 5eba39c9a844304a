"""The optimizers of a training step, behind one interface: ``OptimizersContainer`` (one optimizer over the
model, stepped after backward) and ``OverlappedOptimizer`` (one per unit, stepped during the layer-major
backward). The trainer and the tuner's trials hold either without asking which (torchtitan's
``OptimizersContainer`` / ``OptimizersInBackwardContainer``):

- ``step()`` then ``zero_grad()``; ``step`` also casts the parameter transfer copies (``param_transfer_dtype``)
  that it made stale, so the next forward's unshards find them fresh;
- ``param_groups`` (every inner optimizer's), and the inner ``optimizers`` themselves (iterating the container
  yields them): LR schedulers wrap each, and ``torch.distributed.checkpoint.state_dict`` takes the container
  where it takes a list of optimizers;
- ``state_dict()`` / ``load_state_dict()``: DCP's optimizer state, keyed by parameter name
  (``get_optimizer_state_dict(model, optimizers)``), the layout checkpoints have always held;
- ``close()``: the overlapped one's worker thread stops (a no-op for the plain one).

Overlap. With parameters offloaded, AdamW runs on the host and, done after backward, adds its whole time to
the step (docs/design.md §4). In layer-major backward, unit l's gradient is final once FSDP's post-backward
for unit l has reduce-scattered it and copied it to the host; units l-1 .. 1 still have their backward to
run on the GPU. ``OverlappedOptimizer`` steps unit l's parameters in a worker thread right then, so only the
first unit and the root (embeddings, final norm, LM head) remain after ``loss.backward()``.

Exact: every unit is stepped once per optimizer step with its final gradient, and the next forward waits for
all steps (``wait``). Incompatible with global-norm gradient clipping, which needs every gradient before any
step. With ``param_transfer_dtype`` the worker also casts each unit's transfer copies right after that unit's
step; the main thread casts only those of the units it steps itself.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.fsdp2 import fsdp_params_of

BuildOptimizer = Callable[[list], torch.optim.Optimizer]
"""Makes one inner optimizer for a list of parameters, e.g. ``lambda params: torch.optim.AdamW(params, lr=1e-4)``."""


class OptimizersContainer:
    """One optimizer, ``build(params)``, over every trainable parameter of ``model``, stepped after backward::

        optimizers = OptimizersContainer(model, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers.step()
        optimizers.zero_grad()
    """

    def __init__(self, model: nn.Module, build: BuildOptimizer) -> None:
        self.model = model
        self._engine = speedloader_engine(model, missing_ok=True)  # None: a model without the layer-major engine
        self.optimizers: list[torch.optim.Optimizer] = [build(params) for params in self._partition(model)]

    def _partition(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """The parameters of each inner optimizer."""
        return [[p for p in model.parameters() if p.requires_grad]]

    @property
    def param_groups(self) -> list[dict]:
        """Every inner optimizer's parameter groups (the dicts themselves: setting ``lr`` in one takes effect)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self) -> None:
        """Steps every inner optimizer, then casts the transfer copies the step made stale (a no-op without
        ``param_transfer_dtype``): now, rather than in the next forward's unshards."""
        for opt in self.optimizers:
            opt.step()
        self._refresh_param_transfer()

    def _refresh_param_transfer(self, index: Optional[int] = None) -> None:
        if self._engine is not None:
            self._engine.refresh_param_transfer(index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The optimizer state keyed by parameter name, every inner optimizer in one dict (DCP's layout: what
        ``get_state_dict(model, optimizers)`` gives, so any split of the parameters saves alike)."""
        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state: dict) -> None:
        """Loads :meth:`state_dict`'s layout (each inner optimizer takes the state of its own parameters)."""
        set_optimizer_state_dict(self.model, self.optimizers, state)

    def close(self) -> None:
        """Stops what runs beside the optimizers (nothing here; the overlapped one's worker thread)."""


class OverlappedOptimizer(OptimizersContainer):
    """One optimizer per unit (and one for the root), stepped as soon as that unit's gradients land.

    Use in place of :class:`OptimizersContainer` (``model`` prepared with ``apply_speedloader``)::

        optimizers = OverlappedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()          # units U .. 2 are stepped while backward runs
        optimizers.step()        # steps unit 1 and the root, waits for all steps
        optimizers.zero_grad()

    ``optimizers``: unit 1 .. U, then the root.
    """

    def __init__(self, model: nn.Module, build: BuildOptimizer) -> None:
        if speedloader_engine(model, missing_ok=True) is None:
            raise ValueError("OverlappedOptimizer needs a model prepared with apply_speedloader")
        super().__init__(model, build)
        self._units = [module for module, _ in self._engine.units]
        self._stepped: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._worker = threading.Thread(target=self._run, name="fsdp_speedloader-optimizer", daemon=True)
        self._worker.start()
        self._engine.grad_ready_hook = self.on_unit_grads_ready

    def _partition(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """Each unit's parameters (all blocks of its group), then the root's (every other parameter)."""
        unit_params = [module_params(module) for module, _ in self._engine.units]
        seen = {id(p) for params in unit_params for p in params}
        return unit_params + [[p for p in model.parameters() if id(p) not in seen]]

    def on_unit_grads_ready(self, index: int) -> None:
        """Called by the chain (main thread) once unit ``index``'s post-backward has run."""
        unit = self._units[index - 1]
        # The events of the non-blocking gradient copies to the host, taken now: FSDP clears them
        # when it finalises backward. None: the copy was synchronous (no CUDA, or accumulation).
        events = [e for p in fsdp_params_of(unit) if (e := getattr(p, "grad_offload_event", None)) is not None]
        self._stepped.add(index - 1)
        self._queue.put((index - 1, events))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            index, events = item
            try:
                if self._error is None:
                    for event in events:
                        event.synchronize()  # blocks this thread only, until the gradient is on the host
                    self.optimizers[index].step()
                    self._refresh_param_transfer(index + 1)  # the unit's transfer copies, cast here
            except BaseException as e:  # reported to the main thread by wait()
                self._error = e
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Blocks until every queued unit step is done; re-raises a worker error."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("an overlapped optimizer step failed") from error

    def step(self) -> None:
        """Steps what the overlap has not (the first unit and the root), then waits for all."""
        self.wait()
        for index, opt in enumerate(self.optimizers):
            if index not in self._stepped:
                opt.step()
                self._refresh_param_transfer(index + 1)
        self._stepped.clear()

    def close(self) -> None:
        """Stops the worker thread (idempotent); the model's backward no longer queues unit steps."""
        if self._engine.grad_ready_hook == self.on_unit_grads_ready:
            self._engine.grad_ready_hook = None
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()


def module_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP manages for the unit whose state lives on ``module`` (all blocks of its group)."""
    return [p.sharded_param for p in fsdp_params_of(module)]
