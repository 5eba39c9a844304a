"""The host memory plan by tier (``memory/host_plan.py``, ``app/host_memory.py``): the figures per mode, and the
trainer's refusal of a plan over the host budget -- one line, before the model takes host memory, naming each
setting that frees memory and by how much."""

from __future__ import annotations

import pytest
import torch

import fsdp_speedloader.app.host_memory as host_memory_mod
from dist_utils import tiny_config
from fsdp_speedloader.app.host_memory import host_memory_plan, unit_and_root_shards
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.memory.arena import GIB, HostMemoryBudget
from fsdp_speedloader.memory.host_plan import check_host_plan, plan_host_memory, savings_of, shard_numels
from fsdp_speedloader.models import build_model

UNIT = [(1000, 1000), (24, 24)]  # two parameters per unit, one rank: (padded, local) elements
LLAMA2_7B = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096}  # conf/model/llama2_7b.yaml's shapes


def test_tiers_per_mode():
    units, root = [UNIT] * 4, [(4000, 4000)]
    exact = plan_host_memory(units=units, root=root)
    unit_grads = 4096 + 512  # one unit's shards/gradients, each aligned to 512 B (4000 B -> 4096, 96 B -> 512)
    assert exact.param_shards == exact.grads == 4 * unit_grads + 16384
    assert exact.optimizer_states == 8 * (4 * 1024 + 4000)
    assert exact.bytes_per_param()["optimizer_states"] == 8.0
    ring = plan_host_memory(units=units, root=root, grad_slots_in_flight=2)
    assert ring.grads == 2 * unit_grads + 16384  # two units' regions and the root's own slots
    assert plan_host_memory(units=units, root=root, grad_slots_in_flight=9).grads == exact.grads  # 4 units: 4 regions
    assert ring.param_shards == exact.param_shards and ring.optimizer_states == exact.optimizer_states
    bf16 = plan_host_memory(units=units, root=root, grad_slots_in_flight=2, state_dtype="bf16")
    assert bf16.optimizer_states == exact.optimizer_states // 2
    on_device = plan_host_memory(units=units, root=root, root_on_host=False)
    assert on_device.num_params == 4 * 1024 and on_device.optimizer_states == 8 * 4 * 1024
    assert shard_numels((97, 64), 2, 0) == (49 * 64, 49 * 64) and shard_numels((97, 64), 2, 1) == (49 * 64, 48 * 64)


def test_refusal_is_one_line_with_the_bytes_each_setting_frees():
    plan = plan_host_memory(units=[UNIT] * 4, root=[(4000, 4000)])
    smaller = plan_host_memory(units=[UNIT] * 4, root=[(4000, 4000)], state_dtype="int8")
    budget = HostMemoryBudget(limit_bytes=smaller.total + 100, used_bytes=0, margin=0.0)
    check_host_plan(smaller, budget)  # fits: nothing raised
    with pytest.raises(ValueError) as info:
        check_host_plan(plan, budget, savings=savings_of(plan, [("optim.state_dtype=int8", smaller)]), hint="hint")
    text = str(info.value)
    assert "\n" not in text and text.startswith("the pinned host arena needs ")
    freed = (plan.total - smaller.total) / GIB
    assert f"optim.state_dtype=int8 frees {freed:.2f} GiB (enough)" in text


def test_plan_of_a_model_and_config():
    cfg = tiny_config("unused", offload={"params": True}, schedule={"name": "speedloader"}, model={"num_layers": 6})
    model = build_model(cfg.model, device="meta")
    units, root = unit_and_root_shards(model, blocks_per_unit=1, shards=1)
    assert len(units) == cfg.model.num_layers
    assert sum(local for unit in units for _, local in unit) + sum(local for _, local in root) == sum(
        p.numel() for p in model.parameters())
    plan, alternatives = host_memory_plan(model, cfg, shards=1)
    settings = dict(alternatives)
    assert {"optim.state_dtype=bf16", "optim.state_dtype=int8"} <= set(settings)
    ring = settings["optim.overlap_with_backward=true optim.grad_clip=0 (in-flight gradient slots)"]
    assert ring.grads < plan.grads and ring.param_shards == plan.param_shards
    acts = settings["schedule.activation_store=device (activations on the GPU)"]
    assert acts.activations == 0 < plan.activations
    assert plan.activations == (cfg.model.num_layers + 1) * 2 * 2 * 32 * 64 * 2  # U + 1 slots of N x n x s x h, bf16


def test_fewer_gradient_regions_in_flight_is_named_where_they_free_memory():
    """The default R = 4 in-flight regions (slack for the worker on a busy host) cost 2 units' gradients more than
    R = 2: a plan over the budget names that saving."""
    ring = {"overlap_with_backward": True, "grad_clip": 0.0}
    cfg = tiny_config("unused", offload={"params": True}, schedule={"name": "speedloader"}, optim=ring,
                      model={"num_layers": 6})
    assert cfg.optim.grad_slots_in_flight == 4
    model = build_model(cfg.model, device="meta")
    units, _ = unit_and_root_shards(model, blocks_per_unit=1, shards=1)
    plan, alternatives = host_memory_plan(model, cfg, shards=1)
    two = dict(alternatives)["optim.grad_slots_in_flight=2"]
    region = max(sum(-(-local * 4 // 512) * 512 for _, local in unit) for unit in units)  # fp32, 512-B aligned
    assert plan.grads - two.grads == 2 * region > 0
    low = tiny_config("unused", offload={"params": True}, schedule={"name": "speedloader"},
                      optim={**ring, "grad_slots_in_flight": 2}, model={"num_layers": 6})
    assert "optim.grad_slots_in_flight=2" not in dict(host_memory_plan(model, low, shards=1)[1])


def test_units_kept_on_the_device_leave_the_host_plan():
    """offload.device_units=K: units 1 .. K hold no host shards, gradients or states; activations are unchanged."""
    cfg = tiny_config("unused", offload={"params": True, "device_units": 1}, schedule={"name": "speedloader"},
                      model={"num_layers": 4})
    model = build_model(cfg.model, device="meta")
    units, root = unit_and_root_shards(model, blocks_per_unit=1, shards=1)
    plan, _ = host_memory_plan(model, cfg, shards=1)
    everything, _ = host_memory_plan(model, tiny_config("unused", offload={"params": True},
                                                        schedule={"name": "speedloader"}, model={"num_layers": 4}),
                                     shards=1)
    assert plan.num_params == everything.num_params - sum(local for _, local in units[0])
    assert plan.optimizer_states < everything.optimizer_states and plan.activations == everything.activations


def _refused(cfg, budget: HostMemoryBudget, monkeypatch) -> tuple[str, list]:
    """The trainer's refusal of ``cfg`` under ``budget``: (its one line, the materialisations so far: none)."""
    monkeypatch.setattr(host_memory_mod.HostMemoryBudget, "detect", classmethod(lambda cls, *a, **k: budget))
    materialized = []
    monkeypatch.setattr("fsdp_speedloader.app.trainer.materialize_model", lambda *a, **k: materialized.append(1))
    with pytest.raises(ValueError) as info:
        Trainer(cfg)
    text = str(info.value)
    assert "\n" not in text and not materialized
    return text, materialized


def test_the_trainer_refuses_before_the_model_takes_host_memory(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, offload={"params": True}, schedule={"name": "speedloader"})
    model = build_model(cfg.model, device="meta")
    plan, alternatives = host_memory_plan(model, cfg, shards=1, activation_itemsize=4)
    int8 = dict(alternatives)["optim.state_dtype=int8"]
    text, _ = _refused(cfg, HostMemoryBudget(limit_bytes=(plan.total + int8.total) // 2, used_bytes=0, margin=0.0),
                       monkeypatch)
    assert f"optim.state_dtype=int8 frees {(plan.total - int8.total) / GIB:.2f} GiB (enough)" in text
    assert "lower schedule.num_sub_batches" in text


def test_training_on_the_cpu_is_refused_before_the_states_fill_host_memory(tmp_path, monkeypatch):
    """On the CPU every model state is in host memory (16 B a parameter with fp32 AdamW): a 7B shape on a 24 GiB
    machine is one line naming the GiB and what frees them, before any shard is materialised (it used to fill the
    host's memory until the kernel killed the process)."""
    cfg = tiny_config(tmp_path, model=LLAMA2_7B)
    num_params = sum(p.numel() for p in build_model(cfg.model, device="meta").parameters())
    text, materialized = _refused(cfg, HostMemoryBudget(limit_bytes=24 * GIB, used_bytes=0, margin=0.0), monkeypatch)
    need = num_params * 16  # fp32 parameters, gradients and AdamW's two moments (each tensor 512-B aligned)
    assert text.startswith(f"training on the CPU keeps every model state in host memory: {need / GIB:.2f} GiB for "
                           f"{num_params:,} parameters on this rank"), text
    assert f"optim.state_dtype=bf16 frees {num_params * 4 / GIB:.2f} GiB" in text
    assert "24.00 GiB available" in text and "FSDP_SPEEDLOADER_HOST_MEMORY_LIMIT_GIB" in text
    # two layers of that width fit the budget: no refusal, on to the materialisation
    Trainer(tiny_config(tmp_path / "small", model={**LLAMA2_7B, "num_layers": 2, "vocab_size": 320}))
    assert materialized == [1]


def test_schedule_auto_on_the_cpu_is_refused_before_its_trial_model(tmp_path, monkeypatch):
    """The tuner's trial model, like the run's, holds every state in host memory on the CPU: the same refusal comes
    before the trial steps build it (``app.tune`` and ``schedule=auto``)."""
    import fsdp_speedloader.app.planning as planning_mod

    cfg = tiny_config(tmp_path, schedule={"name": "auto"}, model=LLAMA2_7B)
    budget = HostMemoryBudget(limit_bytes=24 * GIB, used_bytes=0, margin=0.0)
    monkeypatch.setattr(host_memory_mod.HostMemoryBudget, "detect", classmethod(lambda cls, *a, **k: budget))
    monkeypatch.setattr(planning_mod.torch.cuda, "is_available", lambda: False)

    def trial(*args, **kwargs):
        raise AssertionError("the trial model was built")

    monkeypatch.setattr(planning_mod, "tune", trial)
    with pytest.raises(ValueError, match=r"^training on the CPU keeps every model state in host memory: 100\.4"):
        planning_mod.tune_train_config(cfg, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)


def test_offloaded_on_the_cpu_counts_what_stays_on_the_device_and_offers_no_gpu_setting():
    """With offload=params on a machine without a GPU, "the device" is host memory as well: the root, units 1 .. K
    and the activations count, whatever the store, and no setting that would move memory to the GPU is offered
    (following one would only pass the check)."""
    cfg = tiny_config("unused", offload={"params": True, "device_units": 1},
                      schedule={"name": "speedloader", "activation_store": "device"}, model={"num_layers": 4})
    model = build_model(cfg.model, device="meta")
    units, root = unit_and_root_shards(model, blocks_per_unit=1, shards=1)
    gpu, gpu_alternatives = host_memory_plan(model, cfg, shards=1)
    cpu, cpu_alternatives = host_memory_plan(model, cfg, shards=1, on_cpu=True)
    assert gpu.activations == 0 < cpu.activations == (4 + 1) * 2 * 2 * 32 * 64 * 2  # U + 1 slots of N x n x s x h
    assert cpu.num_params == sum(p.numel() for p in model.parameters())  # the root and unit 1 on the host too
    assert cpu.num_params - gpu.num_params == sum(local for _, local in units[0])
    host_root = tiny_config("unused", offload={"params": True}, schedule={"name": "speedloader"},
                            model={"num_layers": 4})
    assert "offload.root=false (the root's states on the GPU)" in dict(host_memory_plan(model, host_root, shards=1)[1])
    offered = " ".join(setting for setting, _ in cpu_alternatives)
    assert "GPU" not in offered and "activation_store=device" not in offered and "offload.root" not in offered
    assert "optim.state_dtype=int8" in offered
