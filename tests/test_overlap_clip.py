"""Global-norm clipping and non-finite-step skipping with the overlapped optimizer (``OverlappedOptimizer`` with
``max_norm`` / ``skip_nonfinite``; ``optim.grad_clip`` with ``optim.overlap_with_backward``).

The reference is the trainer's plain path: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, then
one AdamW step over the model. After every step, the overlapped optimizer's parameters and AdamW states (exp_avg,
exp_avg_sq, step) are compared with it bit for bit (``torch.equal``), at world sizes 1 and 2, parameters offloaded,
the root's states offloaded or not, with a max_norm that clips every step (the tiny model's gradient norm is about
2) and one that never does. A non-finite gradient injected into one unit mid-run must leave the run exactly where a
run that never took that batch is.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
import time

import pytest
import torch

from dist_utils import run_distributed, tiny_config
from engine_cases import batch, cpu_mesh, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.memory.optimizer_overlap import OptimizersContainer, OverlappedOptimizer
from fsdp_speedloader.memory.threads import adopted_num_threads

NUM_SUB = 3
CLIPS = 0.05  # below every step's gradient norm (about 2): the coefficient is < 1 each step
NEVER_CLIPS = 100.0


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)  # what build_adamw makes on the CPU


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pair(offload_root: bool):
    """The same initialised tiny LLaMA (4 units), twice, layer-major with parameters offloaded."""
    base = tiny_model("llama")
    return [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True,
                              offload_root=offload_root) for _ in range(2)]


def _states(model, optimizers) -> dict:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: {k: _full(v) for k, v in state.items()}
            for opt in optimizers for p, state in opt.state.items()}


def _assert_bitwise_equal(reference, plain, model, overlapped) -> None:
    """Parameters and AdamW states of ``model`` (optimizers ``overlapped``) and ``reference`` (``plain``: one
    torch optimizer, or a container) are the same bits."""
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(_full(a), _full(b)), name
    plain = plain if isinstance(plain, OptimizersContainer) else [plain]
    want, got = _states(reference, plain), _states(model, overlapped)
    assert sorted(want) == sorted(got) == sorted(name for name, _ in reference.named_parameters())
    for name, state in want.items():
        assert sorted(state) == sorted(got[name]) == ["exp_avg", "exp_avg_sq", "step"]
        for key, value in state.items():
            assert torch.equal(value, got[name][key]), (name, key)


def _inject(model, *, unit: int, value: float, when) -> list:
    """Writes ``value`` into the first local element of unit ``unit``'s first gradient, just before the overlapped
    optimizer sees that unit's gradients as final, in the backwards where ``when()`` is true (this rank's)."""
    engine = speedloader_engine(model)
    hook, injected = engine.grad_ready_hook, []

    def inject(index: int) -> None:
        if index == unit and when():
            grad = next(p.grad for p in engine.units[unit - 1][0].parameters() if p.grad is not None)
            with torch.no_grad():
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = value
            injected.append(index)
        if hook is not None:
            hook(index)

    engine.grad_ready_hook = inject
    return injected


def _clip_run(rank: int, offload_root: bool, max_norm: float, *, steps: int = 3, bad_step: int = -1,
              bad_value: float = math.inf) -> dict:
    """``steps`` steps of clip-then-step (the reference) and of the overlapped optimizer on this rank's batches,
    compared bit for bit at the end. ``bad_step``: the overlapped run's backward at that step gets ``bad_value`` in
    a gradient of unit 2 (on rank 0 only) and the reference never takes that batch."""
    reference, model = _pair(offload_root)
    plain = _adamw(reference.parameters())
    overlapped = OverlappedOptimizer(model, _adamw, max_norm=max_norm, skip_nonfinite=True)
    step = [0]
    _inject(model, unit=2, value=bad_value, when=lambda: step[0] == bad_step and rank == 0)
    out = {"reference_norms": [], "norms": [], "skipped": []}
    try:
        for step[0] in range(steps):
            ids, labels = batch(NUM_SUB, seed=100 * step[0] + rank)  # the ranks' batches differ
            if step[0] != bad_step:
                reference(input_ids=ids, labels=labels).loss.backward()
                out["reference_norms"].append(_full(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)))
                plain.step()
                plain.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()  # waits, unit by unit, for the last step's updates
            overlapped.step()
            out["norms"].append(overlapped.last_grad_norm)
            out["skipped"].append(overlapped.last_step_skipped)
            overlapped.zero_grad()
        overlapped.wait()
        _assert_bitwise_equal(reference, plain, model, overlapped)
    finally:
        overlapped.close()
    out["num_skipped_steps"] = overlapped.num_skipped_steps
    return out


def _check_norms(out: dict, max_norm: float, bad_step: int = -1) -> None:
    good = [n for i, n in enumerate(out["norms"]) if i != bad_step]
    assert all(torch.equal(a, b) for a, b in zip(good, out["reference_norms"])), (good, out["reference_norms"])
    assert all((n > max_norm) == (max_norm == CLIPS) for n in good), good  # clipping triggered, or never did
    assert out["skipped"] == [i == bad_step for i in range(len(out["norms"]))]
    assert out["num_skipped_steps"] == (bad_step >= 0)


# --- world size 1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload_root", [True, False], ids=["root-offloaded", "root-on-device"])
@pytest.mark.parametrize("max_norm", [CLIPS, NEVER_CLIPS], ids=["clips", "never-clips"])
def test_overlapped_clipping_is_bitwise_clip_then_step(offload_root, max_norm):
    out = _clip_run(0, offload_root, max_norm)
    _check_norms(out, max_norm)


def _norms_as_clip_grad_norm(mesh, placements, dtype, threads) -> None:
    """Gradients large enough for ATen to split a reduction across threads (> 32768 elements), as DTensors (FSDP2's
    gradients: grad_clip takes each norm on the local shard, on the host threads, and wraps it as DTensor would):
    per-tensor norms with DTensor's own placements and bits, the total and the scaled gradients those of
    clip_grad_norm_, at ``threads`` intra-op threads."""
    from torch.distributed.tensor import distribute_tensor

    from fsdp_speedloader.memory.grad_clip import NormTable, _norms, clip_coefficient, clip_grads_, \
        coefficients_by_device, scale_grads_, tensor_norms, total_norm

    gen = torch.Generator().manual_seed(0)
    sizes = [(1000, 300), (70_002,), (64,), (4, 100_000)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        models = [[torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements))
                   for shape in sizes] for _ in range(2)]
        for params in zip(*models):
            grad = torch.randn(params[0].shape, generator=gen).to(dtype)
            for p in params:
                p.grad = distribute_tensor(grad.clone(), mesh, placements)
        grads = [p.grad for p in models[1]]
        for foreach, theirs in ((False, [torch.linalg.vector_norm(g, 2.0) for g in grads]),
                                (True, torch._foreach_norm(grads, 2.0))):
            for mine, want in zip(_norms(grads, foreach), theirs):  # DTensor's own call, each way
                assert mine.placements == want.placements and torch.equal(mine.to_local(), want.to_local())
        want = torch.nn.utils.clip_grad_norm_(models[0], 1.0)
        table: NormTable = {}
        tensor_norms(grads[2:], table)  # in two pieces, as the units' gradients land
        tensor_norms(grads[:2], table)
        got = total_norm(grads, table)
        assert torch.equal(_full(got), _full(want)), (threads, got, want)
        scale_grads_(grads, coefficients_by_device(clip_coefficient(got, 1.0), grads))
        for a, b in zip(models[0], models[1]):
            assert torch.equal(_full(a.grad), _full(b.grad))
        for p, grad in zip(models[1], [g.full_tensor() for g in grads]):  # clip_grads_ in one call, once more
            p.grad = distribute_tensor(grad, mesh, placements)
        assert torch.equal(_full(clip_grads_([p.grad for p in models[1]], 0.5)),
                           _full(torch.nn.utils.clip_grad_norm_(models[0], 0.5)))
        for a, b in zip(models[0], models[1]):
            assert torch.equal(_full(a.grad), _full(b.grad))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_norms_on_several_threads_are_clip_grad_norms_bits(dtype):
    from torch.distributed.tensor import Shard

    for threads in (1, 4):
        _norms_as_clip_grad_norm(cpu_mesh(), [Shard(0)], dtype, threads)


def test_clipping_changes_the_result():
    """The comparison above can fail: without clipping (max_norm 0) the same steps give other parameters."""
    reference, model = _pair(True)
    plain, overlapped = _adamw(reference.parameters()), OverlappedOptimizer(model, _adamw)
    try:
        ids, labels = batch(NUM_SUB, seed=0)
        reference(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIPS)
        plain.step()
        model(input_ids=ids, labels=labels).loss.backward()
        overlapped.step()
    finally:
        overlapped.close()
    assert overlapped.last_grad_norm is None
    assert not all(torch.equal(_full(a), _full(b)) for a, b in zip(reference.parameters(), model.parameters()))


@pytest.mark.parametrize("bad_value", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_nonfinite_step_is_skipped_for_every_unit(bad_value):
    """Step 2 of 4 sees a non-finite gradient in unit 2: afterwards parameters and states are exactly those of
    clip-then-step over the other three batches (no unit half-updated), and the skip is counted."""
    out = _clip_run(0, True, CLIPS, steps=4, bad_step=1, bad_value=bad_value)
    _check_norms(out, CLIPS, bad_step=1)
    assert not math.isfinite(out["norms"][1])


def test_skip_without_clipping_and_the_plain_container_skip_alike():
    """``skip_nonfinite`` alone (max_norm 0) defers too; the plain container skips the same step the same way."""
    models = _pair(True)
    containers = [OptimizersContainer(models[0], _adamw, skip_nonfinite=True),
                  OverlappedOptimizer(models[1], _adamw, skip_nonfinite=True)]
    step = [0]
    for model in models:
        _inject(model, unit=3, value=math.nan, when=lambda: step[0] == 1)
    try:
        for step[0] in range(3):
            ids, labels = batch(NUM_SUB, seed=step[0])
            for model, opt in zip(models, containers):
                model(input_ids=ids, labels=labels).loss.backward()
                opt.step()
                assert opt.last_step_skipped == (step[0] == 1)
                opt.zero_grad()
        containers[1].wait()
        _assert_bitwise_equal(models[0], containers[0], models[1], containers[1])
    finally:
        containers[1].close()
    assert [c.num_skipped_steps for c in containers] == [1, 1]


def test_the_next_forward_waits_only_for_the_steps_it_reads():
    """``step()`` returns before the unit steps are applied; the next forward's unit l starts once the steps of
    the root and units 1 .. l + 1 (forward_prefetch=1) are applied, while later units' steps still run: overlap
    with the forward, and the same bits as clip-then-step."""
    reference, model = _pair(True)
    plain = _adamw(reference.parameters())
    overlapped = OverlappedOptimizer(model, _adamw, max_norm=CLIPS)
    events, lock = [], threading.Lock()

    def log(*event):
        with lock:
            events.append(event)

    for index, opt in enumerate(overlapped.optimizers):
        def slow_step(step=opt.step, index=index):
            time.sleep(0.05)  # a slow CPU step: later units' steps are still queued when the forward starts
            step()
            log("step", index)
        opt.step = slow_step
    engine = speedloader_engine(model)
    wait_for_unit = engine.unit_forward_hook
    engine.unit_forward_hook = lambda index: (wait_for_unit(index), log("forward", index))
    batches = [batch(NUM_SUB, seed=step) for step in range(2)]
    for ids, labels in batches:
        reference(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIPS)
        plain.step()
        plain.zero_grad()
    try:
        for ids, labels in batches:
            model(input_ids=ids, labels=labels).loss.backward()
            overlapped.step()
            log("step", "returned")
            overlapped.zero_grad()
        overlapped.wait()
        _assert_bitwise_equal(reference, plain, model, overlapped)
    finally:
        overlapped.close()
    returned = [i for i, event in enumerate(events) if event == ("step", "returned")]
    second = events[returned[0]:returned[1]]  # the first step's updates, beside the second forward and backward
    root, units = 4, 4
    assert second[1] == ("step", root)  # nothing was applied when step() returned; the root first
    position = {event: i for i, event in enumerate(second)}
    for unit in range(1, units + 1):
        for needed in range(unit, min(unit + 1, units) + 1):  # its own step and the prefetched unit's
            assert position[("step", needed - 1)] < position[("forward", unit)], (unit, needed, second)
    assert position[("step", root)] < position[("forward", 1)]
    assert position[("forward", 1)] < position[("step", units - 1)], second  # the last unit's step overlapped


def test_step_stats_count_the_cpu_steps_and_what_showed_of_them():
    """``step_stats()``: the worker's optimizer seconds (each inner step slowed by 20 ms here) and the main
    thread's seconds blocked on them (the second forward waits for the root's deferred step), then reset."""
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    overlapped = OverlappedOptimizer(model, _adamw, max_norm=CLIPS)
    for opt in overlapped.optimizers:
        def slow_step(step=opt.step):
            time.sleep(0.02)
            step()
        opt.step = slow_step
    try:
        for step in range(2):
            ids, labels = batch(NUM_SUB, seed=step)
            model(input_ids=ids, labels=labels).loss.backward()
            overlapped.step()
            overlapped.zero_grad()
        overlapped.wait()
        stats = overlapped.step_stats()
        assert stats["optimizer_busy_s"] >= 2 * len(overlapped.optimizers) * 0.02, stats
        assert stats["optimizer_wait_s"] >= 0.02, stats
        assert overlapped.step_stats() == {"optimizer_busy_s": 0.0, "optimizer_wait_s": 0.0, "grad_ring_wait_s": 0.0}
    finally:
        overlapped.close()


def test_close_applies_the_queued_steps_and_unhooks_the_model():
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    fsdp_hooks = dict(model._forward_pre_hooks)
    overlapped = OverlappedOptimizer(model, _adamw, max_norm=CLIPS)
    engine = speedloader_engine(model)
    assert engine.unit_forward_hook is not None and engine.grad_ready_hook is not None
    assert len(model._forward_pre_hooks) == len(fsdp_hooks) + 1  # the root's wait, before FSDP's own
    before = [_full(p).clone() for p in model.parameters()]
    ids, labels = batch(NUM_SUB, seed=0)
    model(input_ids=ids, labels=labels).loss.backward()
    overlapped.step()
    overlapped.close()
    assert all(not torch.equal(a, _full(b)) for a, b in zip(before, model.parameters()))  # every unit stepped
    assert engine.unit_forward_hook is None and engine.grad_ready_hook is None
    assert dict(model._forward_pre_hooks) == fsdp_hooks  # the root's wait is gone too
    overlapped.close()


# --- world size 2 ---------------------------------------------------------------------------------------------


def _all_cases(rank: int, world_size: int) -> list:
    """Every case of world size 1 on two ranks (DTensor norms are partial; the global norm is all-reduced), and a
    non-finite gradient on rank 0 only: both ranks skip."""
    outs = []
    for offload_root in (True, False):
        for max_norm in (CLIPS, NEVER_CLIPS):
            outs.append((max_norm, -1, _clip_run(rank, offload_root, max_norm, steps=2)))
    outs.append((CLIPS, 1, _clip_run(rank, True, CLIPS, steps=3, bad_step=1)))
    _host_norms_on_meshes_of_two_ranks()
    return outs


def _host_norms_on_meshes_of_two_ranks() -> None:
    """The local-shard norms on FSDP's 1-D mesh (partial over 2 shards) and on HSDP's 2-D ones (2 replicas of 1
    shard, 1 replica of 2 shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    _norms_as_clip_grad_norm(init_device_mesh("cpu", (2,)), [Shard(0)], torch.float32, 2)
    for shape in ((2, 1), (1, 2)):
        _norms_as_clip_grad_norm(init_device_mesh("cpu", shape), [Replicate(), Shard(0)], torch.float32, 2)


def test_overlapped_clipping_and_skipping_at_world_size_2():
    results = run_distributed(_all_cases, 2)
    for rank_outs in results:
        for max_norm, bad_step, out in rank_outs:
            _check_norms(out, max_norm, bad_step)
    for (_, _, a), (_, _, b) in zip(*results):  # one global norm, the same on both ranks
        assert all(torch.equal(x, y) for x, y in zip(a["norms"], b["norms"]) if math.isfinite(x))


# --- the trainer ----------------------------------------------------------------------------------------------

CLIPPED = {"schedule": {"name": "speedloader"}, "offload": {"params": True},
           "optim": {"grad_clip": 1.0, "warmup_steps": 3, "lr_schedule": "linear"}}


def _trainer(out, overlap: bool, **overrides) -> Trainer:
    return Trainer(tiny_config(out, steps=5, **{**CLIPPED, "optim": {**CLIPPED["optim"],
                                                                     "overlap_with_backward": overlap}}, **overrides))


def _run(trainer: Trainer, *, bad_step: int = -1) -> list:
    """Trains; the backward of step ``bad_step`` (1-based) gets an inf in a gradient of unit 2."""
    _inject(trainer.model, unit=2, value=math.inf, when=lambda: trainer.step + 1 == bad_step)
    return trainer.train()


def _assert_same_run(a: Trainer, b: Trainer, history_a: list, history_b: list) -> None:
    for key in ("loss", "lr", "grad_norm", "step_skipped", "num_skipped_steps"):
        assert [m[key] for m in history_a] == [m[key] for m in history_b], key
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(_full(p), _full(q)), name


def test_trainer_clips_with_the_overlapped_optimizer_as_without(tmp_path):
    """``optim.grad_clip=1.0 optim.overlap_with_backward=true`` trains, step for step the plain path's run."""
    plain, overlapped = _trainer(tmp_path / "plain", False), _trainer(tmp_path / "overlap", True)
    assert isinstance(overlapped.optimizer, OverlappedOptimizer) and overlapped.optimizer.max_norm == 1.0
    history = _run(overlapped)
    _assert_same_run(plain, overlapped, _run(plain), history)
    assert any(m["grad_norm"] > 1.0 for m in history)  # it clipped
    assert [m["num_skipped_steps"] for m in history] == [0] * 5


def test_trainer_skips_a_nonfinite_step_and_goes_on(tmp_path, caplog):
    """Step 2's gradient holds an inf: the step is skipped (the LR schedule does not advance), logged and counted
    in the metrics (metrics.jsonl, as the W&B run gets them), the run goes on, and the plain path does the same."""
    plain, overlapped = _trainer(tmp_path / "plain", False), _trainer(tmp_path / "overlap", True)
    with caplog.at_level(logging.WARNING, logger="fsdp_speedloader.app.trainer"):
        history = _run(overlapped, bad_step=2)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
    assert [m["step_skipped"] for m in history] == [0, 1, 0, 0, 0]
    assert [m["num_skipped_steps"] for m in history] == [0, 1, 1, 1, 1]
    assert math.isinf(history[1]["grad_norm"]) and all(math.isfinite(m["loss"]) for m in history)
    lr = 1e-2
    assert [m["lr"] for m in history] == pytest.approx([lr / 3, 2 * lr / 3, 2 * lr / 3, lr, lr])
    assert "skipped the optimizer step" in caplog.text
    logged = [json.loads(line) for line in (tmp_path / "overlap" / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_skipped_steps"] for r in logged if "loss" in r] == [0, 1, 1, 1, 1]
    _assert_same_run(plain, overlapped, _run(plain, bad_step=2), history)


def _one_overlapped_step(probe, build=_adamw, **worker) -> tuple[list, list, OverlappedOptimizer]:
    """One step of a fresh offloaded model under an OverlappedOptimizer(``worker``): what ``probe()`` returned in
    each inner optimizer's step (on whichever thread ran it), the parameters after it, and the optimizer."""
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    overlapped = OverlappedOptimizer(model, build, max_norm=CLIPS, **worker)
    seen = []
    for opt in overlapped.optimizers:
        def probed_step(step=opt.step):
            seen.append(probe())
            step()
        opt.step = probed_step
    try:
        ids, labels = batch(NUM_SUB, seed=0)
        model(input_ids=ids, labels=labels).loss.backward()
        overlapped.step()
        overlapped.wait()
    finally:
        overlapped.close()
    return seen, [_full(p).clone() for p in model.parameters()], overlapped


def test_worker_threads_sets_the_cpu_threads_of_the_optimizer_worker_only():
    """``worker_threads=1``: the inner steps run on the worker thread with one CPU thread, the same parameters as
    with torch's default (exact), and the main thread keeps its own thread count."""
    main_threads, adopted = torch.get_num_threads(), adopted_num_threads()
    results = []
    for threads in (0, 1):
        seen, params, _ = _one_overlapped_step(lambda: (threading.current_thread().name, torch.get_num_threads()),
                                               worker_threads=threads)
        on_worker = {n for name, n in seen if name == "fsdp_speedloader-optimizer"}
        assert on_worker == ({1} if threads else {main_threads}), seen
        results.append(params)
    assert torch.get_num_threads() == main_threads
    assert adopted_num_threads() == adopted  # threads started later keep torch's count, not the worker's
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_worker_threads_must_be_a_count():
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    with pytest.raises(ValueError, match="worker_threads"):
        OverlappedOptimizer(model, _adamw, worker_threads=-1)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread niceness is Linux's")
def test_worker_nice_lowers_the_workers_priority_only():
    """``worker_nice=5``: the worker thread (and so the CPU threads it starts) runs 5 nicer than the process; the
    main thread keeps its priority; the parameters equal those of a worker at the process's priority (exact)."""
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main_nice = niceness()
    results = []
    for nice in (0, 5):
        seen, params, _ = _one_overlapped_step(niceness, worker_nice=nice)
        assert set(seen) == {min(19, main_nice + nice)}, seen
        results.append(params)
    assert niceness() == main_nice
    assert all(torch.equal(a, b) for a, b in zip(*results))
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    with pytest.raises(ValueError, match="worker_nice"):
        OverlappedOptimizer(model, _adamw, worker_nice=20)


def test_the_trainer_passes_worker_threads_to_the_overlapped_optimizer(tmp_path):
    """``optim.worker_threads`` through the config: the same losses as torch's default thread count (exact)."""
    def losses(threads: int) -> list[float]:
        cfg = tiny_config(tmp_path / str(threads), schedule={"name": "speedloader"}, offload={"params": True}, steps=2,
                          optim={"overlap_with_backward": True, "grad_clip": 0.0, "worker_threads": threads})
        trainer = Trainer(cfg)
        assert trainer.optimizer._worker_threads == threads
        return [m["loss"] for m in trainer.train()]

    assert losses(1) == losses(0)
    with pytest.raises(ValueError, match="optim.worker_threads"):
        tiny_config(tmp_path, optim={"worker_threads": -2})
    with pytest.raises(ValueError, match="optim.worker_nice"):
        tiny_config(tmp_path, optim={"worker_nice": 25})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="per-thread CPU affinity is Linux's")
def test_worker_cpus_pin_the_optimizer_worker_and_its_pool_only():
    """``worker_cpus=[c]``: the worker's inner steps run on CPU c only, with one thread per CPU given; the compressed
    AdamW's pool tasks too (they run where their caller may); the main thread keeps its CPUs; the parameters equal those of
    an unpinned worker (exact). CPUs the process may not use are refused."""
    from fsdp_speedloader.memory.compressed_adamw import CompressedAdamW

    main_cpus = os.sched_getaffinity(0)
    cpu = max(main_cpus)

    def compressed(params):
        return CompressedAdamW(params, state_dtype="int8", lr=1e-2, weight_decay=0.1)

    def probe():
        seen_by_pool = []
        from fsdp_speedloader.memory.threads import run_on_host_threads

        run_on_host_threads([lambda: seen_by_pool.append(os.sched_getaffinity(0))] * 2, threads=2)
        return threading.current_thread().name, os.sched_getaffinity(0), torch.get_num_threads(), seen_by_pool

    results = []
    for cpus in (None, [cpu]):
        seen, params, overlapped = _one_overlapped_step(probe, build=compressed, worker_cpus=cpus)
        if cpus is not None:
            assert overlapped.worker_cpus == [cpu] and overlapped.worker_threads == 1
            on_worker = [(mask, threads, pool) for name, mask, threads, pool in seen
                         if name == "fsdp_speedloader-optimizer"]
            assert on_worker and all(mask == {cpu} and threads == 1 and pool == [{cpu}, {cpu}]
                                     for mask, threads, pool in on_worker), seen
            # what the main thread steps itself (the root, at the end of the backward) keeps the main thread's CPUs
            assert all(mask == main_cpus for name, mask, _, _ in seen if name != "fsdp_speedloader-optimizer"), seen
        results.append(params)
    assert os.sched_getaffinity(0) == main_cpus
    assert all(torch.equal(a, b) for a, b in zip(*results))
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=NUM_SUB, offload_params=True)
    with pytest.raises(ValueError, match="worker_cpus"):
        OverlappedOptimizer(model, _adamw, worker_cpus=[max(main_cpus) + 1000])


def test_rank_cpus_split_the_node_between_its_ranks(monkeypatch):
    """optim.worker_affinity's CPUs: LOCAL_RANK's block of the process's CPUs split LOCAL_WORLD_SIZE ways, less the
    first (the launching thread's); a process its launcher bound to fewer CPUs than the machine's keeps them all."""
    from fsdp_speedloader.memory import threads

    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert threads.rank_cpus() == list(range(32, 48)) and threads.optimizer_cpus() == list(range(33, 48))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert threads.optimizer_cpus() == list(range(1, 64))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {8, 9, 10, 11}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.rank_cpus() == [8, 9, 10, 11] and threads.optimizer_cpus() == [9, 10, 11]
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {5}, raising=False)
    assert threads.optimizer_cpus() == [5]  # one CPU: shared rather than none


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="per-thread CPU affinity is Linux's")
def test_the_trainer_passes_worker_affinity_to_the_overlapped_optimizer(tmp_path):
    """``optim.worker_affinity=true`` through the config: the worker gets this rank's CPUs less one, and the losses
    equal an unpinned run's (exact); it needs the overlapped optimizer."""
    from fsdp_speedloader.memory.threads import optimizer_cpus

    def losses(affinity: bool) -> list[float]:
        cfg = tiny_config(tmp_path / str(affinity), schedule={"name": "speedloader"}, offload={"params": True},
                          steps=2, optim={"overlap_with_backward": True, "grad_clip": 0.0,
                                          "worker_affinity": affinity})
        trainer = Trainer(cfg)
        assert trainer.optimizer.worker_cpus == (optimizer_cpus() if affinity else None)
        return [m["loss"] for m in trainer.train()]

    assert losses(True) == losses(False)
    with pytest.raises(ValueError, match="optim.worker_affinity"):
        tiny_config(tmp_path, optim={"worker_affinity": True})
