"""LLaMA layout: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``.

LLaMA, Mistral and Qwen2 share it; another family of this layout needs only its class added to
``LlamaAdapter.model_classes``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fsdp_speedloader.models.adapter import BlockInputs, ModelAdapter


def _llama_layout_classes() -> tuple[type, ...]:
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)


class LlamaAdapter(ModelAdapter):
    model_classes = _llama_layout_classes()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def block_inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     position_ids: torch.Tensor) -> BlockInputs:
        inputs = super().block_inputs(hidden, attention_mask, position_ids)
        # (cos, sin), each (1 or n, s, head_dim): computed once per sub-batch, shared by all blocks.
        inputs.kwargs["position_embeddings"] = self.model.model.rotary_emb(hidden, position_ids=position_ids)
        return inputs

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)
