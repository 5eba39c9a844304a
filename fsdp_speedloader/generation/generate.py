"""Layer-major generation: ``generate`` runs the prefill and one step per new token on a model prepared with
``apply_speedloader``; each step is ``step.py``'s (every unit unsharded once for all N sub-batches).

A decoding step with the KV cache on the device runs the loop over sub-batches once, on the whole batch
(one "sub-batch" of N x n sequences): the sub-batches exist to bound activation memory and to overlap
KV copies, and such a step has one token per sequence and no copies; its time is host overhead per
decoder-layer call, which N groups would pay N times. The prefill, the host KV cache and
``kv_cache='off'`` keep N sub-batches. ``kv_cache='off'`` recomputes the whole sequence every step, as
``generate(..., use_cache=False)`` does.

With one rank and the weights resident in the compute dtype, the same step runs without FSDP2's hooks, on
the local shards themselves (``fsdp2.run_on_local_shards``): there is nothing to unshard.

``generate`` is ``_prepare_generation`` (what is fixed for the call), then ``_decode`` (the steps), then
``_report`` (``GenerationStats``). CLI: ``python -m fsdp_speedloader.app.generate`` (``conf/generate.yaml``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_speedloader.engine.speedloader import speedloader_engine
from fsdp_speedloader.fsdp2 import local_shard_params, run_on_local_shards
from fsdp_speedloader.generation.host_attention import HostAttentionTimes, attention_on_host
from fsdp_speedloader.generation.kv_cache import KV_CACHE_MODES
from fsdp_speedloader.generation.sampling import select_tokens
from fsdp_speedloader.generation.step import ROOT_METHOD, GenerationRun, GenerationStepState, prompt_positions, \
    register_generation_methods, root_step
from fsdp_speedloader.generation.weight_stream import DEQUANTIZE_MODES, WeightStream
from fsdp_speedloader.quant import KV_CACHE_DTYPES, kv_codec, quantized_linears, quantized_weights


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class GenerationStats:
    """Figures of one ``generate`` call (``return_stats=True``). Throughputs count padded prompt tokens,
    as FlexGen does: prefill = B * prompt_len / prefill_s, decode = B * (steps - 1) / decode_s."""

    batch_size: int
    prompt_len: int
    num_steps: int  # forward steps run = new tokens per sequence (<= max_new_tokens with EOS)
    prefill_s: float
    decode_s: float
    kv_cache: str
    io: dict = field(default_factory=dict)  # KV / activation copy bytes, arena sizes

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.prompt_len / max(self.prefill_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * max(self.num_steps - 1, 0) / max(self.decode_s, 1e-9)

    @property
    def generated_tokens_per_s(self) -> float:
        """New tokens per second over the whole generation (FlexGen's 'total throughput')."""
        return self.batch_size * self.num_steps / max(self.prefill_s + self.decode_s, 1e-9)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "io"}
        out.update(prefill_tokens_per_s=self.prefill_tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                   generated_tokens_per_s=self.generated_tokens_per_s, **self.io)
        return out


# ---------------------------------------------------------------------------------------------
# The public entry
# ---------------------------------------------------------------------------------------------


def _check_inputs(model, input_ids, attention_mask, max_new_tokens, num_sub_batches, do_sample, temperature,
                  top_k, top_p, kv_cache, kv_device_sub_batches, cpu_attention_sub_batches, kv_cache_dtype=None,
                  weight_dequantize="auto") -> None:
    """ValueError, naming what to change, before anything is allocated."""
    speedloader_engine(model)  # ValueError unless prepared with apply_speedloader
    if quantized_linears(model) and quantized_weights(model) is None:
        raise ValueError("the model's linears are quantized but hold no weights yet: call fsdp_speedloader.quant."
                         "materialize_quantized_weights(model, ...) after apply_speedloader")
    if weight_dequantize not in DEQUANTIZE_MODES:
        raise ValueError(f"weight_dequantize={weight_dequantize!r}; choose one of "
                         f"{', '.join(map(repr, DEQUANTIZE_MODES))}")
    if weight_dequantize != "auto" and quantized_weights(model) is None:
        raise ValueError(f"weight_dequantize={weight_dequantize!r} applies to quantized weights; this model's are in "
                         "its compute dtype: leave it 'auto', or quantize the linears (weight_quant)")
    if kv_cache_dtype is not None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))} or None (the compute dtype)")
        if kv_cache == "off":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} stores the KV cache in 8 bits; kv_cache='off' stores "
                             "none: choose kv_cache 'auto', 'device', 'split' or 'host', or kv_cache_dtype=None")
    for name, value in (("max_new_tokens", max_new_tokens), ("num_sub_batches", num_sub_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}; it must be an integer >= 1")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError("input_ids must be an integer (batch, prompt_len) tensor of token ids")
    batch, prompt_len = input_ids.shape
    if batch == 0 or prompt_len == 0:
        raise ValueError(f"empty prompts: input_ids has shape {tuple(input_ids.shape)}; pass at least one prompt "
                         "of at least one token")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids "
                             f"{tuple(input_ids.shape)} (1 for prompt tokens, 0 for left padding)")
        empty = (attention_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"prompt row(s) {empty[:8]} are all padding (attention_mask all 0); drop them or give "
                             "each prompt at least one token")
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("attention_mask has padding at the end of a row: pad prompts on the LEFT "
                             "(tokenizer.padding_side='left'), new tokens follow the last column")
    if batch % num_sub_batches != 0:
        raise ValueError(f"batch of {batch} prompts is not num_sub_batches={num_sub_batches} x sub_batch_size; "
                         f"pass a multiple of {num_sub_batches} prompts or change num_sub_batches")
    adapter = speedloader_engine(model).adapter
    if prompt_len + max_new_tokens > adapter.max_positions:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"{adapter.max_positions} positions; shorten the prompts or lower max_new_tokens "
                         f"to at most {adapter.max_positions - prompt_len}")
    vocab = adapter.config.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab})")
    if kv_cache not in KV_CACHE_MODES:
        raise ValueError(f"kv_cache={kv_cache!r}; choose one of {', '.join(map(repr, KV_CACHE_MODES))}")
    if kv_cache == "split" and num_sub_batches < 2:
        raise ValueError("kv_cache='split' keeps some sub-batches' cache on the device and the others on the host: "
                         "it needs num_sub_batches >= 2 (with one sub-batch use 'device' or 'host')")
    if kv_device_sub_batches is not None:
        if kv_cache != "split":
            raise ValueError(f"kv_device_sub_batches={kv_device_sub_batches!r} applies to kv_cache='split' only "
                             f"(got kv_cache={kv_cache!r})")
        d = kv_device_sub_batches
        if not isinstance(d, int) or isinstance(d, bool) or not 1 <= d < num_sub_batches:
            raise ValueError(f"kv_device_sub_batches={d!r}; a split cache keeps 1 to num_sub_batches - 1 = "
                             f"{num_sub_batches - 1} sub-batches on the device (all: kv_cache='device', none: 'host')")
    c = cpu_attention_sub_batches
    if not isinstance(c, int) or isinstance(c, bool) or c < 0:
        raise ValueError(f"cpu_attention_sub_batches={c!r}; it must be an integer >= 0")
    if c > 0:
        if kv_cache not in ("host", "split"):
            raise ValueError(f"cpu_attention_sub_batches={c} runs attention next to a host KV cache: it needs "
                             f"kv_cache='host' or 'split' (got kv_cache={kv_cache!r})")
        host = num_sub_batches - (kv_device_sub_batches or 0) if kv_cache == "split" else num_sub_batches
        if c > host:
            on_device = f" - kv_device_sub_batches={kv_device_sub_batches}" if kv_cache == "split" else ""
            raise ValueError(f"cpu_attention_sub_batches={c}, but the host holds the cache of {host} sub-batches "
                             f"(num_sub_batches={num_sub_batches}{on_device})")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}; it must be > 0 (or do_sample=False for greedy)")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k={top_k!r}; it must be an integer >= 1 or None")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r}; it must be in (0, 1] or None")


def _eos_list(eos_token_id: Union[int, Sequence[int], None]) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    num_sub_batches: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    kv_cache: str = "auto",
    kv_device_sub_batches: Optional[int] = None,
    cpu_attention_sub_batches: int = 0,
    kv_cache_dtype: Optional[str] = None,
    weight_dequantize: str = "auto",
    seed: Optional[int] = None,
    host_memory_limit_bytes: Optional[int] = None,
    return_stats: bool = False,
    on_step: Optional[Callable[[int], None]] = None,
):
    """Generates ``max_new_tokens`` tokens per prompt, layer-major, on a model prepared with ``apply_speedloader``.

    Args:
        model: prepared with ``apply_speedloader`` (parameters on the GPU or offloaded, sharded over the
            ranks of its mesh). Every rank calls ``generate`` on its own prompts with the same
            ``max_new_tokens`` (FSDP's all-gathers are collective). Switched to eval mode for the call.
        input_ids: (B, prompt_len) token ids, LEFT-padded; B = num_sub_batches x sub_batch_size.
        attention_mask: (B, prompt_len), 1 for prompt tokens and 0 for padding; None: no padding.
        max_new_tokens: new tokens per prompt (fewer when every sequence has ended with EOS).
        num_sub_batches: N; each unit is loaded once per step for all N sub-batches.
        do_sample / temperature / top_k / top_p: greedy (default) or sampling.
        eos_token_id: token id(s) that end a sequence, at any of them; None: no early stop (unlike Hugging
            Face, the model's generation config is NOT consulted: app/generate.py passes its end ids). Ended
            sequences get ``pad_token_id`` (default: the first EOS id); generation stops when all have ended (on
            every rank).
        kv_cache: 'device' (GPU), 'host' (page-locked host arena, copies overlapped with compute),
            'split' (the last ``kv_device_sub_batches`` sub-batches on the GPU, the others on the host:
            only those are copied), 'off' (recompute the prefix every step), 'auto' (device when the
            whole cache fits in half of the GPU memory this process may still use, split when some
            sub-batches do, else host; 'device' without CUDA).
        kv_device_sub_batches: with kv_cache='split', the sub-batches whose cache stays on the GPU
            (1 .. N - 1); None: as many as fit in half of the GPU memory this process may still use.
        cpu_attention_sub_batches: with kv_cache='host' or 'split', the first host sub-batches whose
            decoding attention runs on the CPU next to their cache (FlexGen's ``cpu_cache_compute``): the
            query and output cross the link instead of the cache. The others' cache is copied to the GPU.
            Balances link and CPU memory bandwidth; 0 (default): every host cache is copied.
        kv_cache_dtype: None (the compute dtype), 'int8' or 'fp8' (e4m3): the cache in 8 bits, on the GPU and in
            the host alike, with one scale per (position, sequence, head): half the memory (twice the sequences
            whose cache fits on the GPU), and half the bytes over the link and read by host attention
            (``quant/kv.py``). Not with kv_cache='off'.

        weight_dequantize: for a model whose block linears were quantized (``quant.quantize_linears_`` and
            ``quant.materialize_quantized_weights``: their packed int8 / int4 bytes are streamed unit by unit and
            dequantized on the compute device, ``weight_stream.py``), how a unit that runs several groups (the
            prefill's sub-batches) dequantizes: 'unit' (each weight once, for all groups: the whole unit in
            the compute dtype at once), 'linear' (each linear when it runs, once per group: one weight at a
            time) or 'auto' ('unit' when the largest unit's weights take at most half of the GPU memory left
            at its first such unit, else 'linear'). A one-group step always dequantizes per linear.
        seed: seeds sampling (a private generator: the global RNG is untouched); None: global RNG.
        host_memory_limit_bytes: host budget of the KV arena (default: detected, see ``arena.py``).
        return_stats: also return a ``GenerationStats``.
        on_step: called once per step (the prefill is step 1) with the number of steps done, from the host,
            without waiting for the device; for a progress display (``generate`` itself prints nothing).
    Returns:
        (B, prompt_len + new tokens) LongTensor on ``input_ids``' device, as Hugging Face ``generate``.
    """
    _check_inputs(model, input_ids, attention_mask, max_new_tokens, num_sub_batches, do_sample, temperature,
                  top_k, top_p, kv_cache, kv_device_sub_batches, cpu_attention_sub_batches, kv_cache_dtype,
                  weight_dequantize)
    eos = _eos_list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    run, prompts = _prepare_generation(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                       num_sub_batches=num_sub_batches, kv_cache=kv_cache,
                                       kv_device_sub_batches=kv_device_sub_batches,
                                       cpu_attention_sub_batches=cpu_attention_sub_batches,
                                       host_memory_limit_bytes=host_memory_limit_bytes, kv_cache_dtype=kv_cache_dtype,
                                       weight_dequantize=weight_dequantize)
    generator = torch.Generator(device=run.device).manual_seed(seed) if do_sample and seed is not None else None
    select = functools.partial(select_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=generator)
    was_training = model.training
    model.eval()
    try:
        new_tokens, timing = _decode(model, run, prompts, max_new_tokens=max_new_tokens, select=select, eos=eos,
                                     pad=pad, timed=return_stats, on_step=on_step)
    finally:
        if run.kv is not None:
            run.kv.close()
        if run.weights is not None:
            run.weights.close()
        model.train(was_training)
    out = torch.cat([prompts.ids, torch.stack(new_tokens, dim=1)], dim=1).to(input_ids.device)
    return (out, _report(run, prompts, len(new_tokens), timing)) if return_stats else out


@dataclass(eq=False)
class _Prompts:
    """The prompts of one ``generate`` call, as its steps read them."""

    ids: torch.Tensor  # (B, prompt_len) on the compute device
    mask: Optional[torch.Tensor]  # (B, prompt_len) on the host, 0 = left padding; None: no padding
    positions: torch.Tensor  # (B, prompt_len) on the host


@dataclass
class _Timing:
    """Host clock of one call (``timed``: the GPU's work is waited for at both marks)."""

    prefill_s: float
    total_s: float
    host_attention: Optional[HostAttentionTimes]  # with cpu_attention_sub_batches > 0


def _prepare_generation(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], *,
                        max_new_tokens: int, num_sub_batches: int, kv_cache: str,
                        kv_device_sub_batches: Optional[int], cpu_attention_sub_batches: int,
                        host_memory_limit_bytes: Optional[int], kv_cache_dtype: Optional[str] = None,
                        weight_dequantize: str = "auto") -> tuple[GenerationRun, _Prompts]:
    """What stays fixed for the call: the prompts' mask and positions (on the host, where the masks are
    built), each unit's layer indices, and the generation methods on the model (registered once per model).
    The KV cache comes with the first step, inside the root's call, where the compute dtype is known."""
    engine = speedloader_engine(model)
    batch, prompt_len = input_ids.shape
    mask = None if attention_mask is None else attention_mask.to("cpu", torch.long)
    positions = prompt_positions(mask) if mask is not None else torch.arange(prompt_len).expand(batch, -1)
    if mask is not None and bool((mask == 1).all()):
        mask = None  # as generate: no padding, no mask (the kernels may then use their causal fast path)
    resources = register_generation_methods(model)
    blocks = list(engine.adapter.blocks)
    layer_of = {id(b): getattr(getattr(b, "self_attn", None), "layer_idx", k) for k, b in enumerate(blocks)}
    if sorted(layer_of.values()) != list(range(len(blocks))):
        raise ValueError("the model's attention layers do not carry their block index (self_attn.layer_idx)")
    layer_types = [""] * len(blocks)
    for block, layer_type in zip(blocks, engine.adapter.layer_types):
        layer_types[layer_of[id(block)]] = layer_type
    run = GenerationRun(adapter=engine.adapter, units=engine.units,
               layers=[[layer_of[id(b)] for b in u.blocks] for _, u in engine.units], layer_types=tuple(layer_types),
               store=engine.store,
               device=engine.device, num_sub_batches=num_sub_batches, sub_batch_size=batch // num_sub_batches,
               capacity=prompt_len + max_new_tokens, kv_mode=kv_cache, kv_device_sub_batches=kv_device_sub_batches,
               cpu_attention_sub_batches=cpu_attention_sub_batches, host_memory_limit_bytes=host_memory_limit_bytes,
               resources=resources, block_kwargs=frozenset(inspect.signature(type(blocks[0]).forward).parameters),
               kv_codec=kv_codec(kv_cache_dtype))
    weights = quantized_weights(model)
    if weights is not None:
        run.weights = WeightStream(weights, engine.units, engine.device, exchange=resources.weight_exchange,
                                   dequantize=weight_dequantize)
        resources.weight_exchange = run.weights.exchange
    return run, _Prompts(ids=input_ids.to(engine.device), mask=mask, positions=positions)


def _decode(model: nn.Module, run: GenerationRun, prompts: _Prompts, *, max_new_tokens: int,
            select: Callable[[torch.Tensor], torch.Tensor], eos: list[int], pad: Optional[int], timed: bool,
            on_step: Optional[Callable[[int], None]] = None) -> tuple[list[torch.Tensor], _Timing]:
    """The prefill, then one decoding step per new token, until ``max_new_tokens`` or until every sequence
    has ended on every rank. Returns the new tokens ((B,) per step) and the host clock."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    routing = attention_on_host(run.adapter.config) if run.cpu_attention_sub_batches else contextlib.nullcontext()
    # One rank per shard group, weights resident in the compute dtype: FSDP2's unshard would only copy
    # whole weights into its buffers and out, every unit and step; run on the local shards instead.
    local = local_shard_params(model)
    run.on_local_shards = local is not None
    step_call = root_step if run.on_local_shards else getattr(model, ROOT_METHOD)  # the root's hooked call
    # Timing needs the GPU to finish the prefill (and the last step); without stats nothing waits for it.
    sync = (torch.cuda.current_stream(run.device).synchronize if run.device.type == "cuda" and timed
            else (lambda: None))
    new_tokens: list[torch.Tensor] = []
    unfinished = torch.ones(prompts.ids.shape[0], dtype=torch.long, device=run.device)
    eos_t = torch.tensor(eos, device=run.device) if eos else None
    start = time.perf_counter()
    prefill_s = 0.0
    with routing as host_times, run_on_local_shards(local or ()):
        for step in range(max_new_tokens):
            state = _step_state(run, prompts, new_tokens, step)
            if run.weights is not None:  # no copy of the first unit's weights after the last step
                run.weights.another_step = step + 1 < max_new_tokens
            with torch.profiler.record_function("speedloader::decode_step" if step else "speedloader::prefill"):
                step_call(state)  # one layer-major step (the markers name it in traces: tools/bench_infer.py)
            next_tokens = select(state.logits)
            if eos_t is not None:
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
                unfinished = unfinished & ~torch.isin(next_tokens, eos_t)
            new_tokens.append(next_tokens)
            if step == 0:
                sync()
                prefill_s = time.perf_counter() - start
            if on_step is not None:
                on_step(step + 1)
            # Ranks step together (FSDP's all-gathers are collective): with several ranks every rank
            # votes each step, also one without EOS ids, so a rank that passed none cannot hang the others.
            vote = (eos_t is not None or distributed) and step + 1 < max_new_tokens
            if vote and _all_ended(unfinished, distributed):
                break
    sync()
    return new_tokens, _Timing(prefill_s, time.perf_counter() - start, host_times)


def _step_state(run: GenerationRun, prompts: _Prompts, new_tokens: list[torch.Tensor], step: int) -> GenerationStepState:
    """Step ``step``'s inputs: the whole sequence so far (the prefill, and every step without a KV cache), or
    each sequence's last new token after ``past`` cached positions."""
    batch, prompt_len = prompts.ids.shape
    positions, mask = prompts.positions, prompts.mask
    if step == 0 or run.kv_mode == "off":  # the whole sequence so far, from position 0
        past, ids = 0, torch.cat([prompts.ids, *[t[:, None] for t in new_tokens]], dim=1)
        step_pos = torch.cat([positions, positions[:, -1:] + torch.arange(1, step + 1)], dim=1)
    else:  # one new token per sequence after `past` cached positions
        past, ids = prompt_len + step - 1, new_tokens[-1][:, None]
        step_pos = positions[:, -1:] + step
    step_mask = None if mask is None else torch.cat([mask, torch.ones(batch, step, dtype=mask.dtype)], 1)
    # Host overhead, not the weights, bounds a decoding step (a decoder-layer call per layer and group): with
    # the KV cache on the device, nothing is fetched per sub-batch, and the step's activations are one token
    # per sequence, so each unit runs ONCE on the whole batch.
    whole_batch = past > 0 and run.kv is not None and run.kv.whole_batch_decode
    return GenerationStepState(run=run, input_ids=list(ids.split(batch if whole_batch else run.sub_batch_size)),
                               mask=step_mask, positions=step_pos, past=past)


def _all_ended(unfinished: torch.Tensor, distributed: bool) -> bool:
    """Whether every sequence has ended, on every rank (reads one value back: a host wait)."""
    alive = unfinished.max()
    if distributed:
        dist.all_reduce(alive, op=dist.ReduceOp.MAX)
    return int(alive) == 0


def _report(run: GenerationRun, prompts: _Prompts, num_steps: int, timing: _Timing) -> GenerationStats:
    """The call's figures: times, and what the KV cache, the activation store and host attention moved."""
    io = run.kv.stats() if run.kv is not None else {}
    if hasattr(run.store, "step_stats"):
        io.update({f"activation_{k}": v for k, v in run.store.step_stats().items()})
    if timing.host_attention is not None:
        io.update(timing.host_attention.as_dict())
    if run.weights is not None:
        io.update(run.weights.stats())
    batch, prompt_len = prompts.ids.shape
    return GenerationStats(batch_size=batch, prompt_len=prompt_len, num_steps=num_steps, prefill_s=timing.prefill_s,
                           decode_s=timing.total_s - timing.prefill_s, kv_cache=run.kv_mode, io=io)
