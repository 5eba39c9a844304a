"""The real entry point in subprocesses: torchrun with 2 CPU ranks + Hydra + W&B offline, and a user error.

Under torchrun every rank must use ONE run directory, and only rank 0 writes Hydra's files, the
log, metrics.jsonl and the W&B run. The runs start in a fresh temporary directory (Hydra's
``outputs/`` lands there) with no network: W&B is offline.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_OVERRIDES = ["device=cpu", "steps=3", "log_every=1", "model=llama_tiny", "model.hidden_size=64",
                  "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128", "data=default",
                  "data.seq_len=32", "schedule=canonical", "schedule.sub_batch_size=2", "schedule.num_sub_batches=2",
                  "checkpoint.save_final=true"]
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "FSDP_SPEEDLOADER_RUN_STAMP", "WANDB_API_KEY", "WANDB_RUN_ID")


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}  # an in-process test group sets some
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               WANDB_SILENT="true", WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb_dir"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")  # a CPU run: 2 ranks need no GPU each, also on a GPU machine
    return env


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline ``.wandb`` file (LevelDB log framing of ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    pos, pending, rows = 7, b"", []  # 7-byte file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # FULL or FIRST
            pending = chunk
        elif kind in (3, 4):  # MIDDLE or LAST
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_torchrun_two_ranks_hydra_wandb_offline(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "logger=wandb", "logger.mode=offline"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "OpenMP: idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE" in proc.stdout + proc.stderr  # openmp_wait.py

    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # both ranks agreed on one timestamp
    run = run_dirs[0]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob(".hydra")] == [(run / ".hydra").relative_to(tmp_path)]
    assert (run / ".hydra" / "config.yaml").is_file()
    assert list(run.glob("*.log")) == [run / "train.log"]  # Hydra's job log, rank 0 only

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # written once (rank 0), not twice
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)

    offline_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, offline_runs  # rank 0 only
    history = _wandb_history(next(offline_runs[0].glob("*.wandb")))
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in records])
    assert (run / "checkpoints" / "step_00000003" / "extra_rank1.pt").is_file()


def test_user_error_is_one_line_and_nonzero_exit(tmp_path):
    cmd = [sys.executable, "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "logger=none", "data=text",
           f"data.path={tmp_path / 'missing.txt'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.path" in errors[0] and "missing.txt" in errors[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr


def test_a_user_error_under_torchrun_is_named_in_torchrun_s_summary(tmp_path):
    # torchrun ends a failed job with its own traceback and a summary per rank, the last lines a user sees; they said
    # "To enable traceback see: ..." and the one line that names the cause scrolled away above them.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "logger=none", "data=text",
           f"data.path={tmp_path / 'missing.txt'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.rindex("Root Cause"):]
    assert re.search(r"traceback : error: data\.path: .*missing\.txt", summary), proc.stderr[-4000:]
    assert "To enable traceback see" not in proc.stderr


@pytest.mark.parametrize("entry", ["train", "tune"])
def test_missing_mandatory_value_is_one_line_naming_the_key(tmp_path, entry):
    """``data=text`` leaves ``data.path: ???``: the error names the key to add, not the string '???'."""
    cmd = [sys.executable, "-m", f"fsdp_speedloader.app.{entry}", *TINY_OVERRIDES, "logger=none", "data=text"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: data.path: this setting is required; add data.path=<value> to the command"], \
        proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "???" not in proc.stderr


def _stamp_with_skewed_clock(rank: int, world_size: int) -> str:
    import datetime as real_datetime

    import fsdp_speedloader.app.launch as train_mod

    class SkewedClock(real_datetime.datetime):  # rank 1's clock is years off: its own stamp must lose
        @classmethod
        def now(cls, tz=None):
            return real_datetime.datetime(2001, 1, 1, 0, 0, 0)

    os.environ.pop(train_mod.RUN_STAMP_ENV, None)
    if rank == 1:
        train_mod.datetime = SkewedClock
    return train_mod.agree_on_run_stamp()


def test_ranks_agree_on_rank0_run_stamp():
    from dist_utils import run_distributed

    stamps = run_distributed(_stamp_with_skewed_clock, 2)
    assert stamps[0] == stamps[1] and not stamps[0].startswith("2001"), stamps


def test_only_rank0_writes_hydra_files(monkeypatch):
    from fsdp_speedloader.app.launch import rank_overrides as _rank_overrides

    monkeypatch.setenv("RANK", "0")
    assert _rank_overrides([]) == []
    monkeypatch.setenv("RANK", "1")
    assert _rank_overrides(["steps=3"]) == ["hydra.output_subdir=null", "hydra/job_logging=none",
                                            "hydra/hydra_logging=none"]
    assert "hydra.output_subdir=null" not in _rank_overrides(["hydra.output_subdir=.hydra_1"])


def test_threads_instead_of_torchrun_default(monkeypatch):
    """torchrun's OMP_NUM_THREADS=1 (set when the variable is unset) would leave a rank's host optimizer one core:
    under torchrun with that value, a rank gets its share of the CPUs; any other value, or no torchrun, is kept."""
    from fsdp_speedloader.memory import threads

    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.threads_instead_of_torchrun_default() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert threads.threads_instead_of_torchrun_default() is None  # a share of one CPU: nothing to change
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert threads.threads_instead_of_torchrun_default() is None  # the user's choice
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert threads.threads_instead_of_torchrun_default() is None  # not under torchrun


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_offloaded_run_under_torchrun_uses_its_cpu_share(tmp_path):
    """A real torchrun worker with its states on the host: torchrun's OMP_NUM_THREADS=1 is replaced by the rank's
    share of the CPUs, and the run says so; on the GPU alone (no offload) it is left as it is."""
    cpus = len(os.sched_getaffinity(0))
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "logger=none", "checkpoint.save_final=false"]
    proc = subprocess.run([*base, "offload=params"], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"host threads: {cpus} per rank" in proc.stdout + proc.stderr
    proc = subprocess.run(base, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "host threads:" not in proc.stdout + proc.stderr
