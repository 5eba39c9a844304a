"""GPU tests of the pinned arena, the tensor exchange and the exchange activation store.

Run on the GPU machine:

    python -m pytest -q -m gpu tests/test_exchange_gpu.py

Delays: ``torch.cuda._sleep(cycles)`` queued on a copy stream (``copy_delay_cycles``) or on the
compute stream (``compute_delay_cycles``) makes one side lag by milliseconds, so every missing wait
turns into wrong numbers (and poisoned buffers into NaN) instead of passing by luck.
Tolerances: fp32 relative gradient error (Frobenius) < 1e-5 between the exchange store and the
synchronous store; bf16 < 1e-2 (the same arithmetic; only nondeterministic kernels differ).
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine_cases import assert_grads_close, batch, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.engine.activation_store import ExchangeActivationStore
from fsdp_speedloader.fsdp2 import grad_slots, offloaded_fsdp_params
from fsdp_speedloader.memory.arena import ArenaPlan, PinnedArena, _align
from fsdp_speedloader.memory.exchange import TensorExchange
from fsdp_speedloader.memory.optimizer_overlap import OverlappedOptimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAG = 50_000_000  # GPU clock cycles: ~25 ms, far longer than any copy below
ENGINE_LAG = 2_000_000  # per copy in the engine tests (~1 ms; a step queues ~100 copies)
SHAPE = (4, 256, 1024)  # 4 MiB in fp32


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _arena(num: int, shape=SHAPE, dtype=torch.float32) -> tuple[PinnedArena, list[torch.Tensor]]:
    plan = ArenaPlan()
    for k in range(num):
        plan.add(f"h{k}", "activations", shape, dtype)
    arena = PinnedArena(plan)
    return arena, [arena.slot(f"h{k}") for k in range(num)]


# --- the arena ------------------------------------------------------------------------------------


def test_arena_is_page_locked_exactly_and_outside_the_caching_allocator():
    before = torch.cuda.host_memory_stats()
    arena, (h0, h1) = _arena(2, shape=(3 << 20,), dtype=torch.bfloat16)  # 6 MiB slots: 8 MiB each if rounded
    assert arena.pinned and h0.is_pinned() and h1.is_pinned()
    stats = arena.stats()
    assert stats["arena_page_locked_bytes"] == stats["arena_requested_bytes"] == 2 * 6 * 2**20
    after = torch.cuda.host_memory_stats()
    assert after.get("allocated_bytes.current", 0) == before.get("allocated_bytes.current", 0)
    assert after.get("num_host_alloc", 0) == before.get("num_host_alloc", 0)
    src = torch.randn(3 << 20, device=_device()).to(torch.bfloat16)
    h0.copy_(src, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(h0, src.cpu())


# --- the exchange, operation by operation, with one side lagging ----------------------------------


def test_fetch_waits_for_the_pending_store_into_its_slot():  # read after write (host slot)
    ex = TensorExchange(_device())
    _, (h,) = _arena(1)
    h.zero_()
    x = torch.randn(SHAPE, device=_device())
    ex.copy_delay_cycles = LAG
    ex.store(x, h)
    got = ex.wait(ex.fetch(h))
    assert torch.equal(got, x)  # reading `got` on the compute stream orders after the fetch


def test_store_waits_for_the_pending_fetch_out_of_its_slot():  # write after read (host slot)
    ex = TensorExchange(_device())
    _, (h,) = _arena(1)
    old = torch.randn(SHAPE)
    h.copy_(old)
    ex.copy_delay_cycles = LAG
    handle = ex.fetch(h)  # delayed on the H2D stream
    ex.copy_delay_cycles = 0
    new = torch.randn(SHAPE, device=_device())
    ex.store(new, h)  # must not overwrite h before the fetch has read it
    got = ex.wait(handle)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), old)
    assert torch.equal(h, new.cpu())


def test_store_waits_for_compute_and_keeps_the_source_block():
    ex = TensorExchange(_device())
    _, (h,) = _arena(1)
    x = torch.randn(SHAPE, device=_device())
    torch.cuda._sleep(LAG)  # compute lags: y is not ready for a long time
    y = x * 2
    ex.store(y, h)
    del y  # record_stream: the allocator must not hand y's block to the next allocation yet
    junk = torch.full(SHAPE, float("nan"), device=_device())  # same size: would reuse y's block
    torch.cuda.synchronize()
    assert torch.equal(h, (x * 2).cpu())
    del junk


def test_ring_reuses_a_buffer_only_after_compute_is_done_with_it():  # write after read (ring buffer)
    ex = TensorExchange(_device())
    _, (ha, hb, hc) = _arena(3)
    a, b = torch.randn(SHAPE), torch.randn(SHAPE)
    ha.copy_(a)
    hb.copy_(b)
    t = ex.wait(ex.fetch(ha))
    ptr = t.untyped_storage().data_ptr()
    torch.cuda._sleep(LAG)  # compute lags...
    read = t * 1  # ...so this read of the buffer runs long after the lines below are issued
    del t
    ex.store(torch.zeros(SHAPE, device=_device()), hc)  # an exchange call: the ring sees the buffer free
    tb = ex.wait(ex.fetch(hb))  # reuses the buffer: the copy must wait for `read`
    assert tb.untyped_storage().data_ptr() == ptr
    torch.cuda.synchronize()
    assert torch.equal(read.cpu(), a) and torch.equal(tb.cpu(), b)


def test_ring_reuses_a_buffer_only_after_a_store_has_read_it():
    ex = TensorExchange(_device())
    _, (ha, hb, hc) = _arena(3)
    a, b = torch.randn(SHAPE), torch.randn(SHAPE)
    ha.copy_(a)
    hb.copy_(b)
    t = ex.wait(ex.fetch(ha))
    ptr = t.untyped_storage().data_ptr()
    ex.copy_delay_cycles = LAG
    ex.store(t, hc)  # a fetched tensor stored elsewhere (the D2H reads the ring buffer, late)
    ex.copy_delay_cycles = 0
    del t
    ex.wait(ex.fetch(hc))  # an exchange call: the ring sees the buffer free (this fetch gets a new one)
    tb = ex.wait(ex.fetch(hb))  # reuses the buffer: the copy must wait for the D2H's read
    assert tb.untyped_storage().data_ptr() == ptr
    torch.cuda.synchronize()
    assert torch.equal(hc, a) and torch.equal(tb.cpu(), b)


def test_ring_never_hands_out_a_held_buffer_and_stays_small():
    ex = TensorExchange(_device())
    _, hosts = _arena(4)
    held = [ex.wait(ex.fetch(h)) for h in hosts]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 4
    del held
    ex.store(torch.zeros(SHAPE, device=_device()), hosts[0])  # the ring sees the four free
    for _ in range(10):  # fetch, use, drop: the buffer freed longest ago is reused every time
        t = ex.wait(ex.fetch(hosts[1]))
        del t
    assert ex.step_stats()["exchange_ring_buffers"] == 4  # no growth beyond the peak of 4 held


def test_recarving_the_slots_orders_copies_across_geometries():
    store = ExchangeActivationStore()
    n, s, h = SHAPE
    store.begin_step(3, 2, (n, s, h), torch.float32, _device())
    arena = store.arena
    x = torch.randn(SHAPE, device=_device())
    store.exchange.copy_delay_cycles = LAG
    store.put(0, 1, x)  # late on the D2H stream
    store.exchange.copy_delay_cycles = 0
    store.end_step()
    store.begin_step(3, 4, (n // 2, s, h), torch.float32, _device())  # smaller: the same bytes, re-carved
    assert store.arena is arena
    # Old slot (0, 1) covers new slots (0, 2) and (0, 3): the fetch must wait for the old store.
    got = torch.cat([store.get(0, 2), store.get(0, 3)])
    assert torch.equal(got, x)


def test_wait_time_is_measured_at_the_step_boundary():
    ex = TensorExchange(_device())
    _, (h,) = _arena(1)
    ex.copy_delay_cycles = LAG
    ex.wait(ex.fetch(h))
    ex.end_step()
    stats = ex.step_stats()
    assert stats["exchange_num_fetches"] == 1 and stats["exchange_h2d_bytes"] == h.numel() * 4
    assert stats["exchange_wait_s"] > 1e-3  # the compute stream sat behind a ~25 ms copy


# --- the engine: parity, lagging streams, no page-locked growth -----------------------------------


def _grads(model) -> dict:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def _step(model, ids, labels) -> float:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("param_dtype,rtol", [(None, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_parity_with_the_synchronous_store(param_dtype, rtol, offload, blocks_per_unit):
    n_sub = 3
    base = tiny_model("llama")
    ids, labels = batch(n_sub)
    models = {store: apply_speedloader(copy.deepcopy(base), num_sub_batches=n_sub, blocks_per_unit=blocks_per_unit,
                                       activation_store=store, offload_params=offload, param_dtype=param_dtype)
              for store in ("host", "host_sync")}
    losses = {store: _step(m, ids, labels) for store, m in models.items()}
    assert abs(losses["host"] - losses["host_sync"]) <= rtol * abs(losses["host_sync"])
    assert_grads_close(models["host"], _grads(models["host_sync"]), rtol=rtol)
    assert isinstance(speedloader_engine(models["host"]).store, ExchangeActivationStore)


@pytest.mark.parametrize("lag", ["copy", "compute"])
@pytest.mark.parametrize("offload", [False, True])
def test_engine_is_correct_when_one_side_lags(lag, offload):
    n_sub = 4
    model = apply_speedloader(tiny_model("llama"), num_sub_batches=n_sub, blocks_per_unit=1,
                              activation_store="host", offload_params=offload)
    ids, labels = batch(n_sub)
    loss1 = _step(model, ids, labels)
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    store = speedloader_engine(model).store
    torch.cuda.synchronize()
    store._host.fill_(float("nan"))  # anything read before it was written shows up as NaN
    for buf in store.exchange._ring.all():
        buf.tensor.fill_(float("nan"))
    setattr(store.exchange, f"{lag}_delay_cycles", ENGINE_LAG)
    loss2 = _step(model, ids, labels)
    setattr(store.exchange, f"{lag}_delay_cycles", 0)
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    assert_grads_close(model, want, rtol=1e-5)


@pytest.mark.parametrize("offload", [False, True])
def test_no_page_locked_growth_after_the_first_step(offload):
    n_sub = 4
    model = apply_speedloader(tiny_model("llama"), num_sub_batches=n_sub, activation_store="host",
                              offload_params=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = batch(n_sub)

    def train_step():
        _step(model, ids, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    train_step()
    first = torch.cuda.host_memory_stats()
    ring = speedloader_engine(model).store.step_stats()["exchange_ring_buffers"]
    for _ in range(3):
        train_step()
    later = torch.cuda.host_memory_stats()
    for key in ("num_host_alloc", "allocated_bytes.current", "allocations.current"):
        assert later.get(key, 0) == first.get(key, 0), key
    store = speedloader_engine(model).store
    stats = store.step_stats()
    assert stats["exchange_ring_buffers"] == ring <= 5
    assert stats["arena_page_locked_bytes"] == stats["arena_bytes"]
    if offload:
        # The shards and their gradients are in the arena (page-locked, exact, < 512 B padding each).
        fsdp_params = offloaded_fsdp_params(model)
        assert all(p._sharded_param_data.is_pinned() for p in fsdp_params)
        assert stats["arena_param_shards_page_locked_bytes"] == sum(
            _align(p._sharded_param_data.numel() * 4) for p in fsdp_params)
        assert stats["arena_grad_shards_page_locked_bytes"] == sum(
            _align(p.sharded_param.numel() * 4) for p in fsdp_params)


def test_exchange_traffic_per_step():
    n_sub, layers = 3, 4
    model = apply_speedloader(tiny_model("llama", layers=layers), num_sub_batches=n_sub, activation_store="host")
    ids, labels = batch(n_sub)
    _step(model, ids, labels)
    stats = speedloader_engine(model).store.step_stats()
    a = 2 * 16 * 64 * 4  # n x s x h fp32 bytes
    # Per unit 5 N A (forward: fetch + store; backward: 2 fetches + store), plus the embedding
    # (store; backward fetch) and the head (forward fetch; backward fetch + store); less one fetch per loop that
    # starts with the sub-batch the loop before put last (each unit's forward and backward, the head's forward, the
    # embedding's backward: the chain alternates the order and the store still holds that output on the device).
    saved = 2 * layers + 2
    assert stats["exchange_fetches_saved"] == saved
    assert stats["exchange_h2d_bytes"] == ((3 * layers + 3) * n_sub - saved) * a
    assert stats["exchange_d2h_bytes"] == (2 * layers + 2) * n_sub * a
    assert stats["exchange_wait_s"] >= 0.0
    _step(model, ids, labels)
    assert speedloader_engine(model).store.step_stats()["exchange_unpipelined_fetches"] == 0


# --- FSDP2's offloaded gradients in the arena ------------------------------------------------------

# Caching host allocator statistics (torch 2.11 and 2.13): ".allocated" is the historical total
# increase, so a delta counts the page-locked blocks handed out (new or reused from its cache).
HANDOUTS = ("active_requests.allocated", "active_bytes.allocated", "num_host_alloc", "allocated_bytes.current")


def _host_stats() -> dict:
    stats = torch.cuda.host_memory_stats()
    missing = [k for k in HANDOUTS if k not in stats]
    assert not missing, f"torch.cuda.host_memory_stats() has no {missing}: {sorted(stats)}"
    return {k: stats[k] for k in HANDOUTS}


def _grads_in_arena(store, fsdp_params) -> int:
    """How many of ``fsdp_params`` have a gradient in ``store``'s arena (page-locked)."""
    return sum(p.sharded_param.grad is not None and store.arena.contains(p.sharded_param.grad._local_tensor)
               and p.sharded_param.grad._local_tensor.is_pinned() for p in fsdp_params)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_offloaded_gradients_land_in_the_arena_without_page_locked_blocks(set_to_none, blocks_per_unit):
    """Against FSDP2's own offload (activation_store='host_sync': FSDP2 pins shards and gradients itself)."""
    n_sub = 3
    base = tiny_model("llama")
    models = {store: apply_speedloader(copy.deepcopy(base), num_sub_batches=n_sub, blocks_per_unit=blocks_per_unit,
                                       activation_store=store, offload_params=True) for store in ("host", "host_sync")}
    # SGD: the weights follow the gradients linearly, so kernel-level noise stays at noise level
    # (Adam's g / sqrt(v) can turn it into a full step where a gradient is ~0).
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    fsdp_params = offloaded_fsdp_params(models["host"])
    store = speedloader_engine(models["host"]).store
    handed_out = {k: [] for k in models}
    for step in range(4):
        ids, labels = batch(n_sub, seed=step)
        for key, model in models.items():
            torch.cuda.synchronize()
            before = _host_stats()
            _step(model, ids, labels)  # FSDP2 waits for its gradient copies at the end of backward
            after = _host_stats()
            handed_out[key].append({k: after[k] - before[k] for k in HANDOUTS})
        # fp32, the same arithmetic; only the gradient's host memory differs.
        assert_grads_close(models["host"], _grads(models["host_sync"]), rtol=1e-5)
        # set_to_none=False: FSDP2 adds to the gradient already in the slot. (No local variable may keep
        # a gradient past zero_grad: its slot would then be left alone in the next step.)
        assert _grads_in_arena(store, fsdp_params) == len(fsdp_params)
        for key in models:
            optims[key].step()
            optims[key].zero_grad(set_to_none=set_to_none)
    for step, delta in enumerate(handed_out["host"][1:], start=1):
        # No page-locked memory is added after step 1. (A few small requests per step -- 5 of 8.7 KB in all
        # on the H200 -- are served from blocks cached in step 1; they are not gradients: see below.)
        assert delta["num_host_alloc"] == 0 and delta["allocated_bytes.current"] == 0, (step, delta)
        assert delta["active_requests.allocated"] < len(fsdp_params), (step, delta)
    if set_to_none:  # FSDP2's own path takes a (power-of-two) block per gradient and step: the check can fail
        for own, ours in zip(handed_out["host_sync"], handed_out["host"]):
            assert own["active_requests.allocated"] - ours["active_requests.allocated"] >= len(fsdp_params)
    stats = store.step_stats()
    assert stats["arena_grad_shards_requested_bytes"] == sum(p.numel() * 4 for p in base.parameters())
    assert stats["arena_grad_shards_page_locked_bytes"] == sum(_align(p.numel() * 4) for p in base.parameters())
    for (name, a), (_, b) in zip(models["host"].named_parameters(), models["host_sync"].named_parameters()):
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=1e-5, atol=1e-6, msg=name)


def test_overlapped_optimizer_reads_each_gradient_only_after_its_copy(monkeypatch):
    """The copy into the slot lags on FSDP2's post-reduce stream: a CPU step that did not wait on
    ``grad_offload_event`` would read the slot's old content (zeros, then the previous step's gradient)."""
    n_sub = 3
    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), num_sub_batches=n_sub, activation_store="host",
                                offload_params=True) for _ in range(2)]

    def sgd(params):  # linear in the gradient (see above); a stale read moves a weight by lr x its gradient
        return torch.optim.SGD(params, lr=0.5)

    plain = sgd(models[0].parameters())
    overlapped = OverlappedOptimizer(models[1], sgd)
    try:
        for step in range(3):
            ids, labels = batch(n_sub, seed=step)
            _step(models[0], ids, labels)
            plain.step()
            plain.zero_grad()
            monkeypatch.setattr(grad_slots, "grad_copy_delay_cycles", ENGINE_LAG)
            _step(models[1], ids, labels)  # units U .. 2 are stepped on the CPU while backward runs
            monkeypatch.setattr(grad_slots, "grad_copy_delay_cycles", 0)
            overlapped.step()
            overlapped.zero_grad()
    finally:
        overlapped.close()
    store = speedloader_engine(models[1]).store
    assert all(store.arena.contains(p.sharded_param._local_tensor) for p in offloaded_fsdp_params(models[1]))
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(b.to_local(), a.to_local(), rtol=1e-5, atol=1e-6, msg=name)
