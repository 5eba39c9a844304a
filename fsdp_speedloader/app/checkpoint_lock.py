"""One run per checkpoint directory: the lock file ``<checkpoint.dir>/run.lock``.

Rank 0 of a training run creates the lock file before anything is built and removes it when the run ends (also on
an exception or a SIGTERM/SIGINT stop). It is JSON naming its holder: host, pid (and that process's start time, so a
recycled pid is not taken for the holder), the time the run started, its run directory and, under torchrun, the
job's rendezvous id and restart count (under SLURM, the job id and its restart count).

A second run on the same ``checkpoint.dir`` is refused in one line naming the holder. A lock left by a run that is
gone is taken over with a warning: on the holder's host, when its pid is no longer running (``kill -9``, a crash);
on any host, when it was written by an earlier attempt of the same torchrun job (``--max-restarts``: torchrun stops
every worker of an attempt before it starts the next) or by an earlier run of the same SLURM job (requeued: a
job's steps have ended before it runs again). A lock held from another host by another job cannot be
checked from here: the refusal says to delete the file if that run is gone.

The file is created with its content in one step (a hard link of a written temporary file), so a reader never sees
it half written; taking over a stale lock moves it aside first (a rename, which only one of two racing runs wins).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
"""In ``checkpoint.dir`` while a run uses it."""


def _process_start_ticks(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its closing one.
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _this_process(run_dir: Optional[str]) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start_ticks": _process_start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "run_dir": run_dir,
            "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "torchelastic_restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "token": uuid.uuid4().hex}


def _read(path: Path) -> Optional[dict]:
    """The lock's record; None when it cannot be read as one (empty, garbled)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "host" in record and "pid" in record else None


def describe(holder: dict) -> str:
    """``host H, pid P, since T, run directory R``."""
    parts = [f"host {holder.get('host')}", f"pid {holder.get('pid')}"]
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    if holder.get("run_dir"):
        parts.append(f"run directory {holder['run_dir']}")
    return ", ".join(parts)


def why_stale(holder: dict, me: dict) -> Optional[str]:
    """Why the run that wrote ``holder`` is gone (a phrase), or None when it may still be running."""
    job = holder.get("torchelastic_run_id")
    if (job and job not in ("none", "") and job == me.get("torchelastic_run_id")
            and int(holder.get("torchelastic_restart_count") or 0) < me["torchelastic_restart_count"]):
        return f"it was written by restart {holder.get('torchelastic_restart_count')} of this torchrun job"
    slurm_job = holder.get("slurm_job_id")
    if (slurm_job and slurm_job == me.get("slurm_job_id")
            and int(holder.get("slurm_restart_count") or 0) < me["slurm_restart_count"]):
        return f"it was written before requeue {me['slurm_restart_count']} of this SLURM job"
    if holder.get("host") != me["host"]:
        return None
    pid = int(holder["pid"])
    if pid == me["pid"] and holder.get("pid_start_ticks") == me["pid_start_ticks"]:
        return None  # this very process (another Trainer on the same directory)
    if not _pid_alive(pid):
        return f"process {pid} is not running"
    started = _process_start_ticks(pid)
    if holder.get("pid_start_ticks") is not None and started is not None and started != holder["pid_start_ticks"]:
        return f"process {pid} is another process now (the pid was reused)"
    return None


class CheckpointDirLock:
    """The lock of one checkpoint directory, held by this process (see the module docstring).

    ``CheckpointDirLock.acquire(directory, run_dir=...)`` takes it or raises ValueError naming the holder;
    :meth:`release` removes the file if it still names this holder; :meth:`check` says whether it still does.
    """

    def __init__(self, path: Path, record: dict) -> None:
        self.path = path
        self.record = record
        self.released = False

    @classmethod
    def acquire(cls, directory: str | os.PathLike, *, run_dir: Optional[str] = None) -> "CheckpointDirLock":
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        me = _this_process(run_dir)
        for _ in range(8):  # each round either takes the lock, refuses, or clears a stale one
            if _create_with_content(path, json.dumps(me, indent=1) + "\n"):
                return cls(path, me)
            holder = _read(path)
            if holder is None:
                if not path.exists():  # released between our two looks
                    continue
                raise ValueError(f"checkpoint.dir: {str(directory)!r} has a lock file that cannot be read "
                                 f"({str(path)!r}); if no run uses this directory, delete that file")
            stale = why_stale(holder, me)
            if stale is None:
                own = " (this process)" if holder.get("pid") == me["pid"] and holder.get("host") == me["host"] else ""
                gone = ("" if holder.get("host") == me["host"] else
                        "; if that run is no longer running, delete the lock file")
                raise ValueError(f"checkpoint.dir: {str(directory)!r} is in use by another run ({describe(holder)}"
                                 f"{own}; lock file {str(path)!r}); wait for it to end or give this run another "
                                 f"checkpoint.dir{gone}")
            aside = path.with_name(f"{LOCK_FILE}.stale.{me['token']}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:  # another run took it over first: look again
                continue
            if _read(aside) != holder:  # a fresh lock replaced the stale one between our read and rename: put it back
                _link_back(aside, path)
                continue
            aside.unlink()
            log.warning("checkpoint.dir: took over the lock of a run that is gone (%s: %s)", describe(holder), stale)
        raise ValueError(f"checkpoint.dir: {str(directory)!r}: could not take its lock file {str(path)!r} (other runs "
                         "keep taking it); give this run another checkpoint.dir")

    def check(self) -> Optional[str]:
        """None while the lock file still names this holder, else what happened to it (a phrase)."""
        holder = _read(self.path)
        if holder is None:
            return f"its lock file {str(self.path)!r} is gone"
        if holder.get("token") != self.record["token"]:
            return f"its lock file {str(self.path)!r} now names another run ({describe(holder)})"
        return None

    def release(self) -> None:
        """Removes the lock file if it still names this holder. Idempotent."""
        if self.released:
            return
        self.released = True
        if self.check() is None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def _create_with_content(path: Path, text: str) -> bool:
    """Creates ``path`` holding ``text`` unless it exists (False then), never visible half written."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive create, then write
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink()


def _link_back(aside: Path, path: Path) -> None:
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    aside.unlink()
