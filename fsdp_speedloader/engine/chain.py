"""The autograd Functions that chain N sub-batches through the model layer-major.

Autograd sees one node per FSDP unit, linked by scalar placeholders; the real activations travel
through the activation store, outside autograd:

    ids --EmbedFunction--> p0 --UnitFunction(1)--> p1 ... --UnitFunction(U)--> pU --HeadLossFunction--> loss
           writes x0[i]          reads x0[i], writes x1[i]                          reads xU[i]

Each UnitFunction runs inside its unit's single FSDP-hooked call, so the unit is unsharded once
for all N sub-batches in forward, and once in backward (FSDP's pre-backward hook fires on the
placeholder's gradient; its post-backward, the one reduce-scatter, on the input placeholder's).
Inside, blocks run through their class's forward, never their hooked ``__call__`` (see docs/design.md §3:
a hooked call inside backward silently loses the gradients). Every loop over the sub-batches is a
``for_each_sub_batch`` (activation_store.py), which fixes the order of the store's prefetches and gets; each
loop runs the sub-batches in the reverse order of the loop before (``TrainStepState.next_reversed``), so that it
starts with the sub-batch whose input was just computed and is still on the device.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_speedloader.engine.activation_store import ActivationStore, for_each_sub_batch, grad_slot
from fsdp_speedloader.engine.router_loss import RouterLoss
from fsdp_speedloader.models import BlockInputs, ModelAdapter
from fsdp_speedloader.models.chunked_loss import token_chunks
from fsdp_speedloader.fsdp2 import fold_unsharded_grads, fsdp_params_of


class TrainStepState:
    """Everything one training step shares between the Functions.

    A plain class, on purpose: it is passed through FSDP-hooked calls, and FSDP rebuilds (and casts
    the tensors of) containers and dataclasses it finds in forward arguments, which would copy the
    state per call and lose writes into it (docs/design.md §3).
    """

    def __init__(self, *, adapter: ModelAdapter, store: ActivationStore, num_units: int,
                 input_ids: list[torch.Tensor], position_ids: list[torch.Tensor], shift_labels: list[torch.Tensor],
                 block_inputs: list[BlockInputs], num_label_tokens: torch.Tensor, loss_chunk_tokens: int,
                 replay_rng: bool, grad_ready_hook: Optional[Callable[[int], None]] = None,
                 router_loss: Optional[RouterLoss] = None, keep_activations: int = 0, alternate: bool = True) -> None:
        self.adapter = adapter
        # No backward will read x_l: slots alternate, so the store holds two (as generation's steps), not U + 1.
        self.forward_only = not torch.is_grad_enabled()
        self.store = store
        self.num_units = num_units
        self.input_ids = input_ids  # N x (n, s)
        self.position_ids = position_ids  # N x (n or 1, s)
        self.shift_labels = shift_labels  # N x (n * s,): next-token targets, -100 ignored
        self.block_inputs = block_inputs  # N (one shared object when there is no padding mask)
        self.num_label_tokens = num_label_tokens  # scalar: the loss is a mean over these
        self.loss_chunk_tokens = loss_chunk_tokens
        self.replay_rng = replay_rng  # dropout: recompute must see the forward's random numbers
        self.rng_states: dict = {}
        self.grad_ready_hook = grad_ready_hook  # called with l once unit l's gradients are final
        self.router_loss = router_loss  # MoE with the load-balancing loss: its full-batch statistics
        # (unit, sub-batch) pairs whose forward keeps its autograd graph, so their backward needs no recompute.
        self.alternate = alternate  # SpeedLoaderOptions.alternate_sub_batches
        self.keep_pairs = kept_pairs(num_units, len(input_ids), keep_activations if torch.is_grad_enabled() else 0,
                                     alternate=alternate)
        self.kept: dict[tuple[int, int], tuple] = {}  # pair -> (input leaf, output, router logits) of its graph
        self.kept_pair_bytes = 0  # CUDA: the most GPU memory one kept pair held (its graph, input copy, output)
        self._loops = 0  # loops over the sub-batches run so far this step (embed, units, head; forward, backward)

    def next_reversed(self) -> bool:
        """Whether the next loop over the sub-batches runs N-1 .. 0: every other one does, so each loop starts with
        the sub-batch the one before ended with, whose output the store still holds on the device (unless
        ``alternate`` is off)."""
        self._loops += 1
        return reversed_loop(self._loops, self.alternate)

    @property
    def num_slots(self) -> int:
        return 2 if self.forward_only else self.num_units + 1

    def slot(self, index: int) -> int:
        """The store slot of x_index in forward."""
        return index % 2 if self.forward_only else index

    def unit_grads_ready(self, index: int) -> None:
        """Unit ``index``'s FSDP post-backward (reduce-scatter, copy to host) has been issued."""
        if self.grad_ready_hook is not None and 1 <= index <= self.num_units:
            self.grad_ready_hook(index)

    @property
    def num_sub_batches(self) -> int:
        return len(self.input_ids)

    @functools.cached_property
    def root_fsdp_params(self) -> list:
        """Embedding, final norm and LM head: their per-sub-batch gradients are folded in fp32 too."""
        return fsdp_params_of(self.adapter.model)

    @contextlib.contextmanager
    def router_logits(self) -> Iterator[list[torch.Tensor]]:
        """The router logits of the blocks run inside, in order (always empty without the load-balancing loss)."""
        if self.router_loss is None:
            yield []
            return
        with self.adapter.capture_router_logits() as logits:
            yield logits

    @contextlib.contextmanager
    def rng(self, key: tuple[int, int], *, replay: bool) -> Iterator[None]:
        """Forward records the RNG state before (unit, sub-batch); backward replays it."""
        if not self.replay_rng:
            yield
            return
        device = self.input_ids[0].device
        cuda = [device] if device.type == "cuda" else []
        if not replay:
            self.rng_states[key] = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)
            yield
            return
        cpu_state, cuda_state = self.rng_states.pop(key)
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(cpu_state)
            if cuda:
                torch.cuda.set_rng_state(cuda_state, device)
            yield


def reversed_loop(loop: int, alternate: bool) -> bool:
    """Whether a step's ``loop``-th loop over the sub-batches (1-based: the embeddings', units 1 .. U', the head's in
    forward, then the head's, units U .. 1', the embeddings' in backward) runs them N-1 .. 0: every other one."""
    return alternate and loop % 2 == 0


def backward_order(unit: int, num_units: int, num_sub_batches: int, alternate: bool) -> list[int]:
    """The order in which unit ``unit``'s backward runs the sub-batches: its loop is the step's 2U + 4 - unit-th."""
    order = list(range(num_sub_batches))
    return order[::-1] if reversed_loop(2 * num_units + 4 - unit, alternate) else order


def kept_pairs(num_units: int, num_sub_batches: int, count: int, *, alternate: bool = False
               ) -> frozenset[tuple[int, int]]:
    """The ``count`` (unit, sub-batch) pairs that keep their activations: every sub-batch of the last unit, then
    of the one before, ..., each unit's in the order its backward runs them (the first pairs the backward reaches,
    so their memory is freed before a recompute of the same unit needs any)."""
    pairs = [(unit, i) for unit in range(num_units, 0, -1)
             for i in backward_order(unit, num_units, num_sub_batches, alternate)]
    return frozenset(pairs[:count])


@dataclass(eq=False)
class Unit:
    """``blocks_per_unit`` consecutive blocks: one FSDP group, one chain step. ``index`` is 1-based. ``scope``: what
    every run of its blocks enters, the forward's and the recompute's alike (``kernels.kernel_scope``: the SDPA
    backend, Liger's RoPE)."""

    index: int
    blocks: Sequence[nn.Module]
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @functools.cached_property
    def fsdp_params(self) -> list:
        return fsdp_params_of(self.blocks[0])  # a group's FSDP state lives on its first module

    def forward(self, adapter: ModelAdapter, x: torch.Tensor, inputs: BlockInputs, *, compiled: bool = False
                ) -> torch.Tensor:
        with self.scope():
            for block in self.blocks:
                x = adapter.run_block(block, x, inputs, compiled=compiled)
        return x


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


class EmbedFunction(torch.autograd.Function):
    """Embeds every sub-batch into slot 0.

    Shapes: ids (n, s) -> x0 (n, s, h) per sub-batch.
    Saved for backward: nothing but the step state; backward re-embeds (a cheap gather) and
    backpropagates dL/dx0[i] into the embedding weights.
    Input ``weight`` only anchors the node in autograd; its gradient is accumulated by the
    inner backward, so this Function returns None for it.
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, state: TrainStepState) -> torch.Tensor:
        order = range(state.num_sub_batches)
        for i in reversed(order) if state.next_reversed() else order:
            state.store.put(state.slot(0), i, state.adapter.embed(state.input_ids[i], state.position_ids[i]))
        ctx.state = state
        return _placeholder(weight)

    @staticmethod
    def backward(ctx, grad_placeholder: torch.Tensor):
        state: TrainStepState = ctx.state
        state.unit_grads_ready(1)  # autograd ran unit 1's FSDP post-backward just before this node

        def backprop(i: int, g: torch.Tensor) -> None:  # g = dL/dx0[i]
            with torch.enable_grad():
                x0 = state.adapter.embed(state.input_ids[i], state.position_ids[i])
            torch.autograd.backward(x0, g)
            fold_unsharded_grads(state.root_fsdp_params)

        for_each_sub_batch(state.store, grad_slot(0, state.num_units), state.num_sub_batches, backprop,
                           reverse=state.next_reversed())
        state.store.end_step()
        return None, None


class UnitFunction(torch.autograd.Function):
    """Runs one unit on all N sub-batches: x_{l-1}[i] -> x_l[i].

    Shapes: x (n, s, h) per sub-batch, in the parameters' compute dtype.
    Saved for backward: nothing on the GPU. The inputs x_{l-1}[i] stay in the store and the unit
    is recomputed per sub-batch in backward (activation memory: one sub-batch of one unit), except for
    the pairs in ``state.keep_pairs`` (``keep_activations``): their forward runs with grad and keeps
    its graph on the GPU until their backward, which then only backpropagates.
    Backward, per sub-batch: fetch x_{l-1}[i] and dL/dx_l[i], recompute the unit with grad,
    backpropagate, fold the parameter gradients into FSDP's fp32 accumulator (reduce-scattered
    once by FSDP's post-backward), and write dL/dx_{l-1}[i] to the slot that held x_l[i].
    Streams: all compute on the current stream; the store's ``prefetch``/``put`` start the next
    fetch and the last store on its copy streams where it has them (``for_each_sub_batch``'s order).
    """

    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, state: TrainStepState, unit: Unit) -> torch.Tensor:
        store, src, dst = state.store, state.slot(unit.index - 1), state.slot(unit.index)

        def run(i: int, x: torch.Tensor) -> None:
            keep = (unit.index, i) in state.keep_pairs
            if keep:  # the graph saves its input: a copy, as the store may reuse x's buffer for the next fetch
                before = _allocated(x.device)
                x = x.detach().clone().requires_grad_(True)
            rng = contextlib.nullcontext() if keep else state.rng((unit.index, i), replay=False)
            with torch.set_grad_enabled(keep), rng, state.router_logits() as router_logits:
                y = unit.forward(state.adapter, x, state.block_inputs[i], compiled=True)
            if router_logits:
                state.router_loss.add(i, router_logits)
            if keep:
                state.kept[unit.index, i] = (x, y, router_logits)
                state.kept_pair_bytes = max(state.kept_pair_bytes, _allocated(x.device) - before)
                y = y.detach()
            store.put(dst, i, y)

        for_each_sub_batch(store, src, state.num_sub_batches, run, reverse=state.next_reversed())
        ctx.state, ctx.unit = state, unit
        return _placeholder(placeholder)

    @staticmethod
    def backward(ctx, grad_placeholder: torch.Tensor):
        state: TrainStepState = ctx.state
        unit: Unit = ctx.unit
        state.unit_grads_ready(unit.index + 1)  # the next unit's post-backward ran just before this node
        store, src = state.store, unit.index - 1
        g_in, g_out = grad_slot(unit.index, state.num_units), grad_slot(src, state.num_units)

        def backprop(i: int, x: torch.Tensor, g: torch.Tensor) -> None:  # x = x_{l-1}[i], g = dL/dx_l[i]
            kept = state.kept.pop((unit.index, i), None)
            if kept is None:  # recompute
                x = x.detach().requires_grad_(True)
                with torch.enable_grad(), state.rng((unit.index, i), replay=True), \
                        state.router_logits() as router_logits:
                    y = unit.forward(state.adapter, x, state.block_inputs[i], compiled=True)
            else:  # the forward's graph (the fetched x is not needed)
                x, y, router_logits = kept
            outputs, grads = [y], [g]
            if router_logits:  # this (unit, sub-batch)'s share of the load-balancing loss's gradient
                with torch.enable_grad():
                    outputs.append(state.router_loss.backward_term(i, router_logits))
                grads.append(None)
            torch.autograd.backward(outputs, grads)
            fold_unsharded_grads(unit.fsdp_params)
            store.put(g_out, i, x.grad)

        def next_unit_input(i: int) -> None:  # the next loop (unit l-1's backward) starts with i, or with 0
            if src >= 1:
                store.prefetch(src - 1, i if state.alternate else 0)

        for_each_sub_batch(store, (src, g_in), state.num_sub_batches, backprop, reverse=state.next_reversed(),
                           lookahead=next_unit_input)
        return torch.zeros_like(grad_placeholder), None, None


def _chunk_loss(adapter: ModelAdapter, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of one chunk. x (t, h), labels (t,) -> scalar fp32."""
    logits = adapter.logits(x).float()  # (t, V), soft-capped where the family does: the only full-vocabulary tensor
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


class HeadLossFunction(torch.autograd.Function):
    """Final norm, LM head and cross-entropy of every sub-batch, chunked over tokens.

    Shapes: x_U[i] (n, s, h) -> flattened (n*s, h), chunks of ``loss_chunk_tokens`` rows;
    logits exist for one chunk at a time. Returns the mean token loss of the effective batch.
    Saved for backward: nothing; backward recomputes each chunk with grad, scaled by the
    incoming gradient (so ``(c * loss).backward()`` gives c times the gradients), and writes
    dL/dx_U[i] over x_U[i] in the store.
    """

    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, state: TrainStepState) -> torch.Tensor:
        store, last = state.store, state.slot(state.num_units)
        total = torch.zeros((), dtype=torch.float32, device=placeholder.device)

        def add_loss(i: int, x: torch.Tensor) -> None:
            x, labels = x.flatten(0, 1), state.shift_labels[i]
            for c in token_chunks(x.shape[0], state.loss_chunk_tokens):
                total.add_(_chunk_loss(state.adapter, x[c], labels[c]))

        for_each_sub_batch(store, last, state.num_sub_batches, add_loss, reverse=state.next_reversed())
        ctx.state = state
        loss = total / state.num_label_tokens
        if state.router_loss is not None:  # as the MoE families' forwards: loss += coef * aux (whole batch)
            loss = loss + state.router_loss.coef * state.router_loss.value()
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        state: TrainStepState = ctx.state
        store, last = state.store, state.num_units
        scale = grad_loss / state.num_label_tokens.clamp_min(1.0)  # no targets: zero gradients, as Hugging Face's
        if state.router_loss is not None:  # the units' backwards, which run after this one, read dL/dP
            state.router_loss.backward_from(grad_loss)

        def backprop(i: int, x_i: torch.Tensor) -> None:
            x, labels = x_i.flatten(0, 1), state.shift_labels[i]
            grad = torch.empty_like(x)  # every row is written by its chunk below
            for c in token_chunks(x.shape[0], state.loss_chunk_tokens):
                xc = x[c].detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = _chunk_loss(state.adapter, xc, labels[c]) * scale
                torch.autograd.backward(loss)
                grad[c] = xc.grad
            fold_unsharded_grads(state.root_fsdp_params)
            store.put(grad_slot(last, last), i, grad.view_as(x_i))

        for_each_sub_batch(store, last, state.num_sub_batches, backprop, reverse=state.next_reversed())
        return torch.zeros((), dtype=torch.float32, device=grad_loss.device), None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets as Hugging Face computes them: position t predicts labels[t + 1]. (n, s)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def num_label_tokens(shifted: torch.Tensor, override: Optional[torch.Tensor | int] = None) -> torch.Tensor:
    """Denominator of the mean loss: the counted targets of the whole effective batch. With none (every label
    -100) the loss is 0 / 0 = nan, as the unmodified Hugging Face model's (and its gradients are zero)."""
    if override is not None:
        return torch.as_tensor(override, dtype=torch.float32, device=shifted.device)
    return (shifted != -100).sum().to(torch.float32)
