"""OPT: learned positions (offset 2, derived from the attention mask), optional input/output projections."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import OPTForCausalLM

from fsdp_speedloader.models.adapter import ModelAdapter


class OPTAdapter(ModelAdapter):
    model_classes = (OPTForCausalLM,)

    @property
    def _decoder(self) -> nn.Module:
        return self.model.model.decoder

    @property
    def blocks(self) -> nn.ModuleList:
        return self._decoder.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self._decoder.embed_tokens

    def position_ids(self, attention_mask: Optional[torch.Tensor], shape: torch.Size,
                     device: torch.device) -> torch.Tensor:
        if attention_mask is None:
            return super().position_ids(None, shape, device)
        # As OPTDecoder.forward: padding shifts positions, so a left-padded prompt starts at 0.
        return (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        dec = self._decoder
        hidden = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            hidden = dec.project_in(hidden)
        return hidden + dec.embed_positions(None, 0, position_ids=position_ids).to(hidden.dtype)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        dec = self._decoder
        if dec.final_layer_norm is not None:
            hidden = dec.final_layer_norm(hidden)
        if dec.project_out is not None:
            hidden = dec.project_out(hidden)
        return hidden
