"""What the layer-major engine needs from a Hugging Face causal LM, behind one interface.

The engine never calls ``model.forward``: it embeds, runs blocks and applies the head itself,
one sub-batch at a time. An adapter names those pieces for one model family and reproduces
exactly what the family's own forward does with them (positions, masks, rotary embeddings),
so the layer-major loss equals the unmodified model's.
"""

from __future__ import annotations

import inspect
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

_MASK_PARAMS = set(inspect.signature(create_causal_mask).parameters)


@dataclass
class BlockInputs:
    """Everything a block needs besides its hidden states, for one sub-batch (or all of them)."""

    kwargs: dict
    """Keyword arguments of the block's forward: attention mask, positions, rotary (cos, sin)."""


class ModelAdapter(ABC):
    """Base class; subclasses fill in the family-specific pieces."""

    #: Hugging Face model classes this adapter accepts (checked by ``get_adapter``).
    model_classes: tuple[type, ...] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.compiled_block_forward: Optional[Callable] = None  # set by compile_blocks()

    def compile_blocks(self, *, as_forward: bool = False) -> None:
        """Compiles the blocks' class forward ONCE with ``torch.compile`` (fused norms, activations and rotary
        kernels); every block is an input of the one compiled function, so all blocks share its graphs.

        The layer-major training chain asks for it (``run_block(..., compiled=True)``); generation stays
        eager (its shapes change every step, and its cache is a Python object). ``as_forward``: also make
        it each block's ``forward``, for schedules that call blocks as modules (FSDP2's hooks and
        activation checkpointing then stay outside the compiled code).
        """
        if self.has_dropout:  # the recompute in backward must draw the forward's dropout masks again
            raise ValueError("compile_blocks with dropout: the backward recomputes each block and must replay its "
                             "dropout masks, which compiled kernels do not guarantee (a silent gradient error); set "
                             "the model's dropout to 0 (model.dropout) or schedule.compile_blocks=false")
        self.compiled_block_forward = torch.compile(type(self.blocks[0]).forward)
        if as_forward:
            for block in self.blocks:
                block.forward = types.MethodType(self.compiled_block_forward, block)

    @property
    @abstractmethod
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks, in order."""

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    @abstractmethod
    def embedding(self) -> nn.Embedding:
        """The token embedding (its weight anchors the embedding chain in autograd)."""

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def has_dropout(self) -> bool:
        """True when training would draw random numbers inside blocks (recompute must replay them)."""
        return any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.blocks.modules()) or any(
            getattr(self.config, k, 0.0) > 0 for k in ("dropout", "attention_dropout", "hidden_dropout")
        )

    # --- computation ---------------------------------------------------------------------------
    def position_ids(self, attention_mask: Optional[torch.Tensor], shape: torch.Size,
                     device: torch.device) -> torch.Tensor:
        """Positions of one sub-batch, as the family's forward computes them. (n, s) or (1, s)."""
        return torch.arange(shape[1], device=device).unsqueeze(0)

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings. (n, s) -> (n, s, h)."""

    def block_inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     position_ids: torch.Tensor) -> BlockInputs:
        """Mask and positional inputs shared by every block for one sub-batch."""
        return BlockInputs(kwargs={"attention_mask": self.causal_mask(hidden, attention_mask, position_ids),
                                   "position_ids": position_ids})

    def run_block(self, block: nn.Module, hidden: torch.Tensor, inputs: BlockInputs, *,
                  compiled: bool = False) -> torch.Tensor:
        """One block, WITHOUT its FSDP hooks: the unit's single hooked call already unsharded it.
        ``compiled``: through ``compile_blocks``' function when there is one."""
        forward = self.compiled_block_forward if compiled and self.compiled_block_forward else type(block).forward
        out = forward(block, hidden, **inputs.kwargs)
        return out[0] if isinstance(out, tuple) else out

    @abstractmethod
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (and any projection) before the LM head. (..., h) -> (..., h)."""

    def causal_mask(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    position_ids: torch.Tensor) -> Any:
        """The family's own causal mask (None for sdpa without padding: the kernel is causal)."""
        kwargs: dict[str, Any] = dict(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                      past_key_values=None)
        if "position_ids" in _MASK_PARAMS:
            kwargs["position_ids"] = position_ids
        if "cache_position" in _MASK_PARAMS:  # transformers < 5.20 names the query positions so
            kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
        return create_causal_mask(**kwargs)

    # --- accounting ----------------------------------------------------------------------------
    def num_non_embedding_params(self) -> int:
        """Parameters that do matmul work per token (blocks and the LM head, not lookup tables)."""
        lookup = {id(p) for m in self.model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        total = sum(p.numel() for p in self.model.parameters() if id(p) not in lookup)
        if self.config.tie_word_embeddings:  # a tied LM head still multiplies every token
            total += self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one token, forward + backward: 6 N + 12 L h s (PaLM appendix B)."""
        c = self.config
        return 6.0 * self.num_non_embedding_params() + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len
