"""Per-unit optimizer steps overlapped with backward give exactly the weights of a plain step; the plain
``OptimizersContainer`` and the overlapped one behave alike behind one interface (transfer casts after the
step, the optimizer state by parameter name, ``close``)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from engine_cases import batch, cpu_mesh, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer, OverlappedOptimizer


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _train_both(models, plain, overlapped, *, steps: int, sequences: int) -> None:
    """``steps`` training steps of both models (the plain optimizer's, the overlapped one's, closed after), then
    every parameter equal bit for bit."""
    try:
        for step in range(steps):
            ids, labels = batch(sequences, seed=step)
            for model, opt in zip(models, (plain, overlapped)):
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        overlapped.close()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


@pytest.mark.parametrize("offload,offload_root,device_units", [(False, True, 0), (True, True, 0), (True, False, 0),
                                                                (True, False, 1)])
@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_overlapped_steps_equal_a_plain_step(offload, offload_root, device_units, blocks_per_unit):
    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=3, offload_root=offload_root,
                                blocks_per_unit=blocks_per_unit, offload_params=offload, device_units=device_units)
              for _ in range(2)]
    plain = _adamw(models[0].parameters())
    overlapped = OverlappedOptimizer(models[1], _adamw)
    ready = []
    hook = speedloader_engine(models[1]).grad_ready_hook
    speedloader_engine(models[1]).grad_ready_hook = lambda index: (ready.append(index), hook(index))
    _train_both(models, plain, overlapped, steps=3, sequences=3)
    units = 4 // blocks_per_unit
    assert ready == list(range(units, 0, -1)) * 3  # every unit, last first, once per step


def test_overlapped_pooled_host_steps_equal_a_plain_fused_step():
    """optim.fp32_host_step=pool: the worker's host steps in chunks on the host pool (from the worker thread) give
    the bits of one plain fused step of the same offloaded model."""
    from fsdp_speedloader.memory.local_adamw import LocalShardAdamW

    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True)
              for _ in range(2)]
    plain = LocalShardAdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    overlapped = OverlappedOptimizer(models[1], lambda ps: LocalShardAdamW(ps, lr=1e-2, weight_decay=0.1, fused=True,
                                                                            host_chunk=64))
    _train_both(models, plain, overlapped, steps=2, sequences=2)
    assert all(opt.host_chunk == 64 for opt in overlapped.optimizers)


def test_overlap_needs_a_layer_major_model():
    with pytest.raises(ValueError, match="apply_speedloader"):
        OverlappedOptimizer(tiny_model("llama"), _adamw)


# --- one interface: the plain container and the overlapped one ----------------------------------------------


def _transfer_model(base):
    return apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=3, offload_params=True,
                             param_dtype=torch.bfloat16, param_transfer_dtype=torch.bfloat16)


def test_container_keeps_host_and_device_parameters_in_separate_optimizers():
    """One inner optimizer per side, host first: the build may then compress the host's states only (with the
    root or ``device_units`` on the GPU, one optimizer over both sides would have given the host fp32 states).
    'meta' stands in for the GPU."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4))
    seen = []

    def build(params):
        seen.append({p.device.type for p in params})
        return torch.optim.SGD(params, lr=0.1)

    container = OptimizersContainer(model, build)
    assert seen == [{"cpu"}, {"meta"}] and len(container) == 2
    assert [len(g["params"]) for g in container.param_groups] == [4, 2]


def test_container_step_casts_the_transfer_copies():
    """``OptimizersContainer.step`` casts the bf16 transfer copies its step made stale, as the overlapped one does
    in its worker: nothing is left for the next forward (a bare optimizer step leaves every offloaded one)."""
    base = tiny_model("llama")
    models = [_transfer_model(base) for _ in range(2)]
    bare = _adamw(models[0].parameters())
    container = OptimizersContainer(models[1], _adamw)
    ids, labels = batch(3, seed=0)
    for model, opt in zip(models, (bare, container)):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    num_params = len(list(models[0].parameters()))
    assert speedloader_engine(models[0]).refresh_param_transfer() == num_params
    assert speedloader_engine(models[1]).refresh_param_transfer() == 0
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_plain_and_overlapped_save_the_same_state_by_parameter_name():
    """Both containers' ``state_dict`` is DCP's layout keyed by parameter name (what checkpoints hold): after the
    same steps, the same entries with the same tensors, however the parameters are split among optimizers."""
    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=3, blocks_per_unit=2,
                                offload_params=True) for _ in range(2)]
    containers = [OptimizersContainer(models[0], _adamw), OverlappedOptimizer(models[1], _adamw)]
    try:
        for step in range(2):
            ids, labels = batch(3, seed=step)
            for model, opt in zip(models, containers):
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad()
        states = [opt.state_dict()["state"] for opt in containers]
    finally:
        for opt in containers:
            opt.close()
    assert [len(c) for c in containers] == [1, 2 + 1]  # one optimizer; one per unit of 2 blocks and the root
    assert sorted(states[0]) == sorted(states[1]) == sorted(name for name, _ in models[0].named_parameters())
    for name, state in states[0].items():
        for key, value in state.items():
            other = states[1][name][key]
            assert torch.equal(_full(value), _full(other)), (name, key)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_overlapped_close_is_idempotent_and_unhooks_the_model():
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=3, offload_params=True)
    before = threading.active_count()
    overlapped = OverlappedOptimizer(model, _adamw)
    assert threading.active_count() == before + 1 and speedloader_engine(model).grad_ready_hook is not None
    overlapped.close()
    overlapped.close()
    assert threading.active_count() == before and speedloader_engine(model).grad_ready_hook is None
    ids, labels = batch(3, seed=0)
    model(input_ids=ids, labels=labels).loss.backward()  # no unit step is queued to the stopped worker
