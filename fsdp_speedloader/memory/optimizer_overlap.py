"""CPU optimizer steps overlapped with the layer-major backward, exactly (no stale weights).

With parameters offloaded, AdamW runs on the host and, done after backward, adds its whole time
to the step (1.4 s for 7B, DESIGN.md section 4). In layer-major backward, unit l's gradient is
final once FSDP's post-backward for unit l has reduce-scattered it and copied it to the host;
units l-1 .. 1 still have their backward to run on the GPU. ``OverlappedOptimizer`` steps unit
l's parameters in a worker thread right then, so only the last unit and the root (embeddings,
final norm, LM head) remain after ``loss.backward()``.

Exact: every unit is stepped once per optimizer step with its final gradient, and the next
forward waits for all steps (``wait``). Incompatible with global-norm gradient clipping, which
needs every gradient before any step.

With ``param_transfer_dtype`` the worker also casts each unit's transfer copies right after that
unit's step, so the next forward finds them fresh and the main thread casts only the units it
steps itself (the first unit and the root).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.fsdp2 import fsdp_params_of


class OverlappedOptimizer:
    """One optimizer per unit (and one for the root), stepped as soon as that unit's gradients land.

    Use in place of a plain optimizer:

        opt = OverlappedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=..., fused=True))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()          # units U .. 2 are stepped while backward runs
        opt.step()               # steps unit 1 and the root, waits for all steps
        opt.zero_grad()

    ``optimizers`` (unit 1 .. U, then the root) is what checkpoints and LR schedules see.
    """

    def __init__(self, model: nn.Module, build: Callable[[list], torch.optim.Optimizer]) -> None:
        engine = speedloader_engine(model, missing_ok=True)
        if engine is None:
            raise ValueError("OverlappedOptimizer needs a model prepared with apply_speedloader")
        self._engine = engine
        self._units = [module for module, _ in engine.units]
        unit_params = [[p for p in module_params(unit)] for unit in self._units]
        seen = {id(p) for params in unit_params for p in params}
        root_params = [p for p in model.parameters() if id(p) not in seen]
        self.optimizers = [build(params) for params in unit_params + [root_params]]
        self._stepped: set[int] = set()
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._worker = threading.Thread(target=self._run, name="fsdp_speedloader-optimizer", daemon=True)
        self._worker.start()
        engine.grad_ready_hook = self.on_unit_grads_ready

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

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
                    self._engine.refresh_param_transfer(index + 1)  # the unit's transfer copies, cast here
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
                self._engine.refresh_param_transfer(index + 1)
        self._stepped.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list) -> None:
        for opt, state in zip(self.optimizers, states):
            opt.load_state_dict(state)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()


def module_params(module: nn.Module) -> Iterable[nn.Parameter]:
    """The parameters FSDP manages for the unit whose state lives on ``module`` (all blocks of its group)."""
    return [p.sharded_param for p in fsdp_params_of(module)]
