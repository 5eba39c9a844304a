"""``keep_activations``: (unit, sub-batch) pairs whose forward keeps its graph, so their backward skips the recompute.

Exact: the gradients equal the unmodified model's whatever pairs are kept (none, some, all), offloaded or not,
one or two blocks per unit, with the load-balancing loss of a mixture of experts, at world sizes 1 and 2; and a
kept pair's blocks really run once per step (the saving is real).
"""

from __future__ import annotations

import gc

import pytest
import torch

from dist_utils import run_distributed
from engine_cases import assert_grads_close, batch, cpu_mesh, reference_grads, tiny_family_model, tiny_model
from fsdp_speedloader import apply_speedloader
from fsdp_speedloader.engine.chain import Unit, kept_pairs
from fsdp_speedloader.engine.speedloader import speedloader_engine

# (family, keep_activations, offload_params, activation_store, blocks_per_unit); 4 layers, N = 3
CASES = [("llama", 2, False, "device", 1), ("llama", 100, True, "host", 2), ("llama", 5, True, "host", 1),
         ("mixtral", 4, True, "host", 2), ("qwen3_moe", 12, False, "device", 1)]


def _model(family: str):
    return tiny_model(family) if family == "llama" else tiny_family_model(family)


def _parity(rank: int, world_size: int, family: str, keep: int, offload: bool, store: str, per_unit: int) -> None:
    model = _model(family)
    _, ref_grads = reference_grads(model, [batch(3, seed=r) for r in range(world_size)])
    apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=3, offload_params=offload, activation_store=store,
                      blocks_per_unit=per_unit, keep_activations=keep)
    ids, labels = batch(3, seed=rank)
    for _ in range(2):  # the second step reuses the units' storage: kept graphs must see their own weights
        for p in model.parameters():
            p.grad = None
        model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref_grads)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("family,keep,offload,store,per_unit", CASES)
def test_gradient_parity(family, keep, offload, store, per_unit):
    _parity(0, 1, family, keep, offload, store, per_unit)


def _all_cases(rank: int, world_size: int) -> int:
    for case in CASES:
        _parity(rank, world_size, *case)
    return len(CASES)


@pytest.mark.slow
def test_gradient_parity_world_size_2():
    assert run_distributed(_all_cases, 2, timeout_s=600) == [len(CASES)] * 2


@pytest.mark.parametrize("keep,expected_runs", [(0, 2 * 4 * 3), (5, 2 * 4 * 3 - 5), (100, 4 * 3)])
def test_kept_pairs_are_not_recomputed(monkeypatch, keep, expected_runs):
    """Unit runs per step: forward U x N, plus one recompute per pair not kept."""
    runs = []
    original = Unit.forward
    monkeypatch.setattr(Unit, "forward", lambda self, *a, **k: runs.append(self.index) or original(self, *a, **k))
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=3, keep_activations=keep)
    ids, labels = batch(3)
    model(input_ids=ids, labels=labels).loss.backward()
    assert len(runs) == expected_runs
    with torch.no_grad():  # nothing is kept without a backward to come
        runs.clear()
        model(input_ids=ids, labels=labels)
        assert len(runs) == 4 * 3


def test_the_last_units_are_kept_first():
    assert kept_pairs(3, 2, 3) == {(3, 0), (3, 1), (2, 0)}
    assert kept_pairs(3, 2, 0) == frozenset() and len(kept_pairs(3, 2, 99)) == 6
    # alternating order: unit 2's backward (the step's 8th loop of 10) runs sub-batch 1 first, so 1 is kept
    assert kept_pairs(3, 2, 3, alternate=True) == {(3, 0), (3, 1), (2, 1)}
    assert kept_pairs(3, 2, 4, alternate=True) == {(3, 0), (3, 1), (2, 1), (2, 0)}


@pytest.mark.parametrize("alternate", [True, False])
@pytest.mark.parametrize("keep", [1, 4, 7])
def test_a_unit_partly_kept_backpropagates_its_kept_pairs_first(monkeypatch, alternate, keep):
    """In every unit's backward, the kept pairs come before any recompute, in whatever order its loop runs: a kept
    graph is freed before a recompute of the same unit allocates one, so the peak is one graph, not two."""
    import fsdp_speedloader.engine.chain as chain

    events = []  # ("kept" | "recompute", unit, sub-batch) in backward, in order
    forward = Unit.forward
    monkeypatch.setattr(Unit, "forward", lambda self, *a, **k: (
        events.append(("recompute", self.index)) if torch.is_grad_enabled() else None) or forward(self, *a, **k))
    pop = dict.pop

    class Kept(dict):
        def pop(self, key, default=None):
            value = pop(self, key, default)
            if value is not None:
                events.append(("kept", key[0]))
            return value

    init = chain.TrainStepState.__init__

    def tracked(self, *a, **k):
        init(self, *a, **k)
        self.kept = Kept()

    monkeypatch.setattr(chain.TrainStepState, "__init__", tracked)
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=3, keep_activations=keep,
                              alternate_sub_batches=alternate)
    ids, labels = batch(3)
    loss = model(input_ids=ids, labels=labels).loss
    events.clear()  # the forward's runs of kept pairs ran with grad too
    loss.backward()
    kept_seen = [e for e in events if e[0] == "kept"]
    assert len(kept_seen) == keep
    for unit in range(1, 5):
        kinds = [kind for kind, u in events if u == unit]
        assert kinds == sorted(kinds), (unit, kinds)  # "kept" < "recompute": every kept pair first


def test_keep_activations_is_checked():
    with pytest.raises(ValueError, match="keep_activations"):
        apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), keep_activations=-1)


def test_the_pairs_held_are_reported_mid_step_and_held_only_weakly():
    """``kept_pairs_report``: what an out-of-memory error's message reads while it is handled (the failed step's
    frames keep its state alive); the engine itself holds the step's state weakly, so a caller that goes on
    after the error (the tuner's trials) gets the kept graphs' memory back."""
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=3, keep_activations=5)
    engine = speedloader_engine(model)
    ids, labels = batch(3)
    loss = model(input_ids=ids, labels=labels).loss
    assert engine.kept_pairs_report() == (5, 0)  # forward done, backward to come; no CUDA: no bytes measured
    loss.backward()
    assert engine.kept_pairs_report() == (0, 0)
    loss = model(input_ids=ids, labels=labels).loss
    del loss
    gc.collect()
    assert engine._step_state() is None and engine.kept_pairs_report() == (0, 0)
