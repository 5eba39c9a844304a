"""The routers' load-balancing loss of the whole effective batch, computed layer-major.

Hugging Face's MoE forwards (``load_balancing_loss_func``) take every MoE layer's router logits of the whole
batch, R rows in all (layers x tokens, padding excluded), and return

    aux = E * sum_e  T_e / R  *  P_e / R,    T_e = top-k assignments to expert e,  P_e = sum of softmax probs of e

T is a count (no gradient); only P carries one. Both are sums over (layer, row), so layer-major accumulates
them unit by unit and sub-batch by sub-batch in forward and knows aux, the full-batch statistic, once the
last unit has run (a per-sub-batch aux would be a different, wrong, loss). In backward, dL/dP_e =
coef * E * T_e / R^2 is one vector for every row of every layer: each unit's recompute adds
``sum_rows mask * softmax(logits) . dL/dP`` to what it backpropagates, which gives every router exactly its
share of the gradient.
"""

from __future__ import annotations

from typing import Optional

import torch


class RouterLoss:
    """Accumulates T and P over (unit, sub-batch) in forward; hands each recompute its share of dL/dP."""

    def __init__(self, *, num_experts: int, top_k: int, coef: float, masks: list[Optional[torch.Tensor]],
                 device: torch.device) -> None:
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        # Per sub-batch, the (rows,) float mask of the tokens that count (None: every token), as Hugging Face
        # flattens the attention mask.
        self.masks = [None if m is None else m.reshape(-1).to(torch.float32) for m in masks]
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # T
        self.prob_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # P
        self.rows = torch.zeros((), dtype=torch.float32, device=device)  # R
        self._one = torch.ones((), dtype=torch.float32, device=device)  # expanded: a count of 1 per assignment
        # Per sub-batch, the mask repeated once per routed expert (None: every token counts).
        self._assignment_masks = [None if m is None else m.repeat_interleave(top_k) for m in self.masks]
        self.prob_grad: Optional[torch.Tensor] = None  # dL/dP, (E,): set by the head's backward

    def _routing(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)  # in the logits' dtype, then summed in fp32: Hugging Face's order

    @torch.no_grad()
    def add(self, sub_batch: int, router_logits: list[torch.Tensor]) -> None:
        """Forward: the logits ((rows, E) each) of the MoE layers one unit ran on sub-batch ``sub_batch``."""
        mask = self.masks[sub_batch]
        for logits in router_logits:
            routing = self._routing(logits)
            chosen = torch.topk(routing, self.top_k, dim=-1).indices.reshape(-1)
            weight = self._assignment_masks[sub_batch]
            weight = self._one.expand(chosen.shape) if weight is None else weight
            self.tokens_per_expert.scatter_add_(0, chosen, weight)  # no device sync, unlike bincount
            if mask is None:
                self.prob_per_expert += routing.float().sum(dim=0)
                self.rows += routing.shape[0]
            else:
                self.prob_per_expert += (routing.float() * mask.unsqueeze(-1)).sum(dim=0)
                self.rows += mask.sum()

    def value(self) -> torch.Tensor:
        """aux, the unweighted load-balancing loss of everything added (a scalar, no gradient)."""
        tokens, probs = self.tokens_per_expert / self.rows, self.prob_per_expert / self.rows
        return torch.sum(tokens * probs) * self.num_experts

    def backward_from(self, grad_loss: torch.Tensor) -> None:
        """The head's backward: the training loss holds coef * aux, whose gradient is ``grad_loss``."""
        self.prob_grad = grad_loss * self.coef * self.num_experts * self.tokens_per_expert / self.rows ** 2

    def backward_term(self, sub_batch: int, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """A scalar whose gradient is this recompute's share: sum_rows mask * softmax(logits) . dL/dP."""
        mask = self.masks[sub_batch]
        term = torch.zeros((), dtype=torch.float32, device=self.prob_per_expert.device)
        for logits in router_logits:
            probs = self._routing(logits).float()
            if mask is not None:
                probs = probs * mask.unsqueeze(-1)
            term = term + (probs.sum(dim=0) * self.prob_grad).sum()
        return term
