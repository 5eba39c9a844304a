"""Mixture of experts, layer-major and exact: Mixtral and Qwen3-MoE with the router's load-balancing loss.

Gradient parity of both families over the N x blocks_per_unit x offloading grid, at world size 2, and loading
from a saved (per-expert) Hugging Face directory run with the dense families in tests/test_families.py
(``engine_cases.FAMILY_CASES`` holds the MoE cases, the load-balancing loss on at weight 0.5). Here: what MoE
adds — the load-balancing loss is the whole effective batch's statistic (not a mean of per-sub-batch ones), with
padding; the loss without it; one unshard per unit per forward and backward whatever N is; the real shapes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.mixtral import modeling_mixtral

from engine_cases import (SEQ_LEN, assert_grads_close, batch, cpu_mesh,
                          family_config, steady_state_collectives, tiny_family_model)
from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.models import ModelConfig, build_model, get_adapter

MOE = ["mixtral", "qwen3_moe"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _skewed_model(family: str) -> torch.nn.Module:
    """Routers far from uniform (larger initial weights), so that sub-batches route differently."""
    return build_model(family_config(family, init_std=0.2), device="cpu", seed=2)


def _padded_batch(n_sub: int):
    ids, labels = batch(n_sub, seed=4)
    mask = torch.ones_like(ids)
    for row in range(0, ids.shape[0], 2):
        mask[row, : 1 + row % 5] = 0
    return ids.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100), mask


@pytest.mark.parametrize("family", MOE)
def test_load_balancing_loss_is_the_whole_batch_statistic(family):
    """loss = CE + coef * aux over every layer and every sub-batch at once, with left padding excluded, exactly as
    the unmodified model computes it on the full batch; the mean of per-sub-batch aux losses differs."""
    n_sub = 3
    model = _skewed_model(family)
    ids, labels, mask = _padded_batch(n_sub)
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    with torch.no_grad():  # what a per-sub-batch statistic would give
        per_sub_batch = torch.stack([ref(input_ids=i, attention_mask=m).aux_loss
                                     for i, m in zip(ids.chunk(n_sub), mask.chunk(n_sub))]).mean()
    assert abs(per_sub_batch - want.aux_loss) > 1e-3 * want.aux_loss

    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=n_sub, offload_params=True, blocks_per_unit=2)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    got.loss.backward()
    torch.testing.assert_close(got.aux_loss, want.aux_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)


@pytest.mark.parametrize("family", MOE)
def test_an_adapter_built_later_leaves_the_engine_its_router_logits(family):
    """Code that only inspects the model builds an adapter of its own after the engine's (the trainer's host memory
    plan does): the router logits still reach the engine's load-balancing loss. They used to go to the newest
    adapter only, and an offloaded MoE run's loss was nan at step 1."""
    model = _skewed_model(family)
    ids, labels, mask = _padded_batch(2)
    want = copy.deepcopy(model)(input_ids=ids, attention_mask=mask, labels=labels)
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2, offload_params=True)
    get_adapter(model)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.aux_loss, want.aux_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-6, atol=0)


def test_an_offloaded_moe_run_trains_as_one_on_the_device(tmp_path):
    """The trainer end to end, the load-balancing loss on: offload=params gives the losses of a run whose states
    stay on the device (bit for bit on the CPU)."""
    from dist_utils import tiny_config
    from fsdp_speedloader.app.trainer import Trainer

    moe = {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "output_router_logits": True, "router_aux_loss_coef": 0.1}
    losses = [[m["loss"] for m in Trainer(tiny_config(tmp_path / str(offload), steps=2, model=moe,
                                                      offload={"params": offload})).train()]
              for offload in (False, True)]
    assert losses[0] == losses[1] and all(torch.isfinite(torch.tensor(losses[1]))), losses


@pytest.mark.parametrize("family", MOE)
def test_without_the_load_balancing_loss(family):
    """output_router_logits=False (the published configs): the loss is the token loss alone, no router hooks."""
    model = tiny_family_model(family, output_router_logits=False)
    adapter = get_adapter(model)
    assert not adapter.router_aux_loss and all(not r._forward_hooks for r in adapter.routers)
    ids, labels = batch(3)
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=3)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)


def test_the_loss_is_the_families_own(monkeypatch):
    """The engine's aux loss is Hugging Face's ``load_balancing_loss_func`` of all router logits: doubling it in
    the reference changes the loss the engine must match (guards against comparing a formula with itself)."""
    model = tiny_family_model("mixtral")
    ids, labels = batch(2)
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, labels=labels)
    aux = modeling_mixtral.load_balancing_loss_func(want.router_logits, 4, 2, None)
    torch.testing.assert_close(want.aux_loss, aux)
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2)
    got = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.aux_loss, aux.detach(), rtol=1e-6, atol=0)
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert abs(0.5 * aux.item()) > 0.1  # the term is large in the loss: parity checks see it


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_one_unshard_per_unit_whatever_the_number_of_sub_batches(family, blocks_per_unit):
    """Every expert is loaded once per forward and once per backward for all N sub-batches."""
    counts_by_n = {}
    for n_sub in (1, 4):
        model = tiny_family_model(family)
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=n_sub, blocks_per_unit=blocks_per_unit,
                          offload_params=True)
        counts_by_n[n_sub] = steady_state_collectives(model, *batch(n_sub))
    units = 4 // blocks_per_unit
    expected = {"unshard": 2 * units + 1, "all_gather": 0, "reduce_scatter": units + 1}
    assert counts_by_n == {1: expected, 4: expected}


def test_router_jitter_is_replayed_like_dropout():
    """Mixtral's router jitter draws random numbers in training: the recompute must replay them (and compiled
    blocks, which cannot guarantee that, are refused)."""
    model = tiny_family_model("mixtral")
    model.config.router_jitter_noise = 0.1
    adapter = get_adapter(model)
    assert adapter.has_dropout
    with pytest.raises(ValueError, match="dropout"):
        adapter.compile_blocks()


def test_flops_count_the_routed_experts_only():
    cfg = family_config("qwen3_moe")
    model = build_model(cfg, device="meta")
    adapter = get_adapter(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    every_parameter = super(type(adapter), adapter).flops_per_token(SEQ_LEN)  # the dense count
    assert adapter.flops_per_token(SEQ_LEN) == pytest.approx(every_parameter - 6 * experts * (1 - 2 / 4))


@pytest.mark.parametrize("overrides,field_name", [
    (dict(family="mixtral"), "model.num_experts"),
    (dict(family="qwen3_moe", num_experts=4), "model.num_experts_per_tok"),
    (dict(family="mixtral", num_experts=2, num_experts_per_tok=3), "model.num_experts_per_tok"),
    (dict(family="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
     "model.moe_intermediate_size"),
    (dict(family="llama", output_router_logits=True), "model.output_router_logits"),
    (dict(family="llama", num_experts=4), "model.num_experts"),
])
def test_moe_config_names_the_field(overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        ModelConfig(**overrides)


def test_real_shapes_build_on_meta():
    import yaml
    from pathlib import Path

    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    # conf/model file -> (class, parameters and active non-embedding parameters per token, in billions)
    shapes = {"mixtral_8x7b": ("MixtralForCausalLM", 46.703, 12.749),
              "qwen3_30b_a3b": ("Qwen3MoeForCausalLM", 30.532, 3.042)}
    for option, (cls, billions, active) in shapes.items():
        model = build_model(ModelConfig(**yaml.safe_load((conf / f"{option}.yaml").read_text())), device="meta")
        assert type(model).__name__ == cls
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.001)
        assert get_adapter(model).flops_per_token(0) / 6e9 == pytest.approx(active, abs=0.001)
