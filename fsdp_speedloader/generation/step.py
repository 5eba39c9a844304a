"""One layer-major generation step (SpeedLoader inference, paper 3.2): every unit is unsharded once for all N
sub-batches.

One step (the prefill, then one per new token), inside ONE hooked call of the root (embeddings, final
norm and LM head stay unsharded from the first step on)::

    embed every sub-batch -> activation slot 0
    for unit u = 1..U:                       one FSDP-hooked call: unshard once (prefetched by u - 1)
        for sub-batch i = 1..N:              blocks run through their class forward, no hooks
            fetch x[i] and the KV of (i, unit's layers); run; store x'[i] and the new positions' KV
    final norm + LM head on the last position of every sub-batch -> logits of the whole batch

``unit_step`` is the schedule: which fetch, compute and store happen when (the order per sub-batch is
``for_each_sub_batch``'s). Activations go through the model's activation store, the KV cache through
``kv_cache.py``; both copy on a ``TensorExchange``'s streams when CUDA is present. A model with quantized
linears (``quant/``) also brings each unit's packed weights in before its sub-batches run and queues the next
unit's (``weight_stream.py``); FSDP2 unshards the rest of the unit as before. The loop over steps,
token selection and the figures are ``generate.py``'s.

Parity with Hugging Face ``generate`` (greedy, fp32): positions are ``cumsum(mask) - 1`` as ``generate``
computes them; each layer type's 4-D mask comes from the model's own mask function (``create_causal_mask``,
``create_sliding_window_causal_mask`` for sliding-window layers), given a cache object that reports the same
lengths as ``DynamicCache``'s layer of that type; each layer type gets its rotary table (one shared table, or
Gemma-3's one per type); attention is the block's own Hugging Face attention, which appends to our cache
through ``Cache.update``; the logits are soft-capped where the config says so, as the family's forward does.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from fsdp_speedloader.engine.activation_store import ActivationStore, DeviceActivationStore, for_each_sub_batch
from fsdp_speedloader.engine.chain import Unit
from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.generation.kv_cache import KVCache, build_kv_cache, choose_kv_mode
from fsdp_speedloader.generation.kv_layout import kv_layout_for
from fsdp_speedloader.generation.weight_stream import WeightStream
from fsdp_speedloader.models import BlockInputs, ModelAdapter
from fsdp_speedloader.models.adapter import FULL_ATTENTION, SLIDING_ATTENTION, cache_argument
from fsdp_speedloader.quant import KVCodec

log = logging.getLogger(__name__)

UNIT_METHOD = "speedloader_generate"  # registered on every unit's FSDP module
ROOT_METHOD = "speedloader_generate_step"  # registered on the root
# Each layer type's mask function, as the families' forwards build their ``causal_mask_mapping``
# (``ModelAdapter.attention_masks``, here with a KV cache).
_MASK_FUNCTIONS = {FULL_ATTENTION: create_causal_mask, SLIDING_ATTENTION: create_sliding_window_causal_mask}


# ---------------------------------------------------------------------------------------------
# One step's state, and the schedule
# ---------------------------------------------------------------------------------------------


class GenerationStepState:
    """What one step shares between the root call and the unit calls.

    A plain class, not a dataclass: it passes through FSDP-hooked calls, and FSDP rebuilds
    containers and dataclasses it finds in forward arguments (on CUDA the root's call copies them
    to the device), which would lose ``logits`` written into the copy. ``past`` positions are
    cached; this step adds ``input_ids[i].shape[1]``. ``input_ids`` has one entry per group that runs
    through a unit in one call: the N sub-batches, or one (the whole batch) in a decoding step with the
    KV cache on the device (``KVCache.whole_batch_decode``).
    """

    def __init__(self, *, run: "GenerationRun", input_ids: list[torch.Tensor], mask: Optional[torch.Tensor],
                 positions: torch.Tensor, past: int) -> None:
        self.run = run
        self.input_ids = input_ids  # N x (n, q), or 1 x (B, q), on the device
        self.mask = mask  # (B, past + q) on the host; None: no padding in the batch
        self.positions = positions  # (B, q) on the host
        self.past = past
        self.block_inputs: list[BlockInputs] = []  # one per group, built by the root step
        self.store = run.store  # where this step's block-boundary activations wait (set by the root step)
        self.logits: Optional[torch.Tensor] = None  # (B, V) fp32, set by the root step

    @property
    def num_groups(self) -> int:
        return len(self.input_ids)


@dataclass(eq=False)
class GenerationRun:
    """Everything fixed for one ``generate`` call."""

    adapter: ModelAdapter
    units: list  # (FSDP module, Unit)
    layers: list[list[int]]  # per unit: its blocks' layer indices
    layer_types: tuple[str, ...]  # per layer index: its attention type (ModelAdapter.layer_types)
    store: object  # the model's ActivationStore
    device: torch.device
    num_sub_batches: int
    sub_batch_size: int
    capacity: int  # prompt_len + max_new_tokens
    kv_mode: str  # 'auto' until the first step resolves it
    kv_device_sub_batches: Optional[int]  # 'split': sub-batches whose cache stays on the device (None: fit)
    cpu_attention_sub_batches: int  # host sub-batches whose decoding attention runs on the host
    host_memory_limit_bytes: Optional[int]
    resources: "GenerationResources"
    kv: Optional[KVCache] = None
    kv_codec: Optional[KVCodec] = None  # the cache's 8-bit keys and values (kv_cache_dtype); None: compute dtype
    weights: Optional[WeightStream] = None  # quantized weights (quant.quantize_linears_): fetched and dequantized per unit
    on_local_shards: bool = False  # the modules run on their local shards: no FSDP2 hooks (one rank, resident)
    block_kwargs: frozenset = frozenset()
    slots_planned: bool = False
    # Decoding steps with a KV cache: one token per sequence, whose activations stay on the device.
    decode_store: ActivationStore = field(default_factory=DeviceActivationStore)


@dataclass
class GenerationResources:
    """Kept on the model between calls: the host KV arena and its exchange are reused when they fit."""

    kv_arena: object = None
    kv_exchange: object = None
    weight_exchange: object = None  # the quantized weights' copies (WeightStream)


def unit_step(unit: Unit, state: GenerationStepState) -> None:
    """Runs ``unit`` on every sub-batch: x[src][i] -> x[dst][i], appending to the KV cache. THE schedule.

    Inside the unit's one FSDP-hooked call. Copies: the activation store's ``prefetch``/``put`` and the
    KV cache's ``prefetch``/``update`` start H2D/D2H copies on the exchange streams; compute is on the
    current stream. While sub-batch i computes, sub-batch i + 1's input and KV (or, during the last one,
    the next unit's first input and KV) are copied in, and i - 1's outputs are copied out.
    """
    run = state.run
    store, kv, n_sub = state.store, run.kv, state.num_groups
    src, dst = (unit.index - 1) % 2, unit.index % 2
    layers = run.layers[unit.index - 1]
    next_layers = run.layers[unit.index] if unit.index < len(run.layers) else None

    def run_sub_batch(i: int, x: torch.Tensor) -> None:
        if i + 1 == n_sub and next_layers is not None:  # the last sub-batch: start the next unit's first inputs
            if kv is not None:
                kv.prefetch(0, next_layers)
            if n_sub > 1:
                store.prefetch(dst, 0)  # stored one sub-batch ago; N = 1 would store it only below
        store.put(dst, i, unit.forward(run.adapter, x, state.block_inputs[i]))

    kv_prefetch = None if kv is None else (lambda j: kv.prefetch(j, layers))  # right behind each input's copy
    if run.weights is None:
        for_each_sub_batch(store, src, n_sub, run_sub_batch, also=kv_prefetch)
        return
    # quantized weights: unit u's dequantized once for every group or by each linear, u + 1's copy queued
    run.weights.begin_unit(unit.index, groups=n_sub)
    try:
        for_each_sub_batch(store, src, n_sub, run_sub_batch, also=kv_prefetch)
    finally:
        run.weights.end_unit(unit.index)


def root_step(state: GenerationStepState) -> None:
    """One layer-major step inside the root's hooked call: embed, all units, head."""
    run = state.run
    adapter, device, n_sub = run.adapter, run.device, state.num_groups
    act_dtype = adapter.embedding.weight.dtype  # the unsharded (compute) dtype, inside the root's call
    n, q = state.input_ids[0].shape
    h = adapter.config.hidden_size
    if run.kv is None and run.kv_mode != "off":  # first step: the compute dtype is known here
        _setup_kv(run, act_dtype)
    # A decoding step with a KV cache moves one token per sequence between units (B x h): it stays on the
    # device. Through the host, each sub-batch's input would wait behind the next unit's weights, queued
    # earlier on the same link (copies run in queue order; see host_attention.py).
    store = state.store = run.decode_store if run.kv is not None and state.past > 0 else run.store
    if store is run.store and not run.slots_planned:
        # Plan the activation slots for the longest step once (a re-plan would move the parameter
        # shards that the store's arena may hold), then carve each step's geometry out of them.
        store.begin_step(2, n_sub, (n, run.capacity if run.kv is None else q, h), act_dtype, device)
        run.slots_planned = True
    store.begin_step(2, n_sub, (n, q, h), act_dtype, device)
    if run.kv is not None:
        run.kv.begin_step(state.past, q)
    state.block_inputs = _step_inputs(run, act_dtype, state.mask, state.positions, state.past, n_sub)
    for i in range(n_sub):
        store.put(0, i, adapter.embed(state.input_ids[i], state.block_inputs[i].kwargs["position_ids"]))
    for module, unit in run.units:
        if run.on_local_shards:
            unit_step(unit, state)  # the weights are whole where they lie: nothing to unshard
        else:
            getattr(module, UNIT_METHOD)(state)  # one FSDP-hooked call per unit: one unshard
    last = len(run.units) % 2
    logits = []

    def head(i: int, x: torch.Tensor) -> None:
        # As Hugging Face: final norm on every position, LM head on the last (logits_to_keep=1), soft-capping.
        hidden = adapter.final_hidden(x)[:, -1:, :]
        logits.append(_soft_cap(adapter.config, adapter.lm_head(hidden))[:, -1, :].float())  # (n, V)

    for_each_sub_batch(store, last, n_sub, head)
    store.end_step()
    if run.kv is not None:
        run.kv.end_step()
    if run.weights is not None:
        run.weights.end_step()
    state.logits = torch.cat(logits)


def _soft_cap(config, logits: torch.Tensor) -> torch.Tensor:
    """``c * tanh(logits / c)`` where the config sets ``final_logit_softcapping`` (Gemma), in the head's dtype,
    as ``ModelAdapter.logits`` and the family's forward apply it."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _setup_kv(run: GenerationRun, dtype: torch.dtype) -> None:
    sliding = [layer for layer, t in enumerate(run.layer_types) if t == SLIDING_ATTENTION]
    layout = kv_layout_for(run.adapter.config, num_sub_batches=run.num_sub_batches,
                           sub_batch_size=run.sub_batch_size, capacity=run.capacity, dtype=dtype,
                           sliding_layers=sliding)
    run.kv_mode, on_device = choose_kv_mode(run.kv_mode, layout, run.device,
                                            device_sub_batches=run.kv_device_sub_batches, codec=run.kv_codec)
    res = run.resources
    run.kv = build_kv_cache(run.kv_mode, layout, run.device, device_sub_batches=on_device,
                            cpu_attention=run.cpu_attention_sub_batches, arena=res.kv_arena,
                            exchange=res.kv_exchange, host_memory_limit_bytes=run.host_memory_limit_bytes,
                            codec=run.kv_codec)
    if run.kv_mode in ("host", "split"):
        res.kv_arena, res.kv_exchange = run.kv.arena, run.kv.exchange
    log.debug("KV cache: %s (%d of %d sub-batches on the device, stored in %s), %.3f GiB in the compute dtype, "
              "(layers, positions) %s", run.kv_mode, on_device, layout.num_sub_batches,
              run.kv_codec.name if run.kv_codec else dtype, layout.nbytes / 2**30,
              [(len(layers), span) for layers, span in layout.groups])


def register_generation_methods(model: nn.Module) -> GenerationResources:
    """Registers the generation forward methods on the units and the root (once per model)."""
    res = getattr(model, "_speedloader_generation", None)
    if res is not None:
        return res
    for module, unit in speedloader_engine(model).units:
        setattr(module, UNIT_METHOD, functools.partial(unit_step, unit))
        register_fsdp_forward_method(module, UNIT_METHOD)
    setattr(model, ROOT_METHOD, root_step)
    register_fsdp_forward_method(model, ROOT_METHOD)
    model._speedloader_generation = res = GenerationResources()
    return res


# ---------------------------------------------------------------------------------------------
# Masks and positions (built on the host: Hugging Face's mask code reads the padding mask's values)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _causal_mask(layer_type: str, config, dtype: torch.dtype, mask: Optional[torch.Tensor], positions: torch.Tensor,
                 past: int, cache) -> Optional[torch.Tensor]:
    """The model's own 4-D mask (or None) of ``layer_type``'s layers for one sub-batch, built on the host as
    ``generate`` would: ``mask`` (n, past + q) or None, ``cache`` reporting ``past`` cached positions and the
    sizes of a layer of that type, or None (no cache)."""
    n, q = positions.shape
    builder = _MASK_FUNCTIONS[layer_type]
    params = _params(builder)
    kwargs = dict(config=config, attention_mask=mask)
    kwargs[cache_argument(params)] = cache
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = torch.empty((n, q, 0), dtype=dtype)
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    if "cache_position" in params:  # transformers < 5.20
        kwargs["cache_position"] = torch.arange(past, past + q)
    return builder(**kwargs)


@functools.lru_cache(maxsize=None)
def _rotary_takes_layer_type(rotary_class: type) -> bool:
    # Gemma-3's rotary module holds one table per layer type: forward(x, position_ids, layer_type).
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def _step_inputs(run: GenerationRun, dtype: torch.dtype, mask: Optional[torch.Tensor], positions: torch.Tensor,
                 past: int, num_groups: int) -> list[BlockInputs]:
    """Block keyword arguments of every group (sub-batch, or the whole batch), built once per step: those all
    layers share, and each layer type's mask and rotary table. ``mask`` (B, past + q) and ``positions`` (B, q)
    on the host."""
    n, device, config = positions.shape[0] // num_groups, run.device, run.adapter.config
    first_layer = {}  # layer type -> a layer of that type: the cache reports its mask sizes
    for layer, layer_type in enumerate(run.layer_types):
        first_layer.setdefault(layer_type, layer)
    rotary = getattr(getattr(run.adapter.model, "model", None), "rotary_emb", None)  # LLaMA layout
    rotary_by_type = rotary is not None and _rotary_takes_layer_type(type(rotary))
    like = torch.empty((), dtype=dtype, device=device)  # the rotary modules read only its dtype and device
    out = []
    for i in range(num_groups):
        rows = slice(i * n, (i + 1) * n)
        pos = positions[rows]
        sub_mask = None if mask is None else mask[rows]
        by_type = {}
        for layer_type, layer in first_layer.items():
            sized = None if run.kv is None else run.kv.view(i, sized_as=layer)
            attn = _causal_mask(layer_type, config, dtype, sub_mask, pos, past, sized)
            by_type[layer_type] = {"attention_mask": None if attn is None else attn.to(device, non_blocking=True)}
        pos = pos.to(device, non_blocking=True)
        kwargs = {"position_ids": pos}
        if rotary_by_type:
            for layer_type, type_kwargs in by_type.items():
                type_kwargs["position_embeddings"] = rotary(like, pos, layer_type)
        elif rotary is not None:
            kwargs["position_embeddings"] = rotary(like, position_ids=pos)
        if run.kv is not None:
            kwargs[cache_argument(run.block_kwargs)] = run.kv.view(i)
            kwargs["use_cache"] = True
        if "cache_position" in run.block_kwargs:
            kwargs["cache_position"] = torch.arange(past, past + pos.shape[1], device=device)
        out.append(BlockInputs(kwargs=kwargs, by_layer_type=by_type))
    return out


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions as ``generate`` computes them: ``cumsum(mask) - 1``, padding at 0. (B, s) -> (B, s)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
