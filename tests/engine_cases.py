"""Shared pieces of the engine tests: tiny models, batches and the gradient comparison."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_speedloader.app.config import ModelConfig
from fsdp_speedloader.models import build_model
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group

VOCAB = 96
SEQ_LEN = 16
SUB_BATCH = 2


def cpu_mesh():
    """A CPU (gloo) mesh over the default group, also on a machine with GPUs."""
    maybe_init_process_group("cpu")
    return build_mesh("cpu")


def tiny_model(family: str, *, layers: int = 4, dropout: float = 0.0, seed: int = 1) -> nn.Module:
    cfg = ModelConfig(family=family, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2 if family ==
                      "llama" else None, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                      dropout=dropout)
    return build_model(cfg, device="cpu", seed=seed)


def batch(num_sub_batches: int, *, seed: int = 0, sub_batch: int = SUB_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids; labels with -100 padding at the start of one row and the end of another."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (num_sub_batches * sub_batch, SEQ_LEN), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[-1, SEQ_LEN - 6 :] = -100
    return ids, labels


def reference_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0):
    """Gradients of the UNMODIFIED model: mean over batches (ranks) of each batch's mean token loss."""
    ref = copy.deepcopy(model)
    losses = []
    for ids, labels in batches:
        loss = ref(input_ids=ids, labels=labels).loss
        (loss * scale / len(batches)).backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.grad.clone() for name, p in ref.named_parameters()}


def full_grad(param: torch.Tensor) -> torch.Tensor:
    grad = param.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def assert_grads_close(model: nn.Module, ref_grads: dict, *, rtol: float = 1e-5, atol: float = 1e-8) -> None:
    """Every parameter: relative error (Frobenius) < rtol; gradients that are zero in exact arithmetic
    (e.g. OPT's key bias: softmax ignores a per-row constant) are compared absolutely (< atol)."""
    checked = 0
    for name, param in model.named_parameters():
        got, want = full_grad(param), ref_grads[name]
        assert got is not None, f"{name}: no gradient (lost in the chain)"
        err = (got.float().cpu() - want.float().cpu()).norm().item()
        ref_norm = want.float().norm().item()
        if ref_norm > 1e-6:
            assert err / ref_norm < rtol, f"{name}: relative error {err / ref_norm:.3e} >= {rtol}"
        else:
            assert err < atol, f"{name}: absolute error {err:.3e} on a ~zero gradient"
        checked += 1
    assert checked == len(ref_grads)


def count_collectives() -> tuple[dict, Callable[[], None]]:
    """Counts FSDP2 unshards (at any world size), all-gathers and reduce-scatters; returns (counts, undo).

    At world size 1 FSDP2 unshards without an all-gather collective, so "unshard" is the count to
    check there; "all_gather" matters at world size >= 2.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    counts = {"unshard": 0, "all_gather": 0, "reduce_scatter": 0}
    originals = {"foreach_all_gather": pg.foreach_all_gather, "foreach_reduce": pg.foreach_reduce}
    original_unshard = pg.FSDPParamGroup.unshard

    def wrap(fn, key):
        def counted(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return counted

    def counted_unshard(self, *args, **kwargs):
        before = self._all_gather_result
        out = original_unshard(self, *args, **kwargs)
        counts["unshard"] += before is None and self._all_gather_result is not None
        return out

    pg.foreach_all_gather = wrap(originals["foreach_all_gather"], "all_gather")
    pg.foreach_reduce = wrap(originals["foreach_reduce"], "reduce_scatter")
    pg.FSDPParamGroup.unshard = counted_unshard

    def undo() -> None:
        for name, fn in originals.items():
            setattr(pg, name, fn)
        pg.FSDPParamGroup.unshard = original_unshard

    return counts, undo


def steady_state_collectives(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """``count_collectives`` of one training step of ``model``, after a first step (FSDP2's lazy init)."""
    model(input_ids=ids, labels=labels).loss.backward()
    counts, undo = count_collectives()
    try:
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        undo()
    return dict(counts)


def is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


# ---------------------------------------------------------------------------------------------
# Tiny models of every family (tests/test_families.py): each exercises what its family adds
# ---------------------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # 16 < max positions: scaled, smoothed and kept bands

FAMILY_CASES = {
    # GQA, llama3 rope scaling, tied embeddings (as Llama-3.2 1B/3B)
    "llama3": dict(family="llama", num_kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                   tie_word_embeddings=True),
    "qwen2": dict(family="qwen2", num_kv_heads=2),  # q/k/v biases
    "qwen3": dict(family="qwen3", num_kv_heads=2, head_dim=32),  # q/k RMSNorm, head_dim != hidden / heads
    "mistral": dict(family="mistral", num_kv_heads=2, sliding_window=8),  # window < SEQ_LEN
    # sqrt(h) embedding scale, sliding (window 4) and global layers alternating with their own rotary bases,
    # linear scaling of the global one, logit soft-capping (0.5: active at these logit sizes), tied embeddings
    "gemma3": dict(family="gemma3", num_kv_heads=2, head_dim=32, sliding_window=4, sliding_window_pattern=2,
                   rope_theta=1e6, rope_local_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   final_logit_softcapping=0.5, tie_word_embeddings=True),
    # Mixture of experts (tests/test_moe.py), 4 experts top-2, with the router's load-balancing loss at a large
    # weight (0.5) so that its full-batch statistic and its gradient show in every parity check
    "mixtral": dict(family="mixtral", num_kv_heads=2, num_experts=4, num_experts_per_tok=2,
                    output_router_logits=True, router_aux_loss_coef=0.5),
    # + q/k RMSNorm, narrower experts than the dense MLP width, renormalised top-k weights
    "qwen3_moe": dict(family="qwen3_moe", num_kv_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, output_router_logits=True,
                      router_aux_loss_coef=0.5),
}


def family_config(name: str, *, layers: int = 4, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of family case ``name`` (``FAMILY_CASES``) at the tiny width of ``tiny_model``."""
    fields = dict(hidden_size=64, num_layers=layers, num_heads=4, intermediate_size=128, vocab_size=VOCAB,
                  max_position_embeddings=64, name=name, **FAMILY_CASES[name])
    return ModelConfig(**{**fields, **overrides})


def tiny_family_model(name: str, *, layers: int = 4, seed: int = 1, **overrides) -> nn.Module:
    """An initialised fp32 model of family case ``name``, through its unmodified Hugging Face class."""
    return build_model(family_config(name, layers=layers, **overrides), device="cpu", seed=seed)
