"""Next tokens from the logits of a step: greedy, or Hugging Face's sampling warpers in their order."""

from __future__ import annotations

from typing import Optional

import torch


def select_tokens(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: Optional[int],
                  top_p: Optional[float], generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next tokens of the whole batch from fp32 logits (B, V): argmax, or temperature -> top-k -> top-p
    -> multinomial (Hugging Face's warper order)."""
    if not do_sample:
        return torch.argmax(logits, dim=-1)
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
