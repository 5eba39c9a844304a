"""``apply_speedloader``: turns an unmodified Hugging Face causal LM into a layer-major trainer.

Wiring only: the adapter names the model's pieces, ``parallel.apply_fsdp`` shards units and
root, ``chain`` holds the autograd Functions, the activation store holds x[l][i]. After it,

    out = model(input_ids=ids, labels=ids)   # ids: (num_sub_batches * sub_batch_size, s)
    out.loss.backward()                      # layer-major backward, one reduce-scatter per unit

``position_ids`` (same shape), as the family's forward takes them: positions that restart at each packed document
make its own mask block-causal (``transformers.masking_utils``' packed-sequence path; LLaMA-layout dense families).
Under ``torch.no_grad()`` the forward only computes the loss: no recompute state, and the store's slots alternate
(two, not U + 1), as generation's steps do (validation).
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from fsdp_speedloader.engine.activation_store import ActivationStore, ExchangeActivationStore, build_activation_store
from fsdp_speedloader.engine.chain import EmbedFunction, HeadLossFunction, TrainStepState, Unit, UnitFunction, num_label_tokens, shift_labels
from fsdp_speedloader.engine.router_loss import RouterLoss
from fsdp_speedloader.kernels import apply_kernels
from fsdp_speedloader.fsdp2 import check_torch_version, enable_single_rank_prefetch, fast_path_stats, fsdp_params_of, \
    refresh_param_transfer, require_fsdp2_internals
from fsdp_speedloader.models import ModelAdapter, get_adapter, position_ids_model_classes
from fsdp_speedloader.options import SpeedLoaderOptions
from fsdp_speedloader.parallel import apply_fsdp, build_mesh, check_mesh, compute_device, maybe_init_process_group, \
    set_forward_prefetch

_UNIT_METHOD = "speedloader_forward"
# Arguments of a causal LM's forward that a training step may pass and that change nothing here.
_IGNORED_KWARGS = {"return_dict", "output_attentions", "output_hidden_states", "use_cache", "logits_to_keep"}


class SpeedLoader:
    """The per-model engine: holds the units and the store, runs one layer-major forward."""

    def __init__(self, adapter: ModelAdapter, units: list[tuple[nn.Module, Unit]], store: ActivationStore,
                 options: SpeedLoaderOptions, *, device: torch.device, root: Optional[nn.Module] = None) -> None:
        self.adapter = adapter
        self.options = options
        self.root = root  # the FSDP root (the model), whose state holds the embeddings, norm and head
        self.param_transfer_dtype = options.param_transfer_dtype
        self.units = units  # (FSDP module holding the unit's state, Unit)
        self.store = store
        self.num_sub_batches = options.num_sub_batches
        self.device = device
        self.loss_chunk_tokens = options.loss_chunk_tokens
        self.kept_pair_bytes = 0  # keep_activations: the most GPU memory one kept pair held in the last step
        self._step_state = None  # the step in flight's TrainStepState, weakly: an error's report reads it
        # Called with l once unit l's gradients are final in backward (OverlappedOptimizer sets it).
        self.grad_ready_hook = None
        # Called with l just before unit l's FSDP-hooked forward call, which unshards unit l and prefetches the
        # next forward_prefetch units (OverlappedOptimizer sets it to wait for their deferred steps).
        self.unit_forward_hook = None

    def unit_fsdp_params(self, index: int) -> list:
        """FSDP2's parameters of unit ``index`` (1 .. U), or of the root for ``index == U + 1``."""
        module = self.units[index - 1][0] if index <= len(self.units) else self.root
        return fsdp_params_of(module) if module is not None else []

    def refresh_param_transfer(self, index: Optional[int] = None, *, force: bool = False) -> int:
        """Casts the stale transfer copies (``param_transfer_dtype``) of unit ``index``, or of every unit and
        the root; returns how many. Call it after ``optimizer.step()`` to keep the cast off the next
        forward's unshards (a stale copy is also refreshed there, never used); ``force`` recasts all, for
        writers that neither a ``torch.optim`` optimizer nor a version counter reveals. A no-op when the
        option is off."""
        if self.param_transfer_dtype is None:
            return 0
        indices = range(1, len(self.units) + 2) if index is None else [index]
        return sum(refresh_param_transfer(self.unit_fsdp_params(i), force=force) for i in indices)

    def stats(self) -> dict:
        """The store's figures of the last finished step (``store.step_stats()``), how often each FSDP2
        fast path engaged or fell back (``fsdp2.fast_path_stats()``: counts since the process started), and
        ``kept_pair_bytes``: with ``keep_activations``, the GPU memory one kept (unit, sub-batch) held (CUDA)."""
        return {**self.store.step_stats(), **fast_path_stats(), "kept_pair_bytes": self.kept_pair_bytes}

    def kept_pairs_report(self) -> tuple[int, int]:
        """With ``keep_activations``: (kept (unit, sub-batch) pairs whose activations the step in flight holds now,
        the most GPU bytes one of them held: this step's measure, else the last step's). For an out-of-memory
        error's message: read while the error is handled, the failed step's state is still alive (its frames hold
        it); the engine keeps it only weakly, so a caller that goes on after the error gets the memory back."""
        state = self._step_state() if self._step_state is not None else None
        if state is None:
            return 0, self.kept_pair_bytes
        return len(state.kept), max(state.kept_pair_bytes, self.kept_pair_bytes)

    def _check_inputs(self, input_ids, attention_mask, labels, position_ids, kwargs) -> None:
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("input_ids must be a (batch, seq_len) tensor; inputs_embeds is not supported")
        batch, seq_len = input_ids.shape
        n_sub = self.num_sub_batches
        if batch % n_sub != 0:
            raise ValueError(f"batch of {batch} sequences is not num_sub_batches={n_sub} x sub_batch_size; "
                             f"pass a multiple of {n_sub} sequences or change num_sub_batches")
        if seq_len > self.adapter.max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds the model's {self.adapter.max_positions} "
                             "positions; shorten the sequences (data.seq_len)")
        if labels is None:
            raise ValueError("labels are required: the layer-major forward computes the loss without keeping "
                             "logits; pass labels=input_ids, or use fsdp_speedloader.generation.generate for inference")
        for name, t in (("labels", labels), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; it must match input_ids {tuple(input_ids.shape)}")
        if position_ids is not None and not self.adapter.takes_position_ids:
            family = next(c.__name__ for c in self.adapter.model_classes if isinstance(self.adapter.model, c))
            raise ValueError(f"position_ids (packed documents: data.document_mask) are supported for "
                             f"{', '.join(position_ids_model_classes())}, not {family}; "
                             "pass input_ids, attention_mask and labels only (data.document_mask=false)")
        unknown = {k for k, v in kwargs.items() if v not in (None, False) and k not in _IGNORED_KWARGS}
        if unknown or kwargs.get("use_cache"):
            raise ValueError(f"unsupported forward argument(s) {sorted(unknown) or ['use_cache=True']} "
                             "with apply_speedloader; pass input_ids, attention_mask, position_ids and labels")

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, num_items_in_batch=None,
                position_ids: Optional[torch.Tensor] = None, **kwargs) -> CausalLMOutputWithPast:
        self._check_inputs(input_ids, attention_mask, labels, position_ids, kwargs)
        adapter, device, n_sub = self.adapter, self.device, self.num_sub_batches
        input_ids = input_ids.to(device, non_blocking=True)
        shifted = shift_labels(labels.to(device, non_blocking=True))
        sub = input_ids.shape[0] // n_sub
        masks = [None] * n_sub if attention_mask is None else list(attention_mask.to(device).split(sub))

        # Mask, positions and rotary tables depend on shapes (and padding) only, not on activations.
        act_dtype = adapter.embedding.weight.dtype  # the unsharded (compute-dtype) weight, inside root forward
        probe = torch.empty(sub, input_ids.shape[1], 1, dtype=act_dtype, device=device)
        if position_ids is None:
            position_ids = [adapter.position_ids(m, probe.shape, device) for m in masks]
            shared_inputs = attention_mask is None
        else:  # as the family's forward given them: positions that restart make its mask block-causal (packing)
            position_ids = list(position_ids.to(device, non_blocking=True).split(sub))
            shared_inputs = False
        if shared_inputs:
            shared = adapter.block_inputs(probe, None, position_ids[0])
            block_inputs = [shared] * n_sub
        else:
            block_inputs = [adapter.block_inputs(probe, m, p) for m, p in zip(masks, position_ids)]

        router_loss = None
        if adapter.router_aux_loss:  # MoE: the load-balancing loss of the whole effective batch
            router_loss = RouterLoss(num_experts=adapter.num_experts, top_k=adapter.num_experts_per_tok,
                                     coef=adapter.router_aux_loss_coef, masks=masks, device=device)
        state = TrainStepState(
            adapter=adapter, store=self.store, num_units=len(self.units), input_ids=list(input_ids.split(sub)),
            position_ids=position_ids, shift_labels=[t.reshape(-1) for t in shifted.split(sub)],
            block_inputs=block_inputs, num_label_tokens=num_label_tokens(shifted, num_items_in_batch),
            loss_chunk_tokens=self.loss_chunk_tokens, grad_ready_hook=self.grad_ready_hook,
            replay_rng=adapter.model.training and adapter.has_dropout and torch.is_grad_enabled(),
            router_loss=router_loss, keep_activations=self.options.keep_activations,
            alternate=self.options.alternate_sub_batches)
        self._step_state = weakref.ref(state)
        self.store.begin_step(state.num_slots, n_sub, (sub, input_ids.shape[1], adapter.config.hidden_size),
                              act_dtype, device)

        p = EmbedFunction.apply(adapter.embedding.weight, state)
        for unit_module, unit in self.units:
            if self.unit_forward_hook is not None:
                self.unit_forward_hook(unit.index)
            p = getattr(unit_module, _UNIT_METHOD)(p, state)  # one FSDP-hooked call per unit
        loss = HeadLossFunction.apply(p, state)
        if state.keep_pairs:
            self.kept_pair_bytes = state.kept_pair_bytes
        if not loss.requires_grad:  # no backward will come to release the slots
            self.store.end_step()
        if router_loss is not None:
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=router_loss.value())
        return CausalLMOutputWithPast(loss=loss)


def speedloader_engine(model: nn.Module, *, missing_ok: bool = False) -> Optional[SpeedLoader]:
    """The engine of a model prepared with ``apply_speedloader`` (its units, store, options and stats); for
    any other model ``None`` with ``missing_ok``, else ``ValueError``."""
    engine = getattr(model, "_speedloader", None)
    if engine is None and not missing_ok:
        raise ValueError(f"{type(model).__name__} was not prepared with fsdp_speedloader.apply_speedloader(model, ...)")
    return engine


def _unit_call(unit: Unit, placeholder: torch.Tensor, state: TrainStepState) -> torch.Tensor:
    return UnitFunction.apply(placeholder, state, unit)


def _model_forward(model: nn.Module, input_ids=None, attention_mask=None, labels=None, **kwargs):
    return model._speedloader.forward(input_ids, attention_mask, labels, **kwargs)


def apply_speedloader(model: nn.Module, options: Optional[SpeedLoaderOptions] = None, *,
                      mesh: Optional[DeviceMesh] = None, **overrides) -> nn.Module:
    """Shards ``model`` with FSDP2 and makes its forward/backward layer-major, in place.

    Args:
        model: an unmodified Hugging Face causal LM (LLaMA layout or OPT), on meta, CPU or GPU.
        options: the engine's options (:class:`~fsdp_speedloader.options.SpeedLoaderOptions`).
        mesh: FSDP (1-D) or HSDP (2-D) mesh over all ranks; None: every rank of the default group
            (a one-process group is created when none exists).
        overrides: fields of ``SpeedLoaderOptions`` given as keywords (applied over ``options``), e.g.
            ``apply_speedloader(model, num_sub_batches=4, offload_params=True)``.
    Returns:
        ``model`` itself; ``speedloader_engine(model)`` is its engine.
    """
    check_torch_version()
    require_fsdp2_internals()  # a private FSDP2 name this torch lacks fails here, named, not mid-step
    options = options or SpeedLoaderOptions()
    if overrides:
        options = options.replace(**overrides)
    adapter = get_adapter(model)
    if options.compile_blocks:  # lazy (nothing is traced before the first step); first, so its errors precede sharding
        adapter.compile_blocks()
    store = build_activation_store(options.activation_store, offload_params=options.offload_params)
    if options.param_transfer_dtype is not None:
        store.param_transfer_dtype = options.param_transfer_dtype
    if mesh is None:
        maybe_init_process_group()
        mesh = build_mesh("cuda" if torch.cuda.is_available() else "cpu")
    else:
        check_mesh(mesh)
    if speedloader_engine(model, missing_ok=True) is not None:
        raise ValueError("apply_speedloader was already applied to this model")
    # Before sharding, so FSDP2 wraps the modules that will run; its checks fail before anything changed.
    scope = apply_kernels(model, adapter.blocks, device_type=mesh.device_type, sdpa=options.sdpa_backend,
                          liger_kernels=options.liger_kernels, float8_training=options.float8_training,
                          compiled=options.compile_blocks)

    blocks = list(adapter.blocks)
    groups = [blocks[i : i + options.blocks_per_unit] for i in range(0, len(blocks), options.blocks_per_unit)]
    # The exchange store's arena takes the offloaded shards and their gradients (exact size, one
    # registration): FSDP2 must not pin them tensor by tensor itself.
    arena_holds_params = options.offload_params and options.pin_memory and isinstance(store, ExchangeActivationStore)
    unit_modules = apply_fsdp(model, mesh, units=groups, param_dtype=options.param_dtype,
                              reduce_dtype=options.reduce_dtype, offload_params=options.offload_params,
                              pin_memory=options.pin_memory and not arena_holds_params,
                              offload_root=options.offload_root, device_units=options.device_units)
    if arena_holds_params:
        store.hold_param_shards(model)
    set_forward_prefetch(model, unit_modules, options.forward_prefetch)
    if options.forward_prefetch > 0:  # one rank, offloaded: FSDP2 itself would load each unit on the compute stream
        enable_single_rank_prefetch(unit_modules)
    units = []
    for index, (module, group) in enumerate(zip(unit_modules, groups), start=1):
        unit = Unit(index=index, blocks=group, scope=scope)
        setattr(module, _UNIT_METHOD, functools.partial(_unit_call, unit))
        register_fsdp_forward_method(module, _UNIT_METHOD)
        units.append((module, unit))

    model._speedloader = SpeedLoader(adapter, units, store, options, device=compute_device(mesh.device_type), root=model)
    model.forward = types.MethodType(_model_forward, model)
    return model

