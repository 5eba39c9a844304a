"""Quantized weights of a generation step, unit by unit: the packed bytes cross the link, bf16 is made on the GPU.

With ``quant.quantize_linears_`` a block's linears keep their weights as packed int8 / int4 bytes in one buffer
per block (``quant/weights.py``). In each step, inside each unit's call (``step.unit_step``)::

    begin_unit(u):  wait for unit u's packed copy (queued one unit ahead), queue unit u + 1's (after the last
                    unit: unit 1's, for the next step); then either
                    - "unit": dequantize each linear of u ONCE into the compute dtype on the compute stream, for
                      all of the unit's groups (the prefill's N sub-batches), or
                    - "linear": hand each linear its view of the packed copy, to dequantize when it runs: one
                      linear's weight in the compute dtype at a time instead of the unit's, once per group.
                    One group (a decoding step with the whole cache on the device) always takes "linear": the
                    same work. Several groups take "unit" unless memory is short (``dequantize``, below).
    ...             the groups run through the unit's blocks
    end_unit(u):    drop the dequantized weights and the views of the packed copy (its ring buffer is free)

So a decoding step moves 2x (int8) or about 3.5x (int4 g64) fewer weight bytes than bf16 over the link, and
the GPU memory of a unit is its packed copy (two in flight) plus its dequantized weights (the unit's, or one
linear's). ``dequantize='auto'`` chooses "unit" for the groups of a call when the largest unit's weights in
the compute dtype take at most half of the GPU memory left at its first several-group unit (the cache, the root
and the packed copies are allocated by then; the other half is the groups' activations), else "linear": N
times the dequantization work, one fused kernel per linear and group (``quant/formats.py``). The copies run on
a ``TensorExchange``'s own stream, ordered by events; no host wait. With the weights resident on the GPU (not
offloaded) nothing is copied: each unit is dequantized from where it lies.

The other parameters of the blocks (norms, biases) and the root stay FSDP2's, unsharded as before.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_speedloader.memory.exchange import FetchHandle, TensorExchange
from fsdp_speedloader.memory.gpu_memory import gpu_bytes_available
from fsdp_speedloader.quant import QuantizedWeights


DEQUANTIZE_MODES = ("auto", "unit", "linear")


class WeightStream:
    """Per unit of a prepared model: its blocks' packed weights fetched ahead and dequantized on the GPU."""

    def __init__(self, weights: QuantizedWeights, units: list, device: torch.device,
                 exchange: Optional[TensorExchange] = None, dequantize: str = "auto") -> None:
        if dequantize not in DEQUANTIZE_MODES:
            raise ValueError(f"weight_dequantize={dequantize!r}; choose one of "
                             f"{', '.join(map(repr, DEQUANTIZE_MODES))}")
        self.weights = weights
        self.device = device
        # Per unit (1-based index - 1): its blocks' packed weights.
        self.by_unit = [[weights.of_block(b) for b in unit.blocks] for _, unit in units]
        self.streamed = weights.offloaded
        self.exchange = (exchange or TensorExchange(device)) if self.streamed else None
        self.dequantize = dequantize  # for several groups; 'auto' is resolved at the first such unit
        self._pending: dict[int, list[FetchHandle]] = {}
        self._held: list = []  # the current unit's device views of its packed copy
        self.another_step = True  # the last unit queues the next step's first (False in the last step)
        self.h2d_bytes = 0
        self.num_fetches = 0

    def _fetch(self, index: int) -> list[FetchHandle]:
        handles = []
        for block in self.by_unit[index - 1]:
            self.h2d_bytes += block.nbytes
            self.num_fetches += 1
            handles.append(self.exchange.fetch(block.buffer))
        return handles

    def dequantized_unit_bytes(self) -> int:
        """The largest unit's quantized linears in their compute dtype (what "unit" holds at once)."""
        return max(sum(m.out_features * m.in_features * m.dtype.itemsize for block in unit for m in block.modules)
                   for unit in self.by_unit)

    def _resolve(self) -> str:
        if self.device.type != "cuda":
            return "unit"  # the host's memory is the model's: nothing to save for
        fits = 2 * self.dequantized_unit_bytes() <= gpu_bytes_available(self.device)
        return "unit" if fits else "linear"

    def begin_unit(self, index: int, *, groups: int) -> None:
        """Unit ``index`` (1-based) is about to run ``groups`` groups: its packed weights on the compute device,
        dequantized now ("unit") or by each linear when it runs ("linear")."""
        blocks = self.by_unit[index - 1]
        if self.streamed:
            handles = self._pending.pop(index, None) or self._fetch(index)
            following = index % len(self.by_unit) + 1  # the last unit queues the next step's first
            wanted = following > index or self.another_step
            if wanted and following != index and following not in self._pending:
                self._pending[following] = self._fetch(following)
            buffers = [self.exchange.wait(h) for h in handles]
        else:
            buffers = [None] * len(blocks)  # the blocks' own buffers, on the compute device
        if groups > 1 and self.dequantize == "auto":
            self.dequantize = self._resolve()
        ahead = groups > 1 and self.dequantize == "unit"
        for block, buffer in zip(blocks, buffers):
            for module, packed in block.views(buffer):
                if ahead:
                    module.weight_on_device = packed.dequantize(module.dtype)
                else:
                    module.packed_on_device = packed
        self._held = buffers

    def end_unit(self, index: int) -> None:
        for block in self.by_unit[index - 1]:
            for module in block.modules:
                module.weight_on_device = module.packed_on_device = None
        self._held = []

    def end_step(self) -> None:
        if self.exchange is not None:
            self.exchange.end_step()

    def stats(self) -> dict:
        out = {**self.weights.stats, "weights_h2d_bytes": self.h2d_bytes, "weights_num_fetches": self.num_fetches,
               "weights_dequantize": self.dequantize}  # what several-group units ran ('auto': none ran)
        if self.exchange is not None:
            # The compute stream's wait for the weights in the last step: > 0 where the link bounds the step.
            out["weights_wait_s_last_step"] = self.exchange.step_stats().get("exchange_wait_s", 0.0)
        return out

    def close(self) -> None:
        """Waits for the copies still queued (the next step's prefetch) before their buffers can be reused."""
        self._pending.clear()
        for index in range(1, len(self.by_unit) + 1):
            self.end_unit(index)
        if self.exchange is not None:
            self.exchange.drain()
            self.exchange.clear_ring()
