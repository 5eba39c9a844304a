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

This one host wait per (sub-batch, layer) is deliberate: it is what lets the CPU read keys the GPU has
just written. It waits only for the stream of the thread that computes those sub-batches:
``HostAttentionWorker`` runs them in a thread of their own, on a CUDA stream of their own, while the
generation thread runs the unit on the other sub-batches (whose caches are copied or on the GPU) and the
next unit's weights stream in. Without it, the CPU's attention and the GPU's work on the other
sub-batches would take turns.
"""

from __future__ import annotations

import contextlib
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Sequence

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_PREFIX = "speedloader_host+"


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
    """Starts a copy of a device tensor into page-locked host memory (complete after a stream wait)."""
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
        torch.cuda.current_stream(query.device).synchronize()  # the query, the mask and this token's K/V
        out, weights = original(module, query_host, key, value, mask_host, *args, **kwargs)
        return out.to(query.device, non_blocking=True), weights

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
def attention_on_host(config) -> Iterator[None]:
    """Within the block, the model of ``config`` computes attention on the host for layers whose cache
    returns host keys; everything else is unchanged. Restores the model's attention implementation on exit."""
    name = config._attn_implementation
    if name is not None and name.startswith(_PREFIX):  # nested: already routed
        yield
        return
    config._attn_implementation = _register(name)
    try:
        yield
    finally:
        config._attn_implementation = name


class HostAttentionWorker:
    """Runs a unit on the host-attention sub-batches in a thread and CUDA stream of their own.

    ``start(run_one, inputs)`` queues ``run_one(i, inputs[i])`` for every ``i`` after the caller's stream's
    work so far (the unit's unsharded weights and the inputs); the caller then runs the other sub-batches;
    ``finish()`` returns the outputs, ordered before the caller's stream's next work. The inputs stay
    referenced until then, so no buffer they live in is reused before the worker's stream has read it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-attention")
        self._job: Optional[Future] = None
        self._inputs: Sequence[torch.Tensor] = ()

    def start(self, run_one: Callable[[int, torch.Tensor], torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        assert self._job is None, "finish() the previous unit first"
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._inputs = inputs
        self._job = self._pool.submit(self._run, run_one, inputs)

    def _run(self, run_one, inputs) -> list[torch.Tensor]:
        # Grad mode and the current stream are per thread: set both here.
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with torch.no_grad(), stream:
            return [run_one(i, x) for i, x in enumerate(inputs)]

    def finish(self) -> list[torch.Tensor]:
        job, self._job = self._job, None
        try:
            outputs = job.result()
        finally:
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._inputs = ()
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            for y in outputs:
                y.record_stream(current)  # allocated on the worker's stream, read on the caller's
        return outputs

    def close(self) -> None:
        if self._job is not None:  # an error left a unit unfinished: wait for it without raising again
            self._job.exception()
            self._job = None
        self._pool.shutdown(wait=True)
