"""The KV cache of layer-major generation: where each sub-batch's keys and values live between steps.

Layout of the host cache (one tensor per group of layers that keep as many positions, ``kv_layout.py``;
the device cache orders it for views, see ``DeviceKVCache``)::

    kv[i, l, t, c, j, k, d]     i sub-batch (N)   l layer (L)   t position (capacity T, or a window's W)
                                c 0 = key, 1 = value          j sequence of the sub-batch (n)
                                k key/value head (H_kv)       d head dimension

so ``kv[i, l]`` -- everything layer ``l`` of sub-batch ``i`` has seen -- is ONE contiguous block
(one host-to-device copy per layer per sub-batch and step), and ``kv[i, l, t]`` -- the keys and
values of position ``t`` of every sequence of the sub-batch -- is one small contiguous write.

Sliding-window layers keep only their window: a ring of W slots, position ``t`` in slot ``t mod W``
(``kv_layout.py`` says where each position lies and which ones attention reads, as Hugging Face's
``DynamicSlidingWindowLayer`` hands them to it).

Modes:
- ``DeviceKVCache``: the cache lives on the compute device, laid out ``kv[l, t, c, b, k, d]`` with
  ``b`` the sequence of the WHOLE batch (sub-batch ``i`` is rows ``i*n .. (i+1)*n``): nothing is copied,
  so the layout only has to let attention read any group of rows as a view. ``update`` writes the new
  positions in place and hands the attention views of ``kv[l, :past + q, :, rows]``. Rows of the whole
  batch are one view too, which lets a decoding step run each unit once on all N sub-batches
  (``whole_batch_decode``: one decoder-layer call per layer instead of N). With a codec it holds 8-bit
  codes and scales and hands attention the visible positions dequantized.
- ``SplitKVCache``: the last D sub-batches' cache on the device, the first N - D sub-batches' in the
  host arena (a ``HostKVCache`` and a ``DeviceKVCache`` of their own sub-batches). Each step copies
  only the host part: when the batch outgrows the GPU, the sequences that still fit there cost no link
  bandwidth, and the host adds sequences (tokens per weight pass) at the price of their KV copies.
  Host sub-batches come first so that the schedule's look-ahead fetch of the next unit's sub-batch 0
  (issued during this unit's last sub-batch) is a real copy, and the device sub-batches at the end of
  each unit compute while it runs.
- ``HostKVCache``: the tensor is a slot of an exact-size page-locked ``PinnedArena``; a
  ``TensorExchange`` moves it. Per (unit, sub-batch): ``prefetch`` starts the H2D copy of
  ``kv[i, l, :past + q]`` for the unit's layers (the last q positions are stale; they are
  overwritten on the device before any kernel reads them), ``update`` waits for that copy (first use,
  so a later layer's copy still overlaps an earlier layer's compute), writes the new keys/values
  into the device copy and stores them back with one D2H copy of ``kv[i, l, past:past + q]``.
  Its first ``cpu_attention`` sub-batches are never fetched: in a decoding step ``update`` writes the
  new position into the host cache and hands attention the host views, and ``host_attention.py`` runs
  their attention on the CPU (the query travels instead of the cache). Prefill attention stays on the GPU.

Streams and order (host mode, CUDA): fetch on the exchange's H2D stream; compute waits on the
fetch's event; the store runs on the D2H stream after compute. A step's fetches read positions the
previous step stored, so ``begin_step`` makes the H2D stream wait for everything the D2H stream has
queued so far (one event per step; stores of one token are tiny, prefill stores were queued long
before). Without CUDA the exchange copies synchronously and the same code runs.

The object attention sees is ``SubBatchCache``: the part of Hugging Face's ``Cache`` interface that
the attention layers and the mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``)
use (``update``, ``get_seq_length``, ``get_mask_sizes``, ``get_query_offset``), for transformers 5.x (both
the ``cache_position`` and the query-length forms of ``get_mask_sizes``). It is not a ``transformers.Cache``
subclass: its storage is this module's layout, which no ``Cache`` layer type describes, and its per-layer
state is one integer shared by all layers (every layer has seen the same positions at the same step). The
mask functions pick the layer whose sizes they read by looking into a ``Cache`` (its ``is_sliding``), which
differs between transformers versions; the view handed to them is pinned to one layer of the mask's type
instead (``KVCache.view(i, sized_as=layer)``).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

# kv_layout_for is re-exported: it was this module's before the layout had a file of its own.
from fsdp_speedloader.generation.kv_layout import KVLayout, gather_runs, kv_layout_for  # noqa: F401
from fsdp_speedloader.memory.arena import DEFAULT_MARGIN, ArenaPlan, HostMemoryBudget, PinnedArena
from fsdp_speedloader.memory.exchange import FetchHandle, TensorExchange
from fsdp_speedloader.memory.gpu_memory import gpu_bytes_available
from fsdp_speedloader.quant.kv import KVCodec, attach_scales

KV_CACHE_MODES = ("auto", "device", "split", "host", "off")


def _as_positions(key: torch.Tensor) -> torch.Tensor:
    # (n, H_kv, q, d) as the attention produced it -> (q, n, H_kv, d), the cache's order (a view).
    return key.permute(2, 0, 1, 3)


def _as_attention(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (T, 2, n, H_kv, d) -> keys and values as the attention expects them, (n, H_kv, T, d) views.
    return block[:, 0].permute(1, 2, 0, 3), block[:, 1].permute(1, 2, 0, 3)


def _scales_as_attention(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (T, 2, n, H_kv) scales -> keys' and values' (n, H_kv, T), as _as_attention lays out their codes.
    return block[:, 0].permute(1, 2, 0), block[:, 1].permute(1, 2, 0)


def stored_nbytes(layout: KVLayout, codec: Optional[KVCodec]) -> int:
    """Bytes a cache of ``layout`` holds: the compute dtype, or 8-bit codes and one scale per head_dim codes."""
    if codec is None:
        return layout.nbytes
    return layout.numel * codec.code_dtype.itemsize + layout.numel // layout.head_dim * layout.dtype.itemsize


def _dtype_name(layout: KVLayout, codec: Optional[KVCodec]) -> str:
    return str(layout.dtype).removeprefix("torch.") if codec is None else codec.name


class KVCache(ABC):
    """Keys and values of all sub-batches and layers for one generation; one step at a time.

    Per step: ``begin_step(past, q)``; per (unit, sub-batch) ``prefetch(i, layers)`` (a hint);
    attention calls ``update`` through ``view(i)``; ``end_step()``.
    """

    #: A decoding step may run all sub-batches as one group (``view(0)`` then covers the whole batch).
    whole_batch_decode = False

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.past = 0  # positions every layer has seen before this step
        self.query = 0  # positions this step adds
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def begin_step(self, past: int, query: int) -> None:
        if past + query > self.layout.capacity:
            raise AssertionError(f"KV cache overflow: {past} + {query} > capacity {self.layout.capacity}")
        self.past, self.query = past, query

    def prefetch(self, i: int, layers: Sequence[int]) -> None:
        """Hint: sub-batch ``i`` runs ``layers`` next."""

    def end_step(self) -> None:
        pass

    def view(self, i: int, *, sized_as: Optional[int] = None) -> "SubBatchCache":
        """What attention sees of sub-batch ``i``; ``sized_as``: the layer whose mask sizes it reports whatever
        layer a mask function asks for (one view per layer type, for that type's mask)."""
        return SubBatchCache(self, i, sized_as)

    def mask_sizes(self, layer: int, query: int) -> tuple[int, int]:
        return self.layout.mask_sizes(layer, self.past, query)

    def _check(self, i: int, layer: int, key: torch.Tensor, rows: Optional[int] = None) -> None:
        lay = self.layout
        expected = (rows or lay.sub_batch_size, lay.num_kv_heads, self.query, lay.head_dim)
        assert tuple(key.shape) == expected and key.dtype == lay.dtype, (
            f"attention of layer {layer} gave keys {tuple(key.shape)} {key.dtype}; cache expects {expected} {lay.dtype}")

    @abstractmethod
    def update(self, i: int, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends this step's keys/values (n, H_kv, q, d) of (i, layer); returns those attention reads,
        (n, H_kv, kv_length, d) (``mask_sizes``: every position, or a sliding layer's window)."""

    @abstractmethod
    def positions_kept(self, layer: int) -> int:
        """Positions the storage of ``layer`` holds, read from its tensors (a sliding layer: its window)."""

    def stats(self) -> dict:
        return {"kv_cache_bytes": self.layout.nbytes, "kv_h2d_bytes": self.h2d_bytes, "kv_d2h_bytes": self.d2h_bytes}

    def close(self) -> None:
        pass


class DeviceKVCache(KVCache):
    """The whole cache on the compute device: no copies.

    ``update(i, ...)`` with keys of ``k`` sequences addresses rows ``i*k .. (i+1)*k`` of the batch: sub-batch
    ``i`` when ``k = n``, the whole batch when ``i = 0, k = N x n`` (``whole_batch_decode``).

    With a ``codec`` the buffers hold 8-bit codes and one scale per (position, sequence, head), as the host
    cache's (half the GPU memory: twice the sequences whose cache costs no link bandwidth); a new position is
    quantized once, and attention reads every cached position dequantized, the new one included.
    """

    whole_batch_decode = True

    def __init__(self, layout: KVLayout, device: torch.device, codec: Optional[KVCodec] = None) -> None:
        super().__init__(layout, device)
        lay = layout
        self.codec = codec
        rows = lay.num_sub_batches * lay.sub_batch_size
        # Per group (L_g, span, 2, B, H_kv, d): the batch's rows adjacent, so any group of sub-batches is a view.
        self.buffers = [torch.empty((len(layers), span, 2, rows, lay.num_kv_heads, lay.head_dim),
                                    dtype=lay.dtype if codec is None else codec.code_dtype, device=device)
                        for layers, span in lay.groups]
        self.scales = None if codec is None else [
            torch.empty((len(layers), span, 2, rows, lay.num_kv_heads), dtype=lay.dtype, device=device)
            for layers, span in lay.groups]
        self._where = {layer: (g, j) for g, (layers, _) in enumerate(lay.groups) for j, layer in enumerate(layers)}

    def update(self, i, layer, key, value):
        k = key.shape[0]
        whole = k == self.layout.num_sub_batches * self.layout.sub_batch_size  # every sub-batch at once
        assert i == 0 or not whole, f"sub-batch {i} of a whole-batch call"
        self._check(i, layer, key, rows=k if whole else None)
        g, j = self._where[layer]
        rows = slice(i * k, (i + 1) * k)
        block = self.buffers[g][j, :, :, rows]  # (span, 2, k, H_kv, d)
        keys, values = _as_positions(key), _as_positions(value)
        kept = self.layout.kept_runs(layer, self.past, self.query)
        if self.codec is None:
            for slot, offset, n in kept:
                block[slot : slot + n, 0].copy_(keys[offset : offset + n])
                block[slot : slot + n, 1].copy_(values[offset : offset + n])
        else:
            scales = self.scales[g][j, :, :, rows]  # (span, 2, k, H_kv)
            codes, new_scales = self.codec.quantize(torch.stack((keys, values), dim=1), self.layout.dtype)
            for slot, offset, n in kept:
                block[slot : slot + n].copy_(codes[offset : offset + n])
                scales[slot : slot + n].copy_(new_scales[offset : offset + n])
        if self.past == 0:
            return key, value  # prefill: exactly what attention would use without a cache
        visible = self.layout.visible_runs(layer, self.past, self.query)
        if self.codec is None:
            return _as_attention(gather_runs(block, visible))
        return _as_attention(self.codec.dequantize(gather_runs(block, visible), gather_runs(scales, visible),
                                                   self.layout.dtype))

    def positions_kept(self, layer: int) -> int:
        g, j = self._where[layer]
        return self.buffers[g][j].shape[0]

    def stats(self) -> dict:
        return {**super().stats(), "kv_device_bytes": stored_nbytes(self.layout, self.codec),
                "kv_device_dtype": _dtype_name(self.layout, self.codec)}

    def close(self) -> None:
        self.buffers = self.scales = None


class HostKVCache(KVCache):
    """The cache in a page-locked host arena (plain memory without CUDA), moved by a ``TensorExchange``.

    The arena and the exchange may outlive one generation (``reuse``): a later generation whose
    cache fits in the arena re-carves it without allocating or page-locking again.

    With a ``codec`` (``kv_cache_dtype``) the host holds 8-bit codes and one scale per (position, sequence,
    head) (``quant/kv.py``): half the host memory and half the bytes over the link or read by the CPU. Copied
    blocks are dequantized on the device into the compute dtype; a new position is quantized once, written to
    the host in 8 bits, and attention reads it back dequantized, as every later step will.
    """

    SLOT = "kv_cache"
    SCALES_SLOT = "kv_cache_scales"

    def __init__(self, layout: KVLayout, device: torch.device, *, cpu_attention: int = 0,
                 arena: Optional[PinnedArena] = None, exchange: Optional[TensorExchange] = None,
                 host_memory_limit_bytes: Optional[int] = None, host_memory_margin: float = DEFAULT_MARGIN,
                 codec: Optional[KVCodec] = None) -> None:
        super().__init__(layout, device)
        if not 0 <= cpu_attention <= layout.num_sub_batches:
            raise ValueError(f"cpu_attention_sub_batches={cpu_attention}; the host cache holds "
                             f"{layout.num_sub_batches} sub-batches (0 .. {layout.num_sub_batches})")
        self.cpu_attention = cpu_attention  # sub-batches 0 .. cpu_attention - 1: attention on the host
        self.cpu_read_bytes = 0  # cache bytes those attentions read (instead of copying them)
        self.codec = codec
        code_dtype = layout.dtype if codec is None else codec.code_dtype
        slots = {self.SLOT: ((layout.numel,), code_dtype)}
        if codec is not None:  # one scale per head_dim codes
            slots[self.SCALES_SLOT] = ((layout.numel // layout.head_dim,), layout.dtype)
        nbytes = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                  for name, (shape, dtype) in slots.items()}
        if arena is None or any(name not in arena or arena.capacity(name) < n for name, n in nbytes.items()):
            if arena is not None:
                arena.close()
            plan = ArenaPlan()
            for name, (shape, dtype) in slots.items():
                plan.add(name, "kv_cache", shape, dtype)
            budget = HostMemoryBudget.detect(host_memory_limit_bytes, margin=host_memory_margin)
            hint = (f"lower the batch ({layout.num_sub_batches} sub-batches x {layout.sub_batch_size} sequences), "
                    f"the prompt length or max_new_tokens (capacity {layout.capacity} positions), use "
                    "kv_cache_dtype='int8' (half the bytes), or kv_cache='off' (recompute) or 'device'")
            arena = PinnedArena(plan, budget=budget, hint=hint, pin=device.type == "cuda")
        self.arena = arena
        # position_bytes of what the host holds per (layer, sub-batch, position): codes (and scales).
        self.host_position_bytes = (layout.position_bytes if codec is None else
                                    layout.position_bytes // layout.dtype.itemsize
                                    + layout.position_bytes // layout.head_dim)
        # One slot, carved into one (N, L_g, span, 2, n, H_kv, d) tensor per group of layers (and, with a
        # codec, one (N, L_g, span, 2, n, H_kv) tensor of scales).
        self.host: dict[int, torch.Tensor] = self._carve(arena.slot(self.SLOT, (layout.numel,), code_dtype), ())
        self.host_scales: dict[int, torch.Tensor] = {} if codec is None else self._carve(
            arena.slot(self.SCALES_SLOT, (layout.numel // layout.head_dim,), layout.dtype), (layout.head_dim,))
        self.exchange = exchange if exchange is not None else TensorExchange(device)
        # (sub-batch, layer) -> its fetch (and, with a codec, its scales' fetch)
        self._pending: dict[tuple[int, int], tuple[FetchHandle, Optional[FetchHandle]]] = {}
        self._prefill_stores_unread = False  # host attention's first reads must wait for the prefill's stores

    def _carve(self, flat: torch.Tensor, drop: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """layer -> its (N, span, 2, n, H_kv, d) view of ``flat`` (without the trailing ``drop`` dims)."""
        out, start = {}, 0
        for layers, span in self.layout.groups:
            shape = self.layout.group_shape(len(layers), span)
            shape = shape[: len(shape) - len(drop)]
            group = flat[start : start + math.prod(shape)].view(shape)
            start += math.prod(shape)
            out.update({layer: group[:, j] for j, layer in enumerate(layers)})
        return out

    def begin_step(self, past: int, query: int) -> None:
        super().begin_step(past, query)
        self._pending.clear()
        # Every fetched block has a new length: drop the ring's buffers of the previous length (held
        # ones stay valid; the allocator reuses the memory once their queued copies are done).
        self.exchange.clear_ring()
        if self.exchange.is_cuda and past > 0:
            self.exchange.h2d.wait_stream(self.exchange.d2h)  # this step's fetches read the last stores
        if past == 0:
            self._prefill_stores_unread = self.cpu_attention > 0
        elif self._prefill_stores_unread:
            # The CPU reads the cache directly from now on: the prefill's stores (queued on the exchange's
            # D2H stream) must be in host memory first. One host wait per generation; later positions are
            # written on the stream that host attention waits for.
            if self.exchange.is_cuda:
                self.exchange.d2h.synchronize()
            self._prefill_stores_unread = False

    def prefetch(self, i: int, layers: Sequence[int]) -> None:
        if self.past == 0:
            return  # prefill: nothing cached yet
        if i < self.cpu_attention:
            # Its cache stays where it is: the link is free now, so start the first sub-batch whose cache is
            # copied (it then arrives while the CPU computes, instead of after).
            i = self.cpu_attention
            if i >= self.layout.num_sub_batches:
                return
        for layer in layers:
            if (i, layer) not in self._pending:
                # Every position this step reads, and the slots of the new ones (stale until written on the device).
                length = min(self.past + self.query, self.layout.span(layer))
                self.h2d_bytes += length * self.host_position_bytes
                scales = (self.exchange.fetch(self.host_scales[layer][i, :length]) if self.codec is not None
                          else None)
                self._pending[i, layer] = (self.exchange.fetch(self.host[layer][i, :length]), scales)

    def update(self, i, layer, key, value):
        self._check(i, layer, key)
        lay, past, host = self.layout, self.past, self.host[layer][i]  # host: (span, 2, n, H_kv, d)
        codec, scales = self.codec, self.host_scales[layer][i] if self.codec is not None else None
        kept = lay.kept_runs(layer, past, self.query)
        self.d2h_bytes += sum(n for _, _, n in kept) * self.host_position_bytes
        if past == 0:
            # (q, 2, n, H_kv, d): one contiguous tensor, one D2H copy (two where a window's ring wraps).
            new = torch.stack((_as_positions(key), _as_positions(value)), dim=1)
            new, new_scales = (new, None) if codec is None else codec.quantize(new, lay.dtype)
            for slot, offset, n in kept:
                self.exchange.store(new[offset : offset + n], host[slot : slot + n])
                if codec is not None:
                    self.exchange.store(new_scales[offset : offset + n], scales[slot : slot + n])
            return key, value  # the prompt attends to itself in the compute dtype; later steps read the codes
        visible = lay.visible_runs(layer, past, self.query)
        if i < self.cpu_attention:
            # Written on the compute stream: host attention waits for that stream before reading.
            new = torch.stack((_as_positions(key), _as_positions(value)), dim=1)
            new, new_scales = (new, None) if codec is None else codec.quantize(new, lay.dtype)
            for slot, offset, n in kept:
                host[slot : slot + n].copy_(new[offset : offset + n], non_blocking=True)
                if codec is not None:
                    scales[slot : slot + n].copy_(new_scales[offset : offset + n], non_blocking=True)
            if len(visible) > 1 and new.is_cuda:
                # A wrapped window is joined by a copy on the host, now: it must read the new position too.
                torch.cuda.current_stream(new.device).synchronize()
            self.cpu_read_bytes += sum(n for _, _, n in visible) * self.host_position_bytes
            keys, values = _as_attention(gather_runs(host, visible))
            if codec is None:
                return keys, values
            # The codes go to host attention with their scales (n, H_kv, kv_length); it dequantizes them there.
            key_scales, value_scales = _scales_as_attention(gather_runs(scales, visible))
            return attach_scales(keys, key_scales), attach_scales(values, value_scales)
        self.prefetch(i, (layer,))  # no-op when the schedule prefetched it
        fetched, fetched_scales = self._pending.pop((i, layer))
        block = self.exchange.wait(fetched)  # (min(past + q, span), 2, n, H_kv, d), device
        keys, values = _as_positions(key), _as_positions(value)
        if codec is not None:
            # Dequantized into the compute dtype; the new positions are quantized, stored in 8 bits, and read
            # back dequantized, as every later step reads them.
            block = codec.dequantize(block, self.exchange.wait(fetched_scales), lay.dtype)
            new_codes, new_scales = codec.quantize(torch.stack((keys, values), dim=1), lay.dtype)
            for slot, offset, n in kept:
                block[slot : slot + n] = codec.dequantize(new_codes[offset : offset + n],
                                                          new_scales[offset : offset + n], lay.dtype)
                self.exchange.store(new_codes[offset : offset + n], host[slot : slot + n])
                self.exchange.store(new_scales[offset : offset + n], scales[slot : slot + n])
            return _as_attention(gather_runs(block, visible))
        for slot, offset, n in kept:
            new = block[slot : slot + n]
            new[:, 0].copy_(keys[offset : offset + n])
            new[:, 1].copy_(values[offset : offset + n])
            self.exchange.store(new, host[slot : slot + n])
        return _as_attention(gather_runs(block, visible))

    def positions_kept(self, layer: int) -> int:
        return self.host[layer].shape[1]

    def end_step(self) -> None:
        self._pending.clear()
        self.exchange.end_step()

    def stats(self) -> dict:
        return {**super().stats(), "kv_cpu_attention_sub_batches": self.cpu_attention,
                "kv_cpu_attention_read_bytes": self.cpu_read_bytes,
                "kv_host_dtype": _dtype_name(self.layout, self.codec),
                "kv_host_bytes": self.host_bytes}

    @property
    def host_bytes(self) -> int:
        """Bytes the host holds (codes and scales)."""
        per_position = self.host_position_bytes
        return sum(len(layers) * span for layers, span in self.layout.groups) * self.layout.num_sub_batches * per_position

    def close(self) -> None:
        """Waits for queued copies; the arena stays with the caller for reuse (``self.arena``)."""
        self._pending.clear()
        self.exchange.drain()
        self.exchange.clear_ring()
        self.host = self.host_scales = None


class SplitKVCache(KVCache):
    """Sub-batches ``0 .. N-D-1`` in the host arena (fetched per step), ``N-D .. N-1`` on the device (no copies)."""

    def __init__(self, layout: KVLayout, device: torch.device, device_sub_batches: int, **host_kwargs) -> None:
        super().__init__(layout, device)
        if not 0 < device_sub_batches < layout.num_sub_batches:
            raise ValueError(f"a split KV cache keeps 1 to N - 1 = {layout.num_sub_batches - 1} sub-batches on the "
                             f"device, not {device_sub_batches}")
        self.num_device = device_sub_batches
        self.num_host = layout.num_sub_batches - device_sub_batches
        self.on_host = HostKVCache(dataclasses.replace(layout, num_sub_batches=self.num_host), device, **host_kwargs)
        self.on_device = DeviceKVCache(dataclasses.replace(layout, num_sub_batches=device_sub_batches), device,
                                       codec=host_kwargs.get("codec"))
        self.arena, self.exchange = self.on_host.arena, self.on_host.exchange  # kept for reuse, as HostKVCache's

    def _part(self, i: int) -> tuple[KVCache, int]:
        return (self.on_host, i) if i < self.num_host else (self.on_device, i - self.num_host)

    def begin_step(self, past: int, query: int) -> None:
        super().begin_step(past, query)
        self.on_device.begin_step(past, query)
        self.on_host.begin_step(past, query)

    def prefetch(self, i: int, layers: Sequence[int]) -> None:
        part, j = self._part(i)
        part.prefetch(j, layers)

    def update(self, i, layer, key, value):
        part, j = self._part(i)
        return part.update(j, layer, key, value)

    def positions_kept(self, layer: int) -> int:
        return max(self.on_host.positions_kept(layer), self.on_device.positions_kept(layer))

    def end_step(self) -> None:
        self.on_device.end_step()
        self.on_host.end_step()

    def stats(self) -> dict:
        device = self.on_device.stats()
        return {**self.on_host.stats(), "kv_cache_bytes": self.layout.nbytes, "kv_device_sub_batches": self.num_device,
                "kv_device_bytes": device["kv_device_bytes"], "kv_device_dtype": device["kv_device_dtype"]}

    def close(self) -> None:
        self.on_device.close()
        self.on_host.close()


class SubBatchCache:
    """What Hugging Face attention and mask code see of the cache, for sub-batch ``i`` (all layers)."""

    is_compileable = False

    def __init__(self, cache: KVCache, i: int, sized_as: Optional[int] = None) -> None:
        self._cache = cache
        self._i = i
        self._sized_as = sized_as

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(self._i, layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self._cache.past

    def get_query_offset(self, layer_idx: Optional[int] = 0) -> int:
        return self._cache.past

    def get_mask_sizes(self, query, layer_idx: Optional[int] = 0) -> tuple[int, int]:
        # transformers < 5.20 passes cache_position (a tensor of the query positions), later the query length.
        q = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        return self._cache.mask_sizes(self._sized_as if self._sized_as is not None else (layer_idx or 0), q)


def device_sub_batches_that_fit(layout: KVLayout, device: torch.device, *, device_fraction: float = 0.5,
                                codec: Optional[KVCodec] = None) -> int:
    """Sub-batches whose cache (in ``codec``'s bytes) fits in ``device_fraction`` of the GPU memory this process
    may still use (the units in flight, the host part's fetched blocks and the activations need the rest)."""
    if device.type != "cuda":
        return layout.num_sub_batches
    per_sub_batch = stored_nbytes(layout, codec) // layout.num_sub_batches
    return min(layout.num_sub_batches, int(device_fraction * gpu_bytes_available(device)) // per_sub_batch)


def choose_kv_mode(mode: str, layout: KVLayout, device: torch.device, *, device_sub_batches: Optional[int] = None,
                   device_fraction: float = 0.5, codec: Optional[KVCodec] = None) -> tuple[str, int]:
    """The mode and the number of sub-batches whose cache is on the device.

    'auto': 'device' when every sub-batch fits (``device_sub_batches_that_fit``), 'split' when some do,
    else 'host'; without CUDA the host is the device: 'device'. 'split': ``device_sub_batches`` (None:
    as many as fit, at most N - 1); a ValueError when none fits.
    """
    n_sub = layout.num_sub_batches
    if mode in ("device", "host", "off"):
        return mode, {"device": n_sub, "host": 0, "off": 0}[mode]
    fit = device_sub_batches if device_sub_batches is not None else device_sub_batches_that_fit(
        layout, device, device_fraction=device_fraction, codec=codec)
    if mode == "split":
        fit = min(fit, n_sub - 1)
        if fit < 1:
            raise ValueError(f"kv_cache='split': not one sub-batch's cache "
                             f"({stored_nbytes(layout, codec) / n_sub / 2**30:.2f} GiB) "
                             f"fits in {device_fraction:.0%} of the free GPU memory; use kv_cache='host', or "
                             "smaller sub-batches (more of them)")
        return "split", fit
    if fit >= n_sub:
        return "device", n_sub
    return ("split", fit) if fit >= 1 and n_sub > 1 else ("host", 0)


def build_kv_cache(mode: str, layout: KVLayout, device: torch.device, *, device_sub_batches: int = 0,
                   cpu_attention: int = 0, arena: Optional[PinnedArena] = None,
                   exchange: Optional[TensorExchange] = None,
                   host_memory_limit_bytes: Optional[int] = None, codec: Optional[KVCodec] = None) -> Optional[KVCache]:
    """'device', 'split' (``device_sub_batches`` on the device), 'host' or 'off' (None: the caller
    recomputes the prefix every step). ``cpu_attention``: host sub-batches (the first ones) whose
    decoding attention runs on the host (``host_attention.py``). ``codec``: the cache in 8 bits, wherever it
    lies (not with 'off', which stores nothing)."""
    if codec is not None and mode == "off":
        raise ValueError(f"kv_cache_dtype={codec.name!r} stores the KV cache in 8 bits; kv_cache='off' stores none: "
                         "choose kv_cache 'auto', 'device', 'split' or 'host', or kv_cache_dtype=None")
    if mode == "off":
        return None
    if mode == "device":
        return DeviceKVCache(layout, device, codec=codec)
    host_kwargs = dict(cpu_attention=cpu_attention, arena=arena, exchange=exchange,
                       host_memory_limit_bytes=host_memory_limit_bytes, codec=codec)
    if mode == "split":
        return SplitKVCache(layout, device, device_sub_batches, **host_kwargs)
    if mode == "host":
        return HostKVCache(layout, device, **host_kwargs)
    raise ValueError(f"kv_cache={mode!r}; choose one of {', '.join(map(repr, KV_CACHE_MODES))}")
