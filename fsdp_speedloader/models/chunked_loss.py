"""The canonical schedule's head loss, chunked over tokens as layer-major's is.

An unmodified Hugging Face causal LM computes its training loss from the logits of every token at once: for a
micro-batch of t tokens and a vocabulary of V, the bf16 logits, their fp32 copy in the loss and its gradient take
about 10 t V bytes (4.2 GB for 8 x 4096 tokens of LLaMA's 32,000), more than the blocks' own activations. Layer-major
never holds them (``schedule.loss_chunk_tokens``, ``engine/chain.py``); a baseline that does fits fewer sequences
per micro-batch under the same memory, and an honest comparison gives it the same head.

``causal_lm_loss`` runs the model's own forward with its output-embedding module's ``forward`` bound, for that one
call and on that instance only, to ``LinearCrossEntropy``: the logits of ``chunk_tokens`` tokens at a time, their
loss and, when a gradient is wanted, their gradients at once (as Liger's fused linear cross-entropy does), so the
backward only scales what the forward found and nothing is recomputed. Everything around the head is the model's:
FSDP2's root unit and DeepSpeed ZeRO-3 gather the head's weight for the module's call as they always do. The model
returns the summed loss where its logits would be; this module divides it as Hugging Face's loss does (by
``num_items_in_batch``) and adds a mixture of experts' router loss as its forward does with labels.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


def token_chunks(num_tokens: int, chunk: int) -> Iterator[slice]:
    """Slices of ``chunk`` rows (the last shorter) covering ``num_tokens`` rows."""
    for start in range(0, num_tokens, chunk):
        yield slice(start, min(start + chunk, num_tokens))


class LinearCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of ``hidden @ weight.T`` (ignore index -100), ``chunk`` rows of logits at a time.

    Shapes: hidden (t, h), weight (V, h), labels (t,) -> scalar fp32. Each chunk's logits are upcast to fp32 before
    the loss, as Hugging Face's ``ForCausalLMLoss`` does, and its gradients come from autograd on that same chunk,
    so every number is the unmodified head's on those rows. Saved for backward: the gradients (hidden's, the
    weight's summed over chunks in fp32 then cast), never logits.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        for c in token_chunks(hidden.shape[0], chunk):
            if not (want_h or want_w):  # validation, or a frozen head and input
                total += F.cross_entropy(F.linear(hidden[c], weight).float(), labels[c], ignore_index=-100,
                                         reduction="sum")
                continue
            h = hidden[c].detach().requires_grad_(want_h)
            w = weight.detach().requires_grad_(want_w)
            with torch.enable_grad():
                loss = F.cross_entropy(F.linear(h, w).float(), labels[c], ignore_index=-100, reduction="sum")
            grads = torch.autograd.grad(loss, [t for t, want in ((h, want_h), (w, want_w)) if want])
            if want_h:
                grad_h[c] = grads[0]
            if want_w:
                grad_w += grads[-1]
            total += loss.detach()
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_total.to(g.dtype)  # noqa: E731
        return scale(grad_h), scale(grad_w), None, None


def chunked_loss_unsupported(model: nn.Module) -> Optional[str]:
    """Why ``causal_lm_loss`` must leave ``model``'s head to its own loss (None: it need not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__} has no linear output embedding"
    if head.bias is not None:
        return f"{type(model).__name__}'s LM head has a bias"
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        return "the family soft-caps its logits after the head (final_logit_softcapping)"
    return None


@contextlib.contextmanager
def _head_returns_loss(head: nn.Linear, labels: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
    """For the scope: ``head(hidden)`` returns the summed loss of ``labels`` (already shifted, (t,))."""
    def forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return LinearCrossEntropy.apply(hidden.flatten(0, -2), self.weight, labels, chunk_tokens)

    bound = head.__dict__.get("forward")  # a forward bound on the instance before, if any, comes back after
    head.forward = types.MethodType(forward, head)
    try:
        yield
    finally:
        if bound is None:
            del head.forward  # the class's forward again
        else:
            head.forward = bound


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *,
                   num_tokens: Optional[int | torch.Tensor] = None, chunk_tokens: int = 0,
                   position_ids: Optional[torch.Tensor] = None, router_loss: bool = True,
                   forward: Optional[Callable[..., Any]] = None) -> torch.Tensor:
    """The unmodified model's training loss on (input_ids, labels): Hugging Face's next-token cross-entropy, summed
    over the counted targets and divided by ``num_tokens`` (their count in this batch when None), plus the router
    loss where a mixture of experts returns one (``router_loss=False``: the token loss alone, as a validation
    reports it). ``chunk_tokens`` > 0: the head's logits exist for that many tokens at a time
    (``LinearCrossEntropy``) where the family allows (``chunked_loss_unsupported``); 0: the model's own loss (every
    logit at once). ``forward``: what runs the model, where a wrapper must (DeepSpeed's engine); default ``model``."""
    forward = model if forward is None else forward
    if chunk_tokens <= 0 or chunked_loss_unsupported(model) is not None:
        out = forward(input_ids=input_ids, labels=labels, num_items_in_batch=num_tokens, use_cache=False,
                      position_ids=position_ids)
        aux = getattr(out, "aux_loss", None)
        if aux is None or router_loss:
            return out.loss
        return out.loss - model.router_aux_loss_coef * aux.to(out.loss.device)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()  # position t predicts labels[t + 1], as HF's loss
    with _head_returns_loss(model.get_output_embeddings(), shifted, chunk_tokens):
        out = forward(input_ids=input_ids, use_cache=False, position_ids=position_ids)
    denominator = (shifted != -100).sum() if num_tokens is None else num_tokens
    loss = out.logits / denominator  # the model returns what its head did: the summed loss
    aux = getattr(out, "aux_loss", None)
    if aux is not None and router_loss:  # as the MoE families' forwards add it when given labels
        loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
    return loss
