"""Pinned arena, tensor exchange and the exchange activation store on CPU (world size 1).

The CUDA paths (registration, streams, events) are in test_exchange_gpu.py; here registration is
checked against a fake ``cudart`` that records its calls. Engine tolerances: fp32, relative
gradient error < 1e-5 against the unmodified model; the exchange store against the synchronous
host store: identical bits (the same arithmetic, only the copies differ).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from dist_utils import run_distributed
from engine_cases import assert_grads_close, batch, reference_grads, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.memory import arena as arena_mod
from fsdp_speedloader import fsdp2
from fsdp_speedloader.fsdp2 import counters
from fsdp_speedloader.engine.activation_store import ExchangeActivationStore, HostActivationStore, build_activation_store
from fsdp_speedloader.memory.arena import ALIGNMENT, ArenaPlan, HostMemoryBudget, PinnedArena, check_plan
from fsdp_speedloader.app.config import ModelConfig
from fsdp_speedloader.memory.exchange import TensorExchange
from fsdp_speedloader.fsdp2 import grad_slot_of, offloaded_fsdp_params, plan_fsdp_grads, plan_fsdp_shards
from fsdp_speedloader.models import build_model

MIB = 1 << 20


# --- arena: layout, accounting, registration, budget ---------------------------------------------


def test_slot_layout_is_aligned_typed_and_disjoint():
    plan = (ArenaPlan().add("a", "activations", (3, 5), torch.float32)       # 60 B
            .add("b", "staging", (7,), torch.bfloat16)                       # 14 B
            .add("c", "activations", (2, 2, 128), torch.float16))            # 1024 B
    arena = PinnedArena(plan, pin=False)
    offsets = plan.offsets()
    assert offsets == {"a": 0, "b": ALIGNMENT, "c": 2 * ALIGNMENT}
    assert arena.nbytes == plan.nbytes == 2 * ALIGNMENT + 1024
    views = {name: arena.slot(name) for name in "abc"}
    assert views["a"].shape == (3, 5) and views["a"].dtype == torch.float32
    assert views["b"].shape == (7,) and views["b"].dtype == torch.bfloat16
    assert views["c"].shape == (2, 2, 128) and views["c"].dtype == torch.float16
    base = arena.slot("a").data_ptr()
    assert base % 4096 == 0  # the region is page-aligned, every slot 512-aligned
    for name, view in views.items():
        assert view.is_contiguous()
        assert view.data_ptr() - base == offsets[name]
        assert (view.data_ptr() - base) % ALIGNMENT == 0
    for name, view in views.items():  # writing one slot leaves the others alone
        view.fill_(1)
        assert all(bool((other == 0).all()) for n, other in views.items() if n != name)
        view.zero_()
    # Re-carving: another shape or dtype that fits in the slot's bytes; not one that does not.
    assert arena.slot("c", (512,), torch.float16).data_ptr() == views["c"].data_ptr()
    with pytest.raises(ValueError, match="holds 1024 bytes"):
        arena.slot("c", (513,), torch.float16)
    with pytest.raises(ValueError, match="planned twice"):
        plan.add("a", "staging", (1,), torch.float32)


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records register/unregister calls."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.registered: dict[int, tuple[int, int]] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        if self.rc == 0:
            self.registered[ptr] = (nbytes, flags)
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_page_locked_bytes_equal_requested_bytes_and_registration_follows_the_memory(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    h = 4096
    # Slots whose sizes are multiples of the alignment: nothing is rounded at all.
    plan = (ArenaPlan().add("activations", "activations", (5, 3, 2, 16, h), torch.bfloat16)
            .add("shard0", "param_shards", (1000, 128), torch.float32)
            .add("shard1", "param_shards", (384,), torch.float32))
    requested = 5 * 3 * 2 * 16 * h * 2 + 1000 * 128 * 4 + 384 * 4
    arena = PinnedArena(plan, pin=True)
    stats = arena.stats()
    assert stats["arena_requested_bytes"] == requested
    assert stats["arena_page_locked_bytes"] == requested == arena.nbytes
    activations = 5 * 3 * 2 * 16 * h * 2
    assert stats["arena_activations_page_locked_bytes"] == stats["arena_activations_requested_bytes"] == activations
    assert stats["arena_param_shards_page_locked_bytes"] == 1000 * 128 * 4 + 384 * 4
    # One registration of exactly the arena's bytes (4.24 MiB; one power-of-two block would lock 8 MiB).
    base = arena.slot("activations").data_ptr()
    assert fake.registered == {base: (requested, 0)}
    # close() drops the arena's reference; the region stays registered while a view lives (FSDP
    # may hold parameter shards in it), and is unregistered when the last view dies.
    shard = arena.slot("shard1")
    arena.close()
    del arena
    gc.collect()
    assert fake.unregistered == []
    shard.fill_(1.0)  # still valid memory
    del shard
    gc.collect()
    assert fake.unregistered == [base]


def test_unaligned_slots_pad_to_512_bytes_only():
    plan = ArenaPlan().add("x", "activations", (3,), torch.float32).add("y", "staging", (1,), torch.uint8)
    assert plan.requested_bytes == 13
    assert plan.nbytes == 2 * ALIGNMENT  # < 512 bytes of padding per slot, never a power-of-two rounding
    big = ArenaPlan().add("x", "activations", (3 * MIB + 1,), torch.uint8)
    assert big.nbytes == 3 * MIB + ALIGNMENT


def test_failed_registration_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(rc=2))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 512 bytes failed with cudaError 2"):
        PinnedArena(ArenaPlan().add("x", "staging", (128,), torch.float32), pin=True)


def test_over_large_plan_fails_before_allocating(monkeypatch):
    allocations = []
    monkeypatch.setattr(arena_mod, "_Region", lambda *a, **k: allocations.append(a))
    plan = ArenaPlan().add("activations", "activations", (5, 8, 4, 4096, 4096), torch.bfloat16)  # 5 GiB
    budget = HostMemoryBudget(limit_bytes=4 << 30, used_bytes=1 << 30, margin=0.1)
    with pytest.raises(ValueError) as err:
        PinnedArena(plan, budget=budget, hint="lower schedule.num_sub_batches (N=8)")
    message = str(err.value)
    assert "needs 5.00 GiB" in message and f"({5 << 30} bytes" in message
    assert "2.60 GiB available: limit 4.00 GiB" in message  # 4 * 0.9 - 1
    assert "lower schedule.num_sub_batches (N=8)" in message
    assert allocations == []


def test_bytes_moved_in_from_host_memory_count_once():
    plan = (ArenaPlan().add("activations", "activations", (1 << 20,), torch.uint8)
            .add("shard", "param_shards", (2 << 20,), torch.uint8))
    budget = HostMemoryBudget(limit_bytes=10 << 20, used_bytes=8 << 20, margin=0.0)  # 2 MiB available
    check_plan(plan, budget, hint="-", resident_bytes=2 << 20)  # the shard is already in `used`
    with pytest.raises(ValueError, match=f"needs 0.00 GiB \\({3 << 20} bytes; .* but .*\\({2 << 20} bytes\\)"):
        check_plan(plan, budget, hint="-")


def test_budget_detection(monkeypatch):
    monkeypatch.delenv(arena_mod.LIMIT_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    explicit = HostMemoryBudget.detect(64 << 30, margin=0.2)
    assert (explicit.limit_bytes, explicit.margin, explicit.source) == (64 << 30, 0.2, "host_memory_limit_bytes")
    monkeypatch.setenv(arena_mod.LIMIT_ENV, "100")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    env = HostMemoryBudget.detect()
    assert (env.limit_bytes, env.source, env.processes) == (100 << 30, arena_mod.LIMIT_ENV, 4)
    assert env.available_bytes == (int((100 << 30) * 0.9) - env.used_bytes) // 4
    monkeypatch.delenv(arena_mod.LIMIT_ENV)
    monkeypatch.setattr(arena_mod, "_cgroup_limit_and_usage", lambda: (32 << 30, 2 << 30, "cgroup memory.max"))
    cgroup = HostMemoryBudget.detect()
    assert (cgroup.limit_bytes, cgroup.used_bytes, cgroup.source) == (32 << 30, 2 << 30, "cgroup memory.max")
    monkeypatch.setattr(arena_mod, "_cgroup_limit_and_usage", lambda: None)
    assert HostMemoryBudget.detect().source == "/proc/meminfo MemTotal"
    with pytest.raises(ValueError, match="margin"):
        HostMemoryBudget.detect(margin=1.0)


# --- exchange (CPU: synchronous copies, the same ring) -----------------------------------------


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_ring_never_hands_out_a_buffer_still_in_use():
    ex = TensorExchange(torch.device("cpu"))
    hosts = [torch.full((2, 3), float(k)) for k in range(4)]
    a = ex.wait(ex.fetch(hosts[0]))
    b = ex.wait(ex.fetch(hosts[1]))
    assert _ptr(a) != _ptr(b)
    ptr_a = _ptr(a)
    # A derived alias (as the engine's .detach().requires_grad_()) and an autograd graph keep it in use.
    leaf = a.detach().requires_grad_(True)
    y = (leaf * leaf).sum()  # mul saves `leaf` for backward
    del a
    c = ex.wait(ex.fetch(hosts[2]))
    assert _ptr(c) not in (ptr_a, _ptr(b))
    assert torch.equal(leaf.detach(), hosts[0]) and torch.equal(b, hosts[1]) and torch.equal(c, hosts[2])
    y.backward()
    del y, leaf
    ex.store(torch.zeros(2, 3), hosts[3])  # any exchange call sees a's buffer free
    d = ex.wait(ex.fetch(hosts[3]))  # ...so it is reused, not a new allocation
    assert _ptr(d) == ptr_a and torch.equal(d, torch.zeros(2, 3))
    # A handle that was never waited for also holds its buffer.
    pending = ex.fetch(hosts[0])
    e = ex.wait(ex.fetch(hosts[1]))
    live = [b, c, d, pending.tensor, e]
    assert len({_ptr(t) for t in live}) == len(live)
    assert ex.step_stats()["exchange_ring_buffers"] == len(live)  # grown only for tensors held at once


def test_ring_prefers_the_buffer_freed_longest_ago():
    ex = TensorExchange(torch.device("cpu"), max_ring_size=3)
    host = torch.ones(4)
    a = ex.wait(ex.fetch(host))
    b = ex.wait(ex.fetch(host))
    ptr_a, ptr_b = _ptr(a), _ptr(b)
    del a
    ex.store(torch.zeros(4), torch.empty(4))  # the ring sees a free here
    del b
    h1 = ex.fetch(host)  # sees b free now: a copy into b would wait on everything just queued; a is older
    assert _ptr(h1.tensor) == ptr_a
    h2 = ex.fetch(host)  # b was seen free by the previous call: fine
    assert _ptr(h2.tensor) == ptr_b
    del h2
    h3 = ex.fetch(host)  # only b is free, and only since this call: below max_ring_size the ring grows
    ptr_c = _ptr(h3.tensor)
    assert ptr_c not in (ptr_a, ptr_b) and ex.step_stats()["exchange_ring_buffers"] == 3
    h4 = ex.fetch(host)
    assert _ptr(h4.tensor) == ptr_b
    del h4
    h5 = ex.fetch(host)  # at max_ring_size a buffer freed only now is taken
    assert _ptr(h5.tensor) == ptr_b and ex.step_stats()["exchange_ring_buffers"] == 3
    assert all(torch.equal(h.tensor, host) for h in (h1, h3, h5))


def _store(num_slots=3, num_sub_batches=2, shape=(2, 4, 8), limit=None):
    store = ExchangeActivationStore(host_memory_limit_bytes=limit)
    store.begin_step(num_slots, num_sub_batches, shape, torch.float32, torch.device("cpu"))
    return store


def test_store_get_then_put_same_slot_and_stale_prefetch():
    store = _store()
    x, other = torch.randn(2, 4, 8), torch.zeros(2, 4, 8)
    store.put(2, 1, x)
    store.put(0, 0, other)  # the store now holds slot 0's tensor: the next get of slot 2 copies back from the host
    got = store.get(2, 1)
    store.put(2, 1, torch.zeros(2, 4, 8))  # backward overwrites the slot it just read (grad_slot)
    store.put(0, 0, other)
    assert torch.equal(got, x)  # the fetched tensor is not the host slot
    store.prefetch(2, 1)  # fetches the zeros...
    store.put(2, 1, x + 1)  # ...which are stale now
    store.put(0, 0, other)
    assert torch.equal(store.get(2, 1), x + 1)
    store.end_step()
    stats = store.step_stats()
    assert stats["exchange_num_stores"] == 6 and stats["exchange_num_fetches"] == 3
    assert stats["exchange_fetches_saved"] == 0
    assert stats["exchange_d2h_bytes"] == 6 * x.numel() * 4 and stats["exchange_h2d_bytes"] == 3 * x.numel() * 4
    assert stats["arena_activations_requested_bytes"] == 3 * 2 * x.numel() * 4 == store.host_bytes


def test_the_store_answers_a_get_of_its_last_put_from_the_device():
    """The chain's next loop starts with the sub-batch the loop before put last: the store hands that tensor back
    (no copy, counted), prefetches nothing for it, and copies from the host once another put came in between."""
    store = _store()
    x, y = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    store.put(2, 1, x)
    store.prefetch(2, 1)
    assert store.get(2, 1) is x
    store.put(2, 0, y)
    again = store.get(2, 1)
    assert again is not x and torch.equal(again, x)  # from the host slot: the store copied x there
    store.end_step()  # drops what it held
    assert store.get(2, 0) is not y
    stats = store.step_stats()
    assert stats["exchange_fetches_saved"] == 1 and stats["exchange_num_fetches"] == 1


def test_geometry_change_recarves_or_replans():
    store = _store(shape=(2, 4, 8))
    arena = store.arena
    store.begin_step(3, 2, (1, 4, 8), torch.float32, torch.device("cpu"))  # smaller: same region
    assert store.arena is arena and store.host_bytes == 3 * 2 * 32 * 4
    store.put(1, 1, torch.ones(1, 4, 8))
    assert torch.equal(store.get(1, 1), torch.ones(1, 4, 8))
    store.begin_step(3, 4, (2, 4, 8), torch.float32, torch.device("cpu"))  # larger: a new arena
    assert store.arena is not arena and store.host_bytes == 3 * 4 * 64 * 4


def test_activation_store_choices():
    assert isinstance(build_activation_store("host", offload_params=False), ExchangeActivationStore)
    assert isinstance(build_activation_store("auto", offload_params=True), ExchangeActivationStore)
    assert isinstance(build_activation_store("host_sync", offload_params=True), HostActivationStore)
    with pytest.raises(ValueError, match="'host_sync'"):
        build_activation_store("pinned", offload_params=False)


# --- the engine with the exchange store ----------------------------------------------------------


class RecordingStore(ExchangeActivationStore):
    """Logs every (operation, slot, sub-batch) and the host address each one touched."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, int, int]] = []

    def get(self, slot, i):
        self.log.append(("get", slot, i, self._host[slot, i].data_ptr()))
        return super().get(slot, i)

    def put(self, slot, i, x):
        self.log.append(("put", slot, i, self._host[slot, i].data_ptr()))
        super().put(slot, i, x)


@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_gradients_reuse_activation_slots(blocks_per_unit):
    n_sub, layers = 3, 4
    model = tiny_model("llama", layers=layers)
    ids, labels = batch(n_sub)
    _, ref_grads = reference_grads(model, [(ids, labels)])
    apply_speedloader(model, num_sub_batches=n_sub, blocks_per_unit=blocks_per_unit, activation_store="host")
    store = RecordingStore()
    speedloader_engine(model).store = store
    loss = model(input_ids=ids, labels=labels).loss
    forward_log, host_bytes = list(store.log), store.host_bytes
    loss.backward()
    assert_grads_close(model, ref_grads)
    units = layers // blocks_per_unit
    backward_log = store.log[len(forward_log):]
    # Host memory: exactly (U + 1) x N activation slots, before and after backward, and backward
    # touches no host address that forward did not.
    assert host_bytes == store.host_bytes == (units + 1) * n_sub * 2 * 16 * 64 * 4
    addresses = {addr for *_, addr in forward_log}
    assert len(addresses) == (units + 1) * n_sub
    assert {addr for *_, addr in backward_log} <= addresses

    # Replay the log on the host addresses: what each put writes (the engine's order: forward x_0..x_U,
    # backward dL/dx_U, dL/dx_{U-1}, ..., dL/dx_0, N sub-batches each), and check that every get finds
    # what its reader needs -- so no gradient overwrote an activation or gradient still to be read.
    put_labels = [f"x{k}" for k in range(units + 1)] + [f"g{k}" for k in range(units, -1, -1)]
    content, puts, gets = {}, 0, []
    for op, slot, i, addr in store.log:
        if op == "put":
            content[addr] = put_labels[puts // n_sub]
            puts += 1
        else:
            gets.append(content[addr])
    expected = [f"x{k}" for k in range(units + 1) for _ in range(n_sub)]  # forward: unit l reads x_{l-1}, head x_U
    expected += [f"x{units}"] * n_sub  # head backward
    for unit in range(units, 0, -1):
        expected += [f"x{unit - 1}", f"g{unit}"] * n_sub  # unit backward, alternating per sub-batch
    expected += ["g0"] * n_sub  # embedding backward
    assert gets == expected


@pytest.mark.parametrize("family,num_sub_batches,blocks_per_unit,offload", [
    ("llama", 1, 1, False), ("llama", 3, 2, True), ("opt", 2, 1, True), ("opt", 8, 2, False)])
def test_gradient_parity_with_exchange_store(family, num_sub_batches, blocks_per_unit, offload):
    model = tiny_model(family)
    ids, labels = batch(num_sub_batches)
    scale = 2.5
    ref_loss, ref_grads = reference_grads(model, [(ids, labels)], scale=scale)
    apply_speedloader(model, num_sub_batches=num_sub_batches, blocks_per_unit=blocks_per_unit,
                      activation_store="host", offload_params=offload)
    assert isinstance(speedloader_engine(model).store, ExchangeActivationStore)
    loss = model(input_ids=ids, labels=labels).loss
    (scale * loss).backward()
    torch.testing.assert_close(loss.detach(), ref_loss[0], rtol=1e-6, atol=0)
    assert_grads_close(model, ref_grads)


def test_offloaded_shards_live_in_the_arena_and_train_like_the_sync_store():
    n_sub = 2
    base = tiny_model("llama")
    models = {}
    for store in ("host", "host_sync"):
        models[store] = apply_speedloader(copy.deepcopy(base), num_sub_batches=n_sub, activation_store=store,
                                          offload_params=True)
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    losses = {k: [] for k in models}
    for step in range(3):
        ids, labels = batch(n_sub, seed=step)
        for key, model in models.items():
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optims[key].step()
            optims[key].zero_grad()
            losses[key].append(loss.item())
    assert losses["host"] == losses["host_sync"]
    for (name, a), (_, b) in zip(models["host"].named_parameters(), models["host_sync"].named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name

    store = speedloader_engine(models["host"]).store
    fsdp_params = offloaded_fsdp_params(models["host"])
    assert len(fsdp_params) == len(list(base.parameters()))
    lo = store.arena.slot("activations").data_ptr() - store.arena._offsets["activations"]
    hi = lo + store.arena.nbytes

    def in_arena():
        return all(lo <= p._sharded_param_data.data_ptr() < hi
                   and p.sharded_param._local_tensor.data_ptr() == p._sharded_param_data.data_ptr()
                   for p in fsdp_params)

    assert in_arena()
    stats = store.step_stats()
    assert stats["arena_param_shards_requested_bytes"] == store.param_shard_bytes == sum(
        p.numel() * 4 for p in base.parameters())  # world size 1: no padding
    # FSDP2's own re-pointing (load_state_dict's post hook runs reset_sharded_param) keeps them there.
    models["host"].load_state_dict(models["host"].state_dict())
    assert in_arena()


def test_exchange_traffic_per_step():
    n_sub, layers = 3, 4
    model = apply_speedloader(tiny_model("llama", layers=layers), num_sub_batches=n_sub, activation_store="host")
    ids, labels = batch(n_sub)
    model(input_ids=ids, labels=labels).loss.backward()
    first = speedloader_engine(model).store.step_stats()
    model(input_ids=ids, labels=labels).loss.backward()
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
    # After the first step the ring has what the schedule needs, and every fetch copies into a
    # buffer freed at least one exchange call earlier (never waits on just-queued compute).
    assert first["exchange_unpipelined_fetches"] > 0 and stats["exchange_unpipelined_fetches"] == 0
    assert stats["exchange_ring_buffers"] == first["exchange_ring_buffers"] <= 5


def test_over_large_activation_plan_names_the_setting():
    model = apply_speedloader(tiny_model("llama"), num_sub_batches=4, activation_store="host")
    speedloader_engine(model).store.host_memory_limit_bytes = 1  # nothing is available
    ids, labels = batch(4)
    with pytest.raises(ValueError, match=r"lower schedule.num_sub_batches \(N=4\), schedule.sub_batch_size "
                                         r"\(n=2\) or data.seq_len \(s=16\), or raise schedule.blocks_per_unit"):
        model(input_ids=ids, labels=labels)


# --- FSDP2's offloaded gradients in the arena ----------------------------------------------------


def _offloaded(n_sub=2, model=None, store="host"):
    model = tiny_model("llama") if model is None else model
    return apply_speedloader(model, num_sub_batches=n_sub, activation_store=store, offload_params=True)


def _local_grad(fsdp_param):
    grad = fsdp_param.sharded_param.grad
    return None if grad is None else grad._local_tensor


def test_gradient_slots_are_planned_before_the_first_backward_at_their_exact_size(monkeypatch):
    model = _offloaded()
    ids, labels = batch(2)
    loss = model(input_ids=ids, labels=labels).loss  # the first forward plans the arena; no gradient yet
    store = speedloader_engine(model).store
    fsdp_params = offloaded_fsdp_params(model)
    grad_slots = list(store.arena.slots("grad_shards"))
    assert len(grad_slots) == len(fsdp_params) == len(list(model.parameters()))
    for spec, p in zip(grad_slots, fsdp_params):
        assert spec.shape == tuple(p.sharded_size) and spec.dtype == torch.float32
        assert spec.nbytes == p.sharded_param.numel() * 4  # the shard itself: no padding, no rounding
        assert p.sharded_param.grad is None and store.arena.contains(grad_slot_of(p))
    want = sum(p.numel() * 4 for p in model.parameters())
    stats = store.step_stats()
    assert stats["arena_grad_shards_requested_bytes"] == store.grad_shard_bytes == want
    assert stats["arena_requested_bytes"] == sum(
        stats[f"arena_{kind}_requested_bytes"] for kind in ("activations", "param_shards", "grad_shards"))
    loss.backward()
    assert all(store.arena.contains(_local_grad(p)) for p in fsdp_params)

    # Page-locked: one registration of exactly the planned region (each slot padded to < 512 B), where
    # the caching host allocator would take one power-of-two block per gradient.
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    plan = ArenaPlan()
    plan_fsdp_shards(plan, fsdp_params)
    plan_fsdp_grads(plan, fsdp_params)
    arena = PinnedArena(plan, pin=True)
    stats = arena.stats()
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert stats["arena_grad_shards_requested_bytes"] == sum(sizes)
    assert stats["arena_grad_shards_page_locked_bytes"] == sum(arena_mod._align(n) for n in sizes)
    assert stats["arena_grad_shards_page_locked_bytes"] - sum(sizes) < ALIGNMENT * len(sizes)
    assert sum(1 << (n - 1).bit_length() for n in sizes) > stats["arena_grad_shards_page_locked_bytes"]
    assert list(fake.registered.values()) == [(plan.nbytes, 0)]


def test_gradient_slots_come_with_the_first_step_that_can_produce_gradients():
    model = tiny_model("llama")
    ids, labels = batch(2)
    _, ref_grads = reference_grads(model, [(ids, labels)])
    _offloaded(model=model)
    store = speedloader_engine(model).store
    with torch.no_grad():  # an evaluation (or generation) first: it pays for no gradient slots
        model(input_ids=ids, labels=labels)
    first = store.arena
    assert not list(first.slots("grad_shards")) and store.grad_shard_bytes == 0
    model(input_ids=ids, labels=labels).loss.backward()  # the first training step re-plans once, with them
    assert store.arena is not first and store.grad_shard_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert all(store.arena.contains(_local_grad(p)) for p in offloaded_fsdp_params(model))
    assert_grads_close(model, ref_grads)
    arena = store.arena
    model.zero_grad()
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    model(input_ids=ids, labels=labels).loss.backward()
    assert store.arena is arena
    assert_grads_close(model, ref_grads)


def test_over_large_gradient_plan_fails_before_allocating_and_names_the_setting(monkeypatch):
    model = _offloaded()
    states = sum(arena_mod._align(p.numel() * 4) for p in model.parameters())  # shard slots; gradients alike
    activations = arena_mod._align(5 * 2 * 2 * 16 * 64 * 4)
    # Room for the activations and the shards (they move in from host memory), not for the gradients.
    budget = HostMemoryBudget(limit_bytes=activations + states // 2, used_bytes=0, margin=0.0)
    monkeypatch.setattr(HostMemoryBudget, "detect", classmethod(lambda cls, *a, **k: budget))
    allocations = []
    monkeypatch.setattr(arena_mod, "_Region", lambda *a, **k: allocations.append(a))
    ids, labels = batch(2)
    with pytest.raises(ValueError) as err:
        model(input_ids=ids, labels=labels)
    message = str(err.value)
    needed = activations + 2 * states - sum(p.numel() * 4 for p in model.parameters())  # shards: already resident
    assert f"({needed} bytes; activations" in message
    assert f"grad_shards {states / 2**30:.2f} GiB" in message
    assert "the offloaded parameter shards and their gradients" in message and "offload.pin_memory=false" in message
    assert allocations == []
    assert all(grad_slot_of(p) is None for p in offloaded_fsdp_params(model))


def test_offloaded_gradients_land_in_the_arena_with_exact_zero_grad_and_accumulation_semantics():
    """Against FSDP2's own offload (the synchronous store, no arena): identical gradients in every case."""
    base = tiny_model("llama")
    models = {"host": _offloaded(model=copy.deepcopy(base)), "host_sync": _offloaded(model=copy.deepcopy(base),
                                                                                        store="host_sync")}
    fsdp_params = offloaded_fsdp_params(models["host"])
    arena = speedloader_engine(models["host"]).store

    def backward(seed):
        ids, labels = batch(2, seed=seed)
        for m in models.values():
            m(input_ids=ids, labels=labels).loss.backward()

    def check(in_arena=True):
        for (name, a), (_, b) in zip(models["host"].named_parameters(), models["host_sync"].named_parameters()):
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), name
        assert all(arena.arena.contains(_local_grad(p)) == in_arena for p in fsdp_params)

    def zero_grad(set_to_none):
        for m in models.values():
            m.zero_grad(set_to_none=set_to_none)

    backward(0)
    check()
    slots = [_local_grad(p).data_ptr() for p in fsdp_params]
    zero_grad(True)
    backward(1)  # a fresh gradient: copied into the same slot
    check()
    assert [_local_grad(p).data_ptr() for p in fsdp_params] == slots
    backward(2)  # no zero_grad: FSDP2 adds to the gradient in the slot
    check()
    zero_grad(False)  # zeroed in place (still in the slot), then added to
    backward(3)
    check()
    assert [_local_grad(p).data_ptr() for p in fsdp_params] == slots


def test_a_gradient_still_referenced_after_zero_grad_is_not_overwritten(caplog, monkeypatch):
    monkeypatch.setattr(counters, "_warned", set())  # warnings are once per process
    model = _offloaded()
    fsdp_params = offloaded_fsdp_params(model)
    ids, labels = batch(2)
    model(input_ids=ids, labels=labels).loss.backward()
    store = speedloader_engine(model).store
    held = {name: p.grad for name, p in model.named_parameters()}  # e.g. kept for logging
    kept = {name: g.to_local().clone() for name, g in held.items()}
    model.zero_grad(set_to_none=True)
    ids2, labels2 = batch(2, seed=1)
    before = fsdp2.fast_path_stats()
    with caplog.at_level("WARNING", logger="fsdp_speedloader.fsdp2"):
        model(input_ids=ids2, labels=labels2).loss.backward()
    assert all(torch.equal(held[name].to_local(), kept[name]) for name in held)  # left as they were
    assert not any(store.arena.contains(_local_grad(p)) for p in fsdp_params)  # FSDP2's own memory instead
    assert caplog.text.count("still referenced after zero_grad") == 1  # once, not once per parameter
    after = fsdp2.fast_path_stats()
    assert after["num_grad_slot_fallbacks"] - before["num_grad_slot_fallbacks"] == len(fsdp_params)
    assert after["num_grads_into_slots"] == before["num_grads_into_slots"]
    del held
    model.zero_grad(set_to_none=True)
    model(input_ids=ids2, labels=labels2).loss.backward()
    assert all(store.arena.contains(_local_grad(p)) for p in fsdp_params)
    assert fsdp2.fast_path_stats()["num_grads_into_slots"] - after["num_grads_into_slots"] == len(fsdp_params)


def _uneven_shards(rank: int, world_size: int) -> dict:
    # vocab 97: the embedding and LM head shard into 49 and 48 rows; every other shard is even.
    cfg = ModelConfig(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=128, vocab_size=97, max_position_embeddings=64)
    model = build_model(cfg, device="cpu", seed=1)
    _, ref_grads = reference_grads(model, [batch(2, seed=r) for r in range(world_size)])
    apply_speedloader(model, num_sub_batches=2, activation_store="host", offload_params=True)
    ids, labels = batch(2, seed=rank)
    model(input_ids=ids, labels=labels).loss.backward()
    assert_grads_close(model, ref_grads)
    store = speedloader_engine(model).store
    fsdp_params = offloaded_fsdp_params(model)
    assert all(store.arena.contains(_local_grad(p)) for p in fsdp_params)
    return {"grad_bytes": store.step_stats()["arena_grad_shards_requested_bytes"],
            "local_bytes": sum(p.sharded_param._local_tensor.numel() * 4 for p in fsdp_params),
            "param_bytes": store.step_stats()["arena_param_shards_requested_bytes"]}


@pytest.mark.slow
def test_gradient_slots_hold_the_unpadded_shard_at_world_size_2():
    r0, r1 = run_distributed(_uneven_shards, 2)
    assert r0["grad_bytes"] == r0["local_bytes"] and r1["grad_bytes"] == r1["local_bytes"]
    assert r1["grad_bytes"] == r0["grad_bytes"] - 2 * 64 * 4  # rank 1 has one row less of two (97, 64) weights
    assert r1["param_bytes"] == r0["param_bytes"]  # parameter shards are padded to the same size
