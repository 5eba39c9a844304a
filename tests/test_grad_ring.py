"""In-flight gradient slots: with the overlapped optimizer stepping each unit during the backward, the arena holds R
regions of one unit's gradients instead of a slot per parameter (``fsdp2/grad_slots.py``, ``GradRing``), and the
training is bit for bit the one with a slot per parameter (world sizes 1 and 2, activations on the host or on the
device, the root offloaded or not, a worker slower than the backward, a gradient still referenced)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from dist_utils import run_distributed
from engine_cases import batch, cpu_mesh, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.fsdp2 import fast_path_stats, fsdp_params_of, grad_ring_layout, offloaded_fsdp_params
from fsdp_speedloader.memory.arena import ALIGNMENT
from fsdp_speedloader.memory.optimizer_overlap import OverlappedOptimizer


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _model(base, **options):
    return apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True,
                             **options)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, optimizer, steps: int, *, between=None) -> list:
    losses = []
    for step in range(steps):
        ids, labels = batch(2, seed=step)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if between is not None:
            between(step)
    optimizer.wait()
    return losses


def _state(model, optimizer) -> dict:
    """Every parameter and optimizer state tensor, full, by name."""
    out = {name: _full(p).clone() for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    for opt in optimizer:
        for p, state in opt.state.items():
            for key, value in state.items():
                out[f"{names[id(p)]}:{key}"] = _full(value).clone()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _unit_grad_bytes(model) -> int:
    engine = speedloader_engine(model)
    size, _ = grad_ring_layout([fsdp_params_of(m) for m, _ in engine.units], ALIGNMENT)
    return size


def test_the_arena_holds_regions_for_the_units_in_flight():
    model = _model(tiny_model("llama"))
    opt = OverlappedOptimizer(model, _adamw, grad_slots_in_flight=2)
    assert opt.uses_grad_ring
    before = fast_path_stats()
    try:
        _train(model, opt, 1)
        store = speedloader_engine(model).store
        slots = {s.name: s for s in store.arena.slots("grad_shards")}
        region = _unit_grad_bytes(model)
        assert [n for n in slots if n.startswith("grad_ring:")] == ["grad_ring:0", "grad_ring:1"]
        assert all(slots[f"grad_ring:{r}"].nbytes == region for r in range(2))
        units = {id(p) for m, _ in speedloader_engine(model).units for p in fsdp_params_of(m)}
        root = [p for p in offloaded_fsdp_params(model) if id(p) not in units]
        assert len(slots) == 2 + len(root)  # the root keeps a slot per parameter
        full = sum(p.numel() * 4 for p in model.parameters())
        root_bytes = sum(p.sharded_param.numel() * 4 for p in root)
        assert store.grad_shard_bytes == 2 * region + root_bytes < full
        after = fast_path_stats()
        assert after["num_grads_into_slots"] - before["num_grads_into_slots"] == len(list(model.parameters()))
        assert after["num_grad_slot_fallbacks"] == before["num_grad_slot_fallbacks"]
        # A unit's gradient is gone once its step ran (its region serves the next unit); the root's stays until
        # zero_grad, as with a plain optimizer.
        ids, labels = batch(2, seed=5)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        assert all(p.sharded_param.grad is None for m, _ in speedloader_engine(model).units for p in fsdp_params_of(m))
        assert all(p.sharded_param.grad is not None for p in root)
    finally:
        opt.close()
    # Closed: nothing releases regions any more, so the next training step plans a slot per parameter again.
    ids, labels = batch(2, seed=6)
    model(input_ids=ids, labels=labels).loss.backward()
    store = speedloader_engine(model).store
    assert store.grad_ring is None and not any(s.name.startswith("grad_ring") for s in store.arena.slots())
    assert store.grad_shard_bytes == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("device_units", [0, 1])
def test_regions_beyond_the_units_are_not_planned(device_units):
    """R larger than the number of units with host gradients would only pad the arena: each such unit then has a
    region of its own (units kept on the GPU have no host gradients)."""
    model = _model(tiny_model("llama", layers=3), device_units=device_units)
    units = len(speedloader_engine(model).units) - device_units
    opt = OverlappedOptimizer(model, _adamw, grad_slots_in_flight=units + 3)
    try:
        _train(model, opt, 1)
        store = speedloader_engine(model).store
        regions = [s.name for s in store.arena.slots("grad_shards") if s.name.startswith("grad_ring:")]
        assert store.grad_ring_regions == units == len(regions)
    finally:
        opt.close()


@pytest.mark.parametrize("regions", [1, 2])
@pytest.mark.parametrize("activation_store,offload_root,blocks_per_unit", [
    ("host", True, 1), ("host", False, 2), ("device", True, 1), ("device", False, 1)])
def test_in_flight_slots_train_bit_for_bit_like_a_slot_per_parameter(regions, activation_store, offload_root,
                                                                      blocks_per_unit):
    base = tiny_model("llama", layers=4)
    kw = dict(activation_store=activation_store, offload_root=offload_root, blocks_per_unit=blocks_per_unit)
    runs = []
    for in_flight in (0, regions):
        model = _model(base, **kw)
        opt = OverlappedOptimizer(model, _adamw, grad_slots_in_flight=in_flight)
        assert opt.uses_grad_ring == bool(in_flight)
        try:
            losses = _train(model, opt, 3)
            runs.append((losses, _state(model, opt)))
            store = speedloader_engine(model).store
            assert (store.grad_ring is not None) == bool(in_flight)
            assert store.arena.contains(offloaded_fsdp_params(model)[0].sharded_param.to_local())  # shards in the arena
        finally:
            opt.close()
    assert runs[0][0] == runs[1][0]
    _assert_same(runs[0][1], runs[1][1])


def test_a_worker_slower_than_the_backward_makes_the_backward_wait_not_race():
    """One region and a worker that sleeps before each unit step: every unit after the first waits for the region;
    an early copy would overwrite gradients the worker has yet to read, and the results would differ."""
    base = tiny_model("llama", layers=4)

    def slow_adamw(params):
        opt = _adamw(params)
        step = opt.step

        def delayed(*args, **kwargs):
            time.sleep(0.05)
            return step(*args, **kwargs)

        opt.step = delayed
        return opt

    states, ring_waits = [], []
    for in_flight, build in ((0, _adamw), (1, slow_adamw)):
        model = _model(base)
        opt = OverlappedOptimizer(model, build, grad_slots_in_flight=in_flight)
        before = fast_path_stats()["num_grad_ring_waits"]
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                _train(model, opt, 2)
            states.append(_state(model, opt))
            ring_waits.append(opt.step_stats()["grad_ring_wait_s"])  # both steps' waits
        finally:
            opt.close()
        named = [e for e in prof.events() if e.name == "speedloader::grad_ring_wait"]  # what a trace shows
        assert len(named) == (fast_path_stats()["num_grad_ring_waits"] - before), len(named)
    assert fast_path_stats()["num_grad_ring_waits"] - before >= 2 * 3  # units 3, 2, 1 waited, both steps
    assert ring_waits[0] == 0.0  # no ring, no wait
    assert ring_waits[1] >= 2 * 3 * 0.02, ring_waits  # each waited for most of a 0.05 s step of the unit before
    _assert_same(*states)


def test_a_gradient_still_referenced_is_never_overwritten(caplog):
    """Holding a unit's gradient keeps its region out of the ring: that unit's gradients go to FSDP2's own memory
    (counted, warned once), the held tensor keeps its values, and training is unchanged."""
    base = tiny_model("llama", layers=2)
    held, states = {}, []
    for in_flight in (0, 1):
        model = _model(base)
        opt = OverlappedOptimizer(model, _adamw, grad_slots_in_flight=in_flight)
        if in_flight:  # keep a view of unit 2's first gradient past its step (taken in the worker, before the drop)
            first = fsdp_params_of(speedloader_engine(model).units[1][0])[0].sharded_param
            release = opt._release_grads

            def keep_then_release(index, release=release, first=first):
                if index == 1 and "grad" not in held:
                    held["grad"], held["value"] = first.grad, first.grad.to_local().clone()
                release(index)

            opt._release_grads = keep_then_release
        before = fast_path_stats()["num_grad_slot_fallbacks"]
        try:
            _train(model, opt, 3)
            states.append(_state(model, opt))
        finally:
            opt.close()
    assert fast_path_stats()["num_grad_slot_fallbacks"] > before
    assert torch.equal(held["grad"].to_local(), held["value"])
    _assert_same(*states)


def _ring_at_world_size_2(rank: int, world_size: int) -> dict:
    base = tiny_model("llama", layers=4)
    states = []
    for in_flight in (0, 1):
        model = apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True)
        opt = OverlappedOptimizer(model, _adamw, grad_slots_in_flight=in_flight)
        try:
            _train(model, opt, 3)
            states.append(_state(model, opt))
        finally:
            opt.close()
    return {"same": all(torch.equal(states[0][k], states[1][k]) for k in states[0]) and states[0].keys() ==
            states[1].keys()}


def test_in_flight_slots_at_world_size_2():
    assert all(r["same"] for r in run_distributed(_ring_at_world_size_2, 2))
