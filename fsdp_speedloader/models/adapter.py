"""What the layer-major engine needs from a Hugging Face causal LM, behind one interface.

The engine never calls ``model.forward``: it embeds, runs blocks and applies the head itself,
one sub-batch at a time. An adapter names those pieces for one model family and reproduces
exactly what the family's own forward does with them (positions, masks, rotary embeddings,
logit soft-capping), so the layer-major loss equals the unmodified model's.

Layers of one model may differ in their attention: Hugging Face's forwards build one mask per
*layer type* (``causal_mask_mapping``: 'full_attention', 'sliding_attention') and, for Gemma-3, one
rotary table per type, and hand each layer those of its type. ``ModelAdapter.layer_types`` says
which type each block is, ``block_inputs`` builds every type's arguments once per sub-batch, and
``run_block`` gives each block its own type's.
"""

from __future__ import annotations

import functools
import inspect
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# The mask each layer type gets, as the families' forwards build their ``causal_mask_mapping``.
_MASK_BUILDERS: dict[str, Callable] = {FULL_ATTENTION: create_causal_mask,
                                       SLIDING_ATTENTION: create_sliding_window_causal_mask}


@dataclass
class BlockInputs:
    """Everything a block needs besides its hidden states, for one sub-batch (or all of them)."""

    kwargs: dict
    """Keyword arguments of every block's forward: positions, and the mask and rotary (cos, sin) when all
    blocks share them."""
    by_layer_type: Optional[dict[str, dict]] = None
    """Layer type -> the arguments that differ by type (mask, rotary tables), added to ``kwargs``; None:
    inputs built without layer types, valid for full-attention blocks only (``ModelAdapter.run_block``)."""


class ModelAdapter(ABC):
    """Base class; subclasses fill in the family-specific pieces."""

    #: Hugging Face model classes this adapter accepts (checked by ``get_adapter``).
    model_classes: tuple[type, ...] = ()
    #: Whether the engine's forward takes ``position_ids``: the family's forward hands them to its rotary table and
    #: mask builder alone, so positions that restart per packed document give per-document attention (RoPE, causal).
    takes_position_ids: bool = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.compiled_block_forward: Optional[Callable] = None  # set by compile_blocks()
        unknown = sorted(set(self.layer_types) - set(_MASK_BUILDERS))
        if unknown:
            raise ValueError(f"{type(model).__name__}: layer type(s) {unknown} are not supported (config.layer_types); "
                             f"fsdp_speedloader runs {sorted(_MASK_BUILDERS)}")

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
    def layer_types(self) -> tuple[str, ...]:
        """Each block's attention type, as the family's forward picks its mask (default: full everywhere)."""
        return (FULL_ATTENTION,) * len(self.blocks)

    @functools.cached_property
    def _layer_type_of(self) -> dict[int, str]:
        # By identity: FSDP2 and compile_blocks change a block's class or forward, never the object.
        return {id(block): t for block, t in zip(self.blocks, self.layer_types)}

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def router_aux_loss(self) -> bool:
        """True when the family's forward adds a router load-balancing loss (mixture of experts: models/moe.py)."""
        return False

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
        """Positions, and the mask of every layer type, for one sub-batch (built once, used by every block)."""
        masks = self.attention_masks(hidden, attention_mask, position_ids)
        return BlockInputs(kwargs={"position_ids": position_ids},
                           by_layer_type={t: {"attention_mask": m} for t, m in masks.items()})

    def block_kwargs(self, block: nn.Module, inputs: BlockInputs) -> dict:
        """The keyword arguments of ``block``'s forward: the shared ones and those of its layer type."""
        layer_type = self._layer_type_of[id(block)]
        if inputs.by_layer_type is None:
            if layer_type != FULL_ATTENTION:  # one mask for all layers would silently drop the window
                raise ValueError(f"block inputs without layer types given to a {layer_type} layer of "
                                 f"{type(self.model).__name__}; build them per layer type (ModelAdapter.block_inputs, "
                                 "BlockInputs.by_layer_type)")
            return inputs.kwargs
        return {**inputs.kwargs, **inputs.by_layer_type[layer_type]}

    def run_block(self, block: nn.Module, hidden: torch.Tensor, inputs: BlockInputs, *,
                  compiled: bool = False) -> torch.Tensor:
        """One block, WITHOUT its FSDP hooks: the unit's single hooked call already unsharded it.
        ``compiled``: through ``compile_blocks``' function when there is one."""
        forward = self.compiled_block_forward if compiled and self.compiled_block_forward else type(block).forward
        out = forward(block, hidden, **self.block_kwargs(block, inputs))
        return out[0] if isinstance(out, tuple) else out

    @abstractmethod
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (and any projection) before the LM head. (..., h) -> (..., h)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the family's forward returns as logits: final norm, LM head, then soft-capping where the config
        sets ``final_logit_softcapping`` (Gemma: ``c * tanh(logits / c)``, in the head's dtype). (..., h) -> (..., V).
        """
        logits = self.lm_head(self.final_hidden(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_masks(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                        position_ids: torch.Tensor) -> dict[str, Any]:
        """The family's own mask of each layer type its blocks use: ``create_causal_mask`` for full attention,
        ``create_sliding_window_causal_mask`` (``config.sliding_window``) for sliding-window layers. A mask is None
        where sdpa's causal kernel needs none (no padding, and a window no shorter than the sequence)."""
        return {t: _build_mask(_MASK_BUILDERS[t], self.config, hidden, attention_mask, position_ids)
                for t in sorted(set(self.layer_types))}

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
        return 6.0 * self.num_non_embedding_params() + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The attention term of ``flops_per_token``: 12 L h s, the score and value matmuls (QK^T and AV, forward +
        backward, counted over the whole sequence as PaLM does, not halved for causality), h the attention width
        (heads x head_dim; Gemma-3's differs from the model width). Sliding windows are not discounted."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 12.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len


def config_layer_types(config, num_layers: int) -> tuple[str, ...]:
    """Hugging Face's per-layer attention types (``config.layer_types``), or full attention everywhere."""
    types = getattr(config, "layer_types", None)
    return tuple(types[:num_layers]) if types else (FULL_ATTENTION,) * num_layers


@functools.lru_cache(maxsize=None)
def _params(fn: Callable) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def cache_argument(params: frozenset) -> str:
    """The name of the KV-cache argument of a Hugging Face mask function or decoder layer whose parameters are
    ``params``: ``cache`` in the newer transformers 5.x (5.24 has it; the old name still works there but warns with a
    FutureWarning on every call), ``past_key_values`` in the older ones."""
    return "cache" if "cache" in params else "past_key_values"


def _build_mask(builder: Callable, config, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: torch.Tensor) -> Any:
    """``builder(...)`` (a ``transformers.masking_utils`` mask function) for one sub-batch without a cache, with
    the argument names of the installed transformers."""
    params = _params(builder)
    kwargs: dict[str, Any] = dict(config=config, attention_mask=attention_mask)
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden  # 5.0 names it input_embeds
    kwargs[cache_argument(params)] = None
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if "cache_position" in params:  # transformers < 5.20 names the query positions so
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return builder(**kwargs)


class DecoderLayoutAdapter(ModelAdapter):
    """The layout most Hugging Face decoders share: ``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``lm_head`` (LLaMA, Mistral, Qwen, Gemma-3); a family adds its masks and rotary tables in ``block_inputs``."""

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)  # Gemma-3's scales by sqrt(hidden) inside

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)
