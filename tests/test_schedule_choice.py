"""schedule=auto's choice between layer-major's plan and the canonical schedule gathered once
(fsdp_speedloader/app/schedule_choice.py): the arithmetic by hand, the cases where no trial runs, and the measured
choice end to end on the CPU (the chosen schedule's run equals the same schedule set by hand)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dist_utils import tiny_config
from fsdp_speedloader.app.planning import planned_config, tune_train_config
from fsdp_speedloader.app.schedule_choice import MARGIN, canonical_config, choose_schedule, faster, gathered_bytes, \
    largest_micro_batch
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.parallel import build_mesh, maybe_init_process_group

GIB = 1 << 30


def _cpu_mesh():
    maybe_init_process_group("cpu")
    return build_mesh("cpu")


def _auto(tmp_path, *, optim=None, offload=None, **schedule):
    return tiny_config(tmp_path, offload={"params": True, **(offload or {})}, optim=optim or {}, steps=3,
                       schedule={"name": "auto", "activation_store": "host", "target_batch_size": 8, **schedule})


def _plan(cfg):
    return tune_train_config(cfg, mesh=_cpu_mesh(), param_dtype=torch.float32, reduce_dtype=torch.float32)


def test_the_faster_schedule_by_hand():
    assert faster(1.0, 0.97) == "canonical"  # 3% shorter
    assert faster(1.0, 0.99) == "speedloader"  # within the margin: the tuner's plan
    assert faster(1.0, 1.0 / (1 + MARGIN) + 1e-9) == "speedloader"
    assert faster(0.5, 1.0) == "speedloader"


def test_largest_micro_batch_by_hand():
    # peak = 10 + 2 (m - 1) bytes: m <= 4.5 fits 17; of the divisors of 32, 4
    assert largest_micro_batch(32, {1: 10.0, 2: 12.0}, 17.0) == (4, 16.0)
    assert largest_micro_batch(24, {1: 10.0, 2: 12.0}, 17.0) == (4, 16.0)
    assert largest_micro_batch(30, {1: 10.0, 2: 12.0}, 17.0) == (3, 14.0)  # 4 does not divide 30
    assert largest_micro_batch(32, {1: 10.0, 2: 12.0}, 1e9) == (32, 72.0)  # the whole batch at once
    assert largest_micro_batch(32, {1: 10.0, 2: 12.0}, 1e9, cap=8) == (8, 24.0)  # the cap on n caps m
    assert largest_micro_batch(32, {2: 12.0, 1: 10.0}, 9.0) == (0, 10.0)  # not even one sequence


def test_gathered_bytes():
    assert gathered_bytes(1000, torch.bfloat16) == 4000  # parameters and gradients, 2 bytes each
    assert gathered_bytes(1000, torch.float32) == 8000


def test_canonical_config_runs_the_plans_batch_gathered_once(tmp_path):
    cfg = _auto(tmp_path, optim={"overlap_with_backward": True, "grad_clip": 0.0})
    plan = _plan(cfg)
    run = canonical_config(cfg, plan, 2)
    sched = run.schedule
    assert (sched.name, sched.sub_batch_size, sched.batch_size) == ("canonical", 2, plan.batch_size)
    assert (sched.activation_checkpointing, sched.gradient_sync, sched.reshard_after_forward) == (False, "last", False)
    assert sched.target_batch_size is None and sched.canonical_candidate is None  # the tuner's settings, spent
    assert not run.optim.overlap_with_backward  # the overlap is layer-major's
    assert run.offload.device_units == plan.device_units


def test_no_trial_where_the_canonical_candidate_cannot_win_or_run(tmp_path):
    mesh = _cpu_mesh()
    cfg = _auto(tmp_path)
    plan = _plan(cfg)
    choose = lambda c, p: choose_schedule(c, p, planned_config(p, c), mesh=mesh,  # noqa: E731
                                          param_dtype=torch.float32, reduce_dtype=torch.float32)
    one = dataclasses.replace(plan, sub_batch_size=plan.batch_size, num_sub_batches=1)
    assert choose(cfg, one).name == "speedloader" and choose(cfg, one).reason.startswith("N = 1")
    small = dataclasses.replace(plan, gpu_budget_bytes=1 << 16)  # 64 KiB: the model gathered does not fit
    choice = choose(cfg, small)
    assert choice.name == "speedloader" and "does not fit the GPU budget" in choice.reason
    assert choice.speedloader_step_s == choice.canonical_step_s == 0.0  # decided without a trial
    transfer = _auto(tmp_path, offload={"param_transfer_dtype": "bfloat16"})
    choice = choose(transfer, plan)
    assert choice.name == "speedloader" and "offload.param_transfer_dtype" in choice.reason
    bf16 = _auto(tmp_path, optim={"master_dtype": "bf16", "state_dtype": "bf16"})
    assert "master_dtype=bf16" in choose(bf16, plan).reason


def test_auto_runs_the_schedule_it_measured_faster(tmp_path):
    """Both candidates timed on the plan's whole batch; the trainer runs the faster, and its losses are those of
    the same schedule set by hand (the trials leave the RNG as it was)."""
    cfg = _auto(tmp_path / "auto", canonical_candidate=True)
    trainer = Trainer(cfg)
    plan = trainer.tune_plan
    assert plan.speedloader_step_s > 0 and plan.canonical_step_s > 0
    assert plan.schedule == faster(plan.speedloader_step_s, plan.canonical_step_s)
    assert 1 <= plan.canonical_sub_batch_size <= 2  # on a CPU: capped as n is, by the configured sub-batch
    assert plan.batch_size % plan.canonical_sub_batch_size == 0
    expected = "canonical" if plan.schedule == "canonical" else "speedloader"
    assert trainer.cfg.schedule.name == expected
    assert f"schedule: {plan.schedule} (measured: layer-major" in plan.summary()
    losses = [m["loss"] for m in trainer.train(max_steps=2)]
    assert all(0 < loss < 20 for loss in losses)
    manual = dataclasses.replace(planned_config(plan, cfg), output_dir=str(tmp_path / "manual"))
    assert [m["loss"] for m in Trainer(manual).train(max_steps=2)] == losses
    records = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["tune/canonical"] == int(plan.schedule == "canonical")
    assert records[0]["tune/canonical_step_s"] == pytest.approx(plan.canonical_step_s)


def _auto_on_rank(rank: int, world_size: int, out_dir: str) -> dict:
    trainer = Trainer(_auto(Path(out_dir), canonical_candidate=True))
    plan = trainer.tune_plan
    losses = [m["loss"] for m in trainer.train(max_steps=2)]
    return {"schedule": (plan.schedule, trainer.cfg.schedule.name, plan.canonical_sub_batch_size),
            "times": (plan.speedloader_step_s, plan.canonical_step_s), "losses": losses}


def test_ranks_choose_alike(tmp_path):
    """Two gloo ranks: the trials' times and peaks are maxima over the ranks, so both choose the same schedule and
    train it together."""
    from dist_utils import run_distributed

    a, b = run_distributed(_auto_on_rank, 2, str(tmp_path))
    assert a == b
    assert a["schedule"][0] == faster(*a["times"]) and all(t > 0 for t in a["times"])


def test_the_canonical_plan_as_overrides(tmp_path):
    cfg = _auto(tmp_path)
    plan = dataclasses.replace(_plan(cfg), schedule="canonical", canonical_sub_batch_size=2)
    overrides = dict(o.split("=", 1) for o in plan.overrides())
    assert overrides["schedule"] == "canonical" and overrides["schedule.sub_batch_size"] == "2"
    assert int(overrides["schedule.num_sub_batches"]) * 2 == plan.batch_size
    assert overrides["schedule.reshard_after_forward"] == "false" and overrides["schedule.gradient_sync"] == "last"
    assert plan.memory_error(torch.OutOfMemoryError("CUDA out of memory")) is None  # not the layer-major plan's
    # the overrides compose into a valid training config (Hydra, the experiment's layer-major settings under them)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fsdp_speedloader.app.config import TrainConfig

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        composed = compose("config", overrides=["experiment=llama2_7b_offload", *plan.overrides(),
                                                f"output_dir={tmp_path}"])
    d = OmegaConf.to_container(composed, resolve=True)
    run = TrainConfig.from_dict(d)
    sched = run.schedule
    assert (sched.name, sched.sub_batch_size, sched.reshard_after_forward) == ("canonical", 2, False)


def test_canonical_candidate_is_for_auto_only(tmp_path):
    with pytest.raises(ValueError, match=r"schedule\.canonical_candidate"):
        tiny_config(tmp_path, schedule={"name": "speedloader", "canonical_candidate": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_measures_the_canonical_candidate_by_default(tmp_path):
    """On CUDA schedule=auto tries the canonical candidate without being asked (canonical_candidate null), runs the
    faster, and the run is the same schedule's set by hand (losses within bf16 noise)."""
    cfg = tiny_config(tmp_path / "auto", device="cuda", offload={"params": True}, steps=3,
                      schedule={"name": "auto", "target_batch_size": 8, "max_sub_batch_size": 2})
    trainer = Trainer(cfg)
    plan = trainer.tune_plan
    assert plan.num_sub_batches > 1  # on a GPU the tiny model's plan is one sub-batch (N = 1: nothing to compare)
    assert plan.schedule_reason.startswith("measured: ") and plan.canonical_step_s > 0 and plan.speedloader_step_s > 0
    assert plan.schedule == faster(plan.speedloader_step_s, plan.canonical_step_s)
    assert trainer.cfg.schedule.name == plan.schedule
    losses = [m["loss"] for m in trainer.train(max_steps=2)]
    manual = dataclasses.replace(planned_config(plan, cfg), output_dir=str(tmp_path / "manual"))
    assert [m["loss"] for m in Trainer(manual).train(max_steps=2)] == pytest.approx(losses, rel=2e-2)
