"""Asynchronous checkpoints (``checkpoint.async_save=true``, DCP's ``async_save``), on the CPU with gloo.

- An asynchronous save holds exactly the state of its step (the staging copy is taken before training goes on): the
  same bits as a synchronous save of that step, and a run resumed from it goes on exactly as an uninterrupted one.
- A step directory is complete only once its files are written: until then it is ``step_N.tmp``; a save that fails
  in the background leaves no complete-looking step, and resume takes the one before.
- The staging copy is counted in the host-memory plan, and a run where it does not fit is refused naming the setting.
- Each save's stall is in its step's metrics (``checkpoint_stall_s``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdp_speedloader.app.checkpoint as checkpoint_mod
import fsdp_speedloader.app.checkpoint_async as checkpoint_async
from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.checkpoint import list_checkpoints, verify_checkpoint
from fsdp_speedloader.app.host_memory import check_async_staging, check_host_memory, host_memory_plan
from fsdp_speedloader.app.launch import UserError
from fsdp_speedloader.app.trainer import Trainer
from fsdp_speedloader.memory.arena import HostMemoryBudget
from fsdp_speedloader.models import build_model


def _config(root: Path, name: str, ckpt: Path, *, async_save: bool, resume=None, **overrides):
    return tiny_config(root / name, steps=6, model={"dropout": 0.1},
                       checkpoint={"every": 3, "dir": str(ckpt), "keep_last": 2, "save_final": False,
                                   "resume": resume, "async_save": async_save}, **overrides)


def _saved_state(step_dir: Path) -> dict:
    out = step_dir.parent / f"{step_dir.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=True)


def _assert_same_bits(a: dict, b: dict, where: str = "") -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_bits(a[key], b[key], f"{where}.{key}")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{where}.{key}"
        else:
            assert a[key] == b[key], f"{where}.{key}"


def _runs(root: Path, **overrides) -> dict:
    """Every rank: a synchronous run (saves at 3 and 6), an asynchronous one, and an asynchronous run stopped after
    step 3 then resumed asynchronously to 6."""
    sync = Trainer(_config(root, "sync", root / "ckpt_sync", async_save=False, **overrides)).train()
    asynchronous = Trainer(_config(root, "async", root / "ckpt_async", async_save=True, **overrides)).train()
    Trainer(_config(root, "stopped", root / "ckpt_resumed", async_save=True, **overrides)).train(max_steps=3)
    resumed_trainer = Trainer(_config(root, "resumed", root / "ckpt_resumed", async_save=True, resume="auto",
                                      **overrides))
    assert resumed_trainer.step == 3
    return {"sync": sync, "async": asynchronous, "resumed": resumed_trainer.train()}


def _check(root: Path, runs: dict) -> None:
    losses = [m["loss"] for m in runs["sync"]]
    assert [m["loss"] for m in runs["async"]] == losses  # saving asynchronously changes nothing in training
    assert [m["loss"] for m in runs["resumed"]] == losses[3:]  # bit-exact, as the synchronous resume
    for step in (3, 6):  # the asynchronous save of step 3 was staged before steps 4-6 changed the parameters
        name = f"step_{step:08d}"
        _assert_same_bits(_saved_state(root / "ckpt_sync" / name), _saved_state(root / "ckpt_async" / name), name)
    for ckpt in ("ckpt_async", "ckpt_resumed"):
        assert [s for s, _ in list_checkpoints(root / ckpt)] == [3, 6] and not list((root / ckpt).glob("*.tmp"))
    assert {k for m in runs["async"] for k in m if k == "checkpoint_stall_s"} == {"checkpoint_stall_s"}
    assert [m["step"] for m in runs["async"] if "checkpoint_stall_s" in m] == [3, 6]


def test_async_save_resumes_bit_exact_like_sync(tmp_path):
    _check(tmp_path, _runs(tmp_path))


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_async_save_of_parameters_in_the_host_arena(tmp_path, state_dtype):
    """Layer-major with every state on the host: the shards are views at offsets into the pinned arena, whose DTensor
    wrappers torch's DefaultStager could not copy (``copy_() on an invalid python storage``); the ShardStager's
    saves equal the synchronous ones, and resume bit-exact."""
    _check(tmp_path, _runs(tmp_path, schedule={"name": "speedloader"}, offload={"params": True},
                           optim={"state_dtype": state_dtype}))


def _runs_on_ranks(rank: int, world_size: int, root: str) -> dict:
    return _runs(Path(root))


@pytest.mark.slow
def test_async_save_on_two_ranks(tmp_path):
    per_rank = run_distributed(_runs_on_ranks, 2, str(tmp_path))
    _check(tmp_path, per_rank[0])
    step_dir = tmp_path / "ckpt_async" / "step_00000006"
    assert (step_dir / "extra_rank0.pt").is_file() and (step_dir / "extra_rank1.pt").is_file()


def test_a_step_is_complete_only_once_written(tmp_path, monkeypatch):
    """While the upload thread writes, only ``step_N.tmp`` exists; rank 0 renames it once the write has finished."""
    real_write = checkpoint_async.dcp.FileSystemWriter.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(1.0)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint_async.dcp.FileSystemWriter, "write_data", slow_write)
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(_config(tmp_path, "run", ckpt, async_save=True))
    try:
        trainer.save_checkpoint()  # step 0
        assert trainer.last_checkpoint_stall_s < 1.0  # the write goes on in the background
        assert not (ckpt / "step_00000000").exists() and (ckpt / "step_00000000.tmp").is_dir()
        trainer.checkpointer.poll()  # not finished yet: nothing changes
        assert not (ckpt / "step_00000000").exists()
        trainer.checkpointer.wait()
        assert verify_checkpoint(ckpt / "step_00000000") is None and not (ckpt / "step_00000000.tmp").exists()
    finally:
        trainer.checkpointer.close()
        trainer.release_checkpoint_dir()


def test_a_save_that_fails_in_the_background_leaves_no_complete_step(tmp_path, monkeypatch):
    real_finish = checkpoint_async.dcp.FileSystemWriter.finish

    def crash_at_step_6(self, *args, **kwargs):
        if "step_00000006" in str(self.path):
            raise OSError("disk full")
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint_async.dcp.FileSystemWriter, "finish", crash_at_step_6)
    ckpt = tmp_path / "ckpt"
    failed = (r"checkpoint: the asynchronous save of step 6 failed \(rank 0: OSError: disk full\); [0-9.]+ GiB free "
              r"on the disk of '.*ckpt'; '.*step_00000006.tmp' is left unfinished and is never resumed")
    with pytest.raises(UserError, match=failed):  # one line, as the CLI prints a UserError
        Trainer(_config(tmp_path, "run", ckpt, async_save=True)).train()
    assert [s for s, _ in list_checkpoints(ckpt)] == [3] and (ckpt / "step_00000006.tmp").is_dir()
    monkeypatch.undo()
    resumed = Trainer(_config(tmp_path, "again", ckpt, async_save=True, resume="auto"))
    assert resumed.step == 3
    resumed.train()
    assert [s for s, _ in list_checkpoints(ckpt)] == [3, 6] and not (ckpt / "step_00000006.tmp").exists()


def test_a_synchronous_save_that_fails_is_one_line_with_the_free_disk_space(tmp_path, monkeypatch):
    # a full disk reached the user as torch's 60-line traceback ending in "unexpected pos 704 vs 598"
    real_save = checkpoint_mod.dcp.save

    def full_at_step_6(state, *, checkpoint_id):
        if "step_00000006" in checkpoint_id:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint_mod.dcp, "save", full_at_step_6)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(UserError, match=r"^checkpoint: the save of step 6 failed \(RuntimeError: .*unexpected pos 704 "
                                        r"vs 598\); [0-9.]+ GiB free on the disk of '.*ckpt'; '.*step_00000006.tmp' is "
                                        r"left unfinished and is never resumed$"):
        Trainer(_config(tmp_path, "run", ckpt, async_save=False)).train()
    assert [s for s, _ in list_checkpoints(ckpt)] == [3]


# --- the staging copy in the host-memory plan ------------------------------------------------------------------


def test_the_staging_copy_is_in_the_host_plan_and_refused_when_it_does_not_fit(tmp_path):
    offloaded = {"schedule": {"name": "speedloader"}, "offload": {"params": True}}
    cfg_sync = _config(tmp_path, "a", tmp_path / "c", async_save=False, **offloaded)
    cfg_async = _config(tmp_path, "a", tmp_path / "c", async_save=True, **offloaded)
    model = build_model(cfg_async.model, device="meta")
    num_params = sum(p.numel() for p in model.parameters())
    without, _ = host_memory_plan(model, cfg_sync, shards=1)
    with_staging, alternatives = host_memory_plan(model, cfg_async, shards=1)
    assert without.checkpoint_staging == 0
    assert with_staging.checkpoint_staging == num_params * (4 + 8)  # fp32 parameters and AdamW's two fp32 moments
    assert with_staging.total == without.total + with_staging.checkpoint_staging
    budget = HostMemoryBudget(limit_bytes=(without.total + with_staging.total) // 2, used_bytes=0, margin=0.0)
    check_host_memory(model, cfg_sync, shards=1, activation_dtype=torch.float32, budget=budget)  # fits
    with pytest.raises(ValueError, match=r"checkpoint staging copy 0\.00.*checkpoint.async_save=false \(no staging "
                                         r"copy; each save then stalls for its write\) frees 0\.00 GiB \(enough\)"):
        check_host_memory(model, cfg_async, shards=1, activation_dtype=torch.float32, budget=budget)

    on_device = _config(tmp_path, "b", tmp_path / "c", async_save=True)  # no offload: the copy is the host's part
    assert check_async_staging(model, on_device, shards=1,
                               budget=HostMemoryBudget(limit_bytes=1 << 40, used_bytes=0)) == num_params * 12
    with pytest.raises(ValueError, match=r"checkpoint.async_save=true: its staging copy \(this rank's parameters and "
                                         r"optimizer states\) needs 0\.00 GiB of host memory: .*set "
                                         r"checkpoint.async_save=false"):
        check_async_staging(model, on_device, shards=1, budget=HostMemoryBudget(limit_bytes=1024, used_bytes=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_save_on_the_gpu_from_the_pinned_arena(tmp_path):
    """The full-7B run's layout, small: the root and unit 1 on the GPU, the other units' shards in the pinned host
    arena. The staged copies are page-locked and equal the state at staging time; the state changed after ``start``
    (the next step) does not reach the files; DCP loads back what was staged."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdp_speedloader import apply_speedloader
    from fsdp_speedloader.app.config import ModelConfig
    from fsdp_speedloader.models import materialize_model
    from fsdp_speedloader.parallel import maybe_init_process_group

    maybe_init_process_group("cuda")
    cfg = ModelConfig(hidden_size=256, num_layers=3, num_heads=4, intermediate_size=704, vocab_size=1024,
                      max_position_embeddings=512)
    model = build_model(cfg, device="meta")
    apply_speedloader(model, num_sub_batches=2, param_dtype=torch.bfloat16, offload_params=True, offload_root=False,
                      device_units=1)
    materialize_model(model, cfg, device=torch.device("cuda"), seed=0, param_device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu", "cuda"}
    state = get_model_state_dict(model)
    before = {k: v.to_local().cpu().clone() for k, v in state.items()}
    allocated = torch.cuda.memory_allocated()
    staged = checkpoint_async.ShardStager(pin_memory=True).stage(state)
    # Staging adds nothing on the GPU: every copy, of a GPU shard or of a host one, is in page-locked host memory.
    assert torch.cuda.memory_allocated() == allocated
    for key, value in staged.items():
        local = value.to_local()
        assert local.device.type == "cpu" and local.is_pinned() and torch.equal(local, before[key]), key
        assert (value.device_mesh, value.placements, value.shape) == (state[key].device_mesh, state[key].placements,
                                                                      state[key].shape), key
    saver = checkpoint_async.AsyncSaver(pin_memory=True)
    try:
        saver.start(get_model_state_dict(model), str(tmp_path / "ckpt"))
        with torch.no_grad():  # the next step changes every parameter while the upload thread writes
            for p in model.parameters():
                p.to_local().add_(1.0)
        saver.result()
    finally:
        saver.close()
    target = get_model_state_dict(model)
    checkpoint_async.dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    for key, value in target.items():
        assert torch.equal(value.to_local().cpu(), before[key]), key
