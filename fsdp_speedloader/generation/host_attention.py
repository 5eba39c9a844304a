"""Attention next to a host KV cache: a decoding step's attention runs on the CPU, where the cache is.

A sub-batch whose KV cache is in host memory can copy its whole cache to the GPU every step (``HostKVCache``'s
default) or send the one-token query to the cache and the one-token output back (FlexGen's
``cpu_cache_compute``): the link is then left to the weights, and the CPU reads the cache from host memory.
Which sub-batches do this is the cache's choice (``kv_cache.py``, ``cpu_attention_sub_batches``); this file
only routes their attention.

Routing: Hugging Face attention layers look up their attention function by ``config._attn_implementation``
in ``ALL_ATTENTION_FUNCTIONS``. ``attention_on_host(config)`` registers a wrapper of the model's own function
(``sdpa``, ``eager``, ...), and the original's mask function, under a new name and switches the config to it
for the duration of a generation, so masks are built exactly as before. The wrapper calls the original
function unchanged, on the device, unless the cache handed the layer keys in host memory while its query is
on the GPU: then it copies the query (and the mask) to page-locked host memory, waits for the compute stream
(which also wrote this token's keys and values into the cache), and calls the same function on the host
tensors. That host wait, once per (sub-batch, layer), is what lets the CPU read keys the GPU has just
written; the next unit's weights keep streaming on the copy stream meanwhile.

The output goes back without a copy engine: host-to-device copies run in the order they were queued, across
streams, so a copied output would land only after the next unit's weights, and the CPU and the link would
take turns (figures: ``docs/generation.md``). Instead the output is written to page-locked memory and an
elementwise kernel reads it there (unified addressing); where that is not possible it is copied, with a
warning.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fsdp_speedloader.quant.kv import dequantize_kv, scales_of

_PREFIX = "speedloader_host+"
# 8-bit host cache: keys and values dequantized a few sequences at a time, at most this many bytes of them, so
# the compute-dtype copy stays in the CPU's caches instead of going through host memory.
_DEQUANTIZED_BYTES_PER_CALL = 16 << 20


@dataclass(eq=False)  # compared by identity: nested routings each remove their own record
class HostAttentionTimes:
    """Where the host's time went in the attentions routed to it (host clocks, seconds)."""

    calls: int = 0
    wait_s: float = 0.0  # waiting for the compute stream (the query, mask and new K/V)
    compute_s: float = 0.0  # the attention function itself, on the CPU
    read_in_place: int = 0  # outputs the device read from page-locked memory (the others were copied)

    def as_dict(self) -> dict:
        return {"cpu_attention_calls": self.calls, "cpu_attention_wait_s": self.wait_s,
                "cpu_attention_compute_s": self.compute_s, "cpu_attention_outputs_read_in_place": self.read_in_place}


_times: list[HostAttentionTimes] = []  # the innermost active routing's record
_unread: collections.deque = collections.deque()  # (event, page-locked output): kept until the device read it
_in_place_works: dict[int, bool] = {}  # per CUDA device: can its kernels read page-locked memory in place?


def _original_function(module: torch.nn.Module, name: Optional[str]) -> Callable:
    """The attention function the layer would call under ``name`` (its family's eager one for 'eager')."""
    if name not in (None, "eager"):
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its module; load the model "
                         "with attn_implementation='sdpa' to use cpu_attention_sub_batches")
    return eager


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in page-locked host memory (from the device: complete after a stream wait)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the bytes of the page-locked ``host`` (unified addressing: kernels
    read them in place, over the link)."""
    interface = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1", "data": (host.data_ptr(), False),
                 "version": 2}
    holder = type("PageLockedBytes", (), {"__cuda_array_interface__": interface})()
    return torch.as_tensor(holder, device=device).view(host.dtype).view(host.shape)


def _reads_in_place(device: torch.device) -> bool:
    """Whether kernels on ``device`` read page-locked memory in place (checked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _in_place_works:
        probe = torch.arange(8, dtype=torch.float32).pin_memory()
        try:
            _in_place_works[index] = torch.equal(torch.mul(device_view(probe, device), 1).cpu(), probe)
        except (RuntimeError, TypeError, ValueError):
            _in_place_works[index] = False
        if not _in_place_works[index]:
            warnings.warn(f"{device}: kernels cannot read page-locked host memory in place; host attention "
                          "copies its outputs back, and they wait behind the weights' copies on the link")
    return _in_place_works[index]


def _to_device(out: torch.Tensor, device: torch.device, record: Optional[HostAttentionTimes]) -> torch.Tensor:
    """The host attention output on ``device``, read by a kernel where possible (not queued on the link)."""
    host = _to_host(out)
    if not _reads_in_place(device):
        return host.to(device, non_blocking=True)
    while _unread and _unread[0][0].query():  # outputs the device has read may be reused by the allocator
        _unread.popleft()
    result = torch.mul(device_view(host, device), 1)  # an elementwise kernel, not a copy engine's memcpy
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _unread.append((event, host))
    if record is not None:
        record.read_in_place += 1
    return result


def _wrap(name: Optional[str]) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        original = _original_function(module, name)
        if key.device == query.device:  # a cache on the device (or no GPU at all: the host is the device)
            if scales_of(key) is not None:  # an 8-bit host cache
                return _attend_8bit(original, module, query, key, value, attention_mask, args, kwargs)
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        # Keys and values of this (sub-batch, layer) are in host memory: bring the query to them.
        query_host = _to_host(query)  # (n, H, q, d)
        mask_host = None if attention_mask is None else _to_host(attention_mask)
        t0 = time.perf_counter()
        with torch.profiler.record_function("speedloader::host_attention_wait"):  # named for traces
            torch.cuda.current_stream(query.device).synchronize()  # the query, the mask and this token's K/V
        t1 = time.perf_counter()
        with torch.profiler.record_function("speedloader::host_attention"):
            if scales_of(key) is None:
                out, weights = original(module, query_host, key, value, mask_host, *args, **kwargs)
            else:
                out, weights = _attend_8bit(original, module, query_host, key, value, mask_host, args, kwargs)
        record = _times[-1] if _times else None
        if record is not None:
            record.calls += 1
            record.wait_s += t1 - t0
            record.compute_s += time.perf_counter() - t1
        return _to_device(out, query.device, record), weights

    attention.__qualname__ = f"host_attention[{name}]"
    return attention


def _attend_8bit(original: Callable, module, query, key, value, mask, args, kwargs):
    """The attention function over an 8-bit host cache: ``key`` / ``value`` (n, H_kv, T, d) codes with their
    scales attached (``quant/kv.py``), dequantized into the query's dtype a few sequences at a time (attention
    is independent per sequence), so only the codes and scales come from host memory."""
    key_scales, value_scales = scales_of(key), scales_of(value)
    n, heads, length, dim = key.shape
    per_sequence = 2 * heads * length * dim * query.element_size()
    step = max(1, _DEQUANTIZED_BYTES_PER_CALL // max(per_sequence, 1))
    outs, weights = [], []
    for j in range(0, n, step):
        rows = slice(j, min(n, j + step))
        k = dequantize_kv(key[rows], key_scales[rows], query.dtype)
        v = dequantize_kv(value[rows], value_scales[rows], query.dtype)
        m = mask[rows] if mask is not None and mask.shape[0] == n else mask
        out, w = original(module, query[rows], k, v, m, *args, **kwargs)
        outs.append(out)
        weights.append(w)
    return torch.cat(outs), (None if weights[0] is None else torch.cat(weights))


def _register(name: Optional[str]) -> str:
    wrapped = f"{_PREFIX}{name or 'eager'}"
    if wrapped not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(wrapped, _wrap(name))
        # Masks as the original builds them (an implementation without a mask function gets none).
        mask_function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name or "eager")
        if mask_function is not None:
            ALL_MASK_ATTENTION_FUNCTIONS.register(wrapped, mask_function)
    return wrapped


@contextlib.contextmanager
def attention_on_host(config) -> Iterator[HostAttentionTimes]:
    """Within the block, the model of ``config`` computes attention on the host for layers whose cache
    returns host keys; everything else is unchanged. Restores the model's attention implementation on exit.
    Yields the block's ``HostAttentionTimes``."""
    name = config._attn_implementation
    times = HostAttentionTimes()
    _times.append(times)
    nested = name is not None and name.startswith(_PREFIX)  # already routed: keep the outer routing
    if not nested:
        config._attn_implementation = _register(name)
    try:
        yield times
    finally:
        _times.remove(times)
        if not nested:
            config._attn_implementation = name
        if not _times:  # the outermost routing: let the allocator have the last outputs back once read
            while _unread:
                _unread.popleft()[0].synchronize()
