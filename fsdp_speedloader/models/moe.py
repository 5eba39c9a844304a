"""Mixture-of-experts families: Mixtral and Qwen3-MoE, the LLaMA layout with a routed MLP.

Their forwards build masks as Mistral's does (every layer sliding-window where ``config.sliding_window`` is set)
and one rotary table, so the adapters are Mistral's; what MoE adds is the router:

- each block's sparse MLP has a router (``<Family>TopKRouter``, the module Hugging Face's own
  ``_can_record_outputs["router_logits"]`` records) whose logits pick each token's top-k experts;
- with ``config.output_router_logits`` the family's forward adds ``router_aux_loss_coef`` x the load-balancing
  loss of Switch Transformer, computed over every layer's router logits of the WHOLE batch. The engine
  reproduces that full-batch statistic layer-major (engine/router_loss.py); this adapter lets it see the logits:
  ``capture_router_logits()`` collects each router's logits while blocks run, in order.

Layout: a block is one FSDP unit with all its experts (``blocks_per_unit`` groups several): layer-major
loads every expert once per step whatever N is, so splitting a layer's experts into more units would only add
unit boundaries (docs/design.md §12).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn
from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

from fsdp_speedloader.models.llama import MistralAdapter

_CAPTURE_ATTR = "_speedloader_router_capture"


class _RouterCapture:
    """The forward hook of every router of one model: appends each router's logits to ``captured`` while a
    ``capture_router_logits`` block is open. One per model, shared by every adapter of it: an adapter built later
    only to look at the model (the host memory plan's) must not take the recording from the engine's."""

    def __init__(self, output_index: int) -> None:
        self.output_index = output_index
        self.captured: Optional[list[torch.Tensor]] = None

    def __call__(self, module: nn.Module, args, output) -> None:
        if self.captured is not None:
            self.captured.append(output[self.output_index])


class MoeAdapter(MistralAdapter):
    """Mixtral and Qwen3-MoE: Mistral's masks and rotary table, routers whose logits the engine may capture."""

    model_classes = (MixtralForCausalLM, Qwen3MoeForCausalLM)
    takes_position_ids = False  # the load-balancing loss is a statistic of the whole batch, not per document

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        recorder = type(model)._can_record_outputs["router_logits"]  # Hugging Face's own: which module, which output
        self.routers: list[nn.Module] = [m for m in self.blocks.modules() if isinstance(m, recorder.target_class)]
        self._capture: Optional[_RouterCapture] = getattr(model, _CAPTURE_ATTR, None)
        if self._capture is None and self.router_aux_loss:  # hooks only where read: compiled blocks without aux
            self._capture = _RouterCapture(recorder.index)  # loss trace none
            for router in self.routers:
                router.register_forward_hook(self._capture)
            setattr(model, _CAPTURE_ATTR, self._capture)

    @property
    def num_experts(self) -> int:
        return self.config.num_local_experts if hasattr(self.config, "num_local_experts") else self.config.num_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.config.num_experts_per_tok

    @property
    def router_aux_loss(self) -> bool:
        """True when the family's forward adds the load-balancing loss (``config.output_router_logits``)."""
        return bool(getattr(self.config, "output_router_logits", False))

    @property
    def router_aux_loss_coef(self) -> float:
        return float(self.config.router_aux_loss_coef)

    @property
    def has_dropout(self) -> bool:  # Mixtral's router jitter multiplies by random noise in training
        return super().has_dropout or getattr(self.config, "router_jitter_noise", 0.0) > 0

    @contextlib.contextmanager
    def capture_router_logits(self) -> Iterator[list[torch.Tensor]]:
        """Collects, in call order, the router logits ((tokens, num_experts) each) of the blocks run inside."""
        if not self.router_aux_loss or self._capture is None:
            raise ValueError("router logits are recorded only with config.output_router_logits=True")
        self._capture.captured = captured = []
        try:
            yield captured
        finally:
            self._capture.captured = None

    def flops_per_token(self, seq_len: int) -> float:
        """As dense models, with only the routed experts' parameters doing work: each token multiplies by
        ``num_experts_per_tok`` of the ``num_experts`` experts of a layer (MFU on active parameters)."""
        experts = sum(p.numel() for name, p in self.blocks.named_parameters() if ".experts." in f".{name}")
        inactive = experts * (1 - self.num_experts_per_tok / self.num_experts)
        return super().flops_per_token(seq_len) - 6.0 * inactive
