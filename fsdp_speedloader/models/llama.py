"""LLaMA layout: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``.

One rotary table for every layer. The families of this layout differ inside their blocks (Qwen2's q/k/v
biases, Qwen3's q/k RMSNorm: the block's own forward applies them) and in which mask each layer gets,
as their forwards build it:

- LLaMA (2, 3.x with ``rope_scaling`` of type llama3: the rotary module applies it): one causal mask;
- Mistral: one mask for every layer, sliding-window where ``config.sliding_window`` is set;
- Qwen2/2.5 and Qwen3: the mask of each layer's ``config.layer_types`` entry (sliding-window layers
  only where ``use_sliding_window`` is set).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from fsdp_speedloader.models.adapter import FULL_ATTENTION, SLIDING_ATTENTION, BlockInputs, DecoderLayoutAdapter, \
    config_layer_types


class LlamaAdapter(DecoderLayoutAdapter):
    """LLaMA: ``LlamaModel.forward`` builds one causal mask for all layers."""

    model_classes = (LlamaForCausalLM,)
    takes_position_ids = True

    def block_inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     position_ids: torch.Tensor) -> BlockInputs:
        inputs = super().block_inputs(hidden, attention_mask, position_ids)
        # (cos, sin), each (1 or n, s, head_dim): computed once per sub-batch, shared by all blocks.
        inputs.kwargs["position_embeddings"] = self.model.model.rotary_emb(hidden, position_ids=position_ids)
        return inputs



class MistralAdapter(LlamaAdapter):
    """Mistral: ``MistralModel.forward`` gives every layer the sliding-window mask when ``config.sliding_window``
    is set (it ignores ``layer_types``), else the causal one."""

    model_classes = (MistralForCausalLM,)

    @property
    def layer_types(self) -> tuple[str, ...]:
        kind = FULL_ATTENTION if getattr(self.config, "sliding_window", None) is None else SLIDING_ATTENTION
        return (kind,) * len(self.blocks)


class QwenAdapter(LlamaAdapter):
    """Qwen2/2.5 and Qwen3: each layer gets the mask of its ``config.layer_types`` entry."""

    model_classes = (Qwen2ForCausalLM, Qwen3ForCausalLM)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return config_layer_types(self.config, len(self.blocks))
