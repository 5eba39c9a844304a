"""Per-unit optimizer steps overlapped with backward give exactly the weights of a plain step."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_cases import batch, cpu_mesh, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.memory.optimizer_overlap import OverlappedOptimizer


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


@pytest.mark.parametrize("offload,offload_root", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_overlapped_steps_equal_a_plain_step(offload, offload_root, blocks_per_unit):
    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=3, offload_root=offload_root,
                                blocks_per_unit=blocks_per_unit, offload_params=offload) for _ in range(2)]
    plain = _adamw(models[0].parameters())
    overlapped = OverlappedOptimizer(models[1], _adamw)
    ready = []
    hook = speedloader_engine(models[1]).grad_ready_hook
    speedloader_engine(models[1]).grad_ready_hook = lambda index: (ready.append(index), hook(index))
    try:
        for step in range(3):
            ids, labels = batch(3, seed=step)
            for model, opt in zip(models, (plain, overlapped)):
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        overlapped.close()
    units = 4 // blocks_per_unit
    assert ready == list(range(units, 0, -1)) * 3  # every unit, last first, once per step
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_overlap_needs_a_layer_major_model():
    with pytest.raises(ValueError, match="apply_speedloader"):
        OverlappedOptimizer(tiny_model("llama"), _adamw)
