"""Layer-major gradient parity at world size 4: 2-D HSDP (2 "nodes" x 2 ranks) and 1-D FSDP.

Four spawned gloo ranks. On the HSDP mesh ``build_mesh("cpu", dp_replicate=2)`` ranks {0, 1} and
{2, 3} each hold one full replica, sharded in two; gradients are reduce-scattered within a replica
and all-reduced across replicas. Every rank trains on its own batch, so the reference is the
unmodified model's gradient averaged over the four ranks' batches (fp32: relative error < 1e-5).
One spawn runs every case (process start-up dominates on a CI machine).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dist_utils import run_distributed
from engine_cases import assert_grads_close, batch, count_collectives, reference_grads, tiny_model
from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group

WORLD_SIZE = 4
# (mesh, family, num_sub_batches, blocks_per_unit, activation_store, offload_params)
CASES = [
    ("hsdp", "llama", 3, 1, "host", False),
    ("hsdp", "llama", 2, 2, "device", True),
    ("hsdp", "opt", 1, 2, "host", True),
    ("hsdp", "opt", 3, 1, "device", False),
    ("fsdp", "llama", 2, 1, "host", True),
    ("fsdp", "opt", 3, 2, "device", False),
]


def _parity_at_world_size_4(rank: int, world_size: int) -> dict:
    maybe_init_process_group("cpu")
    meshes = {"hsdp": build_mesh("cpu", dp_replicate=2), "fsdp": build_mesh("cpu")}
    out = {"mesh_shapes": {k: (tuple(m.mesh_dim_names), tuple(m.shape)) for k, m in meshes.items()},
           "cases": 0}
    for mesh_name, family, n_sub, per_unit, store, offload in CASES:
        model = tiny_model(family)
        batches = [batch(n_sub, seed=r) for r in range(world_size)]
        ref_losses, ref_grads = reference_grads(model, batches)
        apply_speedloader(model, mesh=meshes[mesh_name], num_sub_batches=n_sub, blocks_per_unit=per_unit,
                          activation_store=store, offload_params=offload)
        ids, labels = batches[rank]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_losses[rank], rtol=1e-6, atol=0)
        assert_grads_close(model, ref_grads)
        if mesh_name == "hsdp":  # really HSDP: replicated across "nodes", sharded within one
            weight = next(model.parameters())
            assert tuple(weight.placements) == (Replicate(), Shard(0)), weight.placements
            assert weight.to_local().shape[0] == -(-weight.shape[0] // 2)
        out["cases"] += 1

    # One reduce (reduce-scatter, then the all-reduce across replicas) per unit and step, whatever N.
    counts = {}
    for n_sub in (1, 4):
        model = apply_speedloader(tiny_model("llama"), mesh=meshes["hsdp"], num_sub_batches=n_sub,
                                  blocks_per_unit=2)
        ids, labels = batch(n_sub, seed=rank)
        model(input_ids=ids, labels=labels).loss.backward()  # first step: lazy init
        counted, undo = count_collectives()
        try:
            model(input_ids=ids, labels=labels).loss.backward()
        finally:
            undo()
        counts[n_sub] = dict(counted)
    out["counts"] = counts
    return out


@pytest.mark.slow
def test_layer_major_parity_hsdp_2x2_and_fsdp_4():
    results = run_distributed(_parity_at_world_size_4, WORLD_SIZE, timeout_s=600)
    assert [r["cases"] for r in results] == [len(CASES)] * WORLD_SIZE
    assert results[0]["mesh_shapes"] == {"hsdp": (("dp_replicate", "dp_shard"), (2, 2)),
                                         "fsdp": (("dp_shard",), (4,))}
    units = 2  # 4 blocks, 2 per unit
    expected = {"unshard": 2 * units + 1, "all_gather": 2 * units + 1, "reduce_scatter": units + 1}
    for r in results:
        assert r["counts"][1] == expected and r["counts"][4] == expected, r["counts"]
