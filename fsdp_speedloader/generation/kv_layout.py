"""Geometry of the KV cache: which positions each layer keeps, and where they lie.

Every (sub-batch, layer) has one block of ``span`` position slots; position ``t`` lies in slot ``t mod span``.
A full-attention layer's span is the capacity (prompt length + max_new_tokens): it never wraps. A
sliding-window layer (``sliding_layers``, window W = ``config.sliding_window`` shorter than the capacity)
keeps only its window, as Hugging Face's ``DynamicSlidingWindowLayer`` does: span W, a ring. Layers of one
span share one tensor (``groups``), so a model of alternating layers holds two.

Each step a layer attends to the keys Hugging Face's cache hands its attention -- a sliding layer the last
``min(past, W - 1)`` cached positions and the new ones, any other layer every position (``mask_sizes``, the
lengths ``get_mask_sizes`` reports) -- in position order, so the arithmetic, not only the result, is Hugging
Face's. Once a ring has wrapped those keys are two runs of slots, which ``gather_runs`` joins with one copy
of the window per (sub-batch, layer) and step (Hugging Face's cache copies it every step too); the new
position overwrites the one that has just left the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one generation's cache."""

    num_sub_batches: int
    num_layers: int
    capacity: int  # positions: prompt length + max_new_tokens
    sub_batch_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_layers: tuple[int, ...] = ()  # layers whose attention slides over the last `window` positions
    window: Optional[int] = None  # config.sliding_window

    def __post_init__(self) -> None:
        if self.sliding_layers and not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"sliding-window layers {list(self.sliding_layers)} need a window of at least one "
                             f"position (config.sliding_window={self.window!r})")

    def span(self, layer: int) -> int:
        """Positions kept for ``layer``: all (``capacity``), or a sliding layer's window when shorter (a ring)."""
        if layer in self.sliding_layers and self.window < self.capacity:
            return self.window
        return self.capacity

    @property
    def groups(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """(layers, span): the layers that keep the same number of positions share one tensor."""
        spans: dict[int, list[int]] = {}
        for layer in range(self.num_layers):
            spans.setdefault(self.span(layer), []).append(layer)
        return tuple((tuple(layers), span) for span, layers in sorted(spans.items(), reverse=True))

    def group_shape(self, num_layers: int, span: int) -> tuple[int, ...]:
        """The host shape of one group: (N, layers, span, 2, n, H_kv, d)."""
        return (self.num_sub_batches, num_layers, span, 2, self.sub_batch_size, self.num_kv_heads, self.head_dim)

    @property
    def numel(self) -> int:
        return sum(math.prod(self.group_shape(len(layers), span)) for layers, span in self.groups)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    # --- where positions lie: runs of (first slot, offset in the positions, length), in position order -------

    def kept_runs(self, layer: int, past: int, query: int) -> list[tuple[int, int, int]]:
        """Where this step's ``query`` new positions go; only the last ``span`` are kept (a prefill longer
        than the window). Offsets index the new positions."""
        span = self.span(layer)
        kept = min(query, span)
        return [(slot, offset + query - kept, n) for slot, offset, n in _runs(span, past + query - kept, kept)]

    def visible_runs(self, layer: int, past: int, query: int) -> list[tuple[int, int, int]]:
        """The slots attention reads after this step's write: the positions ``mask_sizes`` reports."""
        length, offset = self.mask_sizes(layer, past, query)
        # A ring overwrites positions once it wraps: a step of several tokens after the window has filled would
        # need more than `span` positions at once (generate's decoding steps are one token each).
        assert length <= self.span(layer), f"layer {layer}: {length} positions in a window of {self.span(layer)}"
        return _runs(self.span(layer), offset, length)

    def mask_sizes(self, layer: int, past: int, query: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys ``layer`` attends to after ``past`` cached positions, as Hugging
        Face's cache layers report them: a sliding layer sees its last ``window - 1`` positions and the new ones
        (``DynamicSlidingWindowLayer.get_mask_sizes``), any other layer everything."""
        kept = min(past, self.window - 1) if layer in self.sliding_layers else past
        return kept + query, past - kept

    @property
    def position_bytes(self) -> int:
        """Bytes of one position of one layer of one sub-batch (keys and values of n sequences)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.sub_batch_size * self.num_kv_heads * self.head_dim * element


def kv_layout_for(config, *, num_sub_batches: int, sub_batch_size: int, capacity: int, dtype: torch.dtype,
                  sliding_layers: Sequence[int] = ()) -> KVLayout:
    """The layout for a Hugging Face decoder config (grouped-query attention included); ``sliding_layers``
    (attention layer indices) keep ``config.sliding_window`` positions."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    window = getattr(config, "sliding_window", None) if sliding_layers else None
    return KVLayout(num_sub_batches, config.num_hidden_layers, capacity, sub_batch_size, num_kv_heads, head_dim, dtype,
                    sliding_layers=tuple(sorted(sliding_layers)), window=window)


def _runs(span: int, start: int, count: int) -> list[tuple[int, int, int]]:
    """Positions ``start .. start + count - 1`` of a block of ``span`` slots: one run, or two where it wraps."""
    assert 0 < count <= span, (count, span)
    slot = start % span
    first = min(count, span - slot)
    return [(slot, 0, first)] + ([(0, first, count - first)] if count > first else [])


def gather_runs(block: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """The positions of ``runs`` from a (span, ...) block, in order: a view, or one copy once a ring wrapped."""
    parts = [block[slot : slot + n] for slot, _, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
