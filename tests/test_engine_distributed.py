"""Layer-major engine at world size 2 (spawned gloo ranks): parity, collective counts, mesh errors.

Each rank trains on its own batch; FSDP averages the ranks' gradients, so the reference is the
unmodified model's gradient averaged over both ranks' batches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from dist_utils import run_distributed
from engine_cases import (assert_grads_close, batch, cpu_mesh, reference_grads, steady_state_collectives,
                          tiny_model)
from fsdp_speedloader import apply_speedloader, speedloader_engine

CASES = list(itertools.product(("llama", "opt"), (1, 3), (1, 2), ("device", "host"), (False, True)))


def _assert_rank_parity(rank: int, world_size: int, family: str, n_sub: int, **speedloader_kwargs):
    """One layer-major step on this rank's batch: gradients equal the unmodified model's, averaged over ranks."""
    model = tiny_model(family)
    _, ref_grads = reference_grads(model, [batch(n_sub, seed=r) for r in range(world_size)])
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=n_sub, **speedloader_kwargs)
    ids, labels = batch(n_sub, seed=rank)
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref_grads)
    return model


def _parity_on_all_cases(rank: int, world_size: int) -> int:
    for family, n_sub, per_unit, store, offload in CASES:
        _assert_rank_parity(rank, world_size, family, n_sub, blocks_per_unit=per_unit, activation_store=store,
                            offload_params=offload)
    return len(CASES)


def _compiled_parity(rank: int, world_size: int) -> int:
    """The fastest single-GPU training setting, compiled blocks with the root's states not offloaded, at world
    size 2 (what tools/bench_scale.py's ``speedloader:compile:root=device`` runs on several GPUs)."""
    for family in ("llama", "opt"):
        model = _assert_rank_parity(rank, world_size, family, 2, offload_params=True, activation_store="host",
                                    compile_blocks=True, offload_root=False)
        assert speedloader_engine(model).adapter.compiled_block_forward is not None
    # the first unit's states kept on the device as well (offload.device_units)
    _assert_rank_parity(rank, world_size, "llama", 2, offload_params=True, activation_store="host",
                        offload_root=False, device_units=1)
    return 2


def _collective_counts(rank: int, world_size: int) -> dict:
    out = {}
    for n_sub in (1, 4):
        model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=n_sub, blocks_per_unit=2)
        out[n_sub] = steady_state_collectives(model, *batch(n_sub, seed=rank))
    return out


def _mesh_mismatch(rank: int, world_size: int) -> str:
    cpu_mesh()  # the default group exists; a mesh of this rank alone does not cover it
    lonely = DeviceMesh("cpu", torch.tensor([rank]))
    with pytest.raises(ValueError, match="mesh has 1 ranks but the process group has 2") as info:
        apply_speedloader(tiny_model("llama"), mesh=lonely, num_sub_batches=2)
    return str(info.value)


@pytest.mark.slow
def test_gradient_parity_world_size_2():
    assert run_distributed(_parity_on_all_cases, 2, timeout_s=600) == [len(CASES)] * 2


@pytest.mark.slow
def test_gradient_parity_world_size_2_compiled_blocks_root_not_offloaded():
    assert run_distributed(_compiled_parity, 2, timeout_s=600) == [2, 2]


@pytest.mark.slow
def test_collectives_do_not_grow_with_num_sub_batches_world_size_2():
    counts = run_distributed(_collective_counts, 2)[0]
    units = 2  # 4 blocks, 2 per unit
    expected = {"unshard": 2 * units + 1, "all_gather": 2 * units + 1, "reduce_scatter": units + 1}
    assert counts[1] == expected and counts[4] == expected, counts


def test_mesh_not_matching_the_process_group():
    assert all("mesh=None" in msg for msg in run_distributed(_mesh_mismatch, 2))
