"""Faults: a rank killed mid-run resumes under torchrun, and checkpoints move between world sizes.

1. Two CPU ranks under ``torchrun --max-restarts=1``; rank 1 ``os._exit(1)``s before step 5 of the
   first attempt (``FSDP_SPEEDLOADER_INJECT_FAULT=exit:rank=1,step=5,attempt=0``), after the step-4
   checkpoint. torchrun tears the group down and restarts it; ``checkpoint.resume=auto`` resumes
   at step 4. Nothing is lost or corrupted: the six logged losses equal an uninterrupted run's, the
   final checkpoints hold the same model and optimizer state, and no half-written save remains.
2. A checkpoint written by 1 rank loads on 2, and one written by 2 ranks loads on 1: the full
   (unsharded) model and optimizer states equal those at save time, and the data position is the
   same global position, so the new world size continues with the next unseen sequences.
3. A preempted run (a real SIGTERM to the real entry point) saves the step it was on, then exits with
   128 + 15 and no traceback; a signal that only one rank sees stops every rank at the same step, saved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.checkpoint import list_checkpoints, verify_checkpoint
from fsdp_speedloader.app.data import build_loader
from fsdp_speedloader.app.faults import Fault, fault_from_env, parse_fault
from fsdp_speedloader.app.launch import TrainingInterrupted
from fsdp_speedloader.app.logger import MetricLogger
from fsdp_speedloader.app.trainer import Trainer
from launch_utils import TINY_OVERRIDES, clean_env, read_metrics, tail, torchrun

FAULT = "exit:rank=1,step=5,attempt=0"


def _train_cmd(run_dir: Path, ckpt_dir: Path, *torchrun_args: str) -> list[str]:
    return torchrun("--standalone", "--nproc-per-node", "2", *torchrun_args, "-m", "fsdp_speedloader.app.train",
                    *TINY_OVERRIDES, "schedule=speedloader", "model.dropout=0.1", "steps=6", "checkpoint.every=2",
                    "checkpoint.keep_last=2", "checkpoint.resume=auto", f"checkpoint.dir={ckpt_dir}",
                    f"hydra.run.dir={run_dir}")


def _final_state(ckpt_dir: Path) -> dict:
    """The last checkpoint's model and optimizer state as one plain dict (DCP read without a process group)."""
    step_dir = list_checkpoints(ckpt_dir)[-1][1]
    out = ckpt_dir.parent / f"{ckpt_dir.name}_final.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_killed_rank_resumes_from_last_checkpoint(tmp_path):
    # Both runs at once: they are independent, and the CI machine is idle while one waits on torch imports.
    reference = subprocess.Popen(_train_cmd(tmp_path / "ref", tmp_path / "ref_ckpt"), cwd=tmp_path,
                                 env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    faulty = subprocess.Popen(_train_cmd(tmp_path / "run", tmp_path / "ckpt", "--max-restarts", "1"), cwd=tmp_path,
                              env=clean_env(tmp_path, FSDP_SPEEDLOADER_INJECT_FAULT=FAULT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ref_out, _ = reference.communicate(timeout=300)
    out, _ = faulty.communicate(timeout=300)
    assert reference.returncode == 0, tail(ref_out)
    assert faulty.returncode == 0, tail(out)
    assert "fault: exiting" in out, tail(out)  # the first attempt really lost rank 1 ...
    assert "resumed from" in out and "step_00000004 at step 4" in out, tail(out)  # ... and the second resumed

    expected, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # steps 1-4 from attempt 0, 5-6 from attempt 1
    for key in ("loss", "lr", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-6, abs=1e-7), key

    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000004", "step_00000006"]
    want, have = _final_state(tmp_path / "ref_ckpt"), _final_state(tmp_path / "ckpt")
    assert sorted(have["model"]) == sorted(want["model"])
    for name, tensor in want["model"].items():
        torch.testing.assert_close(have["model"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    for name, state in want["optim"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(have["optim"]["state"][name][key], value, rtol=1e-6, atol=1e-7,
                                       msg=f"{name}.{key}")


# --- a checkpoint written by N ranks loads on M ranks --------------------------------------------


def _config(root: Path, name: str, ckpt: Path, resume=None):
    return tiny_config(root / name, schedule={"name": "speedloader"}, steps=6,
                       checkpoint={"every": 3, "dir": str(ckpt), "save_final": False, "resume": resume})


def _full_state(trainer: Trainer) -> dict:
    """Unsharded model and optimizer state (on rank 0; every rank must call), plus step, scheduler, data."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(trainer.model, options=options),
            "optim": get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options),
            "step": trainer.step, "scheduler": trainer.scheduler.state_dict(), "loader": trainer.loader.state_dict()}


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] and got["loader"] == want["loader"]
    assert got["scheduler"] == want["scheduler"]
    assert sorted(got["model"]) == sorted(want["model"]) and got["model"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"]) and got["optim"]["state"]
    for name, state in want["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optim"]["state"][name][key], value), f"{name}.{key}"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def _global_sequences(cfg, start: int, count: int) -> torch.Tensor:
    """Sequences start .. start+count-1 of the data's global order (one reader, no ranks)."""
    loader = build_loader(cfg.data, vocab_size=cfg.model.vocab_size, batch_size=start + count)
    return loader.next_batch()["input_ids"][start:]


def _on_two_ranks(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    # 1 -> 2: resume the 1-rank checkpoint on 2 ranks.
    resumed = Trainer(_config(root, "w2_from_w1", root / "ckpt_w1", resume="auto"))
    state_from_w1 = _full_state(resumed)
    # The 1-rank run consumed sequences 0-11 (3 steps x 4); the 2 ranks go on with 12-15 and 16-19.
    n = resumed.cfg.schedule.batch_size
    data_ok = torch.equal(resumed.loader.next_batch()["input_ids"], _global_sequences(resumed.cfg, 12 + rank * n, n))

    # 2 -> 1: a fresh 2-rank run saves at step 3 for the parent to load on 1 rank.
    trainer = Trainer(_config(root, "w2", root / "ckpt_w2"))
    trainer.train(max_steps=3)
    saved_by_w2 = _full_state(trainer)
    return {"state_from_w1": state_from_w1, "saved_by_w2": saved_by_w2, "data_ok": data_ok}


@pytest.mark.slow
def test_checkpoint_moves_between_world_sizes(tmp_path):
    saver = Trainer(_config(tmp_path, "w1", tmp_path / "ckpt_w1"))  # this process: world size 1
    saver.train(max_steps=3)
    saved_by_w1 = _full_state(saver)
    assert saved_by_w1["loader"]["position"] == 3 * 4

    rank0, rank1 = run_distributed(_on_two_ranks, 2, str(tmp_path), timeout_s=300)
    _assert_same_state(rank0["state_from_w1"], saved_by_w1)  # 1 -> 2
    assert rank0["data_ok"] and rank1["data_ok"]

    resumed = Trainer(_config(tmp_path, "w1_from_w2", tmp_path / "ckpt_w2", resume="auto"))  # 2 -> 1
    _assert_same_state(_full_state(resumed), rank0["saved_by_w2"])
    assert resumed.loader.state_dict()["position"] == 3 * 2 * 4  # the global position: nothing skipped or repeated
    assert torch.equal(resumed.loader.next_batch()["input_ids"], _global_sequences(resumed.cfg, 24, 4))
    assert resumed.train()[-1]["step"] == 6


# --- the fault specification -----------------------------------------------------------------------


def test_parse_fault():
    assert parse_fault("exit:rank=1,step=5,attempt=0") == Fault("exit", rank=1, step=5, attempt=0)
    assert parse_fault("oom:min_batch_size=8") == Fault("oom", min_batch_size=8)
    assert parse_fault("oom") == Fault("oom")
    for bad in ("crash", "exit:rank=-1", "exit:node=1", "exit:step=0", "exit:step"):
        with pytest.raises(ValueError, match="FSDP_SPEEDLOADER_INJECT_FAULT"):
            parse_fault(bad)


def test_fault_applies_to_its_rank_attempt_and_batch(monkeypatch):
    monkeypatch.setenv("FSDP_SPEEDLOADER_INJECT_FAULT", FAULT)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert fault_from_env(rank=1, batch_size=4) == Fault("exit", rank=1, step=5, attempt=0)
    assert fault_from_env(rank=0, batch_size=4) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted attempt runs clean
    assert fault_from_env(rank=1, batch_size=4) is None
    monkeypatch.setenv("FSDP_SPEEDLOADER_INJECT_FAULT", "oom:min_batch_size=8")
    assert fault_from_env(rank=0, batch_size=4) is None and fault_from_env(rank=0, batch_size=8) is not None
    monkeypatch.delenv("FSDP_SPEEDLOADER_INJECT_FAULT")
    assert fault_from_env(rank=0, batch_size=8) is None


def test_oom_fault_stops_training_before_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_SPEEDLOADER_INJECT_FAULT", "oom:step=2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    trainer = Trainer(tiny_config(tmp_path, steps=3))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        trainer.train()
    assert trainer.step == 1


# --- SIGTERM / SIGINT: save, then exit ----------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_then_exits(tmp_path):
    """The real entry point gets a real SIGTERM mid-run: it saves the step it was on, exits 143 without a
    traceback, and checkpoint.resume=auto goes on from that step."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "schedule=speedloader", "steps=100000",
           f"checkpoint.dir={ckpt}", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 2):  # in the training loop
        assert proc.poll() is None and time.monotonic() < deadline, tail(proc.communicate()[0])
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, tail(out)
    assert "Traceback" not in out and "SIGTERM received: saving a checkpoint" in out, tail(out)
    last = read_metrics(run)[-1]["step"]  # the step the signal interrupted is logged and saved
    assert [step for step, _ in list_checkpoints(ckpt)] == [last], tail(out)
    assert verify_checkpoint(ckpt / f"step_{last:08d}") is None
    resumed = Trainer(tiny_config(tmp_path / "resumed", schedule={"name": "speedloader"}, steps=last + 1,
                                  checkpoint={"resume": "auto", "dir": str(ckpt)}))
    assert resumed.step == last


class _SignalOnRank1(MetricLogger):
    """Rank 1 sends itself SIGTERM when it logs step 2; no other rank sees a signal."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def log(self, metrics: dict, step: int) -> None:
        if self.rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _stopped_by_signal(rank: int, world_size: int, root: str) -> dict:
    cfg = tiny_config(Path(root) / "run", schedule={"name": "speedloader"}, steps=50,
                      checkpoint={"dir": str(Path(root) / "ckpt")})
    trainer = Trainer(cfg, logger=_SignalOnRank1(rank))
    try:
        trainer.train()
    except TrainingInterrupted as stop:
        return {"code": stop.code, "signal": stop.signal_name, "step": trainer.step}
    return {"code": None, "step": trainer.step}


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_saved(tmp_path):
    results = run_distributed(_stopped_by_signal, 2, str(tmp_path), timeout_s=300)
    # Rank 1's signal comes after step 2's agreement: every rank finishes step 3, saves it, and stops.
    assert results == [{"code": 128 + signal.SIGTERM, "signal": "SIGTERM", "step": 3}] * 2, results
    step_dir = tmp_path / "ckpt" / "step_00000003"
    assert [p for _, p in list_checkpoints(tmp_path / "ckpt")] == [step_dir]
    assert verify_checkpoint(step_dir) is None and (step_dir / "extra_rank1.pt").is_file()
