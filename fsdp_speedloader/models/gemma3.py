"""Gemma-3 text (``Gemma3ForCausalLM``): the LLaMA layout with Gemma's own forward semantics.

As ``Gemma3TextModel.forward`` does:

- the embedding scales by sqrt(hidden) itself (``Gemma3TextScaledWordEmbedding``, in the weight's dtype);
- layers alternate sliding-window ('sliding_attention', window ``config.sliding_window``) and global
  ('full_attention') attention by ``config.layer_types``, each type with its own mask AND its own rotary
  table (local base ``rope_local_base_freq``, global ``rope_theta`` with its scaling): one rotary module
  whose forward takes the layer type;
- the logits are soft-capped where ``config.final_logit_softcapping`` is set (``ModelAdapter.logits``);
- the LM head is tied to the embedding (``tie_word_embeddings``, Hugging Face's tying).

Bidirectional attention (``use_bidirectional_attention``, the encoder variant) is refused.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn
from transformers import Gemma3ForCausalLM

from fsdp_speedloader.models.adapter import BlockInputs, DecoderLayoutAdapter, config_layer_types


class Gemma3Adapter(DecoderLayoutAdapter):
    model_classes = (Gemma3ForCausalLM,)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise ValueError("Gemma3ForCausalLM with use_bidirectional_attention=True is not supported (its masks "
                             "are not causal); set config.use_bidirectional_attention=False")
        if "layer_type" not in inspect.signature(type(model.model.rotary_emb).forward).parameters:
            raise ValueError("this transformers' Gemma-3 has no per-layer-type rotary embedding "
                             "(rotary_emb(x, position_ids, layer_type)); install transformers >= 5.0")

    @property
    def layer_types(self) -> tuple[str, ...]:
        return config_layer_types(self.config, len(self.blocks))

    def block_inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     position_ids: torch.Tensor) -> BlockInputs:
        inputs = super().block_inputs(hidden, attention_mask, position_ids)  # the mask of each layer type
        rotary = self.model.model.rotary_emb
        for layer_type, kwargs in inputs.by_layer_type.items():
            # (cos, sin) of this type's base and scaling, each (1 or n, s, head_dim).
            kwargs["position_embeddings"] = rotary(hidden, position_ids, layer_type)
        return inputs

