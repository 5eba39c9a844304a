"""Model families on one GPU, bf16: layer-major within bf16 noise of FSDP2's canonical schedule.

One dense family with everything its forward adds (Gemma-3: scaled embedding, alternating sliding and global
layers with their own rotary tables, soft-capped logits, tied embeddings), Llama-3 (GQA, llama3 rope scaling),
and both mixture-of-experts families with the router's load-balancing loss (Hugging Face's grouped_mm experts
on CUDA). The truth is the unmodified model in fp32 on the whole batch; the canonical schedule runs the whole
batch in bf16 through FSDP2 (the same loss: the load-balancing statistic is the whole batch's); layer-major
must be as close to the truth as it, eager and compiled, offloaded or not.

Run on the GPU machine: ``python -m pytest -m gpu tests/test_gpu_families.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.models import ModelConfig, build_model, get_adapter
from fsdp_speedloader.parallel import apply_fsdp, build_mesh, maybe_init_process_group
from test_gpu_engine import _batch, _grads, _rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16
SHAPE = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1024, vocab_size=2048,
             max_position_embeddings=4096)
FAMILIES = {
    "gemma3": dict(family="gemma3", head_dim=64, sliding_window=64, sliding_window_pattern=2, rope_theta=1e6,
                   rope_local_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    "llama3": dict(family="llama", rope_theta=500000.0, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen3_moe": dict(family="qwen3_moe", head_dim=64, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256, norm_topk_prob=True, output_router_logits=True,
                      router_aux_loss_coef=0.02),
    "mixtral": dict(family="mixtral", num_experts=8, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.02),
}


def _model(family: str):
    model = build_model(ModelConfig(name=family, **SHAPE, **FAMILIES[family]), device="cpu", seed=3)
    adapter = get_adapter(model)
    with torch.no_grad():  # decisive routing: bf16 rounding must not flip a token's experts in one run only
        for router in getattr(adapter, "routers", []):
            router.weight.mul_(20.0)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("store,offload,compiled", [("device", False, False), ("host", True, True)])
def test_bf16_within_noise_of_canonical(family, store, offload, compiled):
    maybe_init_process_group("cuda")
    torch._dynamo.reset()
    base = _model(family)
    ids, labels = _batch(8, 256)
    truth = copy.deepcopy(base).cuda()
    truth_loss = truth(input_ids=ids.cuda(), labels=labels.cuda()).loss
    truth_loss.backward()
    truth_grads = _grads(truth)
    del truth

    canonical = copy.deepcopy(base)
    apply_fsdp(canonical, build_mesh("cuda"), units=[[b] for b in canonical.model.layers], param_dtype=BF16,
               offload_params=offload)
    canonical_loss = canonical(input_ids=ids.cuda(), labels=labels.cuda()).loss
    canonical_loss.backward()
    canonical_grads = _grads(canonical)
    del canonical

    layer_major = apply_speedloader(copy.deepcopy(base), num_sub_batches=4, param_dtype=BF16, activation_store=store,
                                    offload_params=offload, compile_blocks=compiled)
    loss = layer_major(input_ids=ids, labels=labels).loss
    loss.backward()

    canonical_gap = abs(canonical_loss.item() - truth_loss.item())
    assert abs(loss.item() - truth_loss.item()) <= max(2 * canonical_gap, 1e-2), (loss.item(), truth_loss.item())
    err, canonical_err = _rel_err(_grads(layer_major), truth_grads), _rel_err(canonical_grads, truth_grads)
    assert err <= max(1.5 * canonical_err, 5e-3), (err, canonical_err)
