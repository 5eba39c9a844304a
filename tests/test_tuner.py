"""The tuner on the CPU: fits and plans from recorded (synthetic) measurements, budget edge cases, the
trial steps end to end on a tiny model (the CPU stands in for the GPU), ``schedule.name=auto`` in the
trainer, the errors that name a wrong budget, and the ``python -m fsdp_speedloader.app.tune`` entry point.

The GPU figures (predicted peak within 5% of the measured one, 7B width) are in ``test_tuner_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import fsdp_speedloader
from dist_utils import tiny_config
from fsdp_speedloader import SpeedLoaderOptions
from fsdp_speedloader.memory.arena import ArenaPlan, HostMemoryBudget, check_plan
from fsdp_speedloader.app.config import ModelConfig, OptimConfig, TrainConfig
from fsdp_speedloader.app.launch import UserError, fail
from fsdp_speedloader.models import build_model, get_adapter
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group
from fsdp_speedloader.app.optim import build_optimizer
from fsdp_speedloader.app.planning import configured_caps, planned_config, planned_schedule, tune_train_config
from fsdp_speedloader.app.runtime import speedloader_options
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.tuning.trial import Measurement, TrialModel, slot_host_bytes
from fsdp_speedloader.tuning.fit import HOST_METHOD, fit_host, fit_linear
from fsdp_speedloader.tuning.plan import GpuPlanMemoryError, HostPlanMemoryError, TunePlan, plan_from_measurements

GIB = 1 << 30
MIB = 1 << 20
S, H, L = 4096, 4096, 8  # a 7B-width model of 8 layers at seq 4096: 9 slots, bf16 activations
SLOT_BYTES = H * 2  # one token in one slot
TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)


def _measure(n, *, b=1, N=2, gpu, host, reserved=0, storage="arena", layers=L, breakdown=None) -> Measurement:
    units = -(-layers // b)
    return Measurement(sub_batch_size=n, num_sub_batches=N, blocks_per_unit=b, seq_len=S, num_slots=units + 1,
                       gpu_peak_bytes=int(gpu), host_bytes=int(host), gpu_reserved_bytes=int(reserved),
                       activation_bytes_per_token=SLOT_BYTES, activation_storage=storage,
                       host_breakdown=breakdown or {})


def _recorded(gpu0=2 * GIB, gpu_per_seq=1.5 * GIB, host0=30 * GIB, sizes=(2, 4), N=2) -> list[Measurement]:
    """Two trial steps as a 7B-width run would record them: GPU linear in n, host = states + 9 slots."""
    return [_measure(n, N=N, gpu=gpu0 + gpu_per_seq * n, host=host0 + (L + 1) * N * n * S * SLOT_BYTES)
            for n in sizes]


def test_plan_keeps_activations_in_the_gpu_memory_left_over():
    """The trials kept one pair each (its bytes grow with n); the plan fills what n leaves under the target."""
    recorded = _recorded(sizes=(2, 4))
    for m in recorded:
        m.kept_pair_bytes = int(0.3 * GIB * m.sub_batch_size)
    capped = plan_from_measurements(recorded, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                    max_sub_batch_size=4, max_num_sub_batches=8)
    # n = 4: peak 2 + 1.5 x 4 = 8 GiB, 28 GiB left under 36 -> 1 + 28 // 1.2 = 24 of the 8 x 8 = 64 pairs
    assert (capped.sub_batch_size, capped.num_sub_batches) == (4, 8)
    assert capped.kept_pair_bytes == int(1.2 * GIB) and capped.keep_activations == 24
    assert capped.predicted_gpu_bytes == pytest.approx(8 * GIB + 23 * 1.2 * GIB, rel=1e-6)  # within the target
    assert capped.predicted_gpu_bytes <= capped.gpu_target_bytes
    assert "schedule.keep_activations=24" in capped.overrides()
    assert planned_schedule(capped, TrainConfig().schedule).keep_activations == 24
    assert "keep_activations=24 of 8 x 8" in capped.summary() and capped.as_metrics()["tune/keep_activations"] == 24
    roomy = plan_from_measurements(recorded, num_layers=L, gpu_budget_bytes=400 * GIB, host_budget_bytes=120 * GIB,
                                   max_sub_batch_size=1, max_num_sub_batches=2)
    assert roomy.keep_activations == 8 * 2  # every pair: none is recomputed
    fixed = plan_from_measurements(recorded, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                   max_sub_batch_size=4, keep_activations=3)
    assert fixed.keep_activations == 3
    unmeasured = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB,
                                        host_budget_bytes=120 * GIB)
    assert unmeasured.keep_activations == 0  # the CPU stand-in measures no kept pair: nothing planned


def test_plan_keeps_unit_1_on_the_gpu_before_kept_pairs():
    """Offloaded on CUDA: unit 1's states (16 B per parameter) go on the GPU when the memory left over holds them,
    first; the kept pairs fill what is left after them. Given a value, the plan keeps it."""
    recorded = _recorded(sizes=(2, 4))
    for m in recorded:
        m.kept_pair_bytes = int(0.3 * GIB * m.sub_batch_size)
    kw = dict(num_layers=L, host_budget_bytes=120 * GIB, max_sub_batch_size=4, max_num_sub_batches=8)
    plan = plan_from_measurements(recorded, gpu_budget_bytes=40 * GIB, device_unit_bytes_per_block=3 * GIB, **kw)
    # n = 4: peak 8 GiB; unit 1 takes 3 of the 28 GiB left under 36 -> 1 + 25 // 1.2 = 21 kept pairs
    assert (plan.device_units, plan.device_unit_bytes) == (1, 3 * GIB) and plan.keep_activations == 21
    assert plan.predicted_gpu_bytes == pytest.approx(11 * GIB + 20 * 1.2 * GIB, rel=1e-6)
    assert plan.predicted_gpu_bytes <= plan.gpu_target_bytes
    assert "offload.device_units=1" in plan.overrides() and plan.as_metrics()["tune/device_units"] == 1
    assert "device_units=1: the first 1 unit(s) keep their states on the GPU (3.000 GiB a unit" in plan.summary()
    cfg = planned_config(plan, tiny_config("unused", offload={"params": True}, schedule={"name": "auto"}))
    assert cfg.offload.device_units == 1 and cfg.schedule.keep_activations == 21
    tight = plan_from_measurements(recorded, gpu_budget_bytes=11 * GIB, device_unit_bytes_per_block=3 * GIB, **kw)
    assert tight.device_units == 0 and "offload.device_units" not in " ".join(tight.overrides())
    given = plan_from_measurements(recorded, gpu_budget_bytes=40 * GIB, device_units=2, **kw)
    assert given.device_units == 2 and given.keep_activations == 24  # its states were in the trials' peaks
    unplanned = plan_from_measurements(recorded, gpu_budget_bytes=40 * GIB, **kw)
    assert unplanned.device_units == 0 and unplanned.keep_activations == 24


def test_plan_puts_more_units_on_the_gpu_where_the_overlapped_cpu_step_would_show():
    """With an overlapped optimizer the trials time the forward+backward and the CPU step: the plan takes the fewest
    units on the GPU (at least 1, as the memory allows) whose predicted CPU step is at most HOST_STEP_SHARE of the
    forward+backward without recompute, each unit taking its parameters' share off that step."""
    from fsdp_speedloader.tuning.plan import HOST_STEP_SHARE

    unit_params = 200_000_000
    unit_bytes = 16 * unit_params

    def timed(host_step_s):
        recorded = _recorded(sizes=(2, 4))
        for m, base in zip(recorded, (0.40, 0.70)):  # forward+backward without recompute: 4 and 8 sequences
            m.kept_pair_bytes = int(0.3 * GIB * m.sub_batch_size)
            m.recomputed_share = 15 / 16  # one of 8 units x 2 sub-batches kept
            m.fwd_bwd_s = base * (1 + m.recomputed_share / 3)  # each recomputed pair runs its forward again
            m.host_step_s, m.host_step_params = host_step_s, L * unit_params  # every unit offloaded in the trials
        return recorded

    kw = dict(num_layers=L, host_budget_bytes=120 * GIB, max_sub_batch_size=4, max_num_sub_batches=2,
              device_unit_bytes_per_block=unit_bytes)
    # n = 4 x N = 2: 0.70 s; the CPU step 0.40 s over 8 units: 7/8 of it is 0.50 of 0.70, 6/8 of it 0.43
    busy = plan_from_measurements(timed(0.40), gpu_budget_bytes=40 * GIB, **kw)
    assert HOST_STEP_SHARE == 0.45 and (busy.sub_batch_size, busy.num_sub_batches) == (4, 2)
    assert busy.device_units == 2 and busy.host_step_share == pytest.approx(0.40 * 6 / 8 / 0.70)
    # peak 8 GiB + two units; the kept pairs (1.2 GiB each) in what is left under 36 GiB: all 16 of them
    assert busy.keep_activations == 16
    assert busy.predicted_gpu_bytes == pytest.approx(8 * GIB + 2 * unit_bytes + 15 * 1.2 * GIB)
    assert "offload.device_units=2" in busy.overrides() and busy.as_metrics()["tune/host_step_share"] == \
        pytest.approx(0.4286, abs=1e-4)
    assert "the overlapped CPU step predicted at 0.43 of the forward+backward, at most 0.45 wanted" in busy.summary()
    quiet = plan_from_measurements(timed(0.30), gpu_budget_bytes=40 * GIB, **kw)
    assert quiet.device_units == 1 and quiet.host_step_share == pytest.approx(0.30 * 7 / 8 / 0.70)
    # Memory for one unit only: the plan takes it and says how much of the step the CPU's would be.
    tight = plan_from_measurements(timed(0.40), gpu_budget_bytes=int((8 * GIB + 1.5 * unit_bytes) / 0.9), **kw)
    assert tight.device_units == 1 and tight.host_step_share == pytest.approx(0.50)
    # A longer step hides more: 16 sequences on the trials' line (0.40 s + 0.075 s a sequence) take 1.30 s.
    longer = plan_from_measurements(timed(0.40), gpu_budget_bytes=40 * GIB,
                                    **{**kw, "max_num_sub_batches": 4})
    assert longer.batch_size == 16 and longer.device_units == 1
    assert longer.host_step_share == pytest.approx(0.40 * 7 / 8 / 1.30)
    # No CPU step timed (no overlapped optimizer, or the CPU stand-in): unit 1, as before.
    untimed = plan_from_measurements(_recorded(sizes=(2, 4)), gpu_budget_bytes=40 * GIB, **kw)
    assert untimed.device_units == 1 and untimed.host_step_share == 0.0


def test_device_unit_bytes_count_one_rank_s_shard_of_the_largest_block():
    from fsdp_speedloader.tuning.tuner import device_unit_bytes_per_block

    block = sum(p.numel() for p in get_adapter(build_model(TINY, device="meta")).blocks[0].parameters())
    assert device_unit_bytes_per_block(TINY, _cpu_mesh()) == 16 * block


# --- fits ------------------------------------------------------------------------------------------


def test_fit_linear_two_points_is_exact_and_says_so():
    fit = fit_linear([{"n": 2}, {"n": 4}], [5.0, 9.0], ("1", "n"))
    assert fit.coef == pytest.approx((1.0, 2.0)) and fit.r2 == 1.0 and fit.exact
    assert fit.predict({"n": 10}) == pytest.approx(21.0)
    assert "R^2 = 1 by construction (2 points, 2 coefficients)" in fit.describe(1.0, "B")


def test_fit_linear_r2_with_more_points():
    ns = [1, 2, 4, 8, 16]
    noise = [0.3, -0.2, 0.1, -0.4, 0.2]
    fit = fit_linear([{"n": n} for n in ns], [3.0 + 2.0 * n + e for n, e in zip(ns, noise)], ("1", "n"))
    assert not fit.exact and 0.99 < fit.r2 < 1.0
    assert fit.coef[1] == pytest.approx(2.0, abs=0.05)
    bent = fit_linear([{"n": n} for n in ns], [n * n for n in ns], ("1", "n"))
    assert bent.r2 < 0.99  # a quadratic is visibly not a line


def test_fit_linear_needs_distinct_trials():
    with pytest.raises(ValueError, match="trials must differ"):
        fit_linear([{"n": 2}, {"n": 2}], [1.0, 1.0], ("1", "n"))
    with pytest.raises(ValueError, match="trials must differ"):
        fit_linear([{"n": 2}], [1.0], ("1", "n"))


# --- plans from recorded measurements ----------------------------------------------------------------


def test_plan_fills_gpu_then_host():
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    # GPU: 2 + 1.5 n <= 36 GiB (40 less 10%) -> n = 22. Host: 30 GiB + 9 x N x 22 x 4096 x 8 KiB <= 120 GiB -> N = 14.
    assert (plan.sub_batch_size, plan.num_sub_batches, plan.blocks_per_unit) == (22, 14, 1)
    assert plan.limited_by == {"sub_batch_size": "gpu budget", "num_sub_batches": "host budget"}
    assert plan.gpu_fit.coef == pytest.approx((2 * GIB, 1.5 * GIB))
    assert plan.host_fit.coef == pytest.approx((30 * GIB, SLOT_BYTES))  # exact: h x 2 bytes per slot token
    assert plan.predicted_gpu_bytes <= plan.gpu_target_bytes < plan.predict_gpu_bytes(23)
    assert plan.predicted_host_bytes <= 120 * GIB < plan.predict_host_bytes(22, 15)
    assert plan.batch_size == 22 * 14
    auto = dataclasses.replace(TrainConfig().schedule, name="auto", gpu_memory_budget_gib=40.0, target_batch_size=400,
                               tune_blocks_per_unit=[1, 2])
    planned = planned_schedule(plan, auto)  # the budgets are spent on the plan: a hand-set schedule refuses them
    assert (planned.name, planned.gpu_memory_budget_gib, planned.target_batch_size) == ("speedloader", None, None)
    assert planned.tune_blocks_per_unit == [] and planned.batch_size == 22 * 14
    assert plan.overrides()[1:3] == ["schedule.sub_batch_size=22", "schedule.num_sub_batches=14"]
    text = plan.summary()
    assert "R^2 = 1 by construction" in text and "limited by gpu budget" in text
    metrics = plan.as_metrics()
    assert metrics["tune/sub_batch_size"] == 22 and metrics["tune/gpu_fit_points"] == 2
    assert metrics["tune/trial1/measured_gpu_gib"] == pytest.approx(metrics["tune/trial1/fitted_gpu_gib"])
    json.dumps(plan.as_dict())  # JSON-ready


def test_plan_caps():
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  target_batch_size=64)
    # 22 fits one sub-batch, but 22 x 2 is short of 64: the largest n dividing 64 whose N = 64 / n fits
    assert (plan.sub_batch_size, plan.num_sub_batches) == (16, 4) and plan.target_warning() is None
    assert plan.limited_by == {"sub_batch_size": "target_batch_size (the largest n dividing it; 22 fit)",
                               "num_sub_batches": "target_batch_size"}
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  max_sub_batch_size=4, max_num_sub_batches=16)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (4, 16)
    assert plan.limited_by == {"sub_batch_size": "max_sub_batch_size", "num_sub_batches": "max_num_sub_batches"}
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  target_batch_size=8)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (8, 1)
    # the whole target in one sub-batch is the plan meant (no warning); a target n does not divide falls short
    assert plan.whole_batch_fits() and plan.single_sub_batch_warning() is None and plan.target_warning() is None
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  max_sub_batch_size=4, target_batch_size=10)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (2, 5) and plan.target_warning() is None
    # no smaller n that divides the target fits N = target / n (the cap on N): n x N falls short, and says so
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  max_sub_batch_size=4, max_num_sub_batches=4, target_batch_size=10)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (4, 2) and "e.g. 12" in plan.target_warning()
    # N = 1 short of the target is the shortfall the other warning names too (what gives N >= 2)
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  max_sub_batch_size=4, max_num_sub_batches=1, target_batch_size=10)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (4, 1) and "e.g. 12" in plan.target_warning()
    assert "schedule.host_memory_budget_gib" in plan.single_sub_batch_warning(
        ("schedule.gpu_memory_budget_gib", "schedule.host_memory_budget_gib"))


def test_budget_boundaries_are_inclusive():
    # Budgets exactly at n = 5 (GPU, no margin) and N = 3 (host) give exactly that plan.
    gpu = 2 * GIB + 1.5 * GIB * 5
    host = 30 * GIB + (L + 1) * 3 * 5 * S * SLOT_BYTES
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=gpu, host_budget_bytes=host,
                                  gpu_margin=0.0)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (5, 3)
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=gpu - 1, host_budget_bytes=host - 1,
                                  gpu_margin=0.0)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (4, 3)  # one byte less: n = 4, and then N = 3 still fits


def test_gpu_budget_too_small_for_one_sequence():
    # n = 1 needs 3.5 GiB; 3.8 GiB less 10% is 3.42 GiB.
    with pytest.raises(ValueError, match=r"GPU memory budget too small for even one sub-batch.*3\.500 GiB.*"
                                         r"schedule\.gpu_memory_budget_gib"):
        plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=int(3.8 * GIB), host_budget_bytes=120 * GIB)


def test_host_budget_too_small_for_one_sequence():
    # One sequence's slots: 9 x 4096 x 8 KiB = 288 MiB on top of 30 GiB of model states.
    host = 30 * GIB + 287 * MIB
    with pytest.raises(ValueError, match=r"host memory budget too small for even one sub-batch.*30\.281 GiB.*"
                                         r"FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB"):
        plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=host)
    plan = plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=host + MIB)
    assert (plan.num_sub_batches, plan.sub_batch_size) == (1, 1)  # 288 MiB fits: one sequence, N = 1


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="gpu_margin"):
        plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=GIB, host_budget_bytes=GIB, gpu_margin=1.0)
    with pytest.raises(ValueError, match="target_batch_size"):
        plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=GIB, host_budget_bytes=GIB,
                               target_batch_size=0)
    flat = [dataclasses.replace(_measure(n, gpu=GIB, host=GIB), activation_bytes_per_token=0)
            for n in (2, 4)]  # nothing grows with n: nothing bounds the plan
    with pytest.raises(ValueError, match="neither budget bounds"):
        plan_from_measurements(flat, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    with pytest.raises(ValueError, match=r"blocks_per_unit \[2\] asked for"):
        plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                               blocks_per_unit=[2])


def test_plan_with_activations_on_the_gpu():
    # activation_store='device': the slots' exact bytes join the GPU line, so the GPU budget bounds N too.
    slot = (L + 1) * S * SLOT_BYTES  # one sequence in every slot: 288 MiB
    ms = [_measure(n, N=2, gpu=2 * GIB + 1.5 * GIB * n + 2 * n * slot, host=30 * GIB, storage="device")
          for n in (2, 4)]
    plan = plan_from_measurements(ms, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    assert plan.gpu_fit.coef == pytest.approx((2 * GIB, 1.5 * GIB))
    n = plan.sub_batch_size  # largest n with 2 + 1.5 n + n x 0.28 GiB <= 36 GiB at N = 1
    assert n == 19 and plan.limited_by == {"sub_batch_size": "gpu budget", "num_sub_batches": "gpu budget"}
    assert plan.predict_gpu_bytes(n, plan.num_sub_batches) <= plan.gpu_target_bytes
    assert plan.predict_gpu_bytes(n, plan.num_sub_batches + 1) > plan.gpu_target_bytes


def test_plan_over_blocks_per_unit():
    # GPU = 1 + 0.5 b + 1.5 n b GiB (a unit of b blocks: b x parameters, n x b recompute activations).
    def gpu(n, b):
        return GIB * (1 + 0.5 * b + 1.5 * n * b)

    ms = [_measure(n, b=b, gpu=gpu(n, b), host=30 * GIB + (-(-L // b) + 1) * 2 * n * S * SLOT_BYTES)
          for b in (1, 2) for n in (2, 4)]
    plan = plan_from_measurements(ms, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    assert plan.gpu_fit.features == ("1", "n", "b", "n*b")
    assert plan.gpu_fit.coef == pytest.approx((GIB, 0.0, 0.5 * GIB, 1.5 * GIB), abs=1e-3 * GIB)
    # By hand: b = 1 -> n = 23, N = 13 (299 sequences); b = 2 -> n = 11, N = 52 (572): fewer slots per token win.
    assert (plan.blocks_per_unit, plan.sub_batch_size, plan.num_sub_batches) == (2, 11, 52)
    for b in (1, 2):
        n = max(k for k in range(1, 100) if gpu(k, b) <= 36 * GIB)
        N = max(k for k in range(1, 1000) if plan.predict_host_bytes(n, k, b) <= 120 * GIB)
        assert n * N <= plan.batch_size


# --- recorded on an H200 (bench/results/sweep_plan_llama7b_L8.json): the two defects of the first plan ------


def _h200_trials(pinned_growth=True) -> list[Measurement]:
    """The tuner's two trials of 7B width, 8 layers, s = 4096, N = 2, parameters offloaded, activations in
    the arena, as recorded. Between them the caching host allocator's page-locked blocks grew from 18.07 to
    27.11 GiB (``pinned_growth=False``: both at the first level)."""
    arena_shards = 8732819456 - 1207959552  # fp32 parameter shards in the arena
    levels = (19403407451, 29105111216 if pinned_growth else 19403407451)
    out = []
    for n, gpu, pinned in ((2, 5861011456, levels[0]), (4, 8085368832, levels[1])):
        slots = 9 * 2 * n * S * SLOT_BYTES
        breakdown = {"arena": arena_shards + slots, "arena_activations": slots, "model_states": 15049720108,
                     "pinned": pinned}
        host = breakdown["arena"] + breakdown["model_states"] + breakdown["pinned"]
        out.append(_measure(n, gpu=gpu, host=host, breakdown=breakdown))
    return out


H200_BUDGETS = dict(num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=114202206208)  # 106.4 GiB detected


def test_host_constant_that_grows_between_trials_does_not_cut_N():
    # The first tuner fitted a line through both trials: the pinned blocks' growth (9 GiB) became a slope of
    # 74 KB per token instead of the slots' 8 KiB, and the plan stopped at N = 7 where 16 fit (94.7% of the
    # best point). Only the slots grow with the tokens; the rest is the largest constant measured.
    trials = _h200_trials()
    assert [m.host_bytes for m in trials] == [43185947015, 54095610332]  # as recorded
    plan = plan_from_measurements(trials, **H200_BUDGETS, max_sub_batch_size=4, max_num_sub_batches=16)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (4, 16)  # the sweep's best point
    assert plan.limited_by == {"sub_batch_size": "max_sub_batch_size", "num_sub_batches": "max_num_sub_batches"}
    constant = 54095610332 - 9 * 2 * 4 * S * SLOT_BYTES  # the second trial's, the larger
    assert plan.host_fit.coef == (constant, SLOT_BYTES) and plan.host_fit.method == HOST_METHOD
    # Measured vs predicted: the trial at the largest constant exactly, the other over by the growth, never under.
    fitted = [plan.as_dict()["measurements"][k]["fitted_host_bytes"] for k in (0, 1)]
    assert fitted[1] == trials[1].host_bytes and fitted[0] - trials[0].host_bytes == 29105111216 - 19403407451
    # R^2 says it: the line explains less of the trials' difference than their mean (the constant moved).
    assert plan.host_fit.r2 < 0.0 and "largest measured constant" in plan.summary()
    # Without the caps the host budget bounds N: (106.4 GiB - 48.1 GiB) / (9 x 4 x 4096 x 8 KiB) = 51.8.
    uncapped = plan_from_measurements(trials, **H200_BUDGETS, max_sub_batch_size=4)
    assert uncapped.num_sub_batches == 51 and uncapped.limited_by["num_sub_batches"] == "host budget"
    # The constant's level moves the plan only by what it takes, never through the slope.
    steady = plan_from_measurements(_h200_trials(pinned_growth=False), **H200_BUDGETS, max_sub_batch_size=4)
    assert steady.host_fit.coef[1] == SLOT_BYTES and steady.host_fit.r2 == 1.0
    assert steady.num_sub_batches == (114202206208 - steady.host_fit.coef[0]) // (9 * 4 * S * SLOT_BYTES) == 59


def test_plan_respects_the_reserved_memory_line():
    # Peaks measured on the H200 with PyTorch's default allocator (2 x 8 and 4 x 8): reserved is about twice
    # the allocated peak. Budgeting the allocated peak alone gave n = 30 (n = 31 in test_tuner_gpu.py),
    # which ran out of memory once fragmentation filled the 40 GiB cap.
    gpu = {2: 5.53 * GIB, 4: 7.66 * GIB}
    reserved = {2: 11.06 * GIB, 4: 14.39 * GIB}
    allocated_only = plan_from_measurements([_measure(n, gpu=gpu[n], host=30 * GIB) for n in (2, 4)],
                                            num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    assert allocated_only.gpu_reserved_fit is None and allocated_only.sub_batch_size == 30
    plan = plan_from_measurements([_measure(n, gpu=gpu[n], reserved=reserved[n], host=30 * GIB) for n in (2, 4)],
                                  num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    # Reserved: 7.73 + 1.665 n GiB <= 36 GiB -> n = 16; the allocated line alone would allow 30.
    assert plan.sub_batch_size == 16 and plan.limited_by["sub_batch_size"] == "gpu budget"
    assert plan.predicted_gpu_reserved_bytes <= plan.gpu_target_bytes < plan.predict_gpu_reserved_bytes(17)
    assert plan.predicted_gpu_bytes < plan.predicted_gpu_reserved_bytes
    assert plan.gpu_reserved_fit.coef == pytest.approx((7.73 * GIB, 1.665 * GIB))
    metrics = plan.as_metrics()
    assert metrics["tune/trial1/measured_gpu_reserved_gib"] == pytest.approx(14.39)
    assert metrics["tune/gpu_reserved_coef_n_bytes"] == pytest.approx(1.665 * GIB)
    assert "reserved" in plan.summary()
    # A reserved line flatter than the allocated one never predicts less than the allocated peak.
    flat = plan_from_measurements([_measure(n, gpu=gpu[n], reserved=16 * GIB + n * MIB, host=30 * GIB)
                                   for n in (2, 4)], num_layers=L, gpu_budget_bytes=40 * GIB,
                                  host_budget_bytes=120 * GIB)
    assert flat.sub_batch_size == 30 and flat.predict_gpu_reserved_bytes(30) == flat.predict_gpu_bytes(30)


def test_slot_host_bytes_follow_the_store():
    nbytes = 9 * 3 * 5 * S * SLOT_BYTES + 100  # not a multiple of the alignment, not a power of two
    assert slot_host_bytes(nbytes, "arena") == (nbytes + 511) // 512 * 512
    assert slot_host_bytes(nbytes, "pinned") == 1 << nbytes.bit_length()  # the caching host allocator's rounding
    assert slot_host_bytes(1 << 30, "pinned") == 1 << 30
    assert slot_host_bytes(nbytes, "pageable") == nbytes and slot_host_bytes(nbytes, "device") == 0
    # The synchronous host store on CUDA: one power-of-two block of 2 GiB (n = 3) or 4 GiB (n = 5, and 6).
    ms = [_measure(n, gpu=GIB * n, host=30 * GIB + slot_host_bytes(9 * 2 * n * S * SLOT_BYTES, "pinned"),
                   storage="pinned") for n in (3, 5)]
    fit = fit_host(ms)
    assert fit.coef == (30 * GIB, SLOT_BYTES) and fit.r2 == 1.0
    plan = plan_from_measurements(ms, num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB)
    assert plan.predict_host_bytes(6, 2) == 34 * GIB


# --- errors when the plan runs out of memory anyway ----------------------------------------------------


def _plan() -> TunePlan:
    return plan_from_measurements(_recorded(), num_layers=L, gpu_budget_bytes=40 * GIB, host_budget_bytes=120 * GIB,
                                  gpu_budget_source="max_gpu_memory_gib")


def test_gpu_out_of_memory_names_the_gpu_budget():
    plan = _plan()
    error = plan.memory_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    assert isinstance(error, GpuPlanMemoryError) and isinstance(error, torch.OutOfMemoryError)
    assert error.budget == "gpu" and error.predicted_bytes == plan.predicted_gpu_bytes
    text = str(error)
    assert "the GPU memory budget was wrong" in text and "n=22 x N=14" in text
    assert f"predicted a peak of {plan.predicted_gpu_bytes / GIB:.3f} GiB" in text and "max_gpu_memory_gib" in text
    assert "out of memory" in text  # sweep drivers classify the point as 'oom'
    assert plan.memory_error(error) is None  # not wrapped twice
    assert plan.memory_error(ValueError("data.path is missing")) is None
    assert plan.memory_error(RuntimeError("boom")) is None


def test_arena_error_names_the_host_budget_and_the_shortfall():
    plan = _plan()
    arena = ArenaPlan().add("activations", "activations", (9, 14, 22, S, H), torch.bfloat16)
    budget = HostMemoryBudget(limit_bytes=80 * GIB, used_bytes=0, margin=0.1)  # 72 GiB for 86.6 GiB
    with pytest.raises(ValueError) as raised:
        check_plan(arena, budget, hint="lower schedule.num_sub_batches")
    error = plan.memory_error(raised.value)
    assert isinstance(error, HostPlanMemoryError) and isinstance(error, ValueError) and error.budget == "host"
    short = arena.nbytes - budget.available_bytes
    assert error.needed_bytes - error.predicted_bytes == short
    text = str(error)
    assert "the host memory budget was wrong" in text and f"short by {short / GIB:.3f} GiB" in text


# --- trial steps on a tiny model (the CPU stands in for the GPU) -----------------------------------------


def _cpu_mesh():
    maybe_init_process_group("cpu")
    return build_mesh("cpu")


def test_tune_end_to_end_on_cpu():
    rng = torch.get_rng_state()
    plan = fsdp_speedloader.tune(TINY, seq_len=32, offload_params=True, activation_store="host",
                                 host_memory_budget_bytes=64 * MIB, target_batch_size=16)
    assert torch.equal(torch.get_rng_state(), rng), "the trials must leave the global RNG as it was"
    assert [m.sub_batch_size for m in plan.measurements] == [2, 4]
    assert plan.device == "cpu" and plan.gpu_fit.exact and plan.gpu_reserved_fit is None  # no reserved on the CPU
    # Host accounting is exact: 4 bytes (fp32) x h per token per slot, and model states that do not grow.
    assert plan.host_fit.method == HOST_METHOD and plan.host_fit.r2 == 1.0
    assert plan.host_fit.coef[1] == TINY.hidden_size * 4
    params = sum(p.numel() for p in build_model(TINY, device="meta").parameters())
    for m in plan.measurements:
        # Parameters, gradients and two AdamW moments, fp32, whether the gradients are arena slots or not
        # (the parameters are in the arena): 512-byte alignment per slot aside, nothing else.
        fixed = m.host_bytes - m.host_activation_bytes
        assert 4 * params * 4 <= fixed <= 4 * params * 4 + 64 * 1024
        assert m.host_breakdown["model_states"] >= 2 * params * 4
        assert m.host_breakdown["arena_activations"] == 3 * 2 * m.sub_batch_size * 32 * TINY.hidden_size * 4
        assert m.host_activation_bytes == m.host_breakdown["arena_activations"]  # already 512-byte aligned
        assert m.host_bytes == sum(v for k, v in m.host_breakdown.items() if k in ("arena", "model_states"))
        assert plan.predict_host_bytes(m.sub_batch_size, m.num_sub_batches) == m.host_bytes
    assert plan.gpu_fit.coef[1] > 0  # the stand-in grows with n
    assert plan.batch_size <= 16 and plan.predicted_host_bytes <= 64 * MIB


def test_tune_counts_the_parameter_transfer_copies():
    """With param_transfer_dtype the trials hold the run's bf16 transfer copies: 2 bytes per offloaded parameter
    more host memory in the fitted constant than without them (alignment aside)."""
    kwargs = dict(seq_len=32, offload_params=True, activation_store="host", host_memory_budget_bytes=64 * MIB,
                  target_batch_size=16, param_dtype=torch.bfloat16)
    plain = fsdp_speedloader.tune(TINY, **kwargs)
    with_copies = fsdp_speedloader.tune(TINY, param_transfer_dtype=torch.bfloat16, **kwargs)
    params = sum(p.numel() for p in build_model(TINY, device="meta").parameters())
    extra = with_copies.host_fit.coef[0] - plain.host_fit.coef[0]
    assert 2 * params <= extra <= 2 * params + 64 * 1024, (extra, 2 * params)
    assert with_copies.measurements[0].host_breakdown["arena"] > plain.measurements[0].host_breakdown["arena"]


def test_cpu_stand_in_predicts_a_third_size():
    options = SpeedLoaderOptions(num_sub_batches=2)  # activations on the device (the CPU): GPU memory grows with N too
    with TrialModel(TINY, options, mesh=_cpu_mesh(), seed=0,
                    build_optimizer=lambda m: build_optimizer(m, OptimConfig())) as trial:
        trial.prime(4, 32)
        fitted = [trial.measure(n, 32) for n in (2, 4)]
        third = trial.measure(8, 32)
        model_ref = weakref.ref(trial.model)
    assert model_ref() is None, "closing the trial frees the model"
    plan = plan_from_measurements(fitted, num_layers=2, gpu_budget_bytes=GIB, host_budget_bytes=GIB,
                                  target_batch_size=8)
    assert third.activations_on_device and third.device_activation_bytes == 3 * 2 * 8 * 32 * 64 * 4
    assert plan.predict_gpu_bytes(8, 2) == pytest.approx(third.gpu_peak_bytes, rel=0.05)


# --- schedule.name=auto in the trainer ----------------------------------------------------------------------


def _auto_config(tmp_path, *, steps=3, **schedule) -> TrainConfig:
    return tiny_config(tmp_path, offload={"params": True}, steps=steps,
                       schedule={"name": "auto", "activation_store": "host", **schedule})


def test_trainer_auto_runs_the_plan(tmp_path, capsys, monkeypatch):
    # Budgets set from the fits so that the plan is n = 2, N = 3: between the predictions at 2 and 3
    # sequences (GPU) and between 3 and 4 sub-batches of 2 (host).
    probe = tune_train_config(_auto_config(tmp_path / "probe"), mesh=_cpu_mesh(), param_dtype=torch.float32,
                              reduce_dtype=torch.float32)
    gpu = (probe.predict_gpu_bytes(2) + probe.predict_gpu_bytes(3)) / 2 / (1 - probe.gpu_margin)
    host = (probe.predict_host_bytes(2, 3) + probe.predict_host_bytes(2, 4)) / 2
    trainer = Trainer(_auto_config(tmp_path / "auto", gpu_memory_budget_gib=gpu / GIB,
                                   host_memory_budget_gib=host / GIB))
    plan = trainer.tune_plan
    assert (plan.sub_batch_size, plan.num_sub_batches) == (2, 3)
    assert plan.limited_by == {"sub_batch_size": "gpu budget", "num_sub_batches": "host budget"}
    assert plan.gpu_budget_source == "schedule.gpu_memory_budget_gib"
    sched = trainer.cfg.schedule
    assert (sched.name, sched.sub_batch_size, sched.num_sub_batches) == ("speedloader", 2, 3)
    losses = [m["loss"] for m in trainer.train(max_steps=2)]

    # The same run with the plan set by hand: the same losses (the trials leave the RNG as it was).
    manual = tiny_config(tmp_path / "manual", offload={"params": True}, steps=3,
                         schedule={"name": "speedloader", "activation_store": "host", "sub_batch_size": 2,
                                   "num_sub_batches": 3})
    assert [m["loss"] for m in Trainer(manual).train(max_steps=2)] == losses
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and records[0]["tune/num_sub_batches"] == 3  # the plan, logged before step 1

    # Out of GPU memory with the plan (simulated in step 3): the error names the budget that was wrong.
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    trainer.train_step = oom
    with pytest.raises(UserError, match=r"n=2 x N=3.*the GPU memory budget was wrong") as raised:
        trainer.train()  # a UserError: the entry point prints it in one line and exits 2
    assert isinstance(raised.value.__cause__, GpuPlanMemoryError) and raised.value.__cause__.budget == "gpu"
    assert isinstance(raised.value.__cause__.__cause__, torch.OutOfMemoryError)
    assert "\n" not in str(raised.value) and "out of memory" in str(raised.value)  # a sweep's point: 'oom'
    capsys.readouterr()
    monkeypatch.setattr("fsdp_speedloader.app.launch.dist.destroy_process_group", lambda: None)  # keep the group
    with pytest.raises(SystemExit) as exited:  # what app/train.py does with it
        fail(raised.value)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("error: out of GPU memory with the tuned "
                                                                             "plan (n=2 x N=3"), err


def test_trainer_auto_host_budget_too_small(tmp_path):
    cfg = _auto_config(tmp_path, host_memory_budget_gib=1e-4)  # 100 KiB: less than the model states
    with pytest.raises(ValueError, match="host memory budget too small for even one sub-batch"):
        Trainer(cfg)


@pytest.mark.parametrize("schedule,field", [({"gpu_memory_budget_gib": 0.0}, "schedule.gpu_memory_budget_gib"),
                                            ({"host_memory_budget_gib": -1.0}, "schedule.host_memory_budget_gib"),
                                            ({"target_batch_size": 0}, "schedule.target_batch_size"),
                                            ({"max_sub_batch_size": -2}, "schedule.max_sub_batch_size"),
                                            ({"tune_blocks_per_unit": [1, 0]}, "schedule.tune_blocks_per_unit")])
def test_auto_schedule_fields_are_validated(tmp_path, schedule, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _auto_config(tmp_path, **schedule)


def test_auto_schedule_caps_the_sub_batch_size(tmp_path):
    """schedule.max_sub_batch_size caps n, target_batch_size then caps N: the way to a plan of few short sub-batches
    whose GPU memory left over goes to kept pairs (docs/tuner.md)."""
    plan = tune_train_config(_auto_config(tmp_path, max_sub_batch_size=1, target_batch_size=3), mesh=_cpu_mesh(),
                             param_dtype=torch.float32, reduce_dtype=torch.float32)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (1, 3)
    assert plan.limited_by == {"sub_batch_size": "schedule.max_sub_batch_size",
                               "num_sub_batches": "schedule.target_batch_size"}  # the settings, by name


def test_auto_schedule_on_a_cpu_keeps_the_configured_batch(tmp_path):
    """Without CUDA and without a GPU budget the stand-in's budget would be the whole host memory: the plan was one
    sub-batch of thousands of sequences (issue 42). It keeps the configured n x N instead, and says so."""
    cfg = tiny_config(tmp_path, schedule={"name": "auto", "sub_batch_size": 3, "num_sub_batches": 5})
    plan = tune_train_config(cfg, mesh=_cpu_mesh(), param_dtype=torch.float32, reduce_dtype=torch.float32)
    assert (plan.sub_batch_size, plan.num_sub_batches) == (3, 5)
    assert plan.limited_by == {"sub_batch_size": "schedule.sub_batch_size as configured, on a CPU",
                               "num_sub_batches": "schedule.num_sub_batches as configured, on a CPU"}
    assert "limited by schedule.sub_batch_size as configured, on a CPU" in plan.summary()
    # A target batch keeps the configured n and sets N; a cap given is kept; a GPU budget is filled (no caps).
    sched = lambda **kw: tiny_config(tmp_path, schedule={"name": "auto", "sub_batch_size": 3, **kw}).schedule  # noqa
    assert configured_caps(sched(target_batch_size=12))[0] == {"max_sub_batch_size": 3, "max_num_sub_batches": None,
                                                               "target_batch_size": 12}
    assert configured_caps(sched(max_sub_batch_size=8))[0] == {"max_sub_batch_size": 8, "max_num_sub_batches": 2,
                                                               "target_batch_size": None}
    assert "max_sub_batch_size" not in configured_caps(sched(max_sub_batch_size=8))[1]  # named as given


def test_profiled_step_prints_no_profiler_lines(capfd):
    """The CPU stand-in's profiler wrote Kineto's stage lines (and c10's warning about blocks allocated before it
    started) to stderr on every trial step; what the step itself writes still gets through."""
    from fsdp_speedloader.tuning.trial import profiled_peak_bytes

    before = [torch.ones(1 << 16) for _ in range(4)]

    def step():
        after = torch.ones(1 << 18)  # 1 MiB
        before.clear()  # blocks allocated before the profiler started, freed under it
        os.write(2, b"a line of the step itself\n")
        del after

    assert profiled_peak_bytes(step) >= 1 << 20
    err = capfd.readouterr().err
    assert "a line of the step itself" in err
    assert "SyncActivityProfilerHandler" not in err and "Completed Stage" not in err, err
    assert "Memory block of unknown size" not in err, err


# --- the entry point --------------------------------------------------------------------------------------


def test_tune_config_composes():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("tune", overrides=["experiment=llama2_7b_offload", "schedule.gpu_memory_budget_gib=40",
                                         "output_dir=/tmp/x"])
    d = OmegaConf.to_container(cfg, resolve=True)
    d.pop("hydra", None)
    tc = TrainConfig.from_dict(d)
    assert (tc.schedule.name, tc.schedule.gpu_memory_budget_gib, tc.model.name) == ("auto", 40.0, "llama2_7b")


def test_tune_cli(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fsdp_speedloader.app.tune", "experiment=tiny_cpu", "logger=none",
                           "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
                           "data.seq_len=32",
                           "offload=params", "schedule.activation_store=host", "schedule.target_batch_size=8",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((run_dir / "tune_plan.json").read_text())
    plan = record["plan"]
    assert plan["sub_batch_size"] * plan["num_sub_batches"] <= 8
    assert (plan["sub_batch_size"], plan["num_sub_batches"]) == (2, 4)  # tiny_cpu's n, N up to the target (a CPU)
    assert "profiler_start" not in proc.stderr and "Completed Stage" not in proc.stderr, proc.stderr
    assert record["overrides"][0] == "schedule=speedloader"
    assert len(plan["measurements"]) == 2 and math.isclose(plan["host_fit"]["r2"], 1.0)


# --- several ranks ------------------------------------------------------------------------------------------


def _tune_on_rank(rank: int, world_size: int) -> dict:
    plan = fsdp_speedloader.tune(TINY, seq_len=32, offload_params=True, activation_store="host",
                                 host_memory_budget_bytes=(64 + rank) * MIB, target_batch_size=16)
    return {"plan": (plan.sub_batch_size, plan.num_sub_batches), "host_budget": plan.host_budget_bytes,
            "gpu": [m.gpu_peak_bytes for m in plan.measurements], "host": [m.host_bytes for m in plan.measurements]}


@pytest.mark.slow
def test_ranks_agree_on_the_plan():
    from dist_utils import run_distributed

    a, b = run_distributed(_tune_on_rank, 2)
    assert a == b, "every rank fits the maximum over ranks and gets the same plan"
    assert a["host_budget"] == 64 * MIB  # the smallest budget of any rank


def test_train_config_passes_the_run_s_placement_to_the_trials(tmp_path, monkeypatch):
    """schedule=auto tunes with the run's offload.root and offload.param_transfer_dtype, so the trials hold
    the run's states where the run will (a root on the GPU, bf16 transfer copies in the arena)."""
    from fsdp_speedloader.app import planning

    seen = {}
    monkeypatch.setattr(planning, "tune", lambda model, options, **kwargs: seen.update(options=options, **kwargs))
    cfg = tiny_config(tmp_path, schedule={"name": "auto"}, param_dtype="bfloat16",
                      offload={"params": True, "root": False, "param_transfer_dtype": "bf16"})
    planning.tune_train_config(cfg, mesh=None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert seen["options"].offload_root is False and seen["options"].param_transfer_dtype == torch.bfloat16
    assert seen["options"] == speedloader_options(cfg, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _FakeTrial(TrialModel):
    """A real trial model (built from the options it is given, then freed) whose steps are not run: each
    ``measure`` returns memory that is linear in n and b, enough for a plan."""

    built: list = []

    def __init__(self, model_config, options, **kwargs):
        super().__init__(model_config, options, **kwargs)
        compiled = fsdp_speedloader.speedloader_engine(self.model).adapter.compiled_block_forward is not None
        self.built.append((options, compiled))
        self.close()

    def prime(self, n, seq_len):
        pass

    def measure(self, n, seq_len):
        b = self.blocks_per_unit
        return Measurement(sub_batch_size=n, num_sub_batches=self.num_sub_batches, blocks_per_unit=b,
                           seq_len=seq_len, num_slots=-(-TINY.num_layers // b) + 1, gpu_peak_bytes=(10 + n + b) * MIB,
                           host_bytes=MIB, activation_bytes_per_token=TINY.hidden_size * 4, activation_storage="arena")


def test_auto_schedule_with_compiled_blocks_tunes_a_compiled_model(tmp_path, monkeypatch):
    """schedule=auto with schedule.compile_blocks=true: every trial model is built from the run's own
    SpeedLoaderOptions -- compiled blocks, offload, store, dtypes -- with the trials' N and each blocks_per_unit
    candidate, so a compiled run is planned from compiled trials (not from an eager model)."""
    from fsdp_speedloader.tuning import tuner

    monkeypatch.setattr(tuner, "TrialModel", _FakeTrial)
    monkeypatch.setattr(_FakeTrial, "built", [])
    cfg = tiny_config(tmp_path, offload={"params": True},
                      schedule={"name": "auto", "compile_blocks": True, "activation_store": "host",
                                "num_sub_batches": 5, "tune_blocks_per_unit": [2], "target_batch_size": 8})
    plan = tune_train_config(cfg, mesh=_cpu_mesh(), param_dtype=torch.float32, reduce_dtype=torch.float32)
    run = speedloader_options(cfg, param_dtype=torch.float32, reduce_dtype=torch.float32)
    assert run.compile_blocks
    # the trials keep one (unit, sub-batch) pair: they measure its bytes for the plan's keep_activations
    assert _FakeTrial.built == [(run.replace(num_sub_batches=2, blocks_per_unit=b, keep_activations=1), True)
                                for b in (1, 2)]
    assert plan.batch_size <= 8 and {m.blocks_per_unit for m in plan.measurements} == {1, 2}


def test_tune_takes_options_and_keyword_overrides(monkeypatch):
    """``tune(model, options, **overrides)`` as ``apply_speedloader``: the overrides apply over the options, and
    a bad value fails before any trial model is built."""
    from fsdp_speedloader.tuning import tuner

    monkeypatch.setattr(tuner, "TrialModel", _FakeTrial)
    monkeypatch.setattr(_FakeTrial, "built", [])
    options = SpeedLoaderOptions(offload_params=True, activation_store="host", blocks_per_unit=2)
    fsdp_speedloader.tune(TINY, options, seq_len=32, mesh=_cpu_mesh(), loss_chunk_tokens=64, target_batch_size=4,
                          host_memory_budget_bytes=64 * MIB, gpu_memory_budget_bytes=GIB)
    trial_options = options.replace(num_sub_batches=2, loss_chunk_tokens=64, keep_activations=1)  # one kept pair
    assert [o for o, _ in _FakeTrial.built] == [trial_options]
    with pytest.raises(ValueError, match="activation_store"):
        fsdp_speedloader.tune(TINY, options, seq_len=32, mesh=_cpu_mesh(), activation_store="disk")
    with pytest.raises(ValueError, match="tune_blocks_per_unit"):
        fsdp_speedloader.tune(TINY, options, seq_len=32, mesh=_cpu_mesh(), tune_blocks_per_unit=[0])
    assert len(_FakeTrial.built) == 1


@pytest.mark.slow
def test_auto_schedule_trials_run_compiled_blocks(tmp_path):
    """The same end to end: the trial steps of a compiled run go through the compiled block function
    (inductor on the CPU), and the plan comes out of them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_config(tmp_path, offload={"params": True},
                      schedule={"name": "auto", "compile_blocks": True, "activation_store": "host",
                                "target_batch_size": 8})
    plan = tune_train_config(cfg, mesh=_cpu_mesh(), param_dtype=torch.float32, reduce_dtype=torch.float32)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [m.sub_batch_size for m in plan.measurements] == [2, 4] and plan.batch_size <= 8
    torch._dynamo.reset()


def test_auto_schedule_with_the_overlapped_optimizer(tmp_path):
    """schedule=auto with optim.overlap_with_backward: the trials hold the run's per-unit optimizers (their
    state is counted, their worker thread stopped when the trial model is freed)."""
    import threading

    cfg = tiny_config(tmp_path, offload={"params": True}, optim={"overlap_with_backward": True, "grad_clip": 0.0},
                      schedule={"name": "auto", "activation_store": "host", "target_batch_size": 8})
    plain = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, overlap_with_backward=False))
    workers = threading.active_count()
    plans = [tune_train_config(c, mesh=_cpu_mesh(), param_dtype=torch.float32, reduce_dtype=torch.float32)
             for c in (cfg, plain)]
    assert threading.active_count() == workers, "the overlapped optimizers' worker threads were stopped"
    for overlapped, plain_m in zip(plans[0].measurements, plans[1].measurements):
        assert overlapped.host_breakdown["model_states"] == plain_m.host_breakdown["model_states"] > 0


def test_a_detected_host_budget_is_measured_again_after_the_trials(monkeypatch):
    # planned with the memory in use before the trials, a plan filled the host to the brim and the run's own arena
    # check, which counts what the process holds after them, refused it
    from fsdp_speedloader.tuning.tuner import Budgets, _after_trials

    monkeypatch.setenv("FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB", "1000")
    before = Budgets(2**50, "the CPU stand-in: detected host memory", 2**50, "detected: before")
    after = _after_trials(before, host_given=False, device=torch.device("cpu"))
    assert after.host_bytes < 1000 * GIB and after.host_source.startswith("detected after the trials: ")
    assert after.gpu_bytes == after.host_bytes  # the CPU stand-in's budget is host memory too
    given = Budgets(2**50, "schedule.gpu_memory_budget_gib", 2**50, "schedule.host_memory_budget_gib")
    assert _after_trials(given, host_given=True, device=torch.device("cpu")) == given  # what the user set stays
