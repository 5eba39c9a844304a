"""Attention next to a host KV cache: a decoding step's attention runs on the CPU, where the cache is.

When the KV cache of a sub-batch lives in host memory, a decoding step can either copy the cache to
the GPU (``HostKVCache``'s default: the whole ``kv[i, l, :past + 1]`` crosses the link every step) or
send the one-token query to the cache and the one-token output back (FlexGen's ``cpu_cache_compute``):
a few hundred kilobytes per (sub-batch, layer) instead of the whole cache. The CPU then reads the cache
from host memory, and the link is left to the weights. Which sub-batches do this is the cache's
choice (``kv_cache.py``, ``cpu_attention_sub_batches``); this file only routes their attention.

Routing: Hugging Face attention layers look up their attention function by
``config._attn_implementation`` in ``ALL_ATTENTION_FUNCTIONS``. ``attention_on_host(config)`` registers a
wrapper of the model's own function (``sdpa``, ``eager``, ...) under a new name and switches the config
to it for the duration of a generation. The wrapper calls the original function unchanged, on the
device, unless the cache handed the layer keys in host memory while its query is on the GPU: then it
copies the query (and the mask) to page-locked host memory, waits for the compute stream (which also
wrote this token's keys and values into the cache), calls the same function on the host tensors, and
copies the output back. The mask function is the original's, registered under the new name too, so
masks are built exactly as before.

This one host wait per (sub-batch, layer) is deliberate: a decoding step's GPU work is small, the next
unit's weights keep streaming on the copy stream while the CPU computes, and the wait is what lets the
CPU read keys the GPU has just written.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_PREFIX = "speedloader_host+"


@dataclass(eq=False)  # compared by identity: nested routings each remove their own record
class HostAttentionTimes:
    """Where the host's time went in the attentions routed to it (host clocks, seconds)."""

    calls: int = 0
    wait_s: float = 0.0  # waiting for the compute stream (the query, mask and new K/V)
    compute_s: float = 0.0  # the attention function itself, on the CPU

    def as_dict(self) -> dict:
        return {"cpu_attention_calls": self.calls, "cpu_attention_wait_s": self.wait_s,
                "cpu_attention_compute_s": self.compute_s}


_times: list[HostAttentionTimes] = []  # the innermost active routing's record


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
    """A copy of ``tensor`` in page-locked host memory: from the device, complete after a stream wait; from
    the host, at once. The attention output goes back to the device from page-locked memory because a copy
    from pageable memory waits behind the weights' copies queued on the link (``return_copy_ms`` in
    ``tools/bench_host_attention.py``), and the next sub-batch's query waits for it."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _wrap(name: Optional[str]) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        original = _original_function(module, name)
        if key.device == query.device:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        # Keys and values of this (sub-batch, layer) are in host memory: bring the query to them.
        query_host = _to_host(query)  # (n, H, q, d)
        mask_host = None if attention_mask is None else _to_host(attention_mask)
        t0 = time.perf_counter()
        with torch.profiler.record_function("speedloader::host_attention_wait"):  # named for traces
            torch.cuda.current_stream(query.device).synchronize()  # the query, the mask and this token's K/V
        t1 = time.perf_counter()
        with torch.profiler.record_function("speedloader::host_attention"):
            out, weights = original(module, query_host, key, value, mask_host, *args, **kwargs)
        if _times:
            record = _times[-1]
            record.calls += 1
            record.wait_s += t1 - t0
            record.compute_s += time.perf_counter() - t1
        return _to_host(out).to(query.device, non_blocking=True), weights

    attention.__qualname__ = f"host_attention[{name}]"
    return attention


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
