"""What every Hydra entry point (train, tune, generate, sweep) shares: where the configs are, one run directory
for all ranks, the rank-0-only Hydra files, user errors as one line, and the torchrun/SLURM environment.

Under torchrun every rank agrees on ONE run directory: before Hydra composes the config, the process group is
initialised and rank 0's timestamp is broadcast into ``$FSDP_SPEEDLOADER_RUN_STAMP``, which ``hydra.run.dir`` /
``hydra.sweep.dir`` in ``conf/config.yaml`` read (falling back to Hydra's ``${now:...}`` when it is unset). Only
rank 0 writes Hydra's ``.hydra/`` files and logs; every other rank runs with ``hydra.output_subdir=null`` and
Hydra's logging set up off (warnings still reach stderr). Setting ``FSDP_SPEEDLOADER_RUN_STAMP`` yourself names
the run directory.

User errors (a ``ValueError`` raised while a run is set up, or a :class:`UserError` raised later) end the process
with ONE line on stderr, ``error: ...``, and exit code 2: :func:`fail` (under torchrun the same line goes to its
per-worker error file, so its failure summary names the cause). ``FSDP_SPEEDLOADER_TRACEBACK=1`` prints their
traceback too. A run stopped by SIGTERM/SIGINT saves a checkpoint and exits with 128 + the signal number
(:class:`TrainingInterrupted`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import torch.distributed as dist

from fsdp_speedloader import parallel
from fsdp_speedloader.app.cli import check_command_line, config_path  # noqa: F401 (config_path: the entry points')

RUN_STAMP_ENV = "FSDP_SPEEDLOADER_RUN_STAMP"
"""Read by ``hydra.run.dir`` / ``hydra.sweep.dir`` in conf/config.yaml; set by :func:`main`."""
TRACEBACK_ENV = "FSDP_SPEEDLOADER_TRACEBACK"
"""``1``: :func:`fail` prints the traceback of a user error before its one line."""


class UserError(ValueError):
    """A user error found after setup (a memory budget that the first step shows to be wrong): the entry points
    print it as one line, like any ``ValueError`` raised while the run is set up."""


class TrainingInterrupted(SystemExit):
    """Raised by ``Trainer.train`` after a SIGTERM or SIGINT, once every rank has saved its checkpoint: the process
    ends with exit status 128 + the signal number (what a shell or a scheduler reads as "ended by that signal"),
    so ``train && next`` does not go on with an unfinished model."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name

# Overrides for every rank but 0: no .hydra/ files, no log file (Hydra's job and own logging off).
_NON_ZERO_RANK_OVERRIDES = {"hydra.output_subdir": "null", "hydra/job_logging": "none",
                            "hydra/hydra_logging": "none"}


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 under plain python), readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """torchrun's RANK (0 under plain python), readable before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def agree_on_run_stamp() -> str:
    """Sets ``$FSDP_SPEEDLOADER_RUN_STAMP`` to rank 0's time on every rank (unless already set)."""
    stamp = os.environ.get(RUN_STAMP_ENV)
    if stamp:
        return stamp
    stamp = datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    if world_size() > 1:
        # The group the trainer uses later (maybe_init_process_group is a no-op once initialised).
        parallel.maybe_init_process_group()
        box = [stamp]
        dist.broadcast_object_list(box, src=0)
        stamp = box[0]
    os.environ[RUN_STAMP_ENV] = stamp
    return stamp


def rank_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides this rank adds: none on rank 0, no files and no logging setup elsewhere."""
    if rank() == 0:
        return []
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    return [f"{k}={v}" for k, v in _NON_ZERO_RANK_OVERRIDES.items() if k not in given]


def resolved_config(cfg: Any) -> dict:
    """Hydra's composed ``DictConfig`` as a plain dict, resolved once, ``output_dir`` set to Hydra's run directory."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from omegaconf.errors import MissingMandatoryValue

    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # a `???` in conf/ the command line did not fill
        raise ValueError(f"{e.full_key}: this setting is required; add {e.full_key}=<value> to the command") from None
    container.pop("hydra", None)
    container["output_dir"] = HydraConfig.get().runtime.output_dir
    return container


def maybe_export_submitit_env() -> bool:
    """Inside a SLURM job of hydra-submitit-launcher (one task per GPU, no torchrun), sets torch's
    ``env://`` variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from SLURM's, through
    submitit's own helper. A no-op under torchrun and for plain ``python``. True when it exported.
    """
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    from submitit.helpers import TorchDistributedEnvironment  # installed with hydra-submitit-launcher

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def check_writable_dir(path: str | os.PathLike, setting: str) -> None:
    """ValueError naming ``setting`` and ``path`` unless ``path`` is, or can be created as, a writable directory.

    Nothing is created: a probe file is written and removed in ``path`` or, when it does not exist yet, in its
    nearest existing parent (where creating it needs write permission).
    """
    target = Path(path).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = f"set {setting} to a directory you can write to"
    if not existing.is_dir():
        raise ValueError(f"{setting}: cannot write to {str(target)!r}: {str(existing)!r} is a file, not a directory; "
                         f"{fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fsdp_speedloader_write_test_", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{setting}: cannot write to {str(target)!r} ({e.strerror or e}); {fix}") from None


def _run_dir_override(argv: list[str]) -> tuple[str, str]:
    """(Hydra key, directory) of this run's output: the command line's ``hydra.run.dir=`` / ``hydra.sweep.dir=``,
    else the root of the defaults in conf/ (``outputs/``, ``multirun/``) under the working directory."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    for arg in argv:
        name, sep, value = arg.lstrip("+").partition("=")
        if sep and name == key:
            return key, value
    return key, "multirun" if multirun else "outputs"


def fail(error: ValueError) -> NoReturn:
    """A user error: one line on stderr, no traceback (unless ``FSDP_SPEEDLOADER_TRACEBACK=1``), exit code 2."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    print(f"error: {error}", file=sys.stderr, flush=True)
    _tell_torchrun(f"error: {error}")
    # the run's log file (Hydra's <entry point>.log in the run directory) says why the run ended too
    record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, "error: %s", (error,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    if dist.is_initialized():
        dist.destroy_process_group()  # no barrier: other ranks may have failed differently
    sys.exit(2)


def _tell_torchrun(line: str) -> None:
    """Under torchrun, ``line`` in the worker's error file (``$TORCHELASTIC_ERROR_FILE``, the format of torch's
    ``ErrorHandler.record_exception``): torchrun's failure summary, the last thing its console shows, then names the
    cause instead of "To enable traceback see: ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary then says what it said before; the line above is on stderr anyway
        pass


def launch(hydra_main: Callable[[], None], config_name: Optional[str] = None) -> None:
    """Runs a Hydra entry point (train, tune, generate, export) under torchrun or plain python.

    The overrides are checked against the primary config ``config_name`` first (``cli.check_command_line``: an
    unknown key or group option is one line naming the closest valid ones, exit 2). Ranks then agree on rank 0's
    run stamp (one run directory); non-zero ranks get the overrides that keep them from writing Hydra's files and
    logs.
    """
    # Expandable segments unless the user chose: layer-major steps allocate sub-batch-sized blocks
    # whose sizes change between the forward, the head and the backward, and the default allocator's
    # fragmentation can leave GiBs reserved but unallocated (docs/results.md: full LLaMA-2-7B ran out of
    # memory that way). torchtitan's launcher sets the same. Before anything touches CUDA.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    is_help = any(a in ("-h", "--help", "--hydra-help", "--info", "--cfg", "-c") for a in sys.argv[1:])
    try:
        if config_name is not None:
            check_command_line(config_name, sys.argv[1:])
        agree_on_run_stamp()
        if not is_help:  # Hydra creates the run directory before any of our code runs: check it first
            key, run_dir = _run_dir_override(sys.argv[1:])
            check_writable_dir(run_dir, key)
    except ValueError as e:
        fail(e)
    sys.argv.extend(rank_overrides(sys.argv[1:]))
    try:
        hydra_main()
    except TrainingInterrupted:  # every rank saved and stops: leave the group together, then exit 128 + signal
        parallel.destroy_process_group()
        raise
    except KeyboardInterrupt:  # Ctrl-C while the run was set up (the training loop saves and stops instead)
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    parallel.destroy_process_group()  # barrier first: no rank leaves while another still checkpoints
