"""Quantized weights of a generation step, unit by unit: the packed bytes cross the link, bf16 is made on the GPU.

With ``quant.quantize_linears_`` a block's linears keep their weights as packed int8 / int4 bytes in one buffer
per block (``quant/weights.py``). In each step, inside each unit's call (``step.unit_step``)::

    begin_unit(u):  wait for unit u's packed copy (queued one unit ahead), queue unit u + 1's (after the last
                    unit: unit 1's, for the next step); with several groups (the prefill's N sub-batches),
                    dequantize each linear of u ONCE into the compute dtype on the compute stream, for all of
                    them; with one group (a decoding step with the whole cache on the device) each linear
                    dequantizes its view of the packed copy when it runs: the same work, and one linear's
                    weight in the compute dtype at a time instead of the whole unit's
    ...             the groups run through the unit's blocks
    end_unit(u):    drop the dequantized weights and the views of the packed copy (its ring buffer is free)

So a decoding step moves 2x (int8) or about 3.5x (int4 g64) fewer weight bytes than bf16 over the link, and
the GPU memory of a unit is its packed copy (two in flight) plus its dequantized weights (the unit's, or one
linear's). The copies run on a ``TensorExchange``'s own stream, ordered by events; no host wait. With the
weights resident on the GPU (not offloaded) nothing is copied: each unit is dequantized from where it lies.

The other parameters of the blocks (norms, biases) and the root stay FSDP2's, unsharded as before.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_speedloader.memory.exchange import FetchHandle, TensorExchange
from fsdp_speedloader.quant import QuantizedWeights


class WeightStream:
    """Per unit of a prepared model: its blocks' packed weights fetched ahead and dequantized once per call."""

    def __init__(self, weights: QuantizedWeights, units: list, device: torch.device,
                 exchange: Optional[TensorExchange] = None) -> None:
        self.weights = weights
        self.device = device
        # Per unit (1-based index - 1): its blocks' packed weights.
        self.by_unit = [[weights.of_block(b) for b in unit.blocks] for _, unit in units]
        self.streamed = weights.offloaded
        self.exchange = (exchange or TensorExchange(device)) if self.streamed else None
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

    def begin_unit(self, index: int, *, dequantize_ahead: bool = True) -> None:
        """Unit ``index`` (1-based) is about to run: its packed weights on the compute device, dequantized now
        (``dequantize_ahead``: the unit runs several groups) or by each linear when it runs (one group)."""
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
        for block, buffer in zip(blocks, buffers):
            for module, packed in block.views(buffer):
                if dequantize_ahead:
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
        out = {**self.weights.stats, "weights_h2d_bytes": self.h2d_bytes, "weights_num_fetches": self.num_fetches}
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
