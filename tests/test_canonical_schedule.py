"""The canonical schedule (FSDP2 gradient accumulation over micro-batches) at world size 1 and 2.

Every combination of ``schedule.gradient_sync`` (reduce-scatter after every micro-batch, or the last only),
``schedule.reshard_after_forward`` (ZeRO-3, or parameters kept gathered for the whole step) and the recompute (none,
or every other block: ``schedule.activation_checkpointing_every=2``) gives the unmodified model's gradients of the
full batch; the option's point, one unshard per unit per step, is counted.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_utils import run_distributed, tiny_config
from engine_cases import (assert_grads_close, batch, count_collectives, cpu_mesh, reference_grads,
                          tiny_model)
from fsdp_speedloader import parallel
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group
from fsdp_speedloader.app.canonical import canonical_forward_backward, enable_activation_checkpointing
from fsdp_speedloader.app.trainer import Trainer, num_label_tokens

NUM_MICRO_BATCHES = 3
LAYERS = 4  # one FSDP unit per block, plus the root
CASES = list(itertools.product(("every", "last"), (True, False), (0, 2)))  # sync, reshard, recompute every k-th


def _step(model, ids, labels, sync: str, reshard: bool) -> None:
    canonical_forward_backward(model, ids, labels, sub_batch_size=ids.shape[0] // NUM_MICRO_BATCHES,
                               num_tokens=num_label_tokens(labels), gradient_sync=sync, reshard_after_forward=reshard)


def _parity_and_counts(rank: int, world_size: int, device: str = "cpu", rtol: float = 1e-5) -> dict:
    """Per case: the gradients of one step equal the unmodified model's (the mean over ranks of each rank's batch
    mean), then the collectives of a second step."""
    mesh = cpu_mesh() if device == "cpu" else build_mesh(device)
    counts = {}
    for sync, reshard, every in CASES:
        model = tiny_model("llama", layers=LAYERS).to(device)
        batches = [tuple(t.to(device) for t in batch(NUM_MICRO_BATCHES, seed=r)) for r in range(world_size)]
        _, ref_grads = reference_grads(model, batches)
        calls = [0, 0]  # forward calls of blocks 1 and 2: block 2 recomputes in backward
        if every:
            assert enable_activation_checkpointing(model, every) == LAYERS // every
            for i in (0, 1):
                model.model.layers[i].mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        parallel.apply_fsdp(model, mesh, units=[[b] for b in model.model.layers], reshard_after_forward=reshard)
        ids, labels = batches[rank]
        _step(model, ids, labels, sync, reshard)
        assert calls == ([NUM_MICRO_BATCHES, 2 * NUM_MICRO_BATCHES] if every else [0, 0])
        assert_grads_close(model, ref_grads, rtol=rtol)
        model.zero_grad(set_to_none=True)
        counted, undo = count_collectives()
        try:
            _step(model, ids, labels, sync, reshard)
        finally:
            undo()
        assert_grads_close(model, ref_grads, rtol=rtol)  # the second step (nothing stepped the weights) again
        counts[f"{sync},{reshard},{every}"] = dict(counted)
    return counts


def _expected(sync: str, reshard: bool, world_size: int) -> dict:  # the recompute changes no collective
    units = LAYERS + 1
    # ZeRO-3: each block gathered for its forward and again for its backward, the root once, every micro-batch;
    # reshard_after_forward=false: each unit gathered once, for the step's first forward
    unshards = units if not reshard else NUM_MICRO_BATCHES * (2 * LAYERS + 1)
    reduces = units * (NUM_MICRO_BATCHES if sync == "every" else 1)
    return {"unshard": unshards, "all_gather": unshards if world_size > 1 else 0, "reduce_scatter": reduces}


def test_every_option_gives_the_reference_gradients_world_size_1():
    counts = _parity_and_counts(0, 1)
    assert counts == {f"{s},{r},{e}": _expected(s, r, 1) for s, r, e in CASES}


@pytest.mark.slow
def test_every_option_gives_the_reference_gradients_world_size_2():
    counts = run_distributed(_parity_and_counts, 2, timeout_s=600)
    assert counts == [{f"{s},{r},{e}": _expected(s, r, 2) for s, r, e in CASES}] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_option_gives_the_reference_gradients_on_the_gpu():
    """The same on one GPU (NCCL, CUDA streams), fp32: FSDP2 sums in another order than the reference."""
    maybe_init_process_group("cuda")
    counts = _parity_and_counts(0, 1, device="cuda", rtol=1e-4)
    assert counts == {f"{s},{r},{e}": _expected(s, r, 1) for s, r, e in CASES}


def test_trainer_keeps_units_gathered_for_the_step(tmp_path):
    """schedule.reshard_after_forward=false reaches the FSDP units and trains like the default."""
    def run(name: str, reshard: bool) -> list[float]:
        trainer = Trainer(tiny_config(tmp_path / name, steps=3, schedule={
            "name": "canonical", "num_sub_batches": NUM_MICRO_BATCHES, "reshard_after_forward": reshard}))
        block = trainer.model.model.layers[0]
        assert (block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None) == reshard
        return [m["loss"] for m in trainer.train()]

    assert run("kept", False) == pytest.approx(run("default", True), rel=1e-6)


def test_reshard_after_forward_is_for_the_canonical_schedule(tmp_path):
    with pytest.raises(ValueError, match="schedule.reshard_after_forward"):
        tiny_config(tmp_path, schedule={"name": "speedloader", "reshard_after_forward": False})
