"""Layer-major engine on CPU, world size 1: gradient parity, collective counts, optimizer steps, errors.

World size 2 is in test_engine_distributed.py. Tolerances: fp32, relative gradient error < 1e-5.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from engine_cases import (assert_grads_close, batch, cpu_mesh, full_grad, is_fsdp, reference_grads,
                          steady_state_collectives, tiny_model)
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.parallel import apply_fsdp

CASES = list(itertools.product(("llama", "opt"), (1, 2, 3, 8), (1, 2), ("device", "host"), (False, True)))


def _assert_parity(family: str, num_sub_batches: int, *, scale: float = 1.0, **speedloader_kwargs):
    """One layer-major step of ``tiny_model(family)`` prepared with ``speedloader_kwargs``: its loss and
    (``scale * loss``) gradients equal the unmodified model's on the full batch. Returns the model."""
    model = tiny_model(family)
    ids, labels = batch(num_sub_batches)
    ref_loss, ref_grads = reference_grads(model, [(ids, labels)], scale=scale)
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=num_sub_batches, **speedloader_kwargs)
    loss = model(input_ids=ids, labels=labels).loss
    (scale * loss).backward()
    torch.testing.assert_close(loss.detach(), ref_loss[0], rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)
    return model


@pytest.mark.parametrize("family,num_sub_batches,blocks_per_unit,store,offload", CASES)
def test_gradient_parity(family, num_sub_batches, blocks_per_unit, store, offload):
    # scale: (c * loss).backward() must give c times the gradients
    _assert_parity(family, num_sub_batches, scale=2.5, blocks_per_unit=blocks_per_unit, activation_store=store,
                   offload_params=offload)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_gradient_parity_with_the_root_kept_on_the_device(family):
    """offload_root=False: the units offloaded, the root (embeddings, final norm, LM head) not."""
    model = _assert_parity(family, 3, offload_params=True, offload_root=False)
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for m in model.modules() if is_fsdp(m)}
    assert policies == {"CPUOffloadPolicy", "OffloadPolicy"}, policies


@pytest.mark.parametrize("family,device_units,blocks_per_unit", [("llama", 1, 1), ("opt", 3, 1), ("llama", 1, 2),
                                                                 ("llama", 9, 1)])
def test_gradient_parity_with_the_first_units_kept_on_the_device(family, device_units, blocks_per_unit):
    """device_units=K: units 1 .. K not offloaded (their FSDP groups without CPUOffloadPolicy), the rest offloaded;
    more than the units keeps every unit."""
    model = _assert_parity(family, 3, offload_params=True, device_units=device_units, blocks_per_unit=blocks_per_unit)
    units = [m for m, _ in speedloader_engine(model).units]
    policies = [type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in units]
    kept = min(device_units, len(units))
    assert policies == ["OffloadPolicy"] * kept + ["CPUOffloadPolicy"] * (len(units) - kept), policies


def test_device_units_need_offloaded_parameters():
    from fsdp_speedloader import SpeedLoaderOptions

    with pytest.raises(ValueError, match="device_units.*offload_params=True"):
        SpeedLoaderOptions(device_units=1)
    with pytest.raises(ValueError, match="device_units"):
        SpeedLoaderOptions(offload_params=True, device_units=-1)


def test_materialize_moves_only_the_groups_that_do_not_offload():
    """materialize_model's to_empty puts every shard on param_device (the host); the root of offload_root=False
    then gets shards on the compute device, keeping its parameter objects (here 'meta' stands in for the GPU)."""
    from fsdp_speedloader.app.config import ModelConfig
    from fsdp_speedloader.fsdp2 import move_unoffloaded_shards
    from fsdp_speedloader.models import build_model

    cfg = ModelConfig(family="opt", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=320,
                      max_position_embeddings=64)
    model = build_model(cfg, device="meta")
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2, offload_params=True, offload_root=False)
    model.to_empty(device="cpu")
    before = dict(model.named_parameters())
    assert move_unoffloaded_shards(model, torch.device("meta")) == 5  # token/position embeddings, final norm (2), head
    after = dict(model.named_parameters())
    assert all(after[k] is before[k] for k in before)
    moved = {k for k, p in after.items() if p.device.type == "meta"}
    assert moved == {k for k in after if ".layers." not in k}, moved


def test_compiled_blocks_refuse_dropout():
    model = tiny_model("opt", dropout=0.1)
    with pytest.raises(ValueError, match="compile_blocks with dropout"):
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2, compile_blocks=True)
    assert not any(is_fsdp(m) for m in model.modules())  # refused before sharding


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_gradient_parity_with_compiled_blocks(family):
    """compile_blocks=True: the forward and the recompute in backward run through one compiled function."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _assert_parity(family, 2, blocks_per_unit=2, compile_blocks=True)
    assert speedloader_engine(model).adapter.compiled_block_forward is not None


@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_collectives_do_not_grow_with_num_sub_batches(blocks_per_unit):
    counts_by_n = {}
    for n_sub in (1, 4):
        model = tiny_model("llama")
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=n_sub, blocks_per_unit=blocks_per_unit)
        # world size 1: unshards need no all-gather collective
        counts_by_n[n_sub] = steady_state_collectives(model, *batch(n_sub))
    units = 4 // blocks_per_unit
    # Forward: root + every unit once; backward: every unit once (the root stays unsharded).
    expected = {"unshard": 2 * units + 1, "all_gather": 0, "reduce_scatter": units + 1}
    assert counts_by_n[1] == expected, counts_by_n
    assert counts_by_n[4] == expected, counts_by_n


def _canonical_step(model, ids, labels, num_sub_batches):
    """FSDP2 gradient accumulation over micro-batches, the loss normalised over the whole batch."""
    total = (labels[:, 1:] != -100).sum()
    for mb_ids, mb_labels in zip(ids.chunk(num_sub_batches), labels.chunk(num_sub_batches)):
        model(input_ids=mb_ids, labels=mb_labels, num_items_in_batch=total).loss.backward()


def test_ascending_sub_batches_sum_gradients_as_fsdp2_accumulation_does():
    """``alternate_sub_batches=False``: every loop runs 0 .. N-1, so a unit's sub-batch gradients add up in FSDP2's
    micro-batch order: the gradients are bit for bit those of gradient accumulation, and the alternating default's
    are not (the same values in another fp32 summation order)."""
    n_sub, grads = 3, {}
    base = tiny_model("llama")
    ids, labels = batch(n_sub, seed=0)
    canonical = copy.deepcopy(base)
    apply_fsdp(canonical, cpu_mesh(), units=[[b] for b in canonical.model.layers])
    _canonical_step(canonical, ids, labels, n_sub)
    for alternate in (False, True):
        model = copy.deepcopy(base)
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=n_sub, alternate_sub_batches=alternate)
        model(input_ids=ids, labels=labels).loss.backward()
        grads[alternate] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    reference = {n: p.grad.full_tensor() for n, p in canonical.named_parameters()}
    assert all(torch.equal(grads[False][n], g) for n, g in reference.items())
    assert not all(torch.equal(grads[True][n], g) for n, g in reference.items())
    for n, g in reference.items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_two_optimizer_steps_match_canonical(family):
    """The first step's gradients equal FSDP2's gradient accumulation to fp32 rounding, and so do the parameters
    after two AdamW steps. Layer-major sums a unit's sub-batch gradients in the order its loop ran them, which alternates from unit
    to unit (chain.py), so the last bits differ from the ascending sum; AdamW at eps 1e-6 magnifies that where a
    gradient is tiny, hence the parameters' wider absolute tolerance (a wrong gradient shows as ~1e-2)."""
    n_sub = 3
    layer_major = tiny_model(family)
    canonical = copy.deepcopy(layer_major)
    apply_fsdp(canonical, cpu_mesh(), units=[[b] for b in canonical.model.layers]
               if family == "llama" else [[b] for b in canonical.model.decoder.layers])
    apply_speedloader(layer_major, mesh=cpu_mesh(), num_sub_batches=n_sub)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (layer_major, canonical)]
    for step in range(2):
        ids, labels = batch(n_sub, seed=step)
        layer_major(input_ids=ids, labels=labels).loss.backward()
        _canonical_step(canonical, ids, labels, n_sub)
        for (name, a), (_, b) in zip(layer_major.named_parameters(), canonical.named_parameters()):
            if step == 0:  # the same parameters: only the summation order differs
                torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-5, atol=1e-7,
                                           msg=lambda m, name=name: f"{name}: {m}")
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(layer_major.named_parameters(), canonical.named_parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=2e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_dropout_is_replayed_in_recompute():
    # One unit and one sub-batch draw random numbers in the same order as the unmodified forward,
    # so with the same seed both see the same masks; recompute must replay them exactly.
    model = tiny_model("opt", dropout=0.2).train()
    ids, labels = batch(1)
    torch.manual_seed(123)
    _, ref_grads = reference_grads(model, [(ids, labels)])
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=1, blocks_per_unit=4)
    # A first step runs FSDP's lazy initialisation, which may draw random numbers (torch 2.11 does).
    model(input_ids=ids, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref_grads)


def test_no_grad_forward_gives_the_loss():
    model = tiny_model("llama")
    ids, labels = batch(4)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=4, activation_store="host")
    with torch.no_grad():
        got = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert speedloader_engine(model).store.device_bytes == 0


def test_bad_input_says_what_to_change():
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=4)
    ids, labels = batch(4)
    with pytest.raises(ValueError, match="num_sub_batches=4 x sub_batch_size"):
        model(input_ids=ids[:7], labels=labels[:7])
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        long = torch.zeros(8, 65, dtype=torch.long)
        model(input_ids=long, labels=long)
    with pytest.raises(ValueError, match="labels are required"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="labels has shape"):
        model(input_ids=ids, labels=labels[:, :4])
    with pytest.raises(ValueError, match="already applied"):
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_sub_batches"):
            apply_speedloader(tiny_model("llama"), num_sub_batches=bad)
    with pytest.raises(ValueError, match="activation_store"):
        apply_speedloader(tiny_model("llama"), num_sub_batches=2, activation_store="disk")


def test_unsupported_model_class():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="unsupported model class GPT2LMHeadModel"):
        apply_speedloader(gpt2, mesh=cpu_mesh(), num_sub_batches=2)


def test_bf16_sub_batch_gradients_accumulate_in_fp32():
    """bf16 compute, fp32 reduction: N sub-batches summed in fp32 are as precise as canonical
    accumulation (which reduce-scatters each micro-batch in fp32); a bf16 sum would not be."""
    n_sub, base = 16, tiny_model("llama")
    ids, labels = batch(n_sub)
    _, truth = reference_grads(base, [(ids, labels)])

    def error(model) -> float:
        diff = sum((full_grad(p).float() - truth[n]).norm() ** 2 for n, p in model.named_parameters())
        return float((diff / sum(t.norm() ** 2 for t in truth.values())) ** 0.5)

    canonical = copy.deepcopy(base)
    apply_fsdp(canonical, cpu_mesh(), units=[[b] for b in canonical.model.layers], param_dtype=torch.bfloat16)
    _canonical_step(canonical, ids, labels, n_sub)
    layer_major = apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=n_sub,
                                    param_dtype=torch.bfloat16)
    layer_major(input_ids=ids, labels=labels).loss.backward()
    assert error(layer_major) <= 1.05 * error(canonical), (error(layer_major), error(canonical))


def test_step_state_reaches_every_unit_uncopied(monkeypatch):
    """FSDP rebuilds dataclasses and containers in forward arguments (and casts their tensors under
    mixed precision); the step state must reach every unit's hooked call as the same object."""
    from fsdp_speedloader.engine import speedloader

    seen, unit_call = [], speedloader._unit_call
    monkeypatch.setattr(speedloader, "_unit_call", lambda unit, p, state: (seen.append(state), unit_call(unit, p, state))[1])
    head = speedloader.HeadLossFunction
    monkeypatch.setattr(speedloader, "HeadLossFunction",
                        type("Head", (), {"apply": staticmethod(lambda p, state: (seen.append(state), head.apply(p, state))[1])}))
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=2, param_dtype=torch.bfloat16)
    ids, labels = batch(2)
    model(input_ids=ids, labels=labels).loss.backward()
    assert len(seen) == 5 and all(state is seen[-1] for state in seen)  # 4 units, then the head
