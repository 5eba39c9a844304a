"""The FSDP2 seam's contract (fsdp_speedloader/fsdp2/): what it relies on exists, a missing piece fails
loudly at ``apply_speedloader``, an untested torch warns once, and each fast path engages where it can run.

On the CPU (gloo, world size 1, CPU offload; also on a machine with GPUs) the gradient slots and the
transfer copies run their real code path; the staged loads need CUDA streams, so here: the shortcut they
detect on a real one-rank group, the marking and patching, and the counted fallback
(tests/test_gpu_engine.py checks that they engage on a GPU).
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import subprocess
import sys
import warnings

import pytest
import torch

from engine_cases import batch, cpu_mesh, tiny_model
from fsdp_speedloader import apply_speedloader, speedloader_engine
from fsdp_speedloader import fsdp2
from fsdp_speedloader.fsdp2 import contract, counters, param_transfer, prefetch, version

BF16 = torch.bfloat16


def _offloaded(**kwargs):
    model = apply_speedloader(tiny_model("llama"), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True, **kwargs)
    ids, labels = batch(2)
    model(input_ids=ids, labels=labels).loss.backward()  # FSDP2's lazy init; the arena is planned and bound
    model.zero_grad(set_to_none=True)
    return model


# --- what the seam relies on ----------------------------------------------------------------------


def test_the_installed_torch_has_everything_the_seam_lists():
    assert contract.missing_fsdp2_internals() == []


@pytest.mark.parametrize("name", sorted(contract.SYMBOLS))
def test_each_private_symbol_resolves(name):
    assert contract.resolve(name) is not None


def test_signatures_of_what_the_seam_replaces_or_wraps():
    def params(path):
        return list(inspect.signature(contract.resolve(path)).parameters.values())

    assert [p.name for p in params("FSDPParamGroup.unshard")] == ["self", "async_op"]
    assert params("FSDPParamGroup.unshard")[1].default is False
    assert [p.name for p in params("FSDPParamGroup.wait_for_unshard")] == ["self"]
    post_backward = params("FSDPParamGroup.post_backward")
    assert post_backward[0].name == "self" and post_backward[1].kind is inspect.Parameter.VAR_POSITIONAL
    assert params("foreach_reduce")[0].name == "fsdp_params"
    # post_backward looks foreach_reduce up in its module at call time: replacing the global reaches it.
    func = contract.resolve("FSDPParamGroup.post_backward")
    assert "foreach_reduce" in func.__code__.co_names
    assert func.__globals__ is vars(contract.private_module("foreach_reduce"))


def test_fsdp2_source_lines_the_fast_paths_were_read_against():
    assert contract.missing_source_lines() == []
    source = "".join(inspect.getsource(contract.resolve("foreach_reduce")).split())
    assert 'new_sharded_grad=new_sharded_grad.to(torch.device("cpu"),non_blocking=non_blocking)' in source


def test_class_level_names():
    fsdp_param = contract.resolve("FSDPParam")
    assert isinstance(vars(fsdp_param)["all_gather_inputs"], property)
    assert isinstance(vars(fsdp_param)["_sharded_local_tensor"], property)
    assert isinstance(vars(contract.resolve("FSDPParamGroup"))["is_unsharded"], property)
    assert "SHARDED" in contract.resolve("ShardedState").__members__
    assert {"all_gather_work", "param_all_gather_input_numels"} <= set(contract.resolve("AllGatherResult")._fields)
    assert callable(contract.resolve("fully_shard.state"))
    # The attribute check is not vacuous: a name FSDP2 neither defines nor uses fails it.
    assert not contract.declares(fsdp_param, "_speedloader_no_such_attribute")


def test_instance_attributes_on_a_real_offloaded_group():
    model = _offloaded()
    unit = speedloader_engine(model).units[0][0]
    state = contract.resolve("fully_shard.state")(unit)
    if version._release(torch.__version__) >= (2, 13):
        assert isinstance(state._fsdp_param_groups, list) and len(state._fsdp_param_groups) == 1
    else:
        assert isinstance(state._fsdp_param_group, contract.resolve("FSDPParamGroup"))
    group = fsdp2.fsdp_param_groups_of(unit)[0]
    for name in contract.CLASS_ATTRIBUTES["FSDPParamGroup"] + contract.INSTANCE_ATTRIBUTES["FSDPParamGroup"]:
        assert hasattr(group, name), name
    assert isinstance(group.fsdp_params, list) and group._all_gather_result is None and not group.is_unsharded
    assert hasattr(group.comm_ctx, "all_gather_copy_in_stream") and group.mesh_info.shard_mesh_size == 1
    assert isinstance(group.mesh_info, contract.resolve("FSDPMeshInfo"))
    p = group.fsdp_params[0]
    for name in contract.CLASS_ATTRIBUTES["FSDPParam"] + contract.INSTANCE_ATTRIBUTES["FSDPParam"]:
        assert hasattr(p, name), name
    assert p.sharded_state == contract.resolve("ShardedState").SHARDED
    assert type(p._sharded_param_data) is torch.Tensor and p._sharded_param_data.dim() == 1
    assert isinstance(p.sharded_param, contract.resolve("DTensor"))
    assert p.sharded_param._local_tensor is p._sharded_local_tensor
    assert p.offload_to_cpu is True and isinstance(p.pin_memory, bool) and isinstance(p.device, torch.device)
    assert isinstance(p.sharded_size, torch.Size) and isinstance(p.padded_sharded_param_size, torch.Size)
    assert isinstance(p._orig_size, torch.Size) and p.fsdp_placement.dim == 0 and isinstance(p._param_fqn, str)
    assert p.unsharded_accumulated_grad is None


# --- loud failures --------------------------------------------------------------------------------


def _remove_foreach_reduce(monkeypatch):
    monkeypatch.delattr(contract.private_module("foreach_reduce"), "foreach_reduce")
    return "foreach_reduce"


def _remove_wait_for_unshard(monkeypatch):
    monkeypatch.delattr(contract.resolve("FSDPParamGroup"), "wait_for_unshard")
    return "FSDPParamGroup.wait_for_unshard"


def _change_unshard(monkeypatch):
    monkeypatch.setattr(contract.resolve("FSDPParamGroup"), "unshard", lambda self, blocking: None)
    return r"FSDPParamGroup.unshard\(self, async_op, ...\)"


def _rename_group_attribute(monkeypatch):
    monkeypatch.setattr(contract, "STATE_GROUP_ATTRIBUTES", ("_speedloader_renamed_groups",))
    return "FSDPState._speedloader_renamed_groups"


def _remove_copy_in_stream(monkeypatch):
    monkeypatch.setitem(contract.INSTANCE_ATTRIBUTES, "FSDPCommContext", ("all_gather_copy_in_stream_renamed",))
    return "FSDPCommContext.all_gather_copy_in_stream_renamed"


@pytest.mark.parametrize("break_it", [_remove_foreach_reduce, _remove_wait_for_unshard, _change_unshard,
                                      _rename_group_attribute, _remove_copy_in_stream])
def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch, break_it):
    expected = break_it(monkeypatch)
    with pytest.raises(RuntimeError) as err:
        fsdp2.require_fsdp2_internals()
    message = str(err.value)
    assert torch.__version__ in message and ">=2.11, <2.14" in message
    assert len(contract.missing_fsdp2_internals()) == 1
    assert re.search(expected, message), message


def test_apply_speedloader_fails_before_sharding_when_an_internal_is_missing(monkeypatch):
    _remove_foreach_reduce(monkeypatch)
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="foreach_reduce"):
        apply_speedloader(model, mesh=cpu_mesh(), num_sub_batches=2, offload_params=True)
    assert speedloader_engine(model, missing_ok=True) is None and not any(
        hasattr(p, "to_local") for p in model.parameters())  # untouched: nothing was sharded


def test_import_works_on_a_torch_whose_fsdp2_internals_moved():
    script = (
        "import torch.distributed.fsdp._fully_shard._fsdp_param_group as g\n"
        "del g.FSDPParamGroup\n"  # as if a torch release had moved it
        "import fsdp_speedloader\n"
        "from fsdp_speedloader import fsdp2\n"
        "try:\n"
        "    fsdp2.require_fsdp2_internals()\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("RAISED") and "_fsdp_param_group.FSDPParamGroup" in out.stdout


# --- the tested torch range -----------------------------------------------------------------------


@pytest.mark.parametrize("tested, value", [(True, "2.11.0"), (True, "2.13.0+cpu"), (True, "2.12.1+cu128"),
                                           (False, "2.10.2"), (False, "2.14.0"), (False, "2.14.0.dev20260101"),
                                           (False, "3.0.0")])
def test_tested_range(tested, value):
    assert version.is_tested_torch(value) is tested


def test_an_untested_torch_warns_once_naming_the_range(monkeypatch):
    monkeypatch.setattr(version, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.warns(UserWarning, match=r"torch >=2\.11, <2\.14; this is torch 2\.15\.0"):
        apply_speedloader(tiny_model("llama", layers=1), mesh=cpu_mesh(), num_sub_batches=2)  # its first step checks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fsdp2.check_torch_version() is False
    assert not [w for w in caught if "not tested" in str(w.message)]  # once per process


def test_the_tested_torch_does_not_warn(monkeypatch):
    monkeypatch.setattr(version, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fsdp2.check_torch_version() is True


# --- the fast paths engage ------------------------------------------------------------------------


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in fsdp2.fast_path_stats()}


def test_gradient_slots_and_transfer_copies_engage_and_show_in_the_engine_stats():
    model = _offloaded(param_dtype=BF16, param_transfer_dtype=BF16)
    engine = speedloader_engine(model)
    num_params = len(fsdp2.offloaded_fsdp_params(model))
    before = engine.stats()
    ids, labels = batch(2, seed=1)
    model(input_ids=ids, labels=labels).loss.backward()
    after = engine.stats()
    delta = _delta(before, after)
    assert delta["num_grads_into_slots"] == num_params  # one fresh gradient per parameter, each in its slot
    # Every parameter is loaded at least once (units twice: forward and backward), each from its copy.
    assert delta["num_param_transfers"] >= num_params
    assert delta["num_grad_slot_fallbacks"] == delta["num_param_transfer_fallbacks"] == 0
    assert delta["num_staged_loads"] == delta["num_staged_load_fallbacks"] == 0  # CPU: no staging
    assert "arena_grad_shards_requested_bytes" in after and "exchange_h2d_bytes" in after  # the store's, too


def test_a_transfer_copy_that_does_not_match_falls_back_counted_and_warned_once(monkeypatch, caplog):
    monkeypatch.setattr(counters, "_warned", set())
    base = tiny_model("llama")
    models = [apply_speedloader(copy.deepcopy(base), mesh=cpu_mesh(), num_sub_batches=2, offload_params=True,
                                param_dtype=BF16, param_transfer_dtype=dtype) for dtype in (None, BF16)]
    ids, labels = batch(2)
    for m in models:
        m(input_ids=ids, labels=labels).loss.backward()
    broken = fsdp2.offloaded_fsdp_params(models[1])[:2]
    for p in broken:  # e.g. a re-plan that left an old copy behind
        monkeypatch.setattr(p.__dict__[param_transfer._TRANSFER], "tensor", torch.empty(1, dtype=BF16))
    before = fsdp2.fast_path_stats()
    with caplog.at_level(logging.WARNING, logger="fsdp_speedloader.fsdp2"):
        losses = [m(input_ids=ids, labels=labels).loss.item() for m in models]
    delta = _delta(before, fsdp2.fast_path_stats())
    assert losses[0] == losses[1]  # FSDP2's own load of those two: the same bits
    assert delta["num_param_transfer_fallbacks"] == len(broken)  # the root's parameters load once per forward
    assert caplog.text.count("is not used") == 1 and "num_param_transfer_fallbacks" in caplog.text


def test_staged_loads_detect_fsdp2s_one_rank_shortcut_on_a_real_group():
    model = _offloaded()
    unit = speedloader_engine(model).units[0][0]
    group = fsdp2.fsdp_param_groups_of(unit)[0]
    assert not prefetch._single_rank_shortcut(group)  # nothing pending
    handle = unit.unshard(async_op=True)  # FSDP2's unshard, as a prefetch runs it
    assert prefetch._single_rank_shortcut(group)  # world size 1: the placeholder, no work, no inputs
    handle.wait()
    unit.reshard()
    assert group._all_gather_result is None


def test_staged_loads_mark_only_cuda_groups_and_patch_once(monkeypatch):
    model = _offloaded()
    units = [m for m, _ in speedloader_engine(model).units]
    assert fsdp2.enable_single_rank_prefetch(units) == 0  # CPU groups: nothing to stage
    groups = [g for m in units for g in fsdp2.fsdp_param_groups_of(m)]
    for g in groups:
        monkeypatch.setattr(g, "device", torch.device("cuda"))
    assert fsdp2.enable_single_rank_prefetch(units) == len(groups)
    assert all(getattr(g, prefetch._FLAG) for g in groups)
    group_cls, param_cls = contract.resolve("FSDPParamGroup"), contract.resolve("FSDPParam")
    assert group_cls.unshard is prefetch._unshard and group_cls.wait_for_unshard is prefetch._wait_for_unshard
    assert vars(param_cls)["all_gather_inputs"].fget is param_transfer._all_gather_inputs
    fsdp2.enable_single_rank_prefetch(units)  # again: the originals kept are still FSDP2's own
    assert prefetch._original_unshard is not prefetch._unshard
    assert inspect.unwrap(group_cls.unshard) is inspect.unwrap(prefetch._original_unshard)
    assert contract.missing_fsdp2_internals() == []  # the contract still reads FSDP2's own through the patches


def test_a_staged_group_whose_unshard_is_not_the_shortcut_falls_back_counted_and_warned_once(monkeypatch, caplog):
    monkeypatch.setattr(counters, "_warned", set())
    model = _offloaded()
    units = [m for m, _ in speedloader_engine(model).units]
    groups = [g for m in units for g in fsdp2.fsdp_param_groups_of(m)]
    for g in groups:
        monkeypatch.setattr(g, "device", torch.device("cuda"))
    fsdp2.enable_single_rank_prefetch(units)
    for g in groups:
        monkeypatch.setattr(g, "device", torch.device("cpu"))
    monkeypatch.setattr(prefetch, "_single_rank_shortcut", lambda group: False)  # as if FSDP2 all-gathered
    before = fsdp2.fast_path_stats()
    ids, labels = batch(2)
    with caplog.at_level(logging.WARNING, logger="fsdp_speedloader.fsdp2"):
        model(input_ids=ids, labels=labels).loss.backward()
    delta = _delta(before, fsdp2.fast_path_stats())
    params = sum(len(g.fsdp_params) for g in groups)
    assert delta["num_staged_load_fallbacks"] == 2 * params  # forward and backward load of every unit
    assert delta["num_staged_loads"] == 0
    assert caplog.text.count("started a real all-gather") == 1
