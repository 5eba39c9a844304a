"""Checkpoint and resume: an interrupted-and-resumed run continues exactly like an uninterrupted one.

Resume equality: run A trains 6 steps; run B (same config, checkpoint every 3 steps) stops after
step 3; run C is a new Trainer with ``checkpoint.resume=auto`` on B's directory and trains steps
4-6. C's losses must equal A's steps 4-6 (fp32 on the CPU: to 1e-6). Dropout is on, so the RNG
state must be restored too. World size 1 in-process, world size 2 in spawned gloo processes.
"""

from __future__ import annotations

import dataclasses

import os
import shutil
from pathlib import Path

import pytest
import torch

import fsdp_speedloader.app.checkpoint as checkpoint_mod
from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.checkpoint import find_latest_checkpoint, list_checkpoints, resolve_resume_path, \
    verify_checkpoint
from fsdp_speedloader.app.config import CheckpointConfig
from fsdp_speedloader.app.trainer import Trainer

SCHEDULES = ["canonical", "speedloader"]


def _config(out: Path, ckpt_dir: Path, schedule: str, resume=None):
    return tiny_config(out, schedule={"name": schedule}, steps=6, model={"dropout": 0.1},
                       checkpoint={"every": 3, "dir": str(ckpt_dir), "keep_last": 2, "save_final": False,
                                   "resume": resume})


def _resume_runs(root: Path, schedule: str) -> tuple[list[dict], list[dict]]:
    """(A's 6 steps, C's steps 4-6 after B stopped at step 3); every rank calls this."""
    uninterrupted = Trainer(_config(root / "a", root / "a_ckpt", schedule)).train()
    Trainer(_config(root / "b", root / "b_ckpt", schedule)).train(max_steps=3)
    assert [p.name for _, p in list_checkpoints(root / "b_ckpt")] == ["step_00000003"]
    resumed_trainer = Trainer(_config(root / "c", root / "b_ckpt", schedule, resume="auto"))
    assert resumed_trainer.step == 3
    resumed = resumed_trainer.train()
    return uninterrupted, resumed


def _check_resume(uninterrupted: list[dict], resumed: list[dict]) -> None:
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for key in ("loss", "lr", "grad_norm"):
        expected = [m[key] for m in uninterrupted[3:]]
        assert [m[key] for m in resumed] == pytest.approx(expected, rel=1e-6, abs=1e-6), key


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_equals_uninterrupted(tmp_path, schedule):
    _check_resume(*_resume_runs(tmp_path, schedule))


def test_a_resume_reads_no_weights_from_model_path(tmp_path):
    # A resume read all of model.path's safetensors (a 70B's 140 GB) and then overwrote them with the checkpoint's;
    # with the weights gone from model.path (its config.json kept) it failed. It now reads the checkpoint only.
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=320, max_position_embeddings=64)).save_pretrained(hf)

    def config(out: str, **checkpoint):
        return tiny_config(tmp_path / out, steps=4, model={"path": str(hf)}, schedule={"name": "speedloader"},
                           checkpoint={"every": 2, "dir": str(tmp_path / f"{out}_ckpt"), "save_final": False,
                                       **checkpoint})

    uninterrupted = Trainer(config("a")).train()
    Trainer(config("b")).train(max_steps=2)
    for weights in hf.glob("*.safetensors"):
        weights.unlink()
    resumed = Trainer(dataclasses.replace(config("b", resume="auto"), output_dir=str(tmp_path / "c"))).train()
    assert [m["step"] for m in resumed] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in uninterrupted[2:]], rel=1e-6), key
    with pytest.raises(ValueError, match="safetensors"):  # a fresh run does need them
        Trainer(config("d"))
    # model.path gone altogether: the error says how to resume without it (the step's own config.json), and that works
    shutil.rmtree(hf)
    step = dict(list_checkpoints(tmp_path / "b_ckpt"))[2]  # the resume above went on to save step 4 there too
    again = config("e", resume=str(step))
    with pytest.raises(ValueError, match=f"has no config.json.*model.path={step} resumes without"):
        Trainer(again)
    resumed = Trainer(dataclasses.replace(again, model=dataclasses.replace(again.model, path=str(step)))).train()
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in uninterrupted[2:]], rel=1e-6)


def test_tokens_count_on_from_the_checkpoint_after_a_resume_with_another_batch(tmp_path):
    # step x this run's tokens per step counted the steps before the resume at the new batch size
    Trainer(_config(tmp_path / "b", tmp_path / "ckpt", "speedloader")).train(max_steps=3)
    cfg = _config(tmp_path / "c", tmp_path / "ckpt", "speedloader", resume="auto")
    sched = cfg.schedule
    per_step_before = sched.batch_size * cfg.data.seq_len
    bigger = dataclasses.replace(cfg, schedule=dataclasses.replace(sched, num_sub_batches=2 * sched.num_sub_batches))
    resumed = Trainer(bigger).train()
    assert [m["tokens"] for m in resumed] == [3 * per_step_before + k * 2 * per_step_before for k in (1, 2, 3)]


def test_a_resume_with_other_optimizer_settings_runs_them_and_says_so(tmp_path, caplog):
    # the checkpoint's param groups and base LR replaced the command line's: a lower optim.lr after a NaN loss
    # resumed at the old LR and failed again
    Trainer(_config(tmp_path / "b", tmp_path / "ckpt", "speedloader")).train(max_steps=3)
    cfg = _config(tmp_path / "c", tmp_path / "ckpt", "speedloader", resume="auto")
    lower = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.optim.lr / 10, weight_decay=0.0))
    caplog.set_level("WARNING")
    trainer = Trainer(lower)
    assert all(g["weight_decay"] == 0.0 for g in trainer.optimizer.param_groups)
    (warned,) = [r.getMessage() for r in caplog.records if "other optimizer settings" in r.getMessage()]
    assert f"lr {cfg.optim.lr:g} -> {cfg.optim.lr / 10:g}" in warned and "weight_decay 0.1 -> 0.0" in warned
    resumed = trainer.train()
    assert [m["step"] for m in resumed] == [4, 5, 6]
    uninterrupted_lr = [m["lr"] for m in Trainer(_config(tmp_path / "a", tmp_path / "a_ckpt", "speedloader")).train()]
    assert [m["lr"] for m in resumed] == pytest.approx([lr / 10 for lr in uninterrupted_lr[3:]])


def test_a_step_directory_as_checkpoint_dir_is_refused_naming_resume(tmp_path):
    # it started fresh and wrote step_00000003/step_00000006 inside the checkpoint
    Trainer(_config(tmp_path / "b", tmp_path / "ckpt", "speedloader")).train(max_steps=3)
    step = tmp_path / "ckpt" / "step_00000003"
    before = sorted(p.name for p in step.iterdir())
    with pytest.raises(ValueError, match=rf"^checkpoint\.dir: '{step}' is one step's checkpoint, not a directory of "
                                         rf"them; to resume from it: checkpoint\.resume={step} "
                                         rf"checkpoint\.dir={step.parent}$"):
        Trainer(_config(tmp_path / "c", step, "speedloader", resume="auto"))
    assert sorted(p.name for p in step.iterdir()) == before


def _resume_runs_2_ranks(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for schedule in SCHEDULES:
        results[schedule] = _resume_runs(Path(root) / schedule, schedule)
    return results


def test_resume_equals_uninterrupted_2_ranks(tmp_path):
    per_rank = run_distributed(_resume_runs_2_ranks, 2, str(tmp_path))
    for schedule in SCHEDULES:
        uninterrupted, resumed = per_rank[0][schedule]
        _check_resume(uninterrupted, resumed)
        # The reported loss is averaged over ranks: every rank logs the same number.
        assert [m["loss"] for m in per_rank[1][schedule][1]] == [m["loss"] for m in resumed]
        step_dir = tmp_path / schedule / "b_ckpt" / "step_00000003"
        assert (step_dir / "extra_rank0.pt").is_file() and (step_dir / "extra_rank1.pt").is_file()


# --- directory handling ------------------------------------------------------------------------


def _fake_step_dir(path: Path) -> Path:
    """A small but complete step directory: a DCP checkpoint and ``extra_rank0.pt``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.zeros(64)}}, checkpoint_id=str(path))
    torch.save({"step": 0}, path / "extra_rank0.pt")
    return path


def test_tmp_dirs_are_never_resumed(tmp_path):
    good = _fake_step_dir(tmp_path / "step_00000003")
    _fake_step_dir(tmp_path / "step_00000009.tmp")  # a crashed save, even with its metadata written
    _fake_step_dir(tmp_path / "step_00000010.replaced.tmp")
    (tmp_path / "step_00000011").mkdir()  # no .metadata: not complete
    assert find_latest_checkpoint(tmp_path) == good
    assert resolve_resume_path(CheckpointConfig(resume="auto"), tmp_path) == good
    assert resolve_resume_path(CheckpointConfig(resume=str(tmp_path)), tmp_path / "elsewhere") == good
    assert resolve_resume_path(CheckpointConfig(resume=str(good)), tmp_path / "elsewhere") == good
    assert resolve_resume_path(CheckpointConfig(resume=None), tmp_path) is None
    assert resolve_resume_path(CheckpointConfig(resume="auto"), tmp_path / "empty") is None
    with pytest.raises(ValueError, match="checkpoint.resume"):
        resolve_resume_path(CheckpointConfig(resume=str(tmp_path / "step_00000009.tmp")), tmp_path)


def test_crashed_save_leaves_only_tmp_and_resume_starts_fresh(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, schedule={"name": "canonical"}, steps=2,
                      checkpoint={"every": 1, "dir": str(tmp_path / "ckpt")})
    real_save = checkpoint_mod.save_extra

    def crash_on_step_2(extra, path):
        if "step_00000002" in str(path):
            raise OSError("disk full")
        return real_save(extra, path)

    monkeypatch.setattr(checkpoint_mod, "save_extra", crash_on_step_2)
    with pytest.raises(OSError, match="disk full"):
        Trainer(cfg).train()
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_00000001", "step_00000002.tmp"]
    resumed = Trainer(tiny_config(tmp_path, schedule={"name": "canonical"}, steps=2,
                                  checkpoint={"every": 1, "dir": str(tmp_path / "ckpt"), "resume": "auto"}))
    assert resumed.step == 1
    resumed.train()  # the stale .tmp of step 2 is cleared and step 2 is saved for real
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001", "step_00000002"]


def test_resume_with_other_data_is_refused_before_the_weights_are_read(tmp_path, monkeypatch):
    # A corpus run resumed with data=synthetic was a KeyError traceback (after the whole checkpoint was read).
    ckpt = {"every": 1, "dir": str(tmp_path / "ckpt")}
    Trainer(tiny_config(tmp_path, steps=1, checkpoint=ckpt)).train()

    def no_weights(*args, **kwargs):
        raise AssertionError("the checkpoint's weights were read before the data check")

    monkeypatch.setattr(checkpoint_mod.dcp, "load", no_weights)
    with pytest.raises(ValueError, match=r"^data: the checkpoint was saved by a run that read a corpus"):
        Trainer(tiny_config(tmp_path, steps=2, data={"source": "synthetic"}, checkpoint={**ckpt, "resume": "auto"}))


def test_keep_last_prunes_only_old_step_dirs(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "step_00000099.tmp").mkdir()  # another run's crashed save: not ours to delete
    (ckpt / "other").mkdir()
    cfg = tiny_config(tmp_path, schedule={"name": "canonical"}, steps=4,
                      checkpoint={"every": 1, "keep_last": 2, "dir": str(ckpt), "save_final": True})
    Trainer(cfg).train()
    assert sorted(os.listdir(ckpt)) == ["notes.txt", "other", "step_00000003", "step_00000004", "step_00000099.tmp"]
    saved = ckpt / "step_00000004"
    assert (saved / ".metadata").is_file() and (saved / "extra_rank0.pt").is_file()


def test_default_checkpoint_dir_is_under_output_dir(tmp_path):
    cfg = tiny_config(tmp_path, schedule={"name": "canonical"}, steps=1, checkpoint={"save_final": True})
    Trainer(cfg).train()
    assert [p.name for _, p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]


# --- checkpoints written before the optimizers had one interface --------------------------------------------


def _save_previous_layout(trainer: Trainer, step_dir: Path) -> None:
    """What the Checkpointer wrote before ``OptimizersContainer``: ``get_state_dict`` of the one optimizer (of an
    overlapped optimizer's list of inner optimizers), and the LR scheduler's own state (``{"schedulers": [...]}``);
    the RNG states as they were then too: numpy's and python's own tuples (numpy's key a numpy array)."""
    import random

    import numpy as np

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    inner = trainer.optimizer.optimizers
    model_state, optim_state = get_state_dict(trainer.model, inner[0] if len(inner) == 1 else inner)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(step_dir))
    schedulers = [s.state_dict() for s in trainer.scheduler.schedulers]
    scheduler = schedulers[0] if len(schedulers) == 1 else {"schedulers": schedulers}
    torch.save({"step": trainer.step, "scheduler": scheduler, "loader": trainer.loader.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}},
               step_dir / "extra_rank0.pt")


OVERLAPPED = {"schedule": {"name": "speedloader"}, "offload": {"params": True},
              "optim": {"grad_clip": 0.0, "overlap_with_backward": True}}


@pytest.mark.parametrize("run", [{"schedule": {"name": "canonical"}}, {"schedule": {"name": "speedloader"}},
                                 OVERLAPPED], ids=["canonical", "speedloader", "overlapped"])
def test_checkpoint_of_the_previous_layout_resumes_exactly(tmp_path, run, caplog):
    caplog.set_level("WARNING")
    def config(out, **checkpoint):
        return tiny_config(out, steps=4, model={"dropout": 0.1},
                           checkpoint={"every": 0, "save_final": False, "dir": str(tmp_path / "ckpt"), **checkpoint},
                           **run)

    uninterrupted = Trainer(config(tmp_path / "a")).train()
    interrupted = Trainer(config(tmp_path / "b"))
    interrupted.train(max_steps=2)
    _save_previous_layout(interrupted, tmp_path / "ckpt" / "step_00000002")
    resumed = Trainer(config(tmp_path / "c", resume="auto"))
    assert resumed.step == 2
    assert "older format" in caplog.text  # read without weights_only=False, said so
    history = resumed.train()
    for key in ("loss", "lr"):
        assert [m[key] for m in history] == pytest.approx([m[key] for m in uninterrupted[2:]], rel=1e-6), key


# --- checkpoints that never lose work: complete ones only, periodic saves, another model refused -------------


def test_verify_checkpoint_names_what_is_wrong(tmp_path):
    good = _fake_step_dir(tmp_path / "good")
    assert verify_checkpoint(good) is None
    shard = next(good.glob("*.distcp")).name
    damages = {
        "truncated shard": (lambda d: os.truncate(d / shard, 10), f"{shard} is truncated (10 of at least"),
        "missing shard": (lambda d: (d / shard).unlink(), f"{shard} is missing"),
        "garbled metadata": (lambda d: (d / ".metadata").write_bytes(b"not a pickle"), ".metadata cannot be read"),
        "empty metadata": (lambda d: (d / ".metadata").write_bytes(b""), ".metadata cannot be read"),
        "no metadata": (lambda d: (d / ".metadata").unlink(), "no .metadata"),
        "truncated extra": (lambda d: os.truncate(d / "extra_rank0.pt", 20), "extra_rank0.pt cannot be read"),
        "missing extra": (lambda d: (d / "extra_rank0.pt").unlink(), "extra_rank0.pt is missing"),
    }
    for name, (damage, why) in damages.items():
        broken = shutil.copytree(good, tmp_path / name.replace(" ", "_"))
        damage(broken)
        assert why in (verify_checkpoint(broken) or ""), name


def test_resume_auto_skips_an_incomplete_newest_checkpoint(tmp_path, caplog):
    """The newest step is cut short (a full disk, a copy that stopped): resume=auto says so and takes the newest
    complete one, and the run goes on exactly as an uninterrupted one, writing that step again."""
    ckpt = tmp_path / "ckpt"

    def config(name, **checkpoint):
        return tiny_config(tmp_path / name, schedule={"name": "canonical"}, steps=4,
                           checkpoint={"every": 2, "keep_last": 2, "dir": str(ckpt), **checkpoint})

    uninterrupted = Trainer(config("a")).train()
    shard = next((ckpt / "step_00000004").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    (ckpt / "step_00000006.tmp").mkdir()  # a save killed during its write, said too (it was passed over silently)
    caplog.set_level("WARNING")
    resumed = Trainer(config("b", resume="auto"))
    assert resumed.step == 2
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 and "step_00000004" in skipped[0] and "is truncated" in skipped[0], skipped
    assert skipped[1].endswith("step_00000006.tmp: an unfinished save (*.tmp), never resumed"), skipped
    with pytest.raises(ValueError, match=r"step_00000004.* is not a complete checkpoint: __0_0.distcp is truncated"):
        Trainer(config("c", resume=str(ckpt / "step_00000004")))
    history = resumed.train()
    assert [m["loss"] for m in history] == pytest.approx([m["loss"] for m in uninterrupted[2:]], rel=1e-6)
    assert [p.name for _, p in list_checkpoints(ckpt)] == ["step_00000002", "step_00000004"]
    assert verify_checkpoint(ckpt / "step_00000004") is None  # saved again, complete


def test_resume_auto_without_a_checkpoint_dir_warns_that_it_looks_only_in_this_run(tmp_path, caplog):
    """checkpoint.dir unset: auto looks under this run's own directory (a new dated one per run), where nothing
    is to be found; the fresh start is a warning naming checkpoint.dir. With checkpoint.dir set, an empty one is an
    ordinary first run (no warning)."""
    caplog.set_level("INFO")
    Trainer(tiny_config(tmp_path / "a", steps=1, checkpoint={"resume": "auto"}))
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "resume=auto" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint.dir is unset" in warned[0].getMessage(), caplog.text
    assert str(tmp_path / "a" / "checkpoints") in warned[0].getMessage()
    caplog.clear()
    Trainer(tiny_config(tmp_path / "b", steps=1, checkpoint={"resume": "auto", "dir": str(tmp_path / "ckpt")}))
    fresh = [r for r in caplog.records if "resume=auto" in r.getMessage()]
    assert [r.levelname for r in fresh] == ["INFO"] and "starting fresh" in fresh[0].getMessage()


def test_keep_last_never_deletes_newer_numbered_steps(tmp_path):
    """A save prunes only the steps up to its own: a newer-numbered directory (an incomplete one that resume
    skipped, or another run's) never pushes the new checkpoint out."""
    for step in (1, 2, 3, 9):
        _fake_step_dir(tmp_path / f"step_{step:08d}")
    checkpoint_mod.Checkpointer(CheckpointConfig(keep_last=2), tmp_path, rank=0, device="cpu")._prune(3)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3, 9]


def test_time_based_saves(tmp_path):
    def saved(name, minutes):
        ckpt = tmp_path / name
        Trainer(tiny_config(tmp_path / f"{name}_run", schedule={"name": "canonical"}, steps=3,
                            checkpoint={"every_minutes": minutes, "keep_last": 2, "dir": str(ckpt)})).train()
        return [step for step, _ in list_checkpoints(ckpt)]

    assert saved("every_step", 1e-9) == [2, 3]  # due after every step; the last two kept
    assert saved("never", 0) == []
    assert saved("default", 30.0) == []  # a short run: nothing due


def test_unwritable_checkpoint_dir_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import fsdp_speedloader.app.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"checkpoint.dir: cannot write to .*a_file/ckpt.*is a file, not a directory"):
        Trainer(tiny_config(tmp_path, checkpoint={"dir": str(tmp_path / "a_file" / "ckpt")}))


@pytest.mark.parametrize("model,mismatch", [
    ({"hidden_size": 128}, r"model.embed_tokens.weight is \(320, 64\) in the checkpoint but \(320, 128\) in the model"),
    # the same family at another depth: the layers it holds, not "another model family or layout"
    ({"num_layers": 3}, r"it holds 2 layers, the model has 3; resume with model\.num_layers=2"),
    ({"num_layers": 1}, r"it holds 2 layers, the model has 1; resume with model\.num_layers=2"),
], ids=["width", "deeper", "shallower"])
def test_checkpoint_of_another_model_is_refused_before_materialising(tmp_path, monkeypatch, model, mismatch):
    import fsdp_speedloader.app.trainer as trainer_mod

    ckpt = tmp_path / "ckpt"
    Trainer(tiny_config(tmp_path / "a", steps=1, checkpoint={"save_final": True, "dir": str(ckpt)})).train()
    monkeypatch.setattr(trainer_mod, "materialize_model", lambda *a, **k: pytest.fail("materialised"))
    with pytest.raises(ValueError, match=rf"checkpoint '{ckpt / 'step_00000001'}' does not fit this model: {mismatch}"):
        Trainer(tiny_config(tmp_path / "b", model=model, checkpoint={"resume": "auto", "dir": str(ckpt)}))
