"""One run per checkpoint directory, runs that never mix their steps, resume-time refusals, and extra files that
load with ``weights_only=True``.

- The lock (``app/checkpoint_lock.py``): a second run on a held directory is refused naming the holder (in process,
  on 2 gloo ranks without a hang, and through the real entry point while another real run trains); a stale lock
  (dead pid, recycled pid, an earlier torchrun attempt) is taken over with a warning; released at the end.
- A fresh run into a directory holding step directories, or a resume from an older step than the newest, is refused
  unless ``checkpoint.overwrite=true``, which deletes exactly those step directories.
- ``steps`` at or below the checkpoint's step is refused, naming both.
- A tampered ``extra_rank0.pt`` (a pickle that would run code) is refused and its code never runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_config
from fsdp_speedloader.app.checkpoint import list_checkpoints
from fsdp_speedloader.app.checkpoint_extra import read_extra
from fsdp_speedloader.app.checkpoint_lock import LOCK_FILE, CheckpointDirLock, _process_start_ticks
from fsdp_speedloader.app.trainer import Trainer
from launch_utils import TINY_OVERRIDES, clean_env, tail


def _config(root: Path, name: str, ckpt: Path, steps: int = 2, **checkpoint):
    return tiny_config(root / name, schedule={"name": "canonical"}, steps=steps,
                       checkpoint={"every": 1, "keep_last": 5, "dir": str(ckpt), **checkpoint})


# --- the lock ------------------------------------------------------------------------------------------------------


def test_a_second_run_is_refused_naming_the_holder_and_the_lock_is_released(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = Trainer(_config(tmp_path, "a", ckpt))
    holder = json.loads((ckpt / LOCK_FILE).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert holder["run_dir"] == str(tmp_path / "a") and holder["started"]
    with pytest.raises(ValueError, match=rf"checkpoint.dir: '{ckpt}' is in use by another run \(host "
                                         rf"{socket.gethostname()}, pid {os.getpid()}, since .*\(this process\)"):
        Trainer(_config(tmp_path, "b", ckpt, resume="auto"))
    first.train()
    assert not (ckpt / LOCK_FILE).exists()
    Trainer(_config(tmp_path, "c", ckpt, steps=3, resume="auto")).train()  # free again
    assert not (ckpt / LOCK_FILE).exists()


def test_a_refused_setup_releases_the_lock(tmp_path):
    ckpt = tmp_path / "ckpt"
    Trainer(_config(tmp_path, "a", ckpt)).train()
    with pytest.raises(ValueError, match="already holds another run's checkpoints"):
        Trainer(_config(tmp_path, "b", ckpt))  # refused after it took the lock
    assert not (ckpt / LOCK_FILE).exists()


def _write_lock(directory: Path, **fields) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start_ticks": None, "started": "then",
              "run_dir": "elsewhere", "torchelastic_run_id": None, "torchelastic_restart_count": 0, "token": "x"}
    (directory / LOCK_FILE).write_text(json.dumps({**record, **fields}))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_locks_are_taken_over_with_a_warning(tmp_path, caplog, monkeypatch):
    caplog.set_level("WARNING")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = {
            "dead pid": ({"pid": _dead_pid()}, "is not running"),
            "recycled pid": ({"pid": live.pid, "pid_start_ticks": _process_start_ticks(live.pid) + 1}, "was reused"),
            "earlier torchrun attempt": ({"host": "another-node", "torchelastic_run_id": "job7",
                                          "torchelastic_restart_count": 0}, "restart 0 of this torchrun job"),
            "requeued SLURM job": ({"host": "another-node", "slurm_job_id": "4242", "slurm_restart_count": 0},
                                   "before requeue 1 of this SLURM job"),
        }
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        for name, (fields, why) in cases.items():
            directory = tmp_path / name.replace(" ", "_")
            _write_lock(directory, **fields)
            caplog.clear()
            lock = CheckpointDirLock.acquire(directory)
            assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid(), name
            assert any("took over the lock of a run that is gone" in r.getMessage() and why in r.getMessage()
                       for r in caplog.records), (name, caplog.text)
            lock.release()
            assert sorted(os.listdir(directory)) == [], name  # nothing left beside it
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
            monkeypatch.delenv(name)

        held = {"live pid": ({"pid": live.pid, "pid_start_ticks": _process_start_ticks(live.pid)}, "wait for it"),
                "another host": ({"host": "another-node", "pid": 1}, "if that run is no longer running, delete")}
        for name, (fields, hint) in held.items():
            directory = tmp_path / name.replace(" ", "_")
            _write_lock(directory, **fields)
            pattern = (rf"is in use by another run \(host {fields.get('host', '.*')}, pid {fields['pid']}, since then, "
                       rf"run directory elsewhere; .*{hint}")
            with pytest.raises(ValueError, match=pattern):
                CheckpointDirLock.acquire(directory)
            assert json.loads((directory / LOCK_FILE).read_text())["pid"] == fields["pid"]  # left alone
    finally:
        live.kill()
        live.wait()


def test_a_run_that_lost_its_lock_does_not_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer = Trainer(_config(tmp_path, "a", ckpt, steps=2))
    _write_lock(ckpt, host="another-node", pid=4242)  # someone deleted ours and another run took the directory
    with pytest.raises(ValueError, match=r"not saving step 1 into .*: this run no longer holds the directory \(its "
                                         r"lock file .* now names another run \(host another-node, pid 4242"):
        trainer.train()
    assert list(ckpt.glob("step_*")) == []
    assert json.loads((ckpt / LOCK_FILE).read_text())["pid"] == 4242  # not ours to remove


def _second_run_on_two_ranks(rank: int, world_size: int, root: str, holder_pid: int) -> str:
    root = Path(root)
    if rank == 0:  # another live process holds the directory
        _write_lock(root / "ckpt", pid=holder_pid, pid_start_ticks=_process_start_ticks(holder_pid))
    try:
        Trainer(_config(root, "run", root / "ckpt"))
    except ValueError as e:
        return str(e)
    return "not refused"


def test_two_ranks_are_both_refused_without_a_hang(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        errors = run_distributed(_second_run_on_two_ranks, 2, str(tmp_path), live.pid, timeout_s=60)
    finally:
        live.kill()
        live.wait()
    assert errors[0] == errors[1] and f"is in use by another run (host {socket.gethostname()}, pid {live.pid}" \
        in errors[0], errors


@pytest.mark.slow
def test_entry_point_refuses_a_concurrent_run_and_takes_over_after_kill_9(tmp_path):
    """Two real runs at once on one checkpoint.dir: the second exits 2 with one line naming the first; after the
    first is killed with SIGKILL, a third run takes its stale lock over with a warning and trains."""
    ckpt = tmp_path / "ckpt"

    def cmd(name: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "fsdp_speedloader.app.train", *TINY_OVERRIDES, "schedule=canonical",
                f"checkpoint.dir={ckpt}", "checkpoint.every_minutes=0", f"hydra.run.dir={tmp_path / name}", *extra]

    env = clean_env(tmp_path)
    first = subprocess.Popen(cmd("first", "steps=100000", "log_every=100000", "checkpoint.save_final=false"),
                             cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.2)
        second = subprocess.run(cmd("second", "steps=2"), cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, tail(second.stderr)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        expected = f"error: checkpoint.dir: '{ckpt}' is in use by another run (host {socket.gethostname()}, " \
                   f"pid {first.pid}, since "
        assert len(errors) == 1 and errors[0].startswith(expected), errors
        assert "Traceback" not in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = subprocess.run(cmd("third", "steps=2"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, tail(third.stderr)
    assert f"took over the lock of a run that is gone (host {socket.gethostname()}, pid {first.pid}" in third.stdout
    assert [step for step, _ in list_checkpoints(ckpt)] == [2] and not (ckpt / LOCK_FILE).exists()


# --- runs never mix their steps ------------------------------------------------------------------------------------


def test_a_fresh_run_into_another_runs_directory_is_refused_unless_overwrite(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    Trainer(_config(tmp_path, "old", ckpt, steps=3)).train()
    (ckpt / "step_00000007.tmp").mkdir()  # an unfinished save of the old run
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"checkpoint.dir: '{ckpt}' already holds another run's checkpoints "
                                         r"\(step_00000001, step_00000002, step_00000003\) and this run starts "
                                         r"fresh; .*checkpoint.overwrite=true to delete them first"):
        Trainer(_config(tmp_path, "new", ckpt, steps=2))
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 2, 3]  # untouched
    caplog.set_level("WARNING")
    Trainer(_config(tmp_path, "new", ckpt, steps=2, overwrite=True)).train()
    deleted = sorted(r.getMessage() for r in caplog.records if "checkpoint.overwrite=true: deleted" in r.getMessage())
    assert len(deleted) == 4 and "step_00000003" in deleted[2] and "step_00000007.tmp" in deleted[3], deleted
    # Only the new run's steps: step_3 of the old run does not sit beside them.
    assert sorted(os.listdir(ckpt)) == ["notes.txt", "step_00000001", "step_00000002"]


def test_a_resume_from_an_older_step_is_refused_unless_overwrite(tmp_path):
    ckpt = tmp_path / "ckpt"
    Trainer(_config(tmp_path, "old", ckpt, steps=4)).train()
    older = ckpt / "step_00000002"
    with pytest.raises(ValueError, match=r"holds checkpoints newer than step_00000002, which this run resumes from "
                                         r"\(step_00000003, step_00000004\)"):
        Trainer(_config(tmp_path, "branch", ckpt, steps=3, resume=str(older)))
    Trainer(_config(tmp_path, "branch", ckpt, steps=3, resume=str(older), overwrite=True)).train()
    assert [s for s, _ in list_checkpoints(ckpt)] == [1, 2, 3]
    assert read_extra(ckpt / "step_00000003" / "extra_rank0.pt")["step"] == 3


# --- resume-time refusals -------------------------------------------------------------------------------------------


def test_steps_at_or_below_the_checkpoint_are_refused(tmp_path, monkeypatch):
    import fsdp_speedloader.app.trainer as trainer_mod

    ckpt = tmp_path / "ckpt"
    Trainer(_config(tmp_path, "a", ckpt, steps=3)).train()
    monkeypatch.setattr(trainer_mod, "materialize_model", lambda *a, **k: pytest.fail("materialised"))
    for steps in (3, 2):
        with pytest.raises(ValueError, match=rf"steps={steps}: the checkpoint '{ckpt / 'step_00000003'}' is at step 3 "
                                             r"already, so there is nothing left to train; set steps above 3 \(e.g. "
                                             r"steps=6\)"):
            Trainer(_config(tmp_path, "b", ckpt, steps=steps, resume="auto"))


class _WritesAMarker:
    """Unpickling this object opens (creates) a marker file: what a malicious checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_tampered_extra_file_is_refused_and_runs_no_code(tmp_path, monkeypatch):
    import fsdp_speedloader.app.trainer as trainer_mod

    ckpt = tmp_path / "ckpt"
    Trainer(_config(tmp_path, "a", ckpt, steps=1)).train()
    extra_file = ckpt / "step_00000001" / "extra_rank0.pt"
    extra = torch.load(extra_file, weights_only=True)  # what the project writes loads safely
    assert isinstance(extra["rng"]["numpy"], dict) and isinstance(extra["rng"]["python"]["internal"], torch.Tensor)
    marker = tmp_path / "code_ran"
    torch.save({**extra, "loader": _WritesAMarker(marker)}, extra_file)
    monkeypatch.setattr(trainer_mod, "materialize_model", lambda *a, **k: pytest.fail("materialised"))
    with pytest.raises(ValueError, match=rf"checkpoint: '{extra_file}' holds more than tensors and plain values \(the "
                                         r"global .*open\); refused, since loading it could run code"):
        Trainer(_config(tmp_path, "b", ckpt, steps=2, resume="auto"))
    assert not marker.exists()
